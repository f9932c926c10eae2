"""The V4 KV pool SGLang allocates through: window slots per token, compressed entries
per block, compressor-state records per request and per checkpoint.

The network's :class:`~sglang_dsv4.model.state.LayerState` is the contract: the pool
loads a request's layer state at position P from its buffers (:meth:`V4KVPool.load`)
and stores what a forward advanced it to (:meth:`V4KVPool.store`). Checkpoints
(:meth:`V4KVPool.checkpoint`, :meth:`V4KVPool.resume`) share the rows they point at with
the request, so making one copies only the small state record.

Running short never raises into the scheduler. A checkpoint is optional: when its state
record or window slots cannot be had, even after the prefix cache gives back its least
recently used checkpoint, it is skipped and counted (:attr:`V4KVPool.checkpoints_skipped`,
logged at most once per ``SKIP_LOG_INTERVAL_S``). A forward's own window slots and entry
rows are not: for them the pool also takes back what running requests hold beyond what
their forwards read and drops snapshots not taken yet; SGLang's admission and decode
checks consult :meth:`V4KVPool.room_for_windows` first, so a request whose window would
not fit waits in the queue or is retracted instead (:mod:`sglang_dsv4.prefix_cache.admission`).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable

import torch
from sglang.srt.mem_cache.memory_pool import KVCache

from ..config import DeepseekV4Config
from ..model.compressor import CompressorState, SoftmaxPool
from ..model.state import LayerState
from .checkpoint import Checkpoint
from .layout import STATE_DTYPE, PoolLayout
from .request_tables import RequestTables
from .shared_rows import SharedRows

logger = logging.getLogger(__name__)

SKIP_LOG_INTERVAL_S = 60.0
# Why a checkpoint was skipped: the state records, or the window slots, ran short.
NO_RECORD, NO_WINDOW_SLOTS = "records", "window_slots"


class V4KVPool(KVCache):
    def __init__(
        self,
        size: int,
        page_size: int,
        config: DeepseekV4Config,
        kv_dtype: torch.dtype,
        max_requests: int,
        max_context: int,
        device: str,
    ):
        super().__init__(size, page_size, kv_dtype, config.num_layers, device, enable_memory_saver=False)
        self.config = config
        self.layout = layout = PoolLayout(config, kv_dtype)
        request_rows = max_requests + 1
        compressed = layout.compressed_buffers()
        self.window_slots = SharedRows(request_rows * layout.window_slots_per_request, "window slots")
        self.entry_rows = {
            r: SharedRows(layout.entry_rows(r, size, request_rows), f"ratio-{r} entry rows")
            for r in {b.ratio for b in compressed}
        }
        self.records = SharedRows(layout.checkpoint_records_per_request_row * request_rows, "checkpoint records")
        self.tables = RequestTables(
            [b.ratio for b in compressed],
            request_rows,
            max_context,
            config.sliding_window,
            self.window_slots,
            self.entry_rows,
            size,
        )
        self.tables.on_reserve = self._plan_snapshots
        self.tables.on_free = self._drop_snapshots
        slots = self.window_slots.capacity + 1
        self.window = [
            torch.zeros(slots, config.head_dim, dtype=kv_dtype, device=device) for _ in range(self.layer_num)
        ]
        self.ratio = {(b.layer, b.kind): b.ratio for b in compressed}
        self.compressed = {
            (b.layer, b.kind): torch.zeros(self.entry_rows[b.ratio].capacity + 1, b.dim, dtype=kv_dtype, device=device)
            for b in compressed
        }
        states = layout.state_buffers()
        self.state = {(b.layer, b.kind): self._records(request_rows, b) for b in states}
        self.previous_state = {(b.layer, b.kind): self._records(request_rows, b) for b in states}
        self.checkpoint_state = {(b.layer, b.kind): self._records(self.records.capacity + 1, b) for b in states}
        # Checkpoints every this many tokens along a sequence (0: none), taken inside forwards,
        # and (when set) one token before the end of every prefill: where a retry of the same
        # prompt resumes (SGLang never matches a prompt's last token).
        self.snapshot_interval = 0
        self.snapshot_before_extend_end = False
        # The entry row of each block whose last token's slot the prefix cache holds: the
        # persistent entries live as long as the tree keeps those token slots.
        self.entry_of_slot = {r: torch.zeros(size + 1, dtype=torch.int64) for r in self.entry_rows}
        self.pending: dict[int, list[Checkpoint]] = {}
        self.checkpoints_skipped: Counter[str] = Counter({NO_RECORD: 0, NO_WINDOW_SLOTS: 0})
        self._skips_logged: Counter[str] = Counter()
        self._skip_logged_at = -SKIP_LOG_INTERVAL_S
        self.mem_usage = self.allocated_bytes / 2**30

    def _records(self, rows: int, buffer) -> torch.Tensor:
        return torch.zeros(rows, buffer.pools, 3, buffer.dim, dtype=STATE_DTYPE, device=self.device)

    @property
    def allocated_bytes(self) -> int:
        tensors = [
            *self.window,
            *self.compressed.values(),
            *self.state.values(),
            *self.previous_state.values(),
            *self.checkpoint_state.values(),
        ]
        return sum(t.numel() * t.element_size() for t in tensors)

    def set_reclaim(self, evict_checkpoint: Callable[[], bool], evict_tokens: Callable[[], bool]) -> None:
        """What frees rows when some run short: the prefix cache evicting its least recently used
        checkpoint (window slots, records) or cached tokens (entry rows); for a forward's own
        window slots then running requests trimming to the ``per_request`` window, and snapshots
        not taken yet being dropped."""
        self.records.reclaim = evict_checkpoint
        self.window_slots.reclaim = evict_checkpoint
        self.window_slots.last_resort = lambda: self.tables.trim_all() or self._drop_newest_snapshot()
        for rows in self.entry_rows.values():
            rows.reclaim = evict_tokens

    def room_for_windows(self, count: int) -> bool:
        """Whether ``count`` window slots are free once the cache and all_committed rows give
        back what they can (SGLang's admission and decode checks ask before a forward's rows
        are reserved; snapshots of forwards in flight are kept)."""
        return self.window_slots.make_room(count, self.window_slots.reclaim, self.tables.trim_all)

    # --- a forward: load, store, snapshots ---------------------------------------------------

    def load(self, layer: int, request: int, start: int, dtype: torch.dtype) -> LayerState:
        """The layer's state of ``request`` after ``start`` tokens, its KV in the compute ``dtype``."""
        first = max(0, start - self.config.sliding_window)
        window = self.window[layer][self.tables.window_rows(request, first, start)].to(dtype)
        return LayerState(
            window,
            self._load_compressor(layer, "entries", "compressor", request, start, dtype),
            self._load_compressor(layer, "indexer_keys", "indexer", request, start, dtype),
        )

    def store(self, layer: int, request: int, start: int, end: int, state: LayerState) -> None:
        """Write back the state a forward of tokens ``start .. end - 1`` advanced to."""
        # Only the new tokens' rows changed; positions the row keeps no slot for are skipped.
        slots = self.tables.window_rows(request, start, end)
        kept = slots > 0
        self.window[layer][slots[kept]] = state.added[kept].to(self.dtype)
        self._store_compressor(layer, "entries", "compressor", request, start, end, state.compressor)
        self._store_compressor(layer, "indexer_keys", "indexer", request, start, end, state.indexer)

    def snapshot_positions(self, start: int, end: int) -> list[int]:
        """Positions in ``start + 1 .. end`` where a forward of ``start .. end - 1`` takes a checkpoint."""
        interval = self.snapshot_interval
        positions = set(range((start // interval + 1) * interval, end + 1, interval)) if interval > 0 else set()
        if self.snapshot_before_extend_end and end - start >= 2:
            positions.add(end - 1)
        return sorted(positions)

    def snapshots_between(self, request: int, start: int, end: int) -> list[Checkpoint]:
        """The checkpoints a forward of ``start .. end - 1`` fills, in position order."""
        return [c for c in self.pending.get(request, []) if start < c.position <= end]

    def snapshot(self, layer: int, request: int, checkpoint: Checkpoint) -> None:
        """Copy the layer's state record, now at ``checkpoint.position``, into the checkpoint."""
        for (record_layer, kind), records in self.state.items():
            if record_layer == layer:
                self.checkpoint_state[(layer, kind)][checkpoint.record] = records[request]

    def take_snapshots(self, request: int, up_to: int) -> list[Checkpoint]:
        """The row's filled snapshots at positions up to ``up_to``, handed to the caller."""
        pending = self.pending.get(request, [])
        taken = [c for c in pending if c.position <= up_to]
        self.pending[request] = [c for c in pending if c.position > up_to]
        return taken

    def _plan_snapshots(self, request: int, start: int, end: int) -> None:
        """The checkpoints a forward of ``start .. end - 1`` fills, as far as records and window slots allow."""
        window = self.config.sliding_window
        for position in self.snapshot_positions(start, end):
            if not self.records.make_room(1, self.records.reclaim):
                self._skip(NO_RECORD)
            elif not self.tables.hold_window(request, position - window, position):
                self._skip(NO_WINDOW_SLOTS)
            else:
                checkpoint = self._new_checkpoint(request, position, window)
                if checkpoint is not None:
                    self.pending.setdefault(request, []).append(checkpoint)

    def _drop_snapshots(self, request: int) -> None:
        for checkpoint in self.pending.pop(request, []):
            self.release(checkpoint)

    def _drop_newest_snapshot(self) -> bool:
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
        tables, window = self.tables, self.config.sliding_window
        # The row's own forward reads from position - window - 1 on; the other snapshots their windows.
        start = tables.position[row] - tables.last_step[row]
        needed = torch.zeros(tables.position[row] + 1, dtype=torch.bool)
        needed[max(0, tables.position[row] - window - 1) :] = True
        for checkpoint in self.pending[row]:
            needed[max(0, checkpoint.position - window) : checkpoint.position] = True
        positions = torch.arange(max(start, dropped.position - window), dropped.position)
        tables.release_window(row, positions[~needed[positions]])
        self._skip(NO_WINDOW_SLOTS)
        return True

    def _skip(self, reason: str) -> None:
        """Count a skipped checkpoint; log the counts at most once per ``SKIP_LOG_INTERVAL_S``."""
        self.checkpoints_skipped[reason] += 1
        now = time.monotonic()
        if now - self._skip_logged_at >= SKIP_LOG_INTERVAL_S:
            since = self.checkpoints_skipped - self._skips_logged
            logger.warning(
                "sglang-dsv4: skipped %s optional checkpoint(s) since the last report (by reason: %s): "
                "the pool's checkpoint records or window slots ran short; requests are unaffected, later "
                "turns resume from an earlier checkpoint",
                since.total(),
                dict(since),
            )
            self._skips_logged = self.checkpoints_skipped.copy()
            self._skip_logged_at = now

    # --- checkpoints -------------------------------------------------------------------------

    def checkpoint(self, request: int, position: int, commit_all: bool = False) -> Checkpoint | None:
        """A checkpoint of ``request`` at ``position`` from its live state, if the row still has it;
        with ``commit_all`` it also keeps every window slot the row holds before ``position``.

        The row's state is at ``position`` or, after one more single-token forward (SGLang's
        overlap scheduler runs the next decode step before it processes this one's result),
        its previous record is.
        """
        tables = self.tables
        if tables.position[request] == position:
            source = self.state
        elif tables.position[request] == position + 1 and tables.last_step[request] == 1:
            source = self.previous_state
        else:
            return None
        keep = position if commit_all else self.config.sliding_window
        checkpoint = self._new_checkpoint(request, position, keep)
        if checkpoint is not None:
            for key, records in source.items():
                self.checkpoint_state[key][checkpoint.record] = records[request]
        return checkpoint

    def _new_checkpoint(self, request: int, position: int, window: int) -> Checkpoint | None:
        """A checkpoint sharing the row's window slots before ``position``, its record allocated,
        not yet written; none when the row no longer holds the window or no record can be had."""
        slots = self.tables.window_suffix(request, position, max(window, self.config.sliding_window))
        if len(slots) < min(position, self.config.sliding_window):
            return None
        record = self.records.try_alloc(1)
        if record is None:
            self._skip(NO_RECORD)
            return None
        self.window_slots.share(slots)
        return Checkpoint(position, slots, int(record[0]))

    def commit_entries(self, request: int, slots: torch.Tensor, first: int, last: int) -> None:
        """The tree now holds token slots ``slots[first:last]`` of ``request``: each block ending
        there keeps its entry row for as long as the slot lives."""
        for ratio, ends in self._block_ends(first, last).items():
            rows = self.tables.entry_table[ratio][request, (ends + 1) // ratio - 1]
            self.entry_rows[ratio].share(rows)
            self.entry_of_slot[ratio][slots[ends].long()] = rows

    def adopt_entries(self, request: int, slots: torch.Tensor, first: int, last: int) -> None:
        """``request`` computed tokens ``first .. last - 1`` again while the tree already held them
        (at ``slots``): its entries of blocks ending there become the tree's, its own go back."""
        for ratio, ends in self._block_ends(first, last).items():
            blocks = (ends + 1) // ratio - 1
            ours = self.tables.entry_table[ratio][request, blocks]
            theirs = self.entry_of_slot[ratio][slots[ends].long()]
            self.entry_rows[ratio].share(theirs)
            self.entry_rows[ratio].release(ours)
            self.tables.entry_table[ratio][request, blocks] = theirs

    def release_slots(self, slots: torch.Tensor) -> None:
        """The tree let token slots go: the entry rows they kept go with them."""
        slots = slots.long()
        for ratio, of_slot in self.entry_of_slot.items():
            self.entry_rows[ratio].release(of_slot[slots])
            of_slot[slots] = 0

    def _block_ends(self, first: int, last: int) -> dict[int, torch.Tensor]:
        """Per ratio, the positions in ``first .. last - 1`` that end a block."""
        starts = {r: first + (-first - 1) % r for r in self.entry_rows}
        return {r: torch.arange(start, max(start, last), r) for r, start in starts.items()}

    def resume(self, request: int, checkpoint: Checkpoint, prefix_slots: torch.Tensor) -> None:
        """Bind the free row ``request`` to continue from ``checkpoint``, whose prefix's token
        slots are ``prefix_slots`` (their blocks' entries are shared, not copied)."""
        position = checkpoint.position
        entries = {r: of_slot[prefix_slots[r - 1 : position : r].long()] for r, of_slot in self.entry_of_slot.items()}
        if any((rows == 0).any() for rows in entries.values()):
            raise AssertionError("a checkpoint's prefix has a block without an entry row")
        window = checkpoint.window[-self.config.sliding_window :]
        self.tables.bind(request, position, window, entries)
        for key, records in self.state.items():
            records[request] = self.checkpoint_state[key][checkpoint.record]
        checkpoint.touch()

    def start(self, request: int) -> None:
        """Bind the free row ``request`` to a new request at position 0."""
        self.tables.bind(request)

    def release(self, checkpoint: Checkpoint) -> None:
        self.window_slots.release(checkpoint.window)
        self.records.release(torch.tensor([checkpoint.record]))

    def usage(self) -> dict[str, dict[str, int]]:
        """Per kind of row: how many there are and how many are free."""
        return {
            "window_slots": self.window_slots.usage(),
            "checkpoint_records": self.records.usage(),
            **{f"ratio_{r}_entries": rows.usage() for r, rows in sorted(self.entry_rows.items())},
        }

    # --- compressor state ----------------------------------------------------------------------

    def _load_compressor(
        self, layer: int, kind: str, state_kind: str, request: int, start: int, dtype: torch.dtype
    ) -> CompressorState | None:
        key = (layer, kind)
        if key not in self.compressed:
            return None
        ratio = self.ratio[key]
        entries = self.compressed[key][self.tables.entries(request, ratio, 0, start // ratio)].to(dtype)
        record = self.state[(layer, state_kind)][request]
        if start == 0:  # a new request: whatever the row held belongs to an earlier one
            record = torch.zeros_like(record)
            record[:, 0] = float("-inf")
        pools = [
            SoftmaxPool(record[i, 0].clone(), record[i, 1].clone(), record[i, 2].clone()) for i in range(len(record))
        ]
        if len(pools) == 1:
            return CompressorState(entries, pools[0], None, None)
        current, next_half, previous_half = pools
        return CompressorState(entries, current, next_half, previous_half)

    def _store_compressor(
        self, layer: int, kind: str, state_kind: str, request: int, start: int, end: int, state: CompressorState | None
    ) -> None:
        if state is None:
            return
        key = (layer, kind)
        ratio = self.ratio[key]
        first_new, total = start // ratio, state.entries.shape[0]
        if total > first_new:
            rows = self.tables.entries(request, ratio, first_new, total)
            self.compressed[key][rows] = state.entries[first_new:].to(self.dtype)
        pools = [state.current] if state.next_half is None else [state.current, state.next_half, state.previous_half]
        record = self.state[(layer, state_kind)][request]
        if end - start == 1:  # keep the record one token back (see checkpoint())
            self.previous_state[(layer, state_kind)][request] = record
        for i, pool in enumerate(pools):
            record[i, 0], record[i, 1], record[i, 2] = pool.max, pool.denom, pool.weighted

    # --- KVCache's abstract interface: V4 has no per-layer K/V buffers --------------------------

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        raise NotImplementedError("V4 pools are read through load(); there is no key buffer")

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        raise NotImplementedError("V4 pools are read through load(); there is no value buffer")

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError("V4 pools are read through load(); there are no K/V buffers")

    def set_kv_buffer(self, *args, **kwargs) -> None:
        raise NotImplementedError("V4 pools are written through store()")
