"""The V4 pool as SGLang's ``KVCache``: a thin adapter over plain torch objects.

SGLang allocates the KV pool through its ``KVCache`` interface and hands it to the attention
backend and the prefix cache. V4 has no per-layer K/V buffers: its rows are the
:class:`~sglang_dsv4.memory_pool.storage.V4PoolStorage` (window slots, compressed entries,
state records, request tables), the checkpoints made over them are the prefix cache's
:class:`~sglang_dsv4.prefix_cache.checkpoints.Checkpoints`, and the entries its token slots
keep its :class:`~sglang_dsv4.prefix_cache.entry_ownership.EntryOwnership`. This class
carries the three, and wires what frees rows when some run short.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from sglang.srt.mem_cache.memory_pool import KVCache

from .config import DeepseekV4Config
from .memory_pool.storage import V4PoolStorage
from .prefix_cache.checkpoints import Checkpoints
from .prefix_cache.entry_ownership import EntryOwnership


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
        self.entries = EntryOwnership(self.storage)
        self.checkpoints = Checkpoints(self.storage, self.entries)
        self.mem_usage = self.storage.allocated_bytes / 2**30

    def set_reclaim(
        self,
        evict_checkpoint: Callable[[], bool],
        evict_tokens: Callable[[], bool],
        trim_checkpoint_windows: Callable[[], bool],
    ) -> None:
        """What frees rows when some run short. For a checkpoint (its record, its window slots): the
        prefix cache evicting its least recently used checkpoint. For a forward's own window slots,
        cheapest loss first: request rows letting go of what no forward reads and checkpoints of what
        no resume reads (all_committed's windows fall back to what per_request keeps), then least
        recently used checkpoints, then snapshots not taken yet. For entry rows: the prefix cache
        evicting cached tokens."""
        storage = self.storage
        storage.records.reclaim_optional = (evict_checkpoint,)
        storage.window_slots.reclaim_optional = (evict_checkpoint,)
        storage.window_slots.reclaim_for_forwards = (
            storage.tables.keep_only_what_forwards_read,
            trim_checkpoint_windows,
            evict_checkpoint,
            self.checkpoints.drop_newest,
        )
        for rows in storage.entry_rows.values():
            rows.reclaim_for_forwards = (evict_tokens,)

    # --- KVCache's abstract interface: V4 has no per-layer K/V buffers --------------------------

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        raise NotImplementedError("V4 pools are read through their storage; there is no key buffer")

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        raise NotImplementedError("V4 pools are read through their storage; there is no value buffer")

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError("V4 pools are read through their storage; there are no K/V buffers")

    def set_kv_buffer(self, *args, **kwargs) -> None:
        raise NotImplementedError("V4 pools are written by the attention backend, through their storage")
