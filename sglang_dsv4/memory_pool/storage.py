"""The V4 pool's rows, as plain torch tensors: window slots per token, compressed entries per
block, compressor-state records per request row and per checkpoint.

The network's :class:`~sglang_dsv4.model.state.LayerState` is the contract: the storage loads a
request's layer state at position P from its rows (:meth:`V4PoolStorage.load`) and stores what a
forward advanced it to (:meth:`V4PoolStorage.store`); the batched backend reads and writes the same
tensors in place. Window rows, compressed entries and indexer keys are stored in the KV dtype's row
formats (:mod:`sglang_dsv4.kernels.kv_format`: the values themselves, or FP8-packed), encoded where
written and decoded where read; the compressor-state records are float32 whatever it is. Which rows
a request holds is in its :class:`~.request_tables.RequestTables`; who else shares them, by
reference count, in the :class:`~.shared_rows.SharedRows` of each kind. Who takes and gives back
rows, what a checkpoint is and which entries the prefix cache owns belong to
:mod:`sglang_dsv4.prefix_cache` (its cache manager); the SGLang ``KVCache`` that carries all of it
is :class:`sglang_dsv4.kv_cache.V4KVPool`. Nothing here imports SGLang.
"""

from __future__ import annotations

import torch

from ..config import DeepseekV4Config
from ..kernels.kv_format import RowFormat
from ..model.compressor import CompressorState
from ..model.state import LayerState
from .layout import STATE_DTYPE, PoolLayout, StateBuffer
from .request_tables import RequestTables
from .shared_rows import SharedRows


class V4PoolStorage:
    def __init__(
        self,
        config: DeepseekV4Config,
        kv_dtype: torch.dtype,
        *,
        num_tokens: int,
        max_requests: int,
        max_context: int,
        device: torch.device | str,
        verify_tokens: int = 0,
    ):
        """``verify_tokens``: tokens per request of a speculative verify forward (0: no speculation), for which
        the pool also holds the MTP layer's state and each row's rollback records (:class:`PoolLayout`)."""
        self.config, self.dtype, self.device = config, kv_dtype, torch.device(device)
        self.layout = layout = PoolLayout(config, kv_dtype, verify_tokens)
        request_rows = max_requests + 1
        compressed = layout.compressed_buffers()
        self.window_slots = SharedRows(request_rows * layout.window_slots_per_request, "window slots")
        self.entry_rows = {
            r: SharedRows(layout.entry_rows(r, num_tokens, request_rows), f"ratio-{r} entry rows")
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
            num_tokens,
            self.device,
        )
        # Window rows are stored as compressed entries are: FP8-packed under an FP8 KV dtype.
        self.formats = layout.formats
        slots = self.window_slots.capacity + 1
        self.window = [self._rows(self.formats.entries, slots) for _ in layout.layers]
        self.ratio = {(b.layer, b.kind): b.ratio for b in compressed}
        self.compressed = {
            (b.layer, b.kind): self._rows(layout.format_of(b), self.entry_rows[b.ratio].capacity + 1)
            for b in compressed
        }
        self.row_formats = {(b.layer, b.kind): layout.format_of(b) for b in compressed}
        states = layout.state_buffers()
        self.state = {(b.layer, b.kind): self._records(request_rows, b) for b in states}
        # Each row's record one token back: where a checkpoint a decode step late reads (see save_record).
        self.previous_state = {(b.layer, b.kind): self._records(request_rows, b) for b in states}
        # Checkpoint records, then each row's rollback records (see rollback_record): both backends fill
        # either kind as a snapshot inside a forward.
        self.verify_tokens = verify_tokens
        self._first_rollback_record = self.records.capacity + 1
        records = self._first_rollback_record + request_rows * layout.rollback_records_per_request_row
        self.checkpoint_state = {(b.layer, b.kind): self._records(records, b) for b in states}

    def _rows(self, row_format: RowFormat, rows: int) -> torch.Tensor:
        """A zeroed pool of ``rows`` window slots or compressed entries stored in ``row_format``."""
        return row_format.empty(rows, self.device)

    def _records(self, rows: int, buffer: StateBuffer) -> torch.Tensor:
        return torch.zeros(rows, buffer.pools, 3, buffer.dim, dtype=STATE_DTYPE, device=self.device)

    @property
    def allocated_bytes(self) -> int:
        """Device bytes of the rows, and of the request tables' device twins where they are separate."""
        tensors = [
            *self.window,
            *self.compressed.values(),
            *self.state.values(),
            *self.previous_state.values(),
            *self.checkpoint_state.values(),
        ]
        return sum(t.numel() * t.element_size() for t in tensors) + self.tables.device_bytes

    def usage(self) -> dict[str, dict[str, int]]:
        """Per kind of row: how many there are and how many are free."""
        return {
            "window_slots": self.window_slots.usage(),
            "checkpoint_records": self.records.usage(),
            **{f"ratio_{r}_entries": rows.usage() for r, rows in sorted(self.entry_rows.items())},
        }

    # --- state records ---------------------------------------------------------------------

    def save_record(self, row: int, record: int, *, one_step_back: bool = False) -> None:
        """Copy the row's state records (every layer's, or those one token back) into checkpoint record ``record``."""
        source = self.previous_state if one_step_back else self.state
        for key, records in source.items():
            self.checkpoint_state[key][record] = records[row]

    def restore_record(self, row: int, record: int) -> None:
        """The row continues from checkpoint record ``record``."""
        for key, records in self.state.items():
            records[row] = self.checkpoint_state[key][record]

    def snapshot(self, layer: int, row: int, record: int) -> None:
        """Copy the layer's state records of row ``row`` into checkpoint record ``record``."""
        for (record_layer, kind), records in self.state.items():
            if record_layer == layer:
                self.checkpoint_state[(layer, kind)][record] = records[row]

    # --- speculative verify: rollback records ------------------------------------------------

    def rollback_record(self, row: int, offset: int) -> int:
        """The record holding the row's state ``offset`` tokens into its verify forward (``0 .. verify_tokens - 1``)."""
        if not 0 <= offset < self.verify_tokens:
            raise ValueError(f"rollback offset {offset} outside a verify of {self.verify_tokens} tokens")
        return self._first_rollback_record + row * self.verify_tokens + offset

    def begin_verify(self, row: int) -> None:
        """The row's state before its verify forward is its rollback record at offset 0 (the forward fills the
        later ones as it passes their positions)."""
        self.save_record(row, self.rollback_record(row, 0))

    def rollback_records(self, rows: torch.Tensor) -> torch.Tensor:
        """:meth:`rollback_record` of device rows at every offset, on the device: ``[rows, verify_tokens]``;
        the padding record 0 for the padding row 0."""
        offsets = torch.arange(self.verify_tokens, device=rows.device)
        records = self._first_rollback_record + rows.long()[:, None] * self.verify_tokens + offsets
        return torch.where(rows[:, None] > 0, records, 0)

    def begin_verify_rows(self, rows: torch.Tensor, records: torch.Tensor) -> None:
        """:meth:`begin_verify` of device rows on the device: their state records into ``records`` (their
        rollback records at offset 0)."""
        for key, state in self.state.items():
            self.checkpoint_state[key].index_copy_(0, records, state[rows.long()])

    def rollback(self, row: int, start: int, accepted: int) -> None:
        """After a verify forward of ``verify_tokens`` tokens from ``start``, the row's state records at
        ``start + accepted`` (``1 <= accepted <= verify_tokens``): those of the last accepted token, and one
        token back (see :meth:`save_record`); its request tables rewound to that position."""
        if accepted < self.verify_tokens:
            self.restore_record(row, self.rollback_record(row, accepted))
        for key, records in self.previous_state.items():
            records[row] = self.checkpoint_state[key][self.rollback_record(row, accepted - 1)]
        self.tables.rewind(row, start + accepted)

    # --- one request's layer state (the torch reference) -------------------------------------

    def load(self, layer: int, row: int, start: int, dtype: torch.dtype) -> LayerState:
        """The layer's state of row ``row`` after ``start`` tokens, its KV in the compute ``dtype``."""
        first = max(0, start - self.config.sliding_window)
        window = self.formats.entries.decode(self.window[layer][self.tables.window_rows(row, first, start)], dtype)
        return LayerState(
            window,
            self._load_compressor(layer, "entries", "compressor", row, start, dtype),
            self._load_compressor(layer, "indexer_keys", "indexer", row, start, dtype),
            stored_as=self.formats,
        )

    def store(self, layer: int, row: int, start: int, end: int, state: LayerState) -> None:
        """Write back the state a forward of tokens ``start .. end - 1`` advanced to."""
        # Only the new tokens' rows changed; positions the row keeps no slot for are skipped.
        slots = self.tables.window_rows(row, start, end)
        kept = slots > 0
        self.window[layer][slots[kept]] = self.formats.entries.encode(state.added[kept])
        self._store_compressor(layer, "entries", "compressor", row, start, end, state.compressor)
        self._store_compressor(layer, "indexer_keys", "indexer", row, start, end, state.indexer)

    def _load_compressor(
        self, layer: int, kind: str, state_kind: str, row: int, start: int, dtype: torch.dtype
    ) -> CompressorState | None:
        key = (layer, kind)
        if key not in self.compressed:
            return None
        ratio = self.ratio[key]
        rows = self.compressed[key][self.tables.entries(row, ratio, 0, start // ratio)]
        entries = self.row_formats[key].decode(rows, dtype)
        record = self.state[(layer, state_kind)][row].clone()
        if start == 0:  # a new request: whatever the row held belongs to an earlier one
            record.zero_()
            record[:, 0] = float("-inf")
        return CompressorState.of_record(entries, record)

    def _store_compressor(
        self, layer: int, kind: str, state_kind: str, row: int, start: int, end: int, state: CompressorState | None
    ) -> None:
        if state is None:
            return
        key = (layer, kind)
        ratio = self.ratio[key]
        first_new, total = start // ratio, state.entries.shape[0]
        if total > first_new:
            rows = self.tables.entries(row, ratio, first_new, total)
            self.compressed[key][rows] = self.row_formats[key].encode(state.entries[first_new:])
        records = self.state[(layer, state_kind)]
        if end - start == 1:  # keep the record one token back (see save_record)
            self.previous_state[(layer, state_kind)][row] = records[row]
        records[row] = state.record()
