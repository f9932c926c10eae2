"""The V4 pool as SGLang's ``KVCache``: a thin adapter over plain torch objects.

SGLang allocates the KV pool through its ``KVCache`` interface and hands it to the attention
backend and the prefix cache. V4 has no per-layer K/V buffers: its rows are the
:class:`~sglang_dsv4.memory_pool.storage.V4PoolStorage` (window slots, compressed entries,
state records, request tables), and who takes and gives back which is the prefix cache's
:class:`~sglang_dsv4.prefix_cache.manager.CacheManager` (the checkpoints made over the rows,
:attr:`V4KVPool.checkpoints`, and the entries the tree's token slots keep, :attr:`V4KVPool.entry_ownership`,
are the manager's). This class carries the two.
"""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.memory_pool import KVCache

from .config import DeepseekV4Config
from .memory_pool.storage import V4PoolStorage
from .prefix_cache.manager import CacheManager


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
        self.storage = V4PoolStorage(
            config, kv_dtype, num_tokens=size, max_requests=max_requests, max_context=max_context, device=device
        )
        self.manager = CacheManager(self.storage)
        self.entry_ownership, self.checkpoints = self.manager.entry_ownership, self.manager.checkpoints
        self.mem_usage = self.storage.allocated_bytes / 2**30

    # --- KVCache's abstract interface: V4 has no per-layer K/V buffers --------------------------

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        raise NotImplementedError("V4 pools are read through their storage; there is no key buffer")

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        raise NotImplementedError("V4 pools are read through their storage; there is no value buffer")

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError("V4 pools are read through their storage; there are no K/V buffers")

    def set_kv_buffer(self, *args, **kwargs) -> None:
        raise NotImplementedError("V4 pools are written by the attention backend, through their storage")
