"""The V4 KV pool SGLang allocates through: compressed entries per block, windows and
compressor states per request.

The network's :class:`~sglang_dsv4.model.state.LayerState` is the contract: the pool
loads a request's layer state at position P from its buffers (:meth:`V4KVPool.load`)
and stores what a forward advanced it to (:meth:`V4KVPool.store`).
"""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.memory_pool import KVCache

from ..config import DeepseekV4Config
from ..model.compressor import CompressorState, SoftmaxPool
from ..model.state import LayerState
from .block_tables import BlockTables
from .layout import STATE_DTYPE, PoolLayout


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
        self.block_tables = BlockTables([b.ratio for b in compressed], size, request_rows, max_context, device)
        window_shape = (request_rows, config.sliding_window, config.head_dim)
        self.window = [torch.zeros(window_shape, dtype=kv_dtype, device=device) for _ in range(config.num_layers)]
        self.ratio = {(b.layer, b.kind): b.ratio for b in compressed}
        self.compressed = {
            (b.layer, b.kind): torch.zeros(
                self.block_tables.rows_per_ratio[b.ratio], b.dim, dtype=kv_dtype, device=device
            )
            for b in compressed
        }
        self.state = {
            (b.layer, b.kind): torch.zeros(request_rows, b.pools, 3, b.dim, dtype=STATE_DTYPE, device=device)
            for b in layout.state_buffers()
        }
        self.mem_usage = self.allocated_bytes / 2**30

    @property
    def allocated_bytes(self) -> int:
        tensors = [*self.window, *self.compressed.values(), *self.state.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def load(self, layer: int, request: int, start: int, dtype: torch.dtype) -> LayerState:
        """The layer's state of ``request`` after ``start`` tokens, its KV in the compute ``dtype``."""
        return LayerState(
            self._window_rows(layer, request, start).to(dtype),
            self._load_compressor(layer, "entries", "compressor", request, start, dtype),
            self._load_compressor(layer, "indexer_keys", "indexer", request, start, dtype),
        )

    def store(self, layer: int, request: int, start: int, end: int, state: LayerState) -> None:
        """Write back the state a forward of tokens ``start .. end - 1`` advanced to."""
        # Only the new tokens' rows changed: the ring already holds the older ones.
        new_rows = state.window[-min(end - start, state.window.shape[0]) :]
        positions = torch.arange(end - new_rows.shape[0], end, device=new_rows.device)
        self.window[layer][request, positions % self.config.sliding_window] = new_rows.to(self.dtype)
        self._store_compressor(layer, "entries", "compressor", request, start, state.compressor)
        self._store_compressor(layer, "indexer_keys", "indexer", request, start, state.indexer)

    def _window_rows(self, layer: int, request: int, start: int) -> torch.Tensor:
        first = max(0, start - self.config.sliding_window)
        positions = torch.arange(first, start, device=self.window[layer].device)
        return self.window[layer][request, positions % self.config.sliding_window]

    def _load_compressor(
        self, layer: int, kind: str, state_kind: str, request: int, start: int, dtype: torch.dtype
    ) -> CompressorState | None:
        key = (layer, kind)
        if key not in self.compressed:
            return None
        ratio = self.ratio[key]
        entries = self.compressed[key][self.block_tables.rows(ratio, request, 0, start // ratio)].to(dtype)
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
        self, layer: int, kind: str, state_kind: str, request: int, start: int, state: CompressorState | None
    ) -> None:
        if state is None:
            return
        key = (layer, kind)
        ratio = self.ratio[key]
        first_new, total = start // ratio, state.entries.shape[0]
        if total > first_new:
            rows = self.block_tables.rows(ratio, request, first_new, total)
            self.compressed[key][rows] = state.entries[first_new:].to(self.dtype)
        pools = [state.current] if state.next_half is None else [state.current, state.next_half, state.previous_half]
        record = self.state[(layer, state_kind)][request]
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
