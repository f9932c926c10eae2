"""The lifecycle of checkpoints: planned with a forward, filled inside it, handed to the tree,
resumed from, released.

A :class:`~sglang_dsv4.memory_pool.checkpoint.Checkpoint` shares the window slots it needs
with the request that made it, so making one copies only the small state record. Snapshots
inside a forward (every ``interval`` tokens, and one token before the end of a prefill) are
planned when the cache manager reserves the forward's rows (:meth:`Checkpoints.positions`,
:meth:`Checkpoints.plan`), filled by the attention backend as its layers pass their positions,
and taken by the tree when it inserts the request's tokens (:meth:`Checkpoints.take`); a
request's live state gives one at its current end (:meth:`Checkpoints.make`).

Running short never raises into the scheduler. A checkpoint is optional: when its state
record or window slots cannot be had, even after the manager (:mod:`.manager`) has the tree
give back the checkpoints worth least, it is skipped and counted
(:attr:`Checkpoints.skipped`, logged at most once per ``SKIP_LOG_INTERVAL_S``). A forward's
own window slots are not optional: for them the manager also drops snapshots not taken yet
(:meth:`Checkpoints.drop_newest`), and SGLang's admission and decode checks hold back what
still does not fit (:mod:`.admission`).
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import torch

from ..memory_pool.checkpoint import Checkpoint
from ..memory_pool.storage import V4PoolStorage
from .entry_ownership import EntryOwnership

logger = logging.getLogger(__name__)

SKIP_LOG_INTERVAL_S = 60.0
# Why a checkpoint was skipped: the state records, or the window slots, ran short.
NO_RECORD, NO_WINDOW_SLOTS = "records", "window_slots"


class Checkpoints:
    def __init__(self, storage: V4PoolStorage, entry_ownership: EntryOwnership):
        self.storage, self.entry_ownership = storage, entry_ownership
        # Checkpoints every this many tokens along a sequence (0: none), taken inside forwards,
        # and (when set) one token before the end of every prefill: where a retry of the same
        # prompt resumes (SGLang never matches a prompt's last token).
        self.interval = 0
        self.before_extend_end = False
        self.pending: dict[int, list[Checkpoint]] = {}
        self.skipped: Counter[str] = Counter({NO_RECORD: 0, NO_WINDOW_SLOTS: 0})
        self._skips_logged: Counter[str] = Counter()
        self._skip_logged_at = -SKIP_LOG_INTERVAL_S

    # --- snapshots inside a forward ------------------------------------------------------------

    def positions(self, start: int, end: int) -> list[int]:
        """Positions in ``start + 1 .. end`` where a forward of ``start .. end - 1`` takes a checkpoint."""
        interval = self.interval
        positions = set(range((start // interval + 1) * interval, end + 1, interval)) if interval > 0 else set()
        if self.before_extend_end and end - start >= 2:
            positions.add(end - 1)
        return sorted(positions)

    def due_at(self, position: int) -> bool:
        """Whether a one-token forward ending at ``position`` takes a checkpoint (:meth:`positions`)."""
        return self.interval > 0 and position % self.interval == 0

    def plan(self, row: int, position: int) -> None:
        """A snapshot at ``position`` in the row's reserved forward, which holds its window and whose
        record is free (or, if none is, skipped)."""
        checkpoint = self._new(row, position, self.storage.config.sliding_window)
        if checkpoint is not None:
            self.pending.setdefault(row, []).append(checkpoint)

    def between(self, row: int, start: int, end: int) -> list[Checkpoint]:
        """The checkpoints a forward of ``start .. end - 1`` fills, in position order."""
        return [c for c in self.pending.get(row, []) if start < c.position <= end]

    def take(self, row: int, up_to: int) -> list[Checkpoint]:
        """The row's filled snapshots at positions up to ``up_to``, handed to the caller."""
        pending = self.pending.get(row, [])
        taken = [c for c in pending if c.position <= up_to]
        self.pending[row] = [c for c in pending if c.position > up_to]
        return taken

    def drop_pending(self, row: int) -> None:
        """The row is freed: its snapshots not taken yet go."""
        for checkpoint in self.pending.pop(row, []):
            self.release(checkpoint)

    def drop_pending_after(self, row: int, position: int) -> None:
        """The row was rewound to ``position`` (a verify's rejected drafts): its snapshots planned after it go,
        so checkpoints land at accepted positions only."""
        pending = self.pending.get(row, [])
        for checkpoint in pending:
            if checkpoint.position > position:
                self.release(checkpoint)
        self.pending[row] = [c for c in pending if c.position <= position]

    def drop_newest(self) -> bool:
        """A forward's own window slots ran short: drop the most recently planned snapshot not
        taken yet, with the slots its row held only for it (a forward not run yet skips them).

        The snapshot may belong to a forward already launched: SGLang's overlap scheduler builds
        the next batch (reserving its rows, which is where this runs) before it processes the
        results of the one it launched last, and on a CUDA stream that forward may still be
        writing the snapshot's record. Freeing the record and slots now is still safe: what
        writes them next is either a later forward, which runs after that one on the same
        forward stream, or the scheduler processing that forward's results (a checkpoint at a
        request's end), which first waits for the forward (``copy_done``). The scheduler's
        other write, a chunked request's checkpoint, comes before the reservations of its
        scheduling step, and the next step's after those results are processed. On the CPU the
        launched forward has run before this is called (``test_pool.py`` plays that order).
        """
        planned = [(c.last_used, row, c) for row, pending in self.pending.items() for c in pending]
        if not planned:
            return False
        _, row, dropped = max(planned, key=lambda entry: entry[0])
        self.pending[row].remove(dropped)
        self.release(dropped)
        tables, window = self.storage.tables, self.storage.config.sliding_window
        # The row's own forward reads from position - window - 1 on; the other snapshots their windows.
        start = tables.position[row] - tables.last_step[row]
        needed = torch.zeros(tables.position[row] + 1, dtype=torch.bool)
        needed[max(0, tables.position[row] - window - 1) :] = True
        for checkpoint in self.pending[row]:
            needed[max(0, checkpoint.position - window) : checkpoint.position] = True
        # Only the not yet run forward's positions: a snapshot of an earlier forward (the overlap
        # scheduler reserves the next step before taking the last one's) frees just its share.
        positions = torch.arange(max(start, dropped.position - window), max(start, dropped.position))
        tables.release_window(row, positions[~needed[positions]])
        self.skip(NO_WINDOW_SLOTS)
        return True

    def skip(self, reason: str) -> None:
        """Count a skipped checkpoint; log the counts at most once per ``SKIP_LOG_INTERVAL_S``."""
        self.skipped[reason] += 1
        now = time.monotonic()
        if now - self._skip_logged_at >= SKIP_LOG_INTERVAL_S:
            since = self.skipped - self._skips_logged
            logger.warning(
                "sglang-dsv4: skipped %s optional checkpoint(s) since the last report (by reason: %s): "
                "the pool's checkpoint records or window slots ran short; requests are unaffected, later "
                "turns resume from an earlier checkpoint",
                since.total(),
                dict(since),
            )
            self._skips_logged = self.skipped.copy()
            self._skip_logged_at = now

    # --- a request's live state, and resuming --------------------------------------------------

    def make(self, row: int, position: int, commit_all: bool = False) -> Checkpoint | None:
        """A checkpoint of row ``row`` at ``position`` from its live state, if the row still has it;
        with ``commit_all`` it also keeps every window slot the row holds before ``position``.

        The row's state is at ``position`` or, after one more single-token forward (SGLang's
        overlap scheduler runs the next decode step before it processes this one's result),
        its previous record is.
        """
        tables = self.storage.tables
        if tables.position[row] == position:
            one_step_back = False
        elif tables.position[row] == position + 1 and tables.last_step[row] == 1:
            one_step_back = True
        else:
            return None
        keep = position if commit_all else self.storage.config.sliding_window
        checkpoint = self._new(row, position, keep)
        if checkpoint is not None:
            self.storage.save_record(row, checkpoint.record, one_step_back=one_step_back)
        return checkpoint

    def _new(self, row: int, position: int, window: int) -> Checkpoint | None:
        """A checkpoint sharing the row's window slots before ``position``, its record allocated,
        not yet written; none when the row no longer holds the window or no record can be had."""
        storage, sliding_window = self.storage, self.storage.config.sliding_window
        slots = storage.tables.window_suffix(row, position, max(window, sliding_window))
        if len(slots) < min(position, sliding_window):
            return None
        record = storage.records.try_alloc(1)
        if record is None:
            self.skip(NO_RECORD)
            return None
        storage.window_slots.share(slots)
        return Checkpoint(position, slots, int(record[0]))

    def resume(
        self,
        row: int,
        checkpoint: Checkpoint,
        prefix_slots: torch.Tensor,
        prefix_entries: dict[int, torch.Tensor] | None = None,
    ) -> None:
        """Bind the free row ``row`` to continue from ``checkpoint``, whose prefix's token slots are
        ``prefix_slots``, cached by the tree and locked by the request (the row shares the checkpoint's window
        slots and borrows its prefix's entry rows: written into its table, no reference counted on them, so
        binding and freeing the row cost its new tokens, not its history). The entry rows are ``prefix_entries``
        where the tree holds them in path order (per ratio, those of the prefix's complete blocks: a session's end,
        ``V4RadixCache.session_ends``), else gathered by the prefix's token slots (:meth:`EntryOwnership.of_prefix`).

        Borrowing is safe because the tree keeps those entry rows for as long as the row is bound. They live
        as long as the tree holds the token slots of their blocks' last tokens (:class:`EntryOwnership`),
        which it lets go of only when it evicts them (to the host tier too, :mod:`.host_tier`) or is reset.
        SGLang evicts only leaves nobody locks, and the request's lock, taken at admission before its row is
        allocated, covers the prefix until the request lets go of it: each checkpoint moves it down the same
        path (``_lock_deeper``; when it locks anew from the root, the new node's path holds the same prefix
        slots, and nothing is evicted between the unlock and the lock). SGLang releases a request (finished,
        aborted, retracted) by unlocking and then freeing its row, with no eviction between, and resets the tree
        only with no request running. Neither the checkpoint nor any other checkpoint lends the entries, so dropping
        checkpoints (under eviction pressure, retention, per_request's superseded ones) takes none of them.
        The row never lets a borrowed entry go: :meth:`EntryOwnership.adopt` and ``commit`` reach only blocks
        ending at or after the row's resume position, and a speculative rollback never rewinds into the prefix
        (:meth:`RequestTables.rewind` refuses). A forward still in flight when the tree later evicts them reads
        rows written next only by a later forward on the same stream (as :meth:`drop_newest` argues). The
        audit checks it: no borrowed row of a bound row is free (:meth:`CacheManager.audit`).
        """
        position = checkpoint.position
        entries = prefix_entries or self.entry_ownership.of_prefix(prefix_slots, position)
        window = checkpoint.window[-self.storage.config.sliding_window :]
        self.storage.tables.bind(row, position, window, borrowed_entries=entries)
        self.storage.restore_record(row, checkpoint.record)
        checkpoint.touch()

    def trim_to_resumed_window(self, checkpoint: Checkpoint) -> bool:
        """Let go of the checkpoint's window slots before the last ``sliding_window``: a request
        resumed from it reads only those (:meth:`resume`). Whether it held any."""
        window = self.storage.config.sliding_window
        if len(checkpoint.window) <= window:
            return False
        self.storage.window_slots.release(checkpoint.window[:-window])
        checkpoint.window = checkpoint.window[-window:]
        return True

    def release(self, checkpoint: Checkpoint) -> None:
        self.storage.window_slots.release(checkpoint.window)
        self.storage.records.release(torch.tensor([checkpoint.record]))
