"""The cache manager: the one owner of the order in which the V4 pool's rows are taken and given back.

SGLang's request pool holds it as its auxiliary cache (``alloc_to_lengths`` before every forward,
``free`` when a request's row goes), and the radix tree, built after the pool, is bound to it
(:meth:`CacheManager.bind_tree`). For each forward of a request row it

1. makes room for what the forward cannot run without — the window slots of its last
   ``sliding_window + 1`` tokens and the entry rows of its blocks — and takes them
   (:meth:`~sglang_dsv4.memory_pool.request_tables.RequestTables.reserve`);
2. then, as far as room can be made by evicting only what the cache holds, what is optional:
   under ``all_committed`` the slots of the forward's other tokens, and the snapshots the
   checkpoint planner puts in the forward (:class:`~.checkpoints.Checkpoints`).

Room for what a forward cannot run without is made cheapest loss first: rows let go of what no
forward reads, checkpoints of what no resume reads (all_committed's windows fall back to what
per_request keeps), the tree's checkpoints worth least go (:mod:`.retention`), then snapshots not taken yet
(for window slots); the tree's least recently used tokens (for entry rows). SGLang's admission
and decode checks ask :meth:`CacheManager.room_for_windows` for the same count, made the same
way. A cached prefix the tree loads back from its host tier (:mod:`.host_tier`) gets its rows the same
way, all or none (:meth:`CacheManager.rows_for_load_back`). Nothing below calls up: the allocators
(:class:`~sglang_dsv4.memory_pool.shared_rows.SharedRows`) take only what is free and report a shortage, the
tables and the planner hold no callables.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from ..memory_pool.checkpoint import Checkpoint
from ..memory_pool.shared_rows import SharedRows
from ..memory_pool.storage import V4PoolStorage
from .checkpoints import NO_RECORD, NO_WINDOW_SLOTS, Checkpoints
from .entry_ownership import EntryOwnership
from .window_policy import PER_REQUEST, WindowPolicy


class Evictions(Protocol):
    """What the prefix tree gives back when the manager asks; each says whether it freed anything."""

    def evict_checkpoints_while(self, short: Callable[[], bool], for_snapshot: bool = False) -> bool:
        """While ``short()``, release the checkpoint worth least that no request holds its lock on (for a forward's
        snapshot: none that is a session's deepest)."""

    def keep_only_resumed_windows(self) -> bool:
        """Every checkpoint keeps only the window a request resumed from it reads."""

    def evict_some_tokens(self) -> bool:
        """Evict least recently used cached tokens (and the entries and checkpoints they keep)."""


class NothingCached:
    """The evictions of a pool no prefix tree is bound to (yet): nothing is cached, nothing to give back."""

    def evict_checkpoints_while(self, short: Callable[[], bool], for_snapshot: bool = False) -> bool:
        return False

    def keep_only_resumed_windows(self) -> bool:
        return False

    def evict_some_tokens(self) -> bool:
        return False


@dataclass(frozen=True)
class Resume:
    """Where a row resumes: a checkpoint of the tree's, its prefix's token slots and, where the tree holds them in
    path order, its prefix's entry rows per ratio (:meth:`Checkpoints.resume`)."""

    checkpoint: Checkpoint
    prefix_slots: torch.Tensor
    prefix_entries: dict[int, torch.Tensor] | None = None


@dataclass(frozen=True)
class LoadBackRows:
    """Device rows for a cached prefix coming back from the host tier: its entry rows per ratio, and its
    checkpoint's window slots and record (none when it comes back without one)."""

    entries: dict[int, torch.Tensor]
    window: torch.Tensor | None
    record: int | None


class CacheManager:
    def __init__(self, storage: V4PoolStorage):
        self.storage, self.tables = storage, storage.tables
        self.entry_ownership = EntryOwnership(storage)
        self.checkpoints = Checkpoints(storage, self.entry_ownership)
        self.window_policy: WindowPolicy = PER_REQUEST
        self.tree: Evictions = NothingCached()

    def bind_tree(self, tree: Evictions) -> None:
        """The prefix tree, built after the pool: what the manager evicts from when rows run short."""
        self.tree = tree

    # --- a request row's forwards ---------------------------------------------------------------

    def start(self, row: int, target: int, resume: Resume | None = None) -> None:
        """Bind the free ``row`` — fresh, or continuing from a checkpoint (:class:`Resume`) — and reserve its first
        forward, up to ``target`` tokens."""
        if resume is None:
            self.tables.bind(row)
        else:
            self.checkpoints.resume(row, resume.checkpoint, resume.prefix_slots, resume.prefix_entries)
        self.reserve(row, target)

    def reserve(self, row: int, target: int) -> None:
        """Rows for the row's forward up to ``target`` tokens: what it cannot run without, then what is optional."""
        start = self.tables.position[row]
        if target <= start:
            return
        self.window_policy.before_reserve(self, row, start)
        self._room_for_forward(row, target)
        self.tables.reserve(row, target)
        self.window_policy.after_reserve(self, row, start, target)
        self._plan_snapshots(row, start, target)

    def is_bound(self, row: int) -> bool:
        """Whether the request row holds a request's state (a later chunk of a running request)."""
        return bool(self.tables.bound[row])

    def window_slots_for_forward(self, tokens: int) -> int:
        """Window slots of its own a forward of ``tokens`` new tokens takes (reserving it takes as many)."""
        return self.tables.window_slots_for_forward(tokens)

    def window_slots_for_decode(self, rows: list[int], tokens: int) -> int:
        """Window slots of their own the next forward of the decoding ``rows``, ``tokens`` each (one, or a verify
        forward's), takes from what is free: under ``per_request`` a decode step of a row whose window is full
        recycles its oldest slot (:meth:`RequestTables.window_slots_for_decode_steps`); else what a forward of
        ``tokens`` takes, a row."""
        if tokens == 1 and self.window_policy is PER_REQUEST:
            return self.tables.window_slots_for_decode_steps(rows)
        return len(rows) * self.window_slots_for_forward(tokens)

    def room_for_windows(self, count: int) -> bool:
        """Whether forwards can have ``count`` window slots of their own, made as reserving makes
        them (SGLang's admission and decode checks ask before the forwards' rows are reserved)."""
        slots = self.storage.window_slots
        for give_back in (
            self.tables.keep_only_what_forwards_read,
            self.tree.keep_only_resumed_windows,
            lambda: self.tree.evict_checkpoints_while(lambda: slots.free < count),
            self.checkpoints.drop_newest,
        ):
            while slots.free < count and give_back():
                pass
        return slots.free >= count

    def free(self, row: int) -> None:
        """SGLang freed the request row: its snapshots not taken yet, its window slots and entries go."""
        self.checkpoints.drop_pending(row)
        self.tables.free(row)

    def accept_verified(self, row: int, start: int, accepted: int) -> None:
        """A verify forward of the row from ``start`` kept ``accepted`` tokens (the target's own and the drafts
        it accepted): the row's state and tables go back to ``start + accepted`` (the rollback records the
        forward filled), and the snapshots planned after it go."""
        self.checkpoints.drop_pending_after(row, start + accepted)
        self.storage.rollback(row, start, accepted)

    # --- SGLang's auxiliary-cache interface ----------------------------------------------------

    def alloc_to_lengths(self, *, req_pool_indices_cpu: torch.Tensor, target_seq_lens_cpu: torch.Tensor) -> None:
        """Before a forward. Rows not bound yet are started by the prefix tree (:meth:`start`).

        Every run of consecutive plain decode steps (:meth:`steps_plainly`) is reserved at once
        (:meth:`RequestTables.step_each`), the other rows one by one, in the batch's order, so that rows are
        taken and given back in the order reserving row after row takes them."""
        rows, targets = req_pool_indices_cpu.tolist(), target_seq_lens_cpu.tolist()  # SGLang's host copies
        plain = [self.steps_plainly(row, target) for row, target in zip(rows, targets, strict=True)]
        first = 0
        for end in range(1, len(rows) + 1):
            if end == len(rows) or plain[end] != plain[first]:
                self._reserve_run(rows[first:end], targets[first:end], plain[first])
                first = end

    def steps_plainly(self, row: int, target: int) -> bool:
        """Whether the row's forward up to ``target`` is a decode step that changes nothing but the row's own
        window slot and entry rows: no snapshot in it, and what its window policy keeps needs no per-row work."""
        policy = self.window_policy
        return policy.plain_decode_steps and not self.checkpoints.due_at(target) and (
            self.tables.steps_plainly(row, target, trims=policy is PER_REQUEST)
        )

    def _reserve_run(self, rows: list[int], targets: list[int], plain: bool) -> None:
        if plain and self.tables.step_each(rows, trims=self.window_policy is PER_REQUEST):
            return
        for row, target in zip(rows, targets, strict=True):
            if self.tables.bound[row]:
                self.reserve(row, int(target))

    @property
    def dense_capacity(self) -> int:
        """Tokens the scheduler may place: the token pool's, which the entry rows cover."""
        return self.tables.dense_capacity

    def clear(self) -> None:
        for row in range(self.tables.request_rows):
            self.free(row)

    def reset_allocator(self) -> None:
        self.clear()

    # --- checkpoints -----------------------------------------------------------------------------

    def make_checkpoint(self, row: int, position: int, commit_all: bool = False) -> Checkpoint | None:
        """A checkpoint of the row's live state at ``position`` (:meth:`Checkpoints.make`), its record
        had by evicting the checkpoint worth least if none is free."""
        self._room_for_optional(self.storage.records, 1)
        return self.checkpoints.make(row, position, commit_all)

    def hold_optional_window(self, row: int, first: int, last: int) -> bool:
        """Slots for the row's positions ``first .. last - 1`` it does not hold yet, if the tree's
        checkpoints worth least, none a session's deepest, can make room for all of them; whether it
        holds them."""
        missing = self.tables.missing_window(row, first, last)
        room = self._room_for_optional(self.storage.window_slots, len(missing), for_snapshot=True)
        return room and self.tables.hold_window(row, missing)

    def _plan_snapshots(self, row: int, start: int, end: int) -> None:
        """The snapshots a forward of ``start .. end - 1`` fills, as far as records and window slots allow."""
        window = self.storage.config.sliding_window
        for position in self.checkpoints.positions(start, end):
            if not self._room_for_optional(self.storage.records, 1, for_snapshot=True):
                self.checkpoints.skip(NO_RECORD)
            elif not self.hold_optional_window(row, position - window, position):
                self.checkpoints.skip(NO_WINDOW_SLOTS)
            else:
                self.checkpoints.plan(row, position)

    def rows_for_load_back(self, entry_counts: dict[int, int], window_slots: int | None) -> LoadBackRows | None:
        """Device rows for a cached prefix the tree loads back from its host tier: ``entry_counts`` entry rows
        per ratio and, unless ``window_slots`` is None, a checkpoint of that many window slots and a record;
        room made as for a forward's own. All of them, or none (``None``) when they cannot be had."""
        storage, wanted = self.storage, [(rows, entry_counts[r]) for r, rows in self.storage.entry_rows.items()]
        if window_slots is not None:
            self.room_for_windows(window_slots)
            self._room_for_optional(storage.records, 1)
            wanted += [(storage.window_slots, window_slots), (storage.records, 1)]
        for ratio, count in entry_counts.items():
            while storage.entry_rows[ratio].free < count and self.tree.evict_some_tokens():
                pass
        taken = [(allocator, allocator.try_alloc(count)) for allocator, count in wanted]
        if any(rows is None for _, rows in taken):
            for allocator, rows in taken:
                if rows is not None:
                    allocator.release(rows)
            return None
        entries = {ratio: rows for ratio, (_, rows) in zip(storage.entry_rows, taken, strict=False)}
        if window_slots is None:
            return LoadBackRows(entries, None, None)
        return LoadBackRows(entries, taken[-2][1], int(taken[-1][1][0]))

    # --- making room ---------------------------------------------------------------------------

    def _room_for_forward(self, row: int, target: int) -> None:
        """Room for the forward's own window slots and entry rows (the pool's sizing guarantees it
        for the window slots once everything optional is given back; a shortage left is reported
        by the allocator)."""
        self.room_for_windows(self.tables.window_slots_for_forward(target - self.tables.position[row]))
        for ratio, count in self.tables.entry_rows_for_forward(row, target).items():
            rows = self.storage.entry_rows[ratio]
            while rows.free < count and self.tree.evict_some_tokens():
                pass

    def _room_for_optional(self, rows: SharedRows, count: int, for_snapshot: bool = False) -> bool:
        self.tree.evict_checkpoints_while(lambda: rows.free < count, for_snapshot)
        return rows.free >= count

    # --- what the tree asks about the pool --------------------------------------------------------

    def audit(self, cached: list[Checkpoint]) -> dict[str, int]:
        """Rows whose reference count differs from what the request rows, the tree's ``cached``
        checkpoints, the pending snapshots and the tree's entries hold, per kind of row, and the entry rows
        a request row borrows (:meth:`Checkpoints.resume`) that are free (all zero when nothing leaked, was
        freed twice or was freed under a row reading it)."""
        storage, tables = self.storage, self.tables
        holders = [*cached, *(c for row in self.checkpoints.pending.values() for c in row)]
        expected: dict[str, list[torch.Tensor]] = {
            "window_slots": [c.window for c in holders],
            "checkpoint_records": [torch.tensor([c.record]) for c in holders],
            **{f"ratio_{r}_entries": [of_slot] for r, of_slot in self.entry_ownership.of_slot.items()},
        }
        borrowed_free = {f"ratio_{r}_borrowed_entries_free": 0 for r in tables.ratios}
        for row in range(tables.request_rows):
            if tables.bound[row]:
                expected["window_slots"].append(tables.window_table[row, tables.held_from[row] : tables.position[row]])
                for ratio in tables.ratios:
                    expected[f"ratio_{ratio}_entries"].append(tables.counted_entries(row, ratio))
                    borrowed = tables.entries(row, ratio, 0, tables.borrowed[ratio][row])
                    borrowed_free[f"ratio_{ratio}_borrowed_entries_free"] += int(
                        (storage.entry_rows[ratio].refs[borrowed] == 0).sum()
                    )
        shared = {"window_slots": storage.window_slots, "checkpoint_records": storage.records}
        shared.update({f"ratio_{r}_entries": rows for r, rows in storage.entry_rows.items()})
        none = torch.zeros(0, dtype=torch.int64)
        miscounted = {name: rows.miscounted(torch.cat([none, *expected[name]])) for name, rows in shared.items()}
        return {**miscounted, **borrowed_free}

    @property
    def window_slot_bytes(self) -> int:
        return self.storage.layout.window_slot_bytes

    @property
    def record_bytes(self) -> int:
        return self.storage.layout.record_bytes

    def checkpoint_window_bytes(self, checkpoints: list[Checkpoint]) -> int:
        """The bytes of the window slots ``checkpoints`` hold (slots shared between them counted once)."""
        windows = [c.window for c in checkpoints]
        slots = int(torch.unique(torch.cat(windows)).numel()) if windows else 0
        return slots * self.window_slot_bytes

    def reference_counts(self) -> bytes:
        """Every pool row's reference count, as bytes (for the tree's digest)."""
        storage = self.storage
        rows = (storage.window_slots, storage.records, *storage.entry_rows.values())
        return b"".join(r.refs.numpy().tobytes() for r in rows)
