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

from dataclasses import dataclass

import numpy as np
import torch
from sglang.srt.mem_cache.memory_pool import KVCache

from .config import DeepseekV4Config
from .memory_pool.storage import V4PoolStorage
from .memory_pool.transfer import RequestStateTransfer
from .prefix_cache.manager import CacheManager


@dataclass(frozen=True)
class RequestStateRows:
    """A request's state as SGLang's disaggregation asks for it: request row ``row`` at ``length`` tokens. SGLang
    asks once per transfer component with the same arguments; the component's position names the group, and the
    prefix the decode instance holds is known only when the rows are sent or published
    (:func:`sglang_dsv4.disaggregation._resolve_rows`)."""

    transfer: RequestStateTransfer
    row: int
    length: int

    def rows(self, group: str, prefix: int) -> np.ndarray:
        return self.transfer.rows(group, self.row, self.length, prefix)


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
        verify_tokens: int = 0,
        shared: CacheManager | None = None,
        storage_class: type[V4PoolStorage] = V4PoolStorage,
    ):
        """``verify_tokens``: see :class:`~sglang_dsv4.memory_pool.storage.V4PoolStorage`. ``shared``: the
        target's cache manager, whose rows this pool is a second view of (the EAGLE draft model's: its MTP
        layer's state is in the target's pool). ``storage_class``: the rows' storage (the emulator's has rows of no
        width)."""
        super().__init__(size, page_size, kv_dtype, config.num_layers, device, enable_memory_saver=False)
        if shared is None:
            storage = storage_class(
                config,
                kv_dtype,
                num_tokens=size,
                max_requests=max_requests,
                max_context=max_context,
                device=device,
                verify_tokens=verify_tokens,
            )
            shared = CacheManager(storage)
        self.manager, self.storage = shared, shared.storage
        self.entry_ownership, self.checkpoints = self.manager.entry_ownership, self.manager.checkpoints
        self.mem_usage = self.storage.allocated_bytes / 2**30
        self.head_num = 1  # V4's one KV head (what SGLang's disaggregation reads of a non-MLA pool)
        self.transfer = RequestStateTransfer(self.storage)

    # --- SGLang's prefill/decode disaggregation -----------------------------------------------------

    def get_contiguous_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        """No page-indexed buffers: everything a decode instance needs moves as request state."""
        return [], [], []

    def request_state_transfer_indices(self, row: int, length: int) -> RequestStateRows:
        """SGLang's disaggregation asks, on both sides, for a request's state rows at ``length`` tokens (the
        prompt's end). A decode-side row not bound yet is bound there first, its rows reserved to receive."""
        if not self.manager.is_bound(row):
            self.manager.start(row, length)
        return RequestStateRows(self.transfer, row, length)

    # --- SGLang's EAGLE verify ------------------------------------------------------------------

    def clear_unaccepted_c128_draft_states(
        self, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, accept_lens: torch.Tensor, num_draft_tokens: int
    ) -> None:
        """SGLang's EAGLE verify calls this after it counted each request's accepted tokens (``accept_lens``: the
        target's own and the drafts it accepted) in a verify forward of ``num_draft_tokens`` tokens from
        ``seq_lens``: every request's state goes back to its accepted position
        (:meth:`~sglang_dsv4.prefix_cache.manager.CacheManager.accept_verified`)."""
        if num_draft_tokens != self.storage.verify_tokens:
            raise ValueError(f"a verify of {num_draft_tokens} tokens; the pool holds {self.storage.verify_tokens}")
        rows, starts, accepted = (t.tolist() for t in (req_pool_indices, seq_lens, accept_lens))
        for row, start, count in zip(rows, starts, accepted, strict=True):
            self.manager.accept_verified(row, start, count)

    # --- KVCache's abstract interface: V4 has no per-layer K/V buffers --------------------------

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        raise NotImplementedError("V4 pools are read through their storage; there is no key buffer")

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        raise NotImplementedError("V4 pools are read through their storage; there is no value buffer")

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError("V4 pools are read through their storage; there are no K/V buffers")

    def set_kv_buffer(self, *args, **kwargs) -> None:
        raise NotImplementedError("V4 pools are written by the attention backend, through their storage")
