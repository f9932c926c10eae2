"""A decode step's reservation, batched over the rows (CacheManager.alloc_to_lengths), takes and gives back
exactly the rows that reserving row after row does: the oracle is a twin manager run through the same
scheduling, reserving each row of each batch in order with CacheManager.reserve (what alloc_to_lengths did
before it batched the plain decode steps)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

import sglang_dsv4
from sglang_dsv4.config import load_config
from sglang_dsv4.memory_pool.shared_rows import SharedRows
from sglang_dsv4.memory_pool.storage import V4PoolStorage
from sglang_dsv4.prefix_cache.manager import CacheManager
from sglang_dsv4.prefix_cache.window_policy import ALL_COMMITTED, PER_REQUEST

TINY = Path(sglang_dsv4.__file__).parent / "checkpoints" / "tiny"
ROWS, CONTEXT = 8, 512


def manager_of(policy, window_slots: int | None, interval: int) -> CacheManager:
    storage = V4PoolStorage(
        load_config(TINY), torch.float32, num_tokens=ROWS * CONTEXT, max_requests=ROWS, max_context=CONTEXT,
        device="cpu",
    )  # fmt: skip
    if window_slots is not None:  # scarce: the batched step falls back to row after row, which makes room
        storage.window_slots = storage.tables.window_slots = SharedRows(window_slots, "window slots")
    manager = CacheManager(storage)
    manager.window_policy, manager.checkpoints.interval = policy, interval
    return manager


def reserve_row_after_row(manager: CacheManager, rows: list[int], targets: list[int]) -> None:
    for row, target in zip(rows, targets, strict=True):
        if manager.tables.bound[row]:
            manager.reserve(row, target)


def state(manager: CacheManager) -> dict:
    storage, tables = manager.storage, manager.tables
    allocators = {"window": storage.window_slots, "records": storage.records}
    allocators |= {f"entries{r}": rows for r, rows in storage.entry_rows.items()}
    return {
        "window_table": tables.window_table.clone(),
        **{f"entry_table{r}": table.clone() for r, table in tables.entry_table.items()},
        **{f"{name}.refs": rows.refs.clone() for name, rows in allocators.items()},
        **{f"{name}.free": rows.free_stack[: rows.free].clone() for name, rows in allocators.items()},
        "lists": (tables.position, tables.last_step, tables.held_from, tables.bound, tables.entry_count),
        "unlaunched": set(tables.unlaunched),
        "pending": {
            row: [(c.position, c.record, c.window.tolist()) for c in pending]
            for row, pending in manager.checkpoints.pending.items()
        },
        "skipped": dict(manager.checkpoints.skipped),
    }


def assert_same(batched: CacheManager, oracle: CacheManager) -> None:
    got, expected = state(batched), state(oracle)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(got[name], value), name
        else:
            assert got[name] == value, name


@pytest.mark.parametrize(
    "policy, window_slots, interval",
    [
        (PER_REQUEST, None, 0),
        (PER_REQUEST, None, 16),
        (ALL_COMMITTED, None, 16),
        (PER_REQUEST, ROWS * 70, 16),
        (ALL_COMMITTED, ROWS * 70, 0),
    ],
    ids=["per_request", "per_request_snapshots", "all_committed", "per_request_scarce", "all_committed_scarce"],
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_batched_decode_step_takes_the_rows_reserving_row_after_row_takes(policy, window_slots, interval, seed):
    rng = random.Random(seed)
    batched, oracle = (manager_of(policy, window_slots, interval) for _ in range(2))
    for step in range(120):
        tables = oracle.tables
        free_rows = [row for row in range(1, ROWS + 1) if not tables.bound[row]]
        roomy = oracle.storage.window_slots.free > 300  # a scarce pool's scheduler admits no more then
        for row in free_rows[: rng.randint(0, 2) if roomy else 0]:  # requests arriving: a prefill of 1 to 150 tokens
            length = rng.randint(1, 150)
            for manager in (batched, oracle):
                manager.start(row, length)
        running = [row for row in range(1, ROWS + 1) if tables.bound[row]]
        rng.shuffle(running)
        batch = running[: rng.randint(0, len(running))]
        # Mostly one token (decode), at times a chunk; at times a row taking a checkpoint of its live state first.
        chunk = (lambda: rng.randint(2, 40)) if roomy else (lambda: 1)
        targets = [tables.position[row] + (1 if rng.random() < 0.85 else chunk()) for row in batch]
        if batch and rng.random() < 0.2:
            row = batch[0]
            for manager in (batched, oracle):
                checkpoint = manager.make_checkpoint(row, manager.tables.position[row])
                if checkpoint is not None:
                    manager.checkpoints.pending.setdefault(row, []).append(checkpoint)
        if any(t > CONTEXT for t in targets):
            break
        indices, lengths = torch.tensor(batch, dtype=torch.int64), torch.tensor(targets, dtype=torch.int64)
        batched.alloc_to_lengths(req_pool_indices_cpu=indices, target_seq_lens_cpu=lengths)
        reserve_row_after_row(oracle, batch, targets)
        assert_same(batched, oracle)
        if rng.random() < 0.7:
            for manager in (batched, oracle):
                manager.tables.begin_forward()
        for row in running:
            if rng.random() < 0.04:  # a request finishing
                for manager in (batched, oracle):
                    manager.free(row)
        assert_same(batched, oracle)


def sequential_recycle(rows: SharedRows, released: list[int]) -> list[int]:
    taken = []
    for row in released:
        rows.release(torch.tensor([row]))
        taken.append(int(rows.alloc(1)[0]))
    return taken


@pytest.mark.parametrize("seed", range(5))
def test_recycling_rows_each_hands_out_what_release_then_alloc_does_in_turn(seed):
    rng = random.Random(seed)
    batched, oracle = SharedRows(64, "a"), SharedRows(64, "b")
    held = batched.alloc(40).tolist()
    oracle.alloc(40)
    shared = held[:10]
    for rows in (batched, oracle):
        rows.share(torch.tensor(shared))  # released once, these stay held
    released = [rng.choice([0, held.pop(rng.randrange(len(held)))]) for _ in range(20)]
    got = batched.recycle_each(torch.tensor(released))
    assert got.tolist() == sequential_recycle(oracle, released)
    assert torch.equal(batched.refs, oracle.refs)
    assert torch.equal(batched.free_stack[: batched.free], oracle.free_stack[: oracle.free])


def test_recycling_a_row_twice_or_past_the_free_rows_changes_nothing():
    rows = SharedRows(4, "rows")
    held = rows.alloc(3)
    rows.share(held[:1])
    refs, free = rows.refs.clone(), rows.free
    assert rows.recycle_each(torch.tensor([held[0], held[0]])) is None
    assert rows.recycle_each(torch.tensor([0, 0])) is None  # two rows taken, one free
    assert torch.equal(rows.refs, refs) and rows.free == free


def test_a_decode_step_short_of_window_slots_makes_room_as_reserving_row_after_row_does():
    """all_committed rows decoding past what the window slots hold: the batched step finds too few free and the
    rows are reserved one by one, each making room (letting go of what no forward reads) as before."""
    rows, prompt = [1, 2, 3, 4], 200
    batched, oracle = (manager_of(ALL_COMMITTED, len(rows) * 135, 0) for _ in range(2))
    fell_back = 0
    for manager in (batched, oracle):
        for row in rows:
            manager.start(row, prompt)
            manager.tables.begin_forward()
    for step in range(1, 40):
        targets = [prompt + step] * len(rows)
        fell_back += batched.storage.window_slots.free < len(rows)
        batched.alloc_to_lengths(req_pool_indices_cpu=torch.tensor(rows), target_seq_lens_cpu=torch.tensor(targets))
        reserve_row_after_row(oracle, rows, targets)
        for manager in (batched, oracle):
            manager.tables.begin_forward()
        assert_same(batched, oracle)
    assert fell_back > 0


class GiveBacks:
    """Counts the calls that make room for window slots (what a decode check short of free slots runs)."""

    def __init__(self, manager: CacheManager, monkeypatch) -> None:
        self.calls = 0
        for owner, name in ((manager.tables, "keep_only_what_forwards_read"), (manager.checkpoints, "drop_newest"),
                            (manager.tree, "keep_only_resumed_windows")):  # fmt: skip
            monkeypatch.setattr(owner, name, self.counted(getattr(owner, name)))

    def counted(self, function):
        def call(*args, **kwargs):
            self.calls += 1
            return function(*args, **kwargs)

        return call


@pytest.mark.parametrize("window_slots, interval", [(ROWS * 70, 16), (ROWS * 40, 0), (ROWS * 70, 8)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_decode_step_takes_at_most_the_window_slots_the_decode_check_counts(window_slots, interval, seed, monkeypatch):
    """Under ``per_request`` the decode check counts one slot a row less the rows whose oldest slot comes back
    free as they move on: with that many free, reserving the step row after row (snapshots planned in it too)
    never runs short, makes no room, and takes no more than counted."""
    rng = random.Random(seed)
    manager = manager_of(PER_REQUEST, window_slots, interval)
    tables, slots = manager.tables, manager.storage.window_slots
    give_backs = GiveBacks(manager, monkeypatch)
    for step in range(150):
        free_rows = [row for row in range(1, ROWS + 1) if not tables.bound[row]]
        for row in free_rows[: rng.randint(0, 1) if slots.free > 160 else 0]:  # admitted while a window fits
            manager.start(row, rng.randint(1, 150))
            tables.begin_forward()
        batch = [row for row in range(1, ROWS + 1) if tables.bound[row] and rng.random() < 0.8]
        if any(tables.position[row] + 1 > CONTEXT for row in batch):
            break
        counted, free, calls = manager.window_slots_for_decode(batch, 1), slots.free, give_backs.calls
        if free < counted:
            manager.room_for_windows(counted)  # the check's room, made as before
            free, calls = slots.free, give_backs.calls
        reserve_row_after_row(manager, batch, [tables.position[row] + 1 for row in batch])
        assert free - slots.free <= counted
        assert give_backs.calls == calls
        tables.begin_forward()
        for row in batch:
            if rng.random() < 0.03:
                manager.free(row)


def test_a_full_pool_of_windows_decodes_on_the_slots_its_rows_let_go(monkeypatch):
    """Every window slot held by rows decoding past their windows (a served rank at its boundary): each step is
    counted at zero slots from what is free, and reserving it recycles each row's oldest slot, making no room."""
    rows, prompt = [1, 2, 3, 4], 200
    manager = manager_of(PER_REQUEST, len(rows) * (load_config(TINY).sliding_window + 2), 0)
    tables, slots = manager.tables, manager.storage.window_slots
    for row in rows:
        manager.start(row, prompt)
        tables.begin_forward()
    give_backs = GiveBacks(manager, monkeypatch)
    for step in range(1, 20):
        assert manager.room_for_windows(manager.window_slots_for_decode(rows, 1))  # SGLang's decode check
        reserve_row_after_row(manager, rows, [prompt + step] * len(rows))
        tables.begin_forward()
        if step >= 2:  # every row holds its window and the slot before it
            assert slots.free < len(rows) and manager.window_slots_for_decode(rows, 1) == 0
    assert slots.free == 0 and give_backs.calls == 0
