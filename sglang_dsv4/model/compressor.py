"""The KV compressor: one entry per block of ``ratio`` tokens, as a gated softmax pool.

Each token ``j`` contributes a value ``kv_j`` and a gate logit ``g_j + ape[j % ratio]``
per channel; a block's entry is ``sum_j softmax(g)_j * kv_j`` per channel, then
RMSNorm and rope at the block's first position.

* Disjoint (ratio 128, HCA): an entry pools its own block.
* Overlapping (ratio 4, CSA and the indexer): the projections are two series ``Ca``
  and ``Cb``; entry ``w`` pools ``Ca`` of block ``w - 1`` together with ``Cb`` of
  block ``w`` (a softmax over ``2 * ratio`` slots).

A partial block is never kept as raw tokens: the softmax pool is accumulated online
(:class:`SoftmaxPool`: per channel the running max, denominator and weighted sum),
so the state behind a partial block costs O(dim) whatever its length, and prefill of
any length, chunked prefill and decode all go through the same :meth:`Compressor.advance`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .kernel_calls import compressor_advance
from .norms import RMSNorm
from .rope import Rotary, apply_rope


@dataclass
class SoftmaxPool:
    """Online softmax-weighted sum per channel: ``value = weighted / denom``.

    Leading dims are blocks (or none); an empty pool has ``max = -inf`` and zeros.
    Always float32.
    """

    max: torch.Tensor
    denom: torch.Tensor
    weighted: torch.Tensor

    @staticmethod
    def empty(shape: tuple[int, ...], device: torch.device | str = "cpu") -> SoftmaxPool:
        return SoftmaxPool(
            max=torch.full(shape, float("-inf"), device=device),
            denom=torch.zeros(shape, device=device),
            weighted=torch.zeros(shape, device=device),
        )

    @staticmethod
    def of_slots(kv: torch.Tensor, logits: torch.Tensor) -> SoftmaxPool:
        """Pool over dim -2 of ``[..., slots, dim]``; slots with ``-inf`` logits are absent."""
        kv, logits = kv.float(), logits.float()
        peak = logits.max(dim=-2).values
        weights = torch.exp(logits - _finite(peak).unsqueeze(-2))
        return SoftmaxPool(peak, weights.sum(-2), (weights * kv).sum(-2))

    def merge(self, other: SoftmaxPool) -> SoftmaxPool:
        peak = torch.maximum(self.max, other.max)
        mine, theirs = _rescale(self.max, peak), _rescale(other.max, peak)
        return SoftmaxPool(
            peak, self.denom * mine + other.denom * theirs, self.weighted * mine + other.weighted * theirs
        )

    def value(self) -> torch.Tensor:
        return self.weighted / self.denom

    def __getitem__(self, index: int | slice) -> SoftmaxPool:
        return SoftmaxPool(self.max[index], self.denom[index], self.weighted[index])

    def clone(self) -> SoftmaxPool:
        return SoftmaxPool(self.max.clone(), self.denom.clone(), self.weighted.clone())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.max, self.denom, self.weighted))


def _finite(peak: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))


def _rescale(old_max: torch.Tensor, new_max: torch.Tensor) -> torch.Tensor:
    """``exp(old_max - new_max)``, with 0 for an empty pool."""
    return torch.where(torch.isfinite(old_max), torch.exp(old_max - _finite(new_max)), torch.zeros_like(old_max))


@dataclass
class CompressorState:
    """A compressor's state at a token position.

    ``entries`` are the compressed entries of every complete block (persistent).
    ``current`` pools the partial block (the ``Cb`` series when overlapping);
    ``next_half`` pools the partial block's ``Ca`` (overlapping only) and
    ``previous_half`` the last complete block's ``Ca``, which the next entry still needs.
    """

    entries: torch.Tensor
    current: SoftmaxPool
    next_half: SoftmaxPool | None
    previous_half: SoftmaxPool | None

    def clone(self) -> CompressorState:
        return CompressorState(
            self.entries.clone(),
            self.current.clone(),
            self.next_half.clone() if self.next_half is not None else None,
            self.previous_half.clone() if self.previous_half is not None else None,
        )

    @property
    def online_nbytes(self) -> int:
        """Bytes of the partial-block state (everything but the entries)."""
        pools = (self.current, self.next_half, self.previous_half)
        return sum(p.nbytes for p in pools if p is not None)


class Compressor(nn.Module):
    """Compresses blocks of ``ratio`` tokens into entries of ``dim`` channels (release names)."""

    def __init__(self, hidden_size: int, dim: int, ratio: int, overlapping: bool, rotary: Rotary, eps: float):
        super().__init__()
        self.dim = dim
        self.ratio = ratio
        self.overlapping = overlapping
        self.rotary = rotary
        series = 2 if overlapping else 1
        self.wkv = nn.Linear(hidden_size, series * dim, bias=False)
        self.wgate = nn.Linear(hidden_size, series * dim, bias=False)
        self.ape = nn.Parameter(torch.zeros(ratio, series * dim))
        self.norm = RMSNorm(dim, eps)

    def new_state(self, dtype: torch.dtype, device: torch.device | str) -> CompressorState:
        half = SoftmaxPool.empty((self.dim,), device) if self.overlapping else None
        return CompressorState(
            entries=torch.zeros(0, self.dim, dtype=dtype, device=device),
            current=SoftmaxPool.empty((self.dim,), device),
            next_half=half,
            previous_half=half.clone() if half is not None else None,
        )

    def advance(self, x: torch.Tensor, start: int, state: CompressorState) -> int:
        """Feed tokens ``start .. start + len(x) - 1`` (``x`` is ``[L, hidden]``).

        Appends the entries of the blocks this completes to ``state.entries`` and
        returns how many were appended. On CUDA a Triton kernel pools the blocks
        (:func:`sglang_dsv4.model.kernel_calls.compressor_advance`), elsewhere :meth:`advance_reference`.
        """
        return compressor_advance(self, x, start, state)

    def advance_reference(self, x: torch.Tensor, start: int, state: CompressorState) -> int:
        """:meth:`advance` in torch."""
        return self.pool_reference(self.wkv(x), self.wgate(x), start, state)

    def pool_reference(self, kv: torch.Tensor, gate: torch.Tensor, start: int, state: CompressorState) -> int:
        """:meth:`advance` from the projections ``kv = wkv(x)`` and ``gate = wgate(x)``."""
        ratio, length = self.ratio, kv.shape[0]
        offset = start % ratio
        num_blocks = -(-(offset + length) // ratio)
        complete = (offset + length) // ratio
        positions = torch.arange(start, start + length, device=kv.device)
        logits = gate + self.ape[positions % ratio]
        # Lay the tokens out in their blocks' slots; slots outside the chunk are absent.
        slots_kv = kv.new_zeros(num_blocks * ratio, kv.shape[-1])
        slots_logits = logits.new_full((num_blocks * ratio, kv.shape[-1]), float("-inf"))
        slots_kv[offset : offset + length] = kv
        slots_logits[offset : offset + length] = logits
        pools = SoftmaxPool.of_slots(slots_kv.view(num_blocks, ratio, -1), slots_logits.view(num_blocks, ratio, -1))
        if self.overlapping:
            entry_pools = self._advance_overlapping(pools, complete, state)
        else:
            entry_pools = self._advance_disjoint(pools, complete, state)
        if complete == 0:
            return 0
        entries = self.norm(entry_pools.value().to(kv.dtype))
        first_block = start // ratio
        block_starts = (torch.arange(complete, device=kv.device) + first_block) * ratio
        cos, sin = self.rotary.cos_sin(block_starts)
        state.entries = torch.cat([state.entries, apply_rope(entries, cos, sin)])
        return complete

    def _advance_disjoint(self, pools: SoftmaxPool, complete: int, state: CompressorState) -> SoftmaxPool:
        pools = _merge_into_first(pools, state.current)
        state.current = _partial_or_empty(pools, complete, self.dim)
        return pools[:complete]

    def _advance_overlapping(self, pools: SoftmaxPool, complete: int, state: CompressorState) -> SoftmaxPool:
        dim = self.dim
        earlier = _split_channels(pools, slice(0, dim))  # Ca: feeds the next block's entry
        later = _split_channels(pools, slice(dim, 2 * dim))  # Cb: feeds its own block's entry
        earlier = _merge_into_first(earlier, state.next_half)
        later = _merge_into_first(later, state.current)
        previous = _stack_pools(state.previous_half, earlier)  # block i pairs with previous[i]
        entry_pools = previous[:complete].merge(later[:complete])
        if complete:
            state.previous_half = earlier[complete - 1]
        state.current = _partial_or_empty(later, complete, dim)
        state.next_half = _partial_or_empty(earlier, complete, dim)
        return entry_pools


def _split_channels(pools: SoftmaxPool, channels: slice) -> SoftmaxPool:
    return SoftmaxPool(pools.max[..., channels], pools.denom[..., channels], pools.weighted[..., channels])


def _merge_into_first(pools: SoftmaxPool, partial: SoftmaxPool) -> SoftmaxPool:
    """Fold the state's partial-block pool into the chunk's first block."""
    first = pools[0].merge(partial)
    return SoftmaxPool(
        torch.cat([first.max[None], pools.max[1:]]),
        torch.cat([first.denom[None], pools.denom[1:]]),
        torch.cat([first.weighted[None], pools.weighted[1:]]),
    )


def _stack_pools(head: SoftmaxPool, rest: SoftmaxPool) -> SoftmaxPool:
    return SoftmaxPool(
        torch.cat([head.max[None], rest.max]),
        torch.cat([head.denom[None], rest.denom]),
        torch.cat([head.weighted[None], rest.weighted]),
    )


def _partial_or_empty(pools: SoftmaxPool, complete: int, dim: int) -> SoftmaxPool:
    if complete < pools.max.shape[0]:
        return pools[complete].clone()
    return SoftmaxPool.empty((dim,), pools.max.device)
