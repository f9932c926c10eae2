"""What a V4 server allocates, per token slot and per request: the one definition of the pools.

Three lifetimes (DESIGN.md, "Memory lifecycle"):

* per token (persistent): the compressed entries of ratio-4 and ratio-128 layers and the
  indexer keys, one per complete block of ``ratio`` tokens, at rows that
  :class:`~.block_tables.BlockTables` hands out (any page size works);
* per request (transient): the sliding window, a ring of ``sliding_window`` raw KV rows
  per layer, indexed by the request's ``req_pool_idx`` — nothing behind the window is
  ever kept, so the window costs the same whatever the context length;
* per request (compressor state): the online partial-block pools, float32.

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
    def window_bytes_per_request(self) -> int:
        config = self.config
        return config.num_layers * config.sliding_window * config.head_dim * self.kv_bytes

    @property
    def state_bytes_per_request(self) -> int:
        return sum(b.floats for b in self.state_buffers()) * STATE_DTYPE.itemsize

    @property
    def bytes_per_request(self) -> int:
        """Fixed bytes per running request: the window rings and the compressor states."""
        return self.window_bytes_per_request + self.state_bytes_per_request

    @property
    def padding_bytes(self) -> int:
        """One padding row per compressed buffer (row 0, where unused table cells point)."""
        return sum(b.dim * self.kv_bytes for b in self.compressed_buffers())

    def bytes_for(self, context: int) -> float:
        """Bytes one request holds at ``context`` tokens."""
        return self.bytes_per_token * context + self.bytes_per_request
