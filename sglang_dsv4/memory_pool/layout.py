"""What a V4 server allocates, per token slot and per request: the one definition of the pools.

Three lifetimes (DESIGN.md, "Memory lifecycle"):

* per token (persistent): the compressed entries of ratio-4 and ratio-128 layers and the
  indexer keys, one per complete block of ``ratio`` tokens, at rows that
  :class:`~.request_tables.RequestTables` hands out (any page size works);
* per request (transient): window slots, one per token holding its raw KV in every
  layer — a running request holds its last ``sliding_window + 1`` tokens' slots
  (the one extra covers SGLang's one-step scheduling lag), whatever its length;
* per request (compressor state): the online partial-block pools, float32, twice (the
  state after the last forward and the one before it, for the same lag);
* checkpoints: a window of slots and one state record each, what the prefix cache resumes
  requests from. The window slots hold ``CHECKPOINT_WINDOWS_PER_REQUEST_ROW`` checkpoint
  windows per request row besides the running windows; the state records are sized from
  them (:attr:`PoolLayout.checkpoint_records_per_request_row`): a record is small next to a
  window (V4-Flash: 0.58 MiB against 5.4 MiB), so there are enough that the window slots, not
  the records, bound how many checkpoints exist. The pairs a prompt's end leaves (its end and
  one token before) share all but one window slot, so the window slots of one request row back
  at most two checkpoints per ``sliding_window`` slots they hold: 6 records per request row.
  Every checkpoint is optional (a request without one finishes all the same, and a later turn
  resumes from the nearest one it has), so when records or window slots still run short the
  least recently used checkpoint goes, and then the new one is skipped (the cache manager,
  :mod:`sglang_dsv4.prefix_cache.manager`). A forward's own window slots always fit once
  everything optional is given back: a bound row and the one checkpoint its request keeps locked
  then hold at most ``2 * (sliding_window + 1)`` slots (a prefill's read window is that
  checkpoint's; a decode step holds ``sliding_window + 2`` beside it), against the
  ``3 * sliding_window + 1`` each request row is given.

Compressed entries: one row per block of the token pool, and one per request row (a request
resumed inside a block writes that block's entry anew while the tree keeps the block's first
tokens), so a forward whose token slots SGLang found always finds its entry rows.

Window rows, compressed entries and indexer keys are stored in the KV dtype's row formats
(:attr:`PoolLayout.formats`): the values themselves in float32 or bfloat16, or DeepSeek's FP8 rows
under an FP8 KV dtype (584 B a window row or entry, 144 B an indexer key at V4's dims: the reference's
132 B padded to 16-byte rows, :data:`~sglang_dsv4.kernels.kv_format.KEY_ROW_ALIGNMENT`).

The pool (:mod:`.pool`) allocates exactly these buffers, and the KV ledger reads its
figures from here, so the number a user reads is the number the server uses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import DeepseekV4Config
from ..kernels.kv_format import PoolFormats, RowFormat, pool_formats
from .shared_rows import BOOKKEEPING_BYTES_PER_ROW

STATE_DTYPE = torch.float32
TABLE_DTYPE = torch.int64  # the request tables' cells: pool rows
SLOT_ENTRY_DTYPE = torch.int64  # the prefix cache's entry row at each token slot, per ratio (EntryOwnership)
# Pools per series of an online compressor state: a ratio-4 compressor keeps the current
# block's two halves and the previous block's first half; a ratio-128 one its current block.
OVERLAPPING_POOLS, DISJOINT_POOLS = 3, 1
POOL_FIELDS = 3  # running max, denominator, weighted sum
# Checkpoint windows the window slots hold room for, per request row, besides the running
# windows: every running request's prompt-end and request-end checkpoints and the tree's
# sessions between them.
CHECKPOINT_WINDOWS_PER_REQUEST_ROW = 2
# Checkpoints whose windows overlap all but one slot (a prompt's end and one token before):
# how many records a request row's window slots back, per sliding_window of them.
CHECKPOINTS_PER_WINDOW = 2
# State records per request row: after the last forward, and before it.
RECORDS_PER_REQUEST_ROW = 2


@dataclass(frozen=True)
class CompressedBuffer:
    """Compressed entries of one layer: one row per ``ratio`` token slots."""

    layer: int
    ratio: int
    dim: int
    kind: str  # "entries" or "indexer_keys"


@dataclass(frozen=True)
class StateBuffer:
    """One compressor's online partial-block state per request: ``[pools, 3, dim]`` float32."""

    layer: int
    pools: int
    dim: int
    kind: str  # "compressor" or "indexer"

    @property
    def floats(self) -> int:
        return self.pools * POOL_FIELDS * self.dim


@dataclass(frozen=True)
class PoolLayout:
    config: DeepseekV4Config
    kv_dtype: torch.dtype
    # Tokens per request of a speculative verify forward (EAGLE with the MTP layer; 0: no speculation).
    verify_tokens: int = 0

    @property
    def formats(self) -> PoolFormats:
        """How window rows, compressed entries and indexer keys are stored (in the KV dtype, or FP8-packed)."""
        config = self.config
        return pool_formats(self.kv_dtype, config.head_dim, config.rope_head_dim, config.index_head_dim)

    def format_of(self, buffer: CompressedBuffer) -> RowFormat:
        formats = self.formats
        return formats.indexer_keys if buffer.kind == "indexer_keys" else formats.entries

    def row_bytes(self, buffer: CompressedBuffer) -> int:
        return self.format_of(buffer).row_bytes

    @property
    def layers(self) -> range:
        """The layers the pool holds state for: the network's, and its MTP layer on a server drafting with it
        (numbered after them; it reads and writes the pool at the target's positions, through the same request
        tables)."""
        return range(self.config.num_layers + (self.config.num_mtp_layers if self.verify_tokens else 0))

    @property
    def rollback_records_per_request_row(self) -> int:
        """Under speculation, a running request's state record at each position a verify forward may stop at
        but its last (where its live record is): restored when the target rejects the drafts after it. They
        are the request's, never dropped as an optional checkpoint is."""
        return self.verify_tokens

    def compressed_buffers(self) -> list[CompressedBuffer]:
        config, buffers = self.config, []
        for layer in self.layers:
            kind = config.layer_kind(layer)
            if kind == "hca":
                buffers.append(CompressedBuffer(layer, config.hca_rate, config.head_dim, "entries"))
            elif kind == "csa":
                buffers.append(CompressedBuffer(layer, config.csa_rate, config.head_dim, "entries"))
                buffers.append(CompressedBuffer(layer, config.csa_rate, config.index_head_dim, "indexer_keys"))
        return buffers

    def state_buffers(self) -> list[StateBuffer]:
        config, buffers = self.config, []
        for layer in self.layers:
            kind = config.layer_kind(layer)
            if kind == "hca":
                buffers.append(StateBuffer(layer, DISJOINT_POOLS, config.head_dim, "compressor"))
            elif kind == "csa":
                buffers.append(StateBuffer(layer, OVERLAPPING_POOLS, config.head_dim, "compressor"))
                buffers.append(StateBuffer(layer, OVERLAPPING_POOLS, config.index_head_dim, "indexer"))
        return buffers

    @property
    def bytes_per_token(self) -> float:
        """Persistent bytes per token of context: compressed entries and indexer keys."""
        return sum(self.row_bytes(b) / b.ratio for b in self.compressed_buffers())

    @property
    def window_slot_bytes(self) -> int:
        """One token's raw KV in every layer."""
        return len(self.layers) * self.formats.entries.row_bytes

    @property
    def window_slots_per_request(self) -> int:
        """A running request's window plus one, and its share of checkpoint windows."""
        window = self.config.sliding_window
        return window + 1 + CHECKPOINT_WINDOWS_PER_REQUEST_ROW * window

    @property
    def checkpoint_records_per_request_row(self) -> int:
        """State records per request row: as many checkpoints as its window slots can back."""
        return CHECKPOINTS_PER_WINDOW * (self.window_slots_per_request // self.config.sliding_window)

    def entry_rows(self, ratio: int, tokens: int, request_rows: int) -> int:
        """Compressed-entry rows of one ratio: a block of the token pool each, one more per request row."""
        return tokens // ratio + request_rows

    @property
    def record_bytes(self) -> int:
        """One compressor-state record: every layer's online pools."""
        return sum(b.floats for b in self.state_buffers()) * STATE_DTYPE.itemsize

    @property
    def window_bytes_per_request(self) -> int:
        """A running request's window slots: the window and one more token."""
        return (self.config.sliding_window + 1) * self.window_slot_bytes

    @property
    def state_bytes_per_request(self) -> int:
        """A running request's compressor-state records (after its last forward, and before; under
        speculation also its rollback records)."""
        return (RECORDS_PER_REQUEST_ROW + self.rollback_records_per_request_row) * self.record_bytes

    @property
    def running_bytes_per_request(self) -> int:
        """What one running request holds whatever its length."""
        return self.window_bytes_per_request + self.state_bytes_per_request

    @property
    def checkpoint_bytes(self) -> int:
        """One checkpoint whose window shares no slot with another: a window and a record."""
        return self.config.sliding_window * self.window_slot_bytes + self.record_bytes

    @property
    def checkpoint_bytes_per_request(self) -> int:
        """A request row's share of checkpoints: their windows' slots and their state records."""
        windows = CHECKPOINT_WINDOWS_PER_REQUEST_ROW * self.config.sliding_window * self.window_slot_bytes
        return windows + self.checkpoint_records_per_request_row * self.record_bytes

    @property
    def bytes_per_request(self) -> int:
        """Fixed bytes per request row: a running request's, its share of checkpoints, and its
        entry row per compressed buffer."""
        entries = sum(self.row_bytes(b) for b in self.compressed_buffers())
        return self.running_bytes_per_request + self.checkpoint_bytes_per_request + entries

    @property
    def padding_bytes(self) -> int:
        """Row 0 of every compressed buffer, window slot 0 and checkpoint record 0: padding,
        where unused table cells point."""
        return (
            sum(self.row_bytes(b) for b in self.compressed_buffers()) + self.window_slot_bytes + self.record_bytes
        )

    def request_table_bytes(self, context: int) -> int:
        """One request row's tables at ``context`` positions (a window slot per position, an entry row
        per block of each ratio): what the device twin of the request tables holds per row on a GPU."""
        ratios = {b.ratio for b in self.compressed_buffers()}
        return TABLE_DTYPE.itemsize * (context + 1 + sum(context // r + 1 for r in ratios))

    @property
    def bookkeeping_bytes_per_token(self) -> float:
        """What indexes the rows per token slot: each compressed-entry row's count and free-stack place, and
        per ratio the entry row the prefix cache keeps at each slot (``SLOT_ENTRY_DTYPE``)."""
        ratios = {b.ratio for b in self.compressed_buffers()}
        return sum(BOOKKEEPING_BYTES_PER_ROW / r + SLOT_ENTRY_DTYPE.itemsize for r in ratios)

    @property
    def bookkeeping_bytes_per_request(self) -> int:
        """What indexes the rows per request row: its window slots', checkpoint records' and entry rows'."""
        ratios = {b.ratio for b in self.compressed_buffers()}
        rows = self.window_slots_per_request + self.checkpoint_records_per_request_row + len(ratios)
        return BOOKKEEPING_BYTES_PER_ROW * rows

    def state_bytes_at(self, context: int) -> int:
        """A request's state at ``context`` tokens, what a decode instance continues from: the window rows of its
        last ``sliding_window`` tokens, the entries (and indexer keys) of its complete blocks and one state record
        (:mod:`.transfer` moves exactly these)."""
        return self.state_bytes_past(0, context)

    def state_bytes_past(self, prefix: int, context: int) -> int:
        """What a decode instance that holds the request's state at ``prefix`` tokens lacks at ``context``: the
        window rows of positions ``max(prefix, context - sliding_window) .. context - 1``, the entries (and
        indexer keys) of blocks complete at ``context`` but not at ``prefix``, and one state record."""
        window = (context - max(prefix, context - self.config.sliding_window)) * self.window_slot_bytes
        entries = sum((context // b.ratio - prefix // b.ratio) * self.row_bytes(b) for b in self.compressed_buffers())
        return window + entries + self.record_bytes

    def bytes_for(self, context: int) -> float:
        """Bytes one running request holds at ``context`` tokens."""
        return self.bytes_per_token * context + self.running_bytes_per_request
