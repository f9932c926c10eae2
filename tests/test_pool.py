"""The V4 pool keeps exactly the network's per-request state: load/store round trips.

Chunked and resumed forwards run over float32 pools against the network itself, and over FP8 pools (in
float64 compute) against one forward of the same tokens through an FP8 pool: both read the rows as stored.
"""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from conftest import random_ids

from sglang_dsv4.kv_cache import V4KVPool
from sglang_dsv4.memory_pool import request_tables
from sglang_dsv4.memory_pool.request_tables import DeviceTables, RequestTables
from sglang_dsv4.memory_pool.shared_rows import SharedRows
from sglang_dsv4.prefix_cache.manager import NothingCached
from sglang_dsv4.prefix_cache.window_policy import ALL_COMMITTED, PER_REQUEST
from sglang_dsv4.model.state import RequestState


def cold_logits(model, kv_dtype: torch.dtype, ids: torch.Tensor) -> torch.Tensor:
    """The oracle: ``ids`` in one forward from no state, attending the KV as a pool of ``kv_dtype`` stores it
    (float32: the network's own state, which stores nothing)."""
    if kv_dtype == torch.float32:
        return model(ids, model.new_state())
    pool = V4KVPool(1024, 1, model.config, kv_dtype, max_requests=1, max_context=1024, device="cpu")
    return run_through_pool(model, pool, 1, ids, [len(ids)])


def run_through_pool(model, pool: V4KVPool, request: int, ids: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """Logits of ``ids`` fed in ``chunks``, the state living in the pool between chunks (its KV read in the
    model's dtype)."""
    logits, start = [], pool.storage.tables.position[request]
    if not pool.storage.tables.bound[request]:
        pool.storage.tables.bind(request)
    for length in chunks:
        end = start + length
        pool.manager.reserve(request, end)
        layers = [pool.storage.load(layer, request, start, model.dtype) for layer in range(model.config.num_layers)]
        state = RequestState(start, layers)
        logits.append(model(ids[start:end], state))
        for layer, layer_state in enumerate(state.layers):
            pool.storage.store(layer, request, start, end, layer_state)
        start = end
    return torch.cat(logits)


def test_state_resumed_from_the_pool_equals_the_networks_own(model_and_kv_dtype):
    model, kv_dtype = model_and_kv_dtype
    ids = random_ids(300, model.config.vocab_size, seed=80)
    pool = V4KVPool(1024, 1, model.config, kv_dtype, max_requests=4, max_context=1024, device="cpu")
    chunks = [130, 1, 1, 97, 71]  # ends inside ratio-4 and ratio-128 blocks
    through_pool = run_through_pool(model, pool, 3, ids, chunks)
    assert (through_pool - cold_logits(model, kv_dtype, ids)).abs().max() <= 1e-4


def test_a_reused_request_row_starts_from_an_empty_state(tiny_model):
    pool = V4KVPool(1024, 1, tiny_model.config, torch.float32, max_requests=2, max_context=1024, device="cpu")
    first, second = random_ids(200, 1024, seed=81), random_ids(150, 1024, seed=82)
    run_through_pool(tiny_model, pool, 1, first, [200])
    pool.storage.tables.free(1)
    reused = run_through_pool(tiny_model, pool, 1, second, [150])
    assert (reused - tiny_model(second, tiny_model.new_state())).abs().max() <= 1e-4


def test_freeing_a_request_returns_its_entry_rows(tiny_model):
    pool = V4KVPool(1024, 1, tiny_model.config, torch.float32, max_requests=2, max_context=1024, device="cpu")
    before = pool.storage.usage()
    run_through_pool(tiny_model, pool, 2, random_ids(300, 1024, seed=83), [300])
    held = pool.storage.usage()
    assert held["ratio_4_entries"]["free"] == before["ratio_4_entries"]["free"] - 75
    assert held["ratio_128_entries"]["free"] == before["ratio_128_entries"]["free"] - 2
    window = tiny_model.config.sliding_window
    assert held["window_slots"]["free"] == before["window_slots"]["free"] - (window + 1)
    pool.storage.tables.free(2)
    assert pool.storage.usage() == before


# Measured on the builder's tiny model (with its MTP layer): mean logit error 0.007 (bf16) and 0.136 (FP8), greedy
# choices kept at 99.7% and 91% of 300 positions (the median gap between the two best logits is 1.34).
@pytest.mark.parametrize(
    ("kv_dtype", "stored_dtype", "mean_logit_error", "greedy_kept"),
    [(torch.bfloat16, torch.bfloat16, 0.05, 0.95), (torch.float8_e4m3fn, torch.uint8, 0.3, 0.85)],
)
def test_a_lossy_pool_stores_its_rows_and_keeps_the_greedy_choices(
    tiny_model, kv_dtype: torch.dtype, stored_dtype: torch.dtype, mean_logit_error: float, greedy_kept: float
):
    ids = random_ids(300, tiny_model.config.vocab_size, seed=84)
    pool = V4KVPool(1024, 1, tiny_model.config, kv_dtype, max_requests=2, max_context=1024, device="cpu")
    assert all(rows.dtype == stored_dtype for rows in [*pool.storage.window, *pool.storage.compressed.values()])
    through_pool = run_through_pool(tiny_model, pool, 1, ids, [150, 150])
    exact = tiny_model(ids, tiny_model.new_state())
    # Every chunk attends the rows as stored, its own tokens' too (logits here have a spread of 6).
    error = (through_pool - exact).abs()
    assert error[:150].mean() > 1e-3 and error.mean() <= mean_logit_error
    assert (through_pool.argmax(-1) == exact.argmax(-1)).float().mean() >= greedy_kept


def test_a_checkpoint_resumes_exactly_on_another_row(model_and_kv_dtype):
    model, kv_dtype = model_and_kv_dtype
    ids = random_ids(400, model.config.vocab_size, seed=85)
    pool = V4KVPool(2048, 1, model.config, kv_dtype, max_requests=4, max_context=1024, device="cpu")
    run_through_pool(model, pool, 1, ids, [130, 67])  # 197: inside a ratio-4 and a ratio-128 block
    slots = torch.arange(1, 198)  # the token slots a prefix cache would hold for them
    pool.entry_ownership.commit(1, slots, 0, 197)
    checkpoint = pool.checkpoints.make(1, 197)
    pool.storage.tables.free(1)  # the checkpoint and the slots keep what they point at
    pool.checkpoints.resume(2, checkpoint, slots)
    resumed = run_through_pool(model, pool, 2, ids[:400], [203])
    assert (resumed - cold_logits(model, kv_dtype, ids)[197:]).abs().max() <= 1e-4


def test_a_checkpoint_one_decode_step_late_uses_the_state_before_it(model_and_kv_dtype):
    # SGLang's overlap scheduler runs the next decode step before it checkpoints this one.
    model, kv_dtype = model_and_kv_dtype
    ids = random_ids(300, model.config.vocab_size, seed=86)
    pool = V4KVPool(2048, 1, model.config, kv_dtype, max_requests=4, max_context=1024, device="cpu")
    run_through_pool(model, pool, 1, ids, [259, 1])
    slots = torch.arange(1, 260)
    pool.entry_ownership.commit(1, slots, 0, 259)
    checkpoint = pool.checkpoints.make(1, 259)
    pool.checkpoints.resume(3, checkpoint, slots)
    resumed = run_through_pool(model, pool, 3, ids, [41])
    assert (resumed - cold_logits(model, kv_dtype, ids)[259:]).abs().max() <= 1e-4


def test_checkpoints_and_requests_return_every_row_they_shared(tiny_model):
    pool = V4KVPool(2048, 1, tiny_model.config, torch.float32, max_requests=4, max_context=1024, device="cpu")
    before = pool.storage.usage()
    ids = random_ids(300, tiny_model.config.vocab_size, seed=87)
    run_through_pool(tiny_model, pool, 1, ids, [200])
    slots = torch.arange(1, 201)
    pool.entry_ownership.commit(1, slots, 0, 200)
    checkpoint = pool.checkpoints.make(1, 200)
    pool.checkpoints.resume(2, checkpoint, slots)  # row 2 borrows the prefix's entries from the prefix cache
    run_through_pool(tiny_model, pool, 2, ids, [100])
    pool.storage.tables.free(1)
    pool.checkpoints.release(checkpoint)
    pool.storage.tables.free(2)
    assert pool.storage.usage() != before  # the prefix cache still holds the entries row 2 borrowed
    pool.entry_ownership.release_slots(slots)
    assert pool.storage.usage() == before


def test_a_resumed_row_counts_no_reference_on_its_prefixs_entries_and_the_audit_sees_them_freed_under_it(tiny_model):
    pool = V4KVPool(2048, 1, tiny_model.config, torch.float32, max_requests=4, max_context=1024, device="cpu")
    run_through_pool(tiny_model, pool, 1, random_ids(300, tiny_model.config.vocab_size, seed=88), [200])
    slots = torch.arange(1, 201)
    pool.entry_ownership.commit(1, slots, 0, 200)
    checkpoint = pool.checkpoints.make(1, 200)
    pool.storage.tables.free(1)
    refs = {r: rows.refs.clone() for r, rows in pool.storage.entry_rows.items()}
    pool.checkpoints.resume(2, checkpoint, slots)
    assert all(torch.equal(rows.refs, refs[r]) for r, rows in pool.storage.entry_rows.items())
    assert set(pool.manager.audit([checkpoint]).values()) == {0}
    with pytest.raises(AssertionError, match="into the prefix"):
        pool.storage.tables.rewind(2, 150)
    pool.entry_ownership.release_slots(slots)  # what the request's lock on the prefix forbids
    audit = pool.manager.audit([checkpoint])
    assert audit["ratio_4_borrowed_entries_free"] == 50 and audit["ratio_4_entries"] == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 12), max_size=8)), max_size=30))
def test_shared_rows_count_what_is_shared_and_released_and_free_exactly_the_unheld(calls):
    """Sharing and releasing batches of rows (padding 0s, repeats) against plain counts: the counts, the free
    rows and the order they come back in (released rows in increasing order, as one by one from the lowest)."""
    rows, counts, free = SharedRows(12, "rows"), [0] * 13, list(range(12, 0, -1))
    held = rows.alloc(12).tolist()
    free.clear()
    for row in held:
        counts[row] = 1
    for sharing, batch in calls:
        named = [row for row in batch if row > 0]
        if sharing and all(counts[row] > 0 for row in named):
            rows.share(torch.tensor(batch, dtype=torch.int64))
            for row in named:
                counts[row] += 1
        elif not sharing and all(counts[row] >= named.count(row) for row in named):
            rows.release(torch.tensor(batch, dtype=torch.int64))
            for row in named:
                counts[row] -= 1
            free.extend(sorted({row for row in named if counts[row] == 0}))
        else:
            with pytest.raises(AssertionError):
                (rows.share if sharing else rows.release)(torch.tensor(batch, dtype=torch.int64))
            return
        assert rows.refs.tolist() == counts
        assert rows.free_stack[: rows.free].tolist() == free


def make_scarce(pool: V4KVPool, kind: str, capacity: int) -> None:
    """Give ``pool`` only ``capacity`` rows of ``kind`` (``records`` or ``window_slots``), before anything is held."""
    storage = pool.storage
    rows = SharedRows(capacity, getattr(storage, kind).name)
    setattr(storage, kind, rows)
    if kind == "window_slots":
        storage.tables.window_slots = rows


def forward_with_snapshots(model, pool: V4KVPool, request: int, ids: torch.Tensor, start: int, end: int):
    """Logits of tokens ``start .. end - 1`` of ``ids`` from the pool's state, filling the snapshots
    the pool planned for the forward as the attention backend does (in pieces ending at them)."""
    state = RequestState(
        start, [pool.storage.load(layer, request, start, model.dtype) for layer in range(len(model.layers))]
    )
    ends = [(c.position, c) for c in pool.checkpoints.between(request, start, end)]
    logits = []
    for piece_end, checkpoint in ends + ([] if ends and ends[-1][0] == end else [(end, None)]):
        logits.append(model(ids[start:piece_end], state))
        for layer, layer_state in enumerate(state.layers):
            pool.storage.store(layer, request, start, piece_end, layer_state)
            if checkpoint is not None:
                pool.storage.snapshot(layer, request, checkpoint.record)
        start = piece_end
    return torch.cat(logits)


def test_snapshots_beyond_the_records_are_skipped_counted_logged_once_and_the_rest_resume_exactly(
    model_and_kv_dtype, caplog
):
    model, kv_dtype = model_and_kv_dtype
    ids = random_ids(400, model.config.vocab_size, seed=88)
    pool = V4KVPool(2048, 1, model.config, kv_dtype, max_requests=4, max_context=1024, device="cpu")
    make_scarce(pool, "records", 2)
    pool.checkpoints.interval = 64
    pool.storage.tables.bind(1)
    with caplog.at_level(logging.WARNING, logger="sglang_dsv4.prefix_cache.checkpoints"):
        pool.manager.reserve(1, 400)  # snapshots at 64, 128, ..., 384: records for the first two only
    assert [c.position for c in pool.checkpoints.pending[1]] == [64, 128]
    assert dict(pool.checkpoints.skipped) == {"records": 4, "window_slots": 0}
    assert len([r for r in caplog.records if "skipped" in r.getMessage()]) == 1  # once per interval
    cold = cold_logits(model, kv_dtype, ids)
    assert (forward_with_snapshots(model, pool, 1, ids, 0, 400) - cold).abs().max() <= 1e-4
    slots = torch.arange(1, 401)
    pool.entry_ownership.commit(1, slots, 0, 400)
    snapshot = pool.checkpoints.take(1, 400)[-1]
    pool.checkpoints.resume(2, snapshot, slots)
    pool.manager.reserve(2, 400)
    assert (forward_with_snapshots(model, pool, 2, ids, 128, 400) - cold[128:]).abs().max() <= 1e-4


def test_a_forwards_own_window_slots_are_found_by_dropping_snapshots_not_taken_yet(tiny_model):
    window = tiny_model.config.sliding_window
    first, second = random_ids(600, 1024, seed=89), random_ids(300, 1024, seed=90)
    pool = V4KVPool(2048, 1, tiny_model.config, torch.float32, max_requests=4, max_context=1024, device="cpu")
    make_scarce(pool, "window_slots", 650)
    pool.checkpoints.interval = 64
    pool.storage.tables.bind(1)
    pool.manager.reserve(1, 600)  # its window and the snapshots' windows: every one of its 600 tokens
    assert len(pool.checkpoints.pending[1]) == 9 and pool.storage.window_slots.free == 50
    pool.storage.tables.bind(2)
    pool.manager.reserve(2, 300)  # its own last window + 1 must be found: row 1's newest snapshots go
    assert int((pool.storage.tables.window_rows(2, 300 - window - 1, 300) > 0).sum()) == window + 1
    kept = [c.position for c in pool.checkpoints.pending[1]]
    assert kept == [64 * (i + 1) for i in range(len(kept))] and len(kept) < 9
    assert pool.checkpoints.skipped["window_slots"] >= 9 - len(kept)
    # Both forwards run after both reservations, as in one batch: each still exact.
    cold_first = tiny_model(first, tiny_model.new_state())
    assert (forward_with_snapshots(tiny_model, pool, 1, first, 0, 600) - cold_first).abs().max() <= 1e-4
    cold_second = tiny_model(second, tiny_model.new_state())
    assert (forward_with_snapshots(tiny_model, pool, 2, second, 0, 300) - cold_second).abs().max() <= 1e-4
    slots = torch.arange(1, 601)
    pool.entry_ownership.commit(1, slots, 0, 600)
    last_kept = pool.checkpoints.take(1, 600)[-1]
    pool.storage.tables.free(1)
    pool.storage.tables.free(2)
    pool.checkpoints.resume(3, last_kept, slots)
    pool.manager.reserve(3, 600)
    resumed = forward_with_snapshots(tiny_model, pool, 3, first, last_kept.position, 600)
    assert (resumed - cold_first[last_kept.position :]).abs().max() <= 1e-4


def test_a_launched_forwards_row_lets_go_of_its_snapshots_windows_before_any_checkpoint_is_evicted(tiny_model):
    """Issue 22: once a forward is launched, its row needs only the window its next forward reads;
    the windows of the snapshots it filled are the checkpoints' to keep or lose."""
    window = tiny_model.config.sliding_window
    pool = V4KVPool(2048, 1, tiny_model.config, torch.float32, max_requests=4, max_context=1024, device="cpu")
    make_scarce(pool, "window_slots", 650)
    cached: list = []  # the tree's checkpoints, least recently used first

    class Tree(NothingCached):
        def evict_checkpoints_while(self, short, for_snapshot: bool = False) -> bool:
            released = False
            while short() and cached:
                pool.checkpoints.release(cached.pop(0))
                released = True
            return released

    pool.manager.bind_tree(Tree())
    pool.checkpoints.interval = 64
    tables = pool.storage.tables
    tables.bind(1)
    pool.manager.reserve(1, 600)  # its window and nine snapshots' windows: every one of its 600 tokens' slots
    tables.begin_forward()
    cached += pool.checkpoints.take(1, 600)  # the tree takes them
    assert len(cached) == 9 and pool.storage.window_slots.free == 50
    pool.checkpoints.interval = 0  # row 2 plans no snapshots: only its own window + 1 is asked for
    tables.bind(2)
    pool.manager.reserve(2, 300)
    assert int((tables.window_rows(2, 300 - window - 1, 300) > 0).sum()) == window + 1
    # Row 1 let go of all but its next forward's window; then the oldest checkpoints went until 79 more
    # slots were free (each frees the 64 its window does not share with the next one; the first none).
    assert int((tables.window_table[1] > 0).sum()) == window + 1
    assert [c.position for c in cached] == [64 * i for i in range(4, 10)]
    assert pool.storage.window_slots.free == 50 + 2 * 64 - (window + 1)


def test_room_for_windows_counts_only_what_running_requests_can_give_back(tiny_model):
    window = tiny_model.config.sliding_window
    pool = V4KVPool(2048, 1, tiny_model.config, torch.float32, max_requests=4, max_context=1024, device="cpu")
    make_scarce(pool, "window_slots", 3 * (window + 1))
    pool.manager.window_policy = ALL_COMMITTED
    pool.storage.tables.bind(1)
    pool.manager.reserve(1, 300)  # all_committed: every token's slot
    pool.manager.reserve(1, 301)
    assert pool.storage.window_slots.free == 3 * (window + 1) - 301
    # Row 1 falls back to what per_request keeps for its last forward (which may not have run):
    # the window before it, one slot for a checkpoint one step late, and its new token.
    assert pool.manager.room_for_windows(window + 1)
    assert pool.storage.window_slots.free == 3 * (window + 1) - (window + 2)
    pool.storage.tables.bind(2)
    pool.manager.reserve(2, 300)  # all of its window slots do not fit: what per_request keeps does
    assert pool.storage.window_slots.free == window
    assert not pool.manager.room_for_windows(window + 1)  # the two running windows hold the rest
    assert pool.manager.room_for_windows(window)


def test_a_snapshot_dropped_after_its_forward_ran_leaves_that_forwards_checkpoints_and_the_next_exact(tiny_model):
    """SGLang's overlap scheduler reserves the next batch's rows before it processes the results of
    the forward it launched last: the snapshots dropped then may be ones that forward already wrote."""
    first, second = random_ids(300, 1024, seed=91), random_ids(200, 1024, seed=92)
    pool = V4KVPool(2048, 1, tiny_model.config, torch.float32, max_requests=4, max_context=1024, device="cpu")
    make_scarce(pool, "window_slots", 400)
    pool.checkpoints.interval = 128
    pool.storage.tables.bind(1)
    pool.manager.reserve(1, 300)  # snapshots at 128 and 256: every one of its 300 tokens' slots
    cold_first = tiny_model(first, tiny_model.new_state())
    assert (forward_with_snapshots(tiny_model, pool, 1, first, 0, 300) - cold_first).abs().max() <= 1e-4
    # The next batch is reserved before the first forward's result is processed: row 2's own
    # window finds its slots by dropping row 1's newest snapshot, which that forward filled.
    pool.storage.tables.bind(2)
    pool.manager.reserve(2, 200)
    assert [c.position for c in pool.checkpoints.pending[1]] == [128]
    assert pool.checkpoints.skipped["window_slots"] >= 1
    cold_second = tiny_model(second, tiny_model.new_state())
    assert (forward_with_snapshots(tiny_model, pool, 2, second, 0, 200) - cold_second).abs().max() <= 1e-4
    # Then the first forward's result: its kept snapshot and its end's checkpoint resume exactly.
    slots = torch.arange(1, 301)
    pool.entry_ownership.commit(1, slots, 0, 300)
    resumable = [*pool.checkpoints.take(1, 300), pool.checkpoints.make(1, 300)]
    assert [c.position for c in resumable] == [128, 300]
    pool.storage.tables.free(1)
    pool.storage.tables.free(2)
    for checkpoint in resumable:
        pool.checkpoints.resume(3, checkpoint, slots)
        pool.manager.reserve(3, 301)
        ids = torch.cat([first, second[:1]])
        resumed = forward_with_snapshots(tiny_model, pool, 3, ids, checkpoint.position, 301)
        assert (resumed - tiny_model(ids, tiny_model.new_state())[checkpoint.position :]).abs().max() <= 1e-4
        pool.storage.tables.free(3)


def with_device_twins(tables: RequestTables) -> RequestTables:
    """Give the tables device twins of their own, as on a GPU (on the CPU a twin is its host table),
    so that a forward reading them sees what the last flush copied and nothing later."""
    mirrors = [tables._window, *tables._entries.values()]
    for mirror in mirrors:
        mirror.device = mirror.host.clone()
    tables.on_device = DeviceTables(tables._window.device, {r: m.device for r, m in tables._entries.items()})
    return tables


def assert_twins_equal(tables: RequestTables) -> None:
    assert torch.equal(tables.on_device.window_table, tables.window_table)
    for ratio, table in tables.entry_table.items():
        assert torch.equal(tables.on_device.entry_table[ratio], table), f"ratio {ratio}"


@pytest.mark.parametrize("long_span", [request_tables.LONG_SPAN, 16, 1 << 30])
def test_the_device_tables_change_only_at_a_flush_and_then_equal_the_hosts(tiny_model, long_span, monkeypatch):
    """Rows bound fresh and from checkpoints, reserved in prefill and decode steps, trimmed under both
    window policies, snapshots planned and taken, rows freed: after each flush the twins equal the
    host tables, and between flushes they keep what the last one copied (spans noted as spans from the default
    width, from 16 columns, and never)."""
    monkeypatch.setattr(request_tables, "LONG_SPAN", long_span)
    pool = V4KVPool(4096, 1, tiny_model.config, torch.float32, max_requests=4, max_context=1024, device="cpu")
    tables = with_device_twins(pool.storage.tables)
    pool.checkpoints.interval = 64
    generator = torch.Generator().manual_seed(93)
    slots = torch.arange(1, 1025)
    checkpoints = []
    for step in range(60):
        copied = tables.on_device.window_table.clone()
        row = int(torch.randint(1, 5, (1,), generator=generator))
        pool.manager.window_policy = (PER_REQUEST, ALL_COMMITTED)[step % 2]
        if not tables.bound[row]:
            if checkpoints and step % 3 == 0:
                pool.checkpoints.resume(row, checkpoints.pop(), slots)
            else:
                tables.bind(row)
        position = tables.position[row]
        length = 1 if step % 4 else int(torch.randint(2, 200, (1,), generator=generator))
        if position + length > 1000:
            tables.free(row)
        else:
            pool.manager.reserve(row, position + length)
            if step % 5 == 0 and position + length > 0:
                pool.entry_ownership.commit(row, slots, 0, position + length)
                made = pool.checkpoints.make(row, position + length)
                checkpoints.extend([] if made is None else [made])
                for taken in pool.checkpoints.take(row, position + length):
                    pool.checkpoints.release(taken)
        assert torch.equal(tables.on_device.window_table, copied)  # nothing reaches the twin before a flush
        if step % 3 == 2:
            tables.flush()
            assert_twins_equal(tables)
    pool.manager.clear()
    tables.flush()
    assert_twins_equal(tables)
    assert not tables.on_device.window_table.any()


def test_dropping_a_snapshot_of_the_forward_before_the_reserved_one_frees_only_its_share(tiny_model):
    """The overlap scheduler reserves a row's next decode step before the tree takes the snapshots of
    the forward before it; when another row's window then runs short, the snapshot dropped may be one
    of that earlier forward, all of whose window lies before the step's start."""
    window = tiny_model.config.sliding_window
    pool = V4KVPool(2048, 1, tiny_model.config, torch.float32, max_requests=4, max_context=1024, device="cpu")
    make_scarce(pool, "window_slots", 300)
    pool.checkpoints.interval = 128
    tables = pool.storage.tables
    tables.bind(1)
    pool.manager.reserve(1, 200)  # a snapshot at 128, whose window (0 .. 127) lies before the next step
    pool.manager.reserve(1, 201)  # the next decode step, reserved before the tree takes it
    assert [c.position for c in pool.checkpoints.pending[1]] == [128]
    held = pool.storage.window_slots.free
    tables.bind(2)
    pool.manager.reserve(2, held + 1)  # more than is free: the snapshot at 128 goes, row 1 keeps its window
    assert pool.checkpoints.pending[1] == [] and pool.checkpoints.skipped["window_slots"] == 1
    assert int((tables.window_rows(1, 201 - window - 1, 201) > 0).sum()) == window + 1
