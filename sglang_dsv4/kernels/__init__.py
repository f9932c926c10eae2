"""Triton kernels (and torch's CUDA-only grouped GEMM) for the GPU, and the one place that picks them over
the torch reference.

Each function below takes the network's module and its inputs and runs the Triton kernel
when the tensors are on CUDA, the module's torch reference otherwise. The kernel modules
(and Triton) are imported only on the CUDA path, so CPU hosts never need them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..model.compressor import Compressor, CompressorState
    from ..model.mhc import HyperConnection
    from ..model.norms import RMSNorm


def mhc_pre(hc: HyperConnection, norm: RMSNorm, streams: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A sublayer's input ``norm(collapse(streams))`` and its mixing weights ``(x, post, comb)``."""
    if streams.is_cuda:
        from . import mhc

        return mhc.fused_pre(streams, _mixing_weights(hc), norm.weight, norm.eps)
    x, post, comb = hc.pre(streams)
    return norm(x), post, comb


def mhc_post_pre(
    output: torch.Tensor,
    streams: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    next_hc: HyperConnection,
    next_norm: RMSNorm,
) -> tuple[torch.Tensor, ...]:
    """A sublayer's post and the next sublayer's pre: ``(new streams, next x, next post, next comb)``."""
    if streams.is_cuda:
        from . import mhc

        return mhc.fused_post_pre(
            output, streams, post, comb, _mixing_weights(next_hc), next_norm.weight, next_norm.eps
        )
    new_streams = next_hc.post(output, streams, post, comb)
    return (new_streams, *mhc_pre(next_hc, next_norm, new_streams))


def mhc_post(output: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """A sublayer's post alone: the new streams."""
    if streams.is_cuda:
        from . import mhc

        return mhc.fused_post(output, streams, post, comb)
    from ..model.mhc import HyperConnection

    return HyperConnection.post(output, streams, post, comb)


def compressor_advance(compressor: Compressor, x: torch.Tensor, start: int, state: CompressorState) -> int:
    """Feed tokens ``start .. start + len(x) - 1``; append the entries they complete. Returns how many."""
    if not x.is_cuda:
        return compressor.advance_reference(x, start, state)
    return _compressor_advance_kernel(compressor, x, start, state)


def _compressor_advance_kernel(compressor: Compressor, x: torch.Tensor, start: int, state: CompressorState) -> int:
    """:func:`compressor_advance` through the Triton kernel, on the state's pools stacked as one record."""
    from ..model.compressor import SoftmaxPool
    from . import compressor as kernel

    pools = [state.current] if not compressor.overlapping else [state.current, state.next_half, state.previous_half]
    record = torch.stack([torch.stack([pool.max, pool.denom, pool.weighted]) for pool in pools])[None]
    weights = kernel.CompressorWeights(
        ape=compressor.ape,
        norm_weight=compressor.norm.weight,
        norm_eps=compressor.norm.eps,
        inv_freq=compressor.rotary.inv_freq_on(x.device),
        ratio=compressor.ratio,
        overlapping=compressor.overlapping,
    )
    rows = torch.zeros(1, dtype=torch.int32, device=x.device)
    entries = kernel.compress_extend(
        compressor.wkv(x), compressor.wgate(x), [start], [x.shape[0]], record, rows, weights
    )
    updated = [SoftmaxPool(pool[0], pool[1], pool[2]) for pool in record[0]]
    state.current = updated[0]
    if compressor.overlapping:
        state.next_half, state.previous_half = updated[1], updated[2]
    state.entries = torch.cat([state.entries, entries])
    return entries.shape[0]


def _mixing_weights(hc: HyperConnection):
    from .mhc import MixingWeights

    return MixingWeights(hc.fn, hc.base, hc.scale, hc.sinkhorn_iters, hc.hc_eps, hc.norm_eps)


def grouped_gated_mlp(
    x: torch.Tensor,
    group_sizes: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    activation: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Rows of ``x`` grouped by expert (the first ``group_sizes[0]`` rows expert 0's, and so on)
    through their expert's gated MLP ``w2[e] activation(w1[e] x, w3[e] x)``; rows past the last
    group are left unwritten.

    On CUDA in bf16, torch's grouped GEMM over the groups (no host sync); elsewhere one GEMM
    per non-empty group, after one read of the group sizes.
    """
    if x.is_cuda and x.dtype == torch.bfloat16:
        offsets = torch.cumsum(group_sizes, 0).to(torch.int32)
        gate = torch._grouped_mm(x, w1.transpose(1, 2), offs=offsets)
        up = torch._grouped_mm(x, w3.transpose(1, 2), offs=offsets)
        return torch._grouped_mm(activation(gate, up), w2.transpose(1, 2), offs=offsets)
    out = x.new_zeros(x.shape[0], w2.shape[1])
    start = 0
    for expert, size in enumerate(group_sizes.tolist()):
        if size:
            rows = x[start : start + size]
            out[start : start + size] = activation(rows @ w1[expert].T, rows @ w3[expert].T) @ w2[expert].T
            start += size
    return out
