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
* checkpoints (``CHECKPOINTS_PER_REQUEST_ROW`` per request row): a window of slots and
  one state record each, what the prefix cache resumes requests from.

The pool (:mod:`.pool`) allocates exactly these buffers, and the KV ledger reads its
figures from here, so the number a user reads is the number the server uses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import DeepseekV4Config

STATE_DTYPE = torch.float32
# Pools per series of an online compressor state: a ratio-4 compressor keeps the current
# block's two halves and the previous block's first half; a ratio-128 one its current block.
OVERLAPPING_POOLS, DISJOINT_POOLS = 3, 1
POOL_FIELDS = 3  # running max, denominator, weighted sum
# Checkpoints the pool holds room for, per request row: enough for every running request's
# prompt-end and request-end checkpoints and the tree's sessions between them.
CHECKPOINTS_PER_REQUEST_ROW = 2
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

    @property
    def kv_bytes(self) -> int:
        return torch.empty(0, dtype=self.kv_dtype).element_size()

    def compressed_buffers(self) -> list[CompressedBuffer]:
        config, buffers = self.config, []
        for layer in range(config.num_layers):
            kind = config.layer_kind(layer)
            if kind == "hca":
                buffers.append(CompressedBuffer(layer, config.hca_rate, config.head_dim, "entries"))
            elif kind == "csa":
                buffers.append(CompressedBuffer(layer, config.csa_rate, config.head_dim, "entries"))
                buffers.append(CompressedBuffer(layer, config.csa_rate, config.index_head_dim, "indexer_keys"))
        return buffers

    def state_buffers(self) -> list[StateBuffer]:
        config, buffers = self.config, []
        for layer in range(config.num_layers):
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
        return sum(b.dim * self.kv_bytes / b.ratio for b in self.compressed_buffers())

    @property
    def window_slot_bytes(self) -> int:
        """One token's raw KV in every layer."""
        return self.config.num_layers * self.config.head_dim * self.kv_bytes

    @property
    def window_slots_per_request(self) -> int:
        """A running request's window plus one, and its share of checkpoint windows."""
        window = self.config.sliding_window
        return window + 1 + CHECKPOINTS_PER_REQUEST_ROW * window

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
        """A running request's compressor-state records (after its last forward, and before)."""
        return RECORDS_PER_REQUEST_ROW * self.record_bytes

    @property
    def running_bytes_per_request(self) -> int:
        """What one running request holds whatever its length."""
        return self.window_bytes_per_request + self.state_bytes_per_request

    @property
    def checkpoint_bytes(self) -> int:
        """One checkpoint whose window shares no slot with another: a window and a record."""
        return self.config.sliding_window * self.window_slot_bytes + self.record_bytes

    @property
    def bytes_per_request(self) -> int:
        """Fixed bytes per request row: a running request's, and its share of checkpoints."""
        return self.running_bytes_per_request + CHECKPOINTS_PER_REQUEST_ROW * self.checkpoint_bytes

    @property
    def padding_bytes(self) -> int:
        """Row 0 of every compressed buffer, window slot 0 and checkpoint record 0: padding,
        where unused table cells point."""
        return (
            sum(b.dim * self.kv_bytes for b in self.compressed_buffers()) + self.window_slot_bytes + self.record_bytes
        )

    def bytes_for(self, context: int) -> float:
        """Bytes one running request holds at ``context`` tokens."""
        return self.bytes_per_token * context + self.running_bytes_per_request
