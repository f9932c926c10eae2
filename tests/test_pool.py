"""The V4 pool keeps exactly the network's per-request state: load/store round trips."""

from __future__ import annotations

import logging

import torch
from conftest import random_ids

from sglang_dsv4.memory_pool.pool import V4KVPool
from sglang_dsv4.memory_pool.shared_rows import SharedRows
from sglang_dsv4.model.state import RequestState


def run_through_pool(model, pool: V4KVPool, request: int, ids: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """Logits of ``ids`` fed in ``chunks``, the state living in the pool between chunks."""
    logits, start = [], pool.tables.position[request]
    if not pool.tables.bound[request]:
        pool.start(request)
    for length in chunks:
        end = start + length
        pool.tables.reserve(request, end)
        layers = [pool.load(layer, request, start, torch.float32) for layer in range(model.config.num_layers)]
        state = RequestState(start, layers)
        logits.append(model(ids[start:end], state))
        for layer, layer_state in enumerate(state.layers):
            pool.store(layer, request, start, end, layer_state)
        start = end
    return torch.cat(logits)


def test_state_resumed_from_the_pool_equals_the_networks_own(tiny_model):
    ids = random_ids(300, tiny_model.config.vocab_size, seed=80)
    pool = V4KVPool(1024, 1, tiny_model.config, torch.float32, max_requests=4, max_context=1024, device="cpu")
    chunks = [130, 1, 1, 97, 71]  # ends inside ratio-4 and ratio-128 blocks
    through_pool = run_through_pool(tiny_model, pool, 3, ids, chunks)
    assert (through_pool - tiny_model(ids, tiny_model.new_state())).abs().max() <= 1e-4


def test_a_reused_request_row_starts_from_an_empty_state(tiny_model):
    pool = V4KVPool(1024, 1, tiny_model.config, torch.float32, max_requests=2, max_context=1024, device="cpu")
    first, second = random_ids(200, 1024, seed=81), random_ids(150, 1024, seed=82)
    run_through_pool(tiny_model, pool, 1, first, [200])
    pool.tables.free(1)
    reused = run_through_pool(tiny_model, pool, 1, second, [150])
    assert (reused - tiny_model(second, tiny_model.new_state())).abs().max() <= 1e-4


def test_freeing_a_request_returns_its_entry_rows(tiny_model):
    pool = V4KVPool(1024, 1, tiny_model.config, torch.float32, max_requests=2, max_context=1024, device="cpu")
    before = pool.usage()
    run_through_pool(tiny_model, pool, 2, random_ids(300, 1024, seed=83), [300])
    held = pool.usage()
    assert held["ratio_4_entries"]["free"] == before["ratio_4_entries"]["free"] - 75
    assert held["ratio_128_entries"]["free"] == before["ratio_128_entries"]["free"] - 2
    window = tiny_model.config.sliding_window
    assert held["window_slots"]["free"] == before["window_slots"]["free"] - (window + 1)
    pool.tables.free(2)
    assert pool.usage() == before


def test_bfloat16_pool_stores_bfloat16_and_keeps_the_greedy_choices(tiny_model):
    ids = random_ids(300, tiny_model.config.vocab_size, seed=84)
    pool = V4KVPool(1024, 1, tiny_model.config, torch.bfloat16, max_requests=2, max_context=1024, device="cpu")
    assert pool.window[0].dtype == torch.bfloat16 and all(b.dtype == torch.bfloat16 for b in pool.compressed.values())
    through_pool = run_through_pool(tiny_model, pool, 1, ids, [150, 150])
    exact = tiny_model(ids, tiny_model.new_state())
    assert (through_pool[:150] - exact[:150]).abs().max() <= 1e-4  # the first chunk reads nothing back
    later = slice(150, None)  # reads the window and entries back, rounded to bfloat16
    assert (through_pool[later] - exact[later]).abs().max() > 1e-3
    assert (through_pool[later].argmax(-1) == exact[later].argmax(-1)).float().mean() >= 0.95


def test_a_checkpoint_resumes_exactly_on_another_row(tiny_model):
    ids = random_ids(400, tiny_model.config.vocab_size, seed=85)
    pool = V4KVPool(2048, 1, tiny_model.config, torch.float32, max_requests=4, max_context=1024, device="cpu")
    run_through_pool(tiny_model, pool, 1, ids, [130, 67])  # 197: inside a ratio-4 and a ratio-128 block
    slots = torch.arange(1, 198)  # the token slots a prefix cache would hold for them
    pool.commit_entries(1, slots, 0, 197)
    checkpoint = pool.checkpoint(1, 197)
    pool.tables.free(1)  # the checkpoint and the slots keep what they point at
    pool.resume(2, checkpoint, slots)
    resumed = run_through_pool(tiny_model, pool, 2, ids[:400], [203])
    cold = tiny_model(ids, tiny_model.new_state())
    assert (resumed - cold[197:]).abs().max() <= 1e-4


def test_a_checkpoint_one_decode_step_late_uses_the_state_before_it(tiny_model):
    # SGLang's overlap scheduler runs the next decode step before it checkpoints this one.
    ids = random_ids(300, tiny_model.config.vocab_size, seed=86)
    pool = V4KVPool(2048, 1, tiny_model.config, torch.float32, max_requests=4, max_context=1024, device="cpu")
    run_through_pool(tiny_model, pool, 1, ids, [259, 1])
    slots = torch.arange(1, 260)
    pool.commit_entries(1, slots, 0, 259)
    checkpoint = pool.checkpoint(1, 259)
    pool.resume(3, checkpoint, slots)
    resumed = run_through_pool(tiny_model, pool, 3, ids, [41])
    assert (resumed - tiny_model(ids, tiny_model.new_state())[259:]).abs().max() <= 1e-4


def test_checkpoints_and_requests_return_every_row_they_shared(tiny_model):
    pool = V4KVPool(2048, 1, tiny_model.config, torch.float32, max_requests=4, max_context=1024, device="cpu")
    before = pool.usage()
    ids = random_ids(300, tiny_model.config.vocab_size, seed=87)
    run_through_pool(tiny_model, pool, 1, ids, [200])
    slots = torch.arange(1, 201)
    pool.commit_entries(1, slots, 0, 200)
    checkpoint = pool.checkpoint(1, 200)
    pool.resume(2, checkpoint, slots)
    run_through_pool(tiny_model, pool, 2, ids, [100])
    pool.tables.free(1)
    pool.release(checkpoint)
    pool.release_slots(slots)
    assert pool.usage() != before  # row 2 still holds the shared entries
    pool.tables.free(2)
    assert pool.usage() == before


def make_scarce(pool: V4KVPool, kind: str, capacity: int) -> None:
    """Give ``pool`` only ``capacity`` rows of ``kind`` (``records`` or ``window_slots``), before anything is held."""
    rows = SharedRows(capacity, getattr(pool, kind).name)
    setattr(pool, kind, rows)
    if kind == "window_slots":
        pool.tables.window_slots = rows


def forward_with_snapshots(model, pool: V4KVPool, request: int, ids: torch.Tensor, start: int, end: int):
    """Logits of tokens ``start .. end - 1`` of ``ids`` from the pool's state, filling the snapshots
    the pool planned for the forward as the attention backend does (in pieces ending at them)."""
    state = RequestState(start, [pool.load(layer, request, start, torch.float32) for layer in range(len(model.layers))])
    ends = [(c.position, c) for c in pool.snapshots_between(request, start, end)]
    logits = []
    for piece_end, checkpoint in ends + ([] if ends and ends[-1][0] == end else [(end, None)]):
        logits.append(model(ids[start:piece_end], state))
        for layer, layer_state in enumerate(state.layers):
            pool.store(layer, request, start, piece_end, layer_state)
            if checkpoint is not None:
                pool.snapshot(layer, request, checkpoint)
        start = piece_end
    return torch.cat(logits)


def test_snapshots_beyond_the_records_are_skipped_counted_logged_once_and_the_rest_resume_exactly(tiny_model, caplog):
    ids = random_ids(400, tiny_model.config.vocab_size, seed=88)
    pool = V4KVPool(2048, 1, tiny_model.config, torch.float32, max_requests=4, max_context=1024, device="cpu")
    make_scarce(pool, "records", 2)
    pool.snapshot_interval = 64
    pool.start(1)
    with caplog.at_level(logging.WARNING, logger="sglang_dsv4.memory_pool.pool"):
        pool.tables.reserve(1, 400)  # snapshots at 64, 128, ..., 384: records for the first two only
    assert [c.position for c in pool.pending[1]] == [64, 128]
    assert dict(pool.checkpoints_skipped) == {"records": 4, "window_slots": 0}
    assert len([r for r in caplog.records if "skipped" in r.getMessage()]) == 1  # once per interval
    cold = tiny_model(ids, tiny_model.new_state())
    assert (forward_with_snapshots(tiny_model, pool, 1, ids, 0, 400) - cold).abs().max() <= 1e-4
    slots = torch.arange(1, 401)
    pool.commit_entries(1, slots, 0, 400)
    snapshot = pool.take_snapshots(1, 400)[-1]
    pool.resume(2, snapshot, slots)
    pool.tables.reserve(2, 400)
    assert (forward_with_snapshots(tiny_model, pool, 2, ids, 128, 400) - cold[128:]).abs().max() <= 1e-4


def test_a_forwards_own_window_slots_are_found_by_dropping_snapshots_not_taken_yet(tiny_model):
    window = tiny_model.config.sliding_window
    first, second = random_ids(600, 1024, seed=89), random_ids(300, 1024, seed=90)
    pool = V4KVPool(2048, 1, tiny_model.config, torch.float32, max_requests=4, max_context=1024, device="cpu")
    make_scarce(pool, "window_slots", 650)
    pool.set_reclaim(lambda: False, lambda: False)  # no prefix cache: nothing cached to evict
    pool.snapshot_interval = 64
    pool.start(1)
    pool.tables.reserve(1, 600)  # its window and the snapshots' windows: every one of its 600 tokens
    assert len(pool.pending[1]) == 9 and pool.window_slots.free == 50
    pool.start(2)
    pool.tables.reserve(2, 300)  # its own last window + 1 must be found: row 1's newest snapshots go
    assert int((pool.tables.window_rows(2, 300 - window - 1, 300) > 0).sum()) == window + 1
    kept = [c.position for c in pool.pending[1]]
    assert kept == [64 * (i + 1) for i in range(len(kept))] and len(kept) < 9
    assert pool.checkpoints_skipped["window_slots"] >= 9 - len(kept)
    # Both forwards run after both reservations, as in one batch: each still exact.
    cold_first = tiny_model(first, tiny_model.new_state())
    assert (forward_with_snapshots(tiny_model, pool, 1, first, 0, 600) - cold_first).abs().max() <= 1e-4
    cold_second = tiny_model(second, tiny_model.new_state())
    assert (forward_with_snapshots(tiny_model, pool, 2, second, 0, 300) - cold_second).abs().max() <= 1e-4
    slots = torch.arange(1, 601)
    pool.commit_entries(1, slots, 0, 600)
    last_kept = pool.take_snapshots(1, 600)[-1]
    pool.tables.free(1)
    pool.tables.free(2)
    pool.resume(3, last_kept, slots)
    pool.tables.reserve(3, 600)
    resumed = forward_with_snapshots(tiny_model, pool, 3, first, last_kept.position, 600)
    assert (resumed - cold_first[last_kept.position :]).abs().max() <= 1e-4


def test_room_for_windows_counts_only_what_running_requests_can_give_back(tiny_model):
    window = tiny_model.config.sliding_window
    pool = V4KVPool(2048, 1, tiny_model.config, torch.float32, max_requests=4, max_context=1024, device="cpu")
    make_scarce(pool, "window_slots", 3 * (window + 1))
    pool.set_reclaim(lambda: False, lambda: False)
    pool.tables.window_policy = "all_committed"
    pool.start(1)
    pool.tables.reserve(1, 300)  # all_committed: every token's slot
    pool.tables.reserve(1, 301)
    assert pool.window_slots.free == 3 * (window + 1) - 301
    # Row 1 falls back to what per_request keeps for its last forward (which may not have run):
    # the window before it, one slot for a checkpoint one step late, and its new token.
    assert pool.room_for_windows(window + 1)
    assert pool.window_slots.free == 3 * (window + 1) - (window + 2)
    pool.start(2)
    pool.tables.reserve(2, 300)  # all of its window slots do not fit: what per_request keeps does
    assert pool.window_slots.free == window
    assert not pool.room_for_windows(window + 1)  # the two running windows hold the rest
    assert pool.room_for_windows(window)


def test_a_snapshot_dropped_after_its_forward_ran_leaves_that_forwards_checkpoints_and_the_next_exact(tiny_model):
    """SGLang's overlap scheduler reserves the next batch's rows before it processes the results of
    the forward it launched last: the snapshots dropped then may be ones that forward already wrote."""
    first, second = random_ids(300, 1024, seed=91), random_ids(200, 1024, seed=92)
    pool = V4KVPool(2048, 1, tiny_model.config, torch.float32, max_requests=4, max_context=1024, device="cpu")
    make_scarce(pool, "window_slots", 400)
    pool.set_reclaim(lambda: False, lambda: False)
    pool.snapshot_interval = 128
    pool.start(1)
    pool.tables.reserve(1, 300)  # snapshots at 128 and 256: every one of its 300 tokens' slots
    cold_first = tiny_model(first, tiny_model.new_state())
    assert (forward_with_snapshots(tiny_model, pool, 1, first, 0, 300) - cold_first).abs().max() <= 1e-4
    # The next batch is reserved before the first forward's result is processed: row 2's own
    # window finds its slots by dropping row 1's newest snapshot, which that forward filled.
    pool.start(2)
    pool.tables.reserve(2, 200)
    assert [c.position for c in pool.pending[1]] == [128]
    assert pool.checkpoints_skipped["window_slots"] >= 1
    cold_second = tiny_model(second, tiny_model.new_state())
    assert (forward_with_snapshots(tiny_model, pool, 2, second, 0, 200) - cold_second).abs().max() <= 1e-4
    # Then the first forward's result: its kept snapshot and its end's checkpoint resume exactly.
    slots = torch.arange(1, 301)
    pool.commit_entries(1, slots, 0, 300)
    resumable = [*pool.take_snapshots(1, 300), pool.checkpoint(1, 300)]
    assert [c.position for c in resumable] == [128, 300]
    pool.tables.free(1)
    pool.tables.free(2)
    for checkpoint in resumable:
        pool.resume(3, checkpoint, slots)
        pool.tables.reserve(3, 301)
        ids = torch.cat([first, second[:1]])
        resumed = forward_with_snapshots(tiny_model, pool, 3, ids, checkpoint.position, 301)
        assert (resumed - tiny_model(ids, tiny_model.new_state())[checkpoint.position :]).abs().max() <= 1e-4
        pool.tables.free(3)
