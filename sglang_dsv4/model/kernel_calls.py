"""The network's calls into the kernels: each takes the network's module and its inputs and runs the
Triton kernel where :func:`~sglang_dsv4.kernels.dispatch.uses_triton` says so, the module's torch
implementation otherwise. The kernels take tensors only; this is where modules become tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..kernels.dispatch import uses_triton
from .rope import apply_rope

if TYPE_CHECKING:
    from .attention import Attention
    from .compressor import Compressor, CompressorState
    from .indexer import Indexer
    from .mhc import HyperConnection
    from .norms import RMSNorm


def mhc_pre(hc: HyperConnection, norm: RMSNorm, streams: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A sublayer's input ``norm(collapse(streams))`` and its mixing weights ``(x, post, comb)``."""
    if uses_triton(streams):
        from ..kernels import mhc

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
    if uses_triton(streams):
        from ..kernels import mhc

        return mhc.fused_post_pre(
            output, streams, post, comb, _mixing_weights(next_hc), next_norm.weight, next_norm.eps
        )
    new_streams = next_hc.post(output, streams, post, comb)
    return (new_streams, *mhc_pre(next_hc, next_norm, new_streams))


def mhc_post(output: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """A sublayer's post alone: the new streams."""
    if uses_triton(streams):
        from ..kernels import mhc

        return mhc.fused_post(output, streams, post, comb)
    from .mhc import HyperConnection

    return HyperConnection.post(output, streams, post, comb)


def compressor_advance(compressor: Compressor, x: torch.Tensor, start: int, state: CompressorState) -> int:
    """Feed tokens ``start .. start + len(x) - 1``; append the entries they complete. Returns how many."""
    if not uses_triton(x):
        return compressor.advance_reference(x, start, state)
    return compressor_advance_kernel(compressor, x, start, state)


def compressor_advance_kernel(compressor: Compressor, x: torch.Tensor, start: int, state: CompressorState) -> int:
    """:func:`compressor_advance` through the Triton kernel, on the state's pools stacked as one record."""
    from ..kernels import compressor as kernel
    from .compressor import SoftmaxPool

    pools = [state.current] if not compressor.overlapping else [state.current, state.next_half, state.previous_half]
    record = torch.stack([torch.stack([pool.max, pool.denom, pool.weighted]) for pool in pools])[None]
    rows = torch.zeros(1, dtype=torch.int32, device=x.device)
    entries = kernel.compress_extend(
        compressor.wkv(x), compressor.wgate(x), [start], [x.shape[0]], record, rows, _compressor_weights(compressor, x)
    )
    updated = [SoftmaxPool(pool[0], pool[1], pool[2]) for pool in record[0]]
    state.current = updated[0]
    if compressor.overlapping:
        state.next_half, state.previous_half = updated[1], updated[2]
    state.entries = torch.cat([state.entries, entries])
    return entries.shape[0]


def compressor_decode_kernel(
    compressor: Compressor, x: torch.Tensor, positions: torch.Tensor, state: torch.Tensor, state_rows: torch.Tensor
) -> torch.Tensor:
    """One token per request (``x [requests, hidden]`` at ``positions``) through the Triton decode kernel:
    advances records ``state_rows`` of ``state`` (the V4 pool's ``[rows, pools, 3, dim]``) in place and
    returns each request's entry, zeros where its token does not complete a block. Graph-capturable."""
    from ..kernels import compressor as kernel

    weights = _compressor_weights(compressor, x)
    return kernel.compress_decode(compressor.wkv(x), compressor.wgate(x), positions, state, state_rows, weights)


def _compressor_weights(compressor: Compressor, x: torch.Tensor):
    from ..kernels.compressor import CompressorWeights

    return CompressorWeights(
        ape=compressor.ape,
        norm_weight=compressor.norm.weight,
        norm_eps=compressor.norm.eps,
        inv_freq=compressor.rotary.inv_freq_on(x.device),
        ratio=compressor.ratio,
        overlapping=compressor.overlapping,
    )


def _mixing_weights(hc: HyperConnection):
    from ..kernels.mhc import MixingWeights

    return MixingWeights(hc.fn, hc.base, hc.scale, hc.sinkhorn_iters, hc.hc_eps, hc.norm_eps)


def attend_visible(
    attention: Attention,
    q: torch.Tensor,
    keys: torch.Tensor,
    raw_count: int,
    visible: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """The attention's softmax over ``keys`` (the window's ``raw_count`` rows, then the entries) where
    ``visible [L, len(keys)]``, and the sink; inverse rope on the output, ``[L, heads, head_dim]``.

    The Triton kernel does all of it in one pass; the torch path is the network's own softmax."""
    if uses_triton(q):
        from ..kernels.attention import attend_visible as kernel

        scale = attention.head_dim**-0.5
        return kernel(q, keys, raw_count, visible, attention.attn_sink, cos, sin, scale=scale)
    return apply_rope(attention._attend(q, keys, visible), cos, sin, inverse=True)


def select_visible(
    indexer: Indexer,
    x: torch.Tensor,
    q_residual: torch.Tensor,
    positions: torch.Tensor,
    keys: torch.Tensor,
    visible: torch.Tensor,
) -> torch.Tensor:
    """Boolean ``[L, len(keys)]``: the indexer's top-k of each query's visible keys (scoring, then an
    exact top-k, in Triton; :meth:`~.indexer.Indexer.select_reference` in torch)."""
    if uses_triton(x):
        from ..kernels.indexer import select_visible as kernel

        q, head_weights = indexer.queries(x, q_residual, positions)
        return kernel(q, head_weights, keys, visible, indexer.topk, scale=indexer.head_dim**-0.5)
    return indexer.select_reference(x, q_residual, positions, keys, visible)
