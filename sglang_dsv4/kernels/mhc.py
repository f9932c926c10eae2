"""Fused mHC for the GPU: a sublayer's post and the next sublayer's pre in two launches.

The torch reference (:mod:`sglang_dsv4.model.mhc`) runs dozens of tiny kernels per
sublayer (the 20 Sinkhorn iterations alone are 40 reductions), so on the GPU it is
launch-bound. Here a whole ``post`` + next ``pre`` is two launches:

1. :func:`_post_and_mix_partials`, a grid over (token blocks, channel splits): writes the
   new streams ``post[k] * output + sum_j comb[j, k] * streams[j]`` and, from the new
   streams rounded to their dtype, partial sums of squares and partial products with
   the ``(2 + n) * n`` rows of ``fn`` (a tensor-core dot; bf16 products are exact in
   float32, and the RMS scale is applied after the dot, which is the same by linearity).
2. :func:`_gates_and_collapse`, one program per token: adds up the partials, forms the
   sigmoid gates and the Sinkhorn-normalised ``comb`` in float32, collapses the streams
   with ``pre`` and applies the next sublayer's RMSNorm to the collapsed row.

The second launch reads the new streams back; it walks the tokens in reverse so that
the rows the first launch wrote last are still in L2 when they are read.

Shapes: ``streams [tokens, n, hidden]`` with n = 4 (every V4 config's ``hc_mult``),
``output [tokens, hidden]``, ``post [tokens, n]`` and ``comb [tokens, n, n]`` float32. No host
synchronisation: every call can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .interpreter import INTERPRETED

STREAMS = 4  # hc_mult of every V4 config; the partials pass holds one tile per stream
MIX_COLUMNS_PAD = 32  # (2 + n) * n = 24 mix columns for n = 4, padded to a power of two
BLOCK_TOKENS = 16  # tokens per program of the partials pass (the dot needs 16 rows)
BLOCK_CHANNELS = 64  # channels per step of the partials pass
COLLAPSE_CHANNELS = 1024  # channels per step of the collapse
# Programs of the partials pass to aim for, 4 per H200 multiprocessor: at batch 1024, 16 per
# multiprocessor (more channel splits, more partials) was 13% slower; at batch 64 the same
# (benchmarks/NOTES.md).
PROGRAMS_WANTED = 528


@triton.jit
def _post_and_mix_partials(
    output_ptr,
    streams_ptr,
    post_ptr,
    comb_ptr,
    new_streams_ptr,
    fn_ptr,
    partial_mix_ptr,
    partial_sumsq_ptr,
    tokens,
    hidden,
    tiles_per_split,
    MIXES: tl.constexpr,
    MIX_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    APPLY_POST: tl.constexpr,
    MIX: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    """Program (token block, channel split) for n = 4 streams: each stream a ``[BLOCK_T, BLOCK_C]`` tile."""
    token_block, split = tl.program_id(0), tl.program_id(1)
    # 64-bit scalar bases per token block, 32-bit offsets inside it: fewer registers per element.
    first_token = token_block * BLOCK_T
    streams_ptr += first_token.to(tl.int64) * 4 * hidden
    new_streams_ptr += first_token.to(tl.int64) * 4 * hidden
    output_ptr += first_token.to(tl.int64) * hidden
    local = tl.arange(0, BLOCK_T)
    token = first_token + local
    token_ok = token < tokens
    mixes = tl.zeros([BLOCK_T, MIX_PAD], tl.float32)
    sumsq = tl.zeros([BLOCK_T], tl.float32)
    first_tile = split * tiles_per_split
    for tile in range(first_tile, first_tile + tiles_per_split):
        c = tile * BLOCK_C + tl.arange(0, BLOCK_C)
        ok = token_ok[:, None] & (c < hidden)[None, :]
        at = local[:, None] * 4 * hidden + c[None, :]  # stream 0; stream j is j * hidden further
        s0 = tl.load(streams_ptr + at, mask=ok, other=0.0)
        s1 = tl.load(streams_ptr + at + hidden, mask=ok, other=0.0)
        s2 = tl.load(streams_ptr + at + 2 * hidden, mask=ok, other=0.0)
        s3 = tl.load(streams_ptr + at + 3 * hidden, mask=ok, other=0.0)
        if APPLY_POST:
            out = tl.load(output_ptr + local[:, None] * hidden + c[None, :], mask=ok, other=0.0)
            out = out.to(tl.float32)
            s0, s1, s2, s3 = s0.to(tl.float32), s1.to(tl.float32), s2.to(tl.float32), s3.to(tl.float32)
            dtype = new_streams_ptr.dtype.element_ty
            n0 = _new_stream(0, out, s0, s1, s2, s3, post_ptr, comb_ptr, token, token_ok).to(dtype)
            n1 = _new_stream(1, out, s0, s1, s2, s3, post_ptr, comb_ptr, token, token_ok).to(dtype)
            n2 = _new_stream(2, out, s0, s1, s2, s3, post_ptr, comb_ptr, token, token_ok).to(dtype)
            n3 = _new_stream(3, out, s0, s1, s2, s3, post_ptr, comb_ptr, token, token_ok).to(dtype)
            tl.store(new_streams_ptr + at, n0, mask=ok)
            tl.store(new_streams_ptr + at + hidden, n1, mask=ok)
            tl.store(new_streams_ptr + at + 2 * hidden, n2, mask=ok)
            tl.store(new_streams_ptr + at + 3 * hidden, n3, mask=ok)
            if MIX:
                # Read the tile back (from L2) for the dot. Fed straight from the arithmetic,
                # the compiler redoes all of it in the dot's operand layout, which repeats
                # the tile in every warp and needs all 255 registers.
                tl.debug_barrier()
                n0 = tl.load(new_streams_ptr + at, mask=ok, other=0.0)
                n1 = tl.load(new_streams_ptr + at + hidden, mask=ok, other=0.0)
                n2 = tl.load(new_streams_ptr + at + 2 * hidden, mask=ok, other=0.0)
                n3 = tl.load(new_streams_ptr + at + 3 * hidden, mask=ok, other=0.0)
        else:
            n0, n1, n2, n3 = s0, s1, s2, s3
        if MIX:
            mixes, sumsq = _mix_stream(mixes, sumsq, n0, 0, fn_ptr, c, hidden, MIXES, MIX_PAD, DOT_IN_FP32)
            mixes, sumsq = _mix_stream(mixes, sumsq, n1, 1, fn_ptr, c, hidden, MIXES, MIX_PAD, DOT_IN_FP32)
            mixes, sumsq = _mix_stream(mixes, sumsq, n2, 2, fn_ptr, c, hidden, MIXES, MIX_PAD, DOT_IN_FP32)
            mixes, sumsq = _mix_stream(mixes, sumsq, n3, 3, fn_ptr, c, hidden, MIXES, MIX_PAD, DOT_IN_FP32)
    if MIX:
        at = split * tokens + token
        mix = tl.arange(0, MIX_PAD)
        tl.store(partial_mix_ptr + at[:, None] * MIX_PAD + mix[None, :], mixes, mask=token_ok[:, None])
        tl.store(partial_sumsq_ptr + at, sumsq, mask=token_ok)


@triton.jit
def _new_stream(k: tl.constexpr, out, s0, s1, s2, s3, post_ptr, comb_ptr, token, token_ok):
    """Stream ``k`` after the post: ``post[t, k] * out + sum_j comb[t, j, k] * s_j`` (float32)."""
    at = comb_ptr + token * 16 + k
    new = tl.load(post_ptr + token * 4 + k, mask=token_ok, other=0.0)[:, None] * out
    new += tl.load(at, mask=token_ok, other=0.0)[:, None] * s0
    new += tl.load(at + 4, mask=token_ok, other=0.0)[:, None] * s1
    new += tl.load(at + 8, mask=token_ok, other=0.0)[:, None] * s2
    new += tl.load(at + 12, mask=token_ok, other=0.0)[:, None] * s3
    return new


@triton.jit
def _mix_stream(
    mixes,
    sumsq,
    stream,
    k: tl.constexpr,
    fn_ptr,
    c,
    hidden,
    MIXES: tl.constexpr,
    MIX_PAD: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    """Add stream ``k``'s tile to the partial sums of squares and products with ``fn``."""
    as_float = stream.to(tl.float32)
    sumsq += tl.sum(as_float * as_float, axis=1)
    mix = tl.arange(0, MIX_PAD)
    fn = tl.load(  # fn[m, k * hidden + c] as [BLOCK_C, MIX_PAD]
        fn_ptr + mix[None, :] * 4 * hidden + k * hidden + c[:, None],
        mask=(mix < MIXES)[None, :] & (c < hidden)[:, None],
        other=0.0,
    )
    if DOT_IN_FP32:
        mixes = tl.dot(as_float, fn.to(tl.float32), mixes, input_precision="ieee")
    else:
        mixes = tl.dot(stream, fn, mixes)
    return mixes, sumsq


@triton.jit
def _gates_and_collapse(
    partial_mix_ptr,
    partial_sumsq_ptr,
    base_ptr,
    scale_ptr,
    streams_ptr,
    norm_weight_ptr,
    x_ptr,
    post_ptr,
    comb_ptr,
    tokens,
    splits,
    sinkhorn_iters,
    hc_eps,
    mix_norm_eps,
    norm_eps,
    HIDDEN: tl.constexpr,
    N: tl.constexpr,
    MIX_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """One token: its gates, the collapse with the sublayer's RMSNorm, then ``comb`` (Sinkhorn)
    last, its serial iterations overlapping other programs' loads."""
    token = tokens - 1 - tl.program_id(0)  # reverse order: the last-written streams are hot in L2
    stream = tl.arange(0, N)
    split = tl.arange(0, SPLITS_PAD)
    split_ok = split < splits
    at = (split * tokens + token) * MIX_PAD
    sumsq = tl.sum(tl.load(partial_sumsq_ptr + split * tokens + token, mask=split_ok, other=0.0), axis=0)
    inv_rms = tl.rsqrt(sumsq / (N * HIDDEN) + mix_norm_eps)
    pre_logits = _sum_partials(partial_mix_ptr, at, stream, split_ok) * inv_rms
    post_logits = _sum_partials(partial_mix_ptr, at + N, stream, split_ok) * inv_rms
    pre_base = tl.load(base_ptr + stream).to(tl.float32)
    post_base = tl.load(base_ptr + N + stream).to(tl.float32)
    pre = tl.sigmoid(pre_logits * tl.load(scale_ptr).to(tl.float32) + pre_base) + hc_eps
    post = 2 * tl.sigmoid(post_logits * tl.load(scale_ptr + 1).to(tl.float32) + post_base)
    tl.store(post_ptr + token * N + stream, post)

    # The collapse, rounded to the streams' dtype as the reference rounds it, then the
    # sublayer's RMSNorm over the row. The first pass only loads (a store could alias a later
    # load, which would keep the loads apart), unrolled, so the row's loads are in flight at
    # once; the second pass reads the row again (now in L1/L2) and writes the normed collapse.
    token64 = token.to(tl.int64)
    stream_rows = streams_ptr + token64 * N * HIDDEN + stream[:, None] * HIDDEN
    x_row = x_ptr + token64 * HIDDEN
    x_sumsq = tl.zeros([BLOCK_H], tl.float32)
    for chunk in tl.static_range(0, HIDDEN, BLOCK_H):
        x = _collapse(stream_rows, pre, chunk, HIDDEN, BLOCK_H, x_ptr.dtype.element_ty).to(tl.float32)
        x_sumsq += x * x
    inv_rms_x = tl.rsqrt(tl.sum(x_sumsq, axis=0) / HIDDEN + norm_eps)
    for chunk in tl.static_range(0, HIDDEN, BLOCK_H):
        x = _collapse(stream_rows, pre, chunk, HIDDEN, BLOCK_H, x_ptr.dtype.element_ty).to(tl.float32)
        c = chunk + tl.arange(0, BLOCK_H)
        weight = tl.load(norm_weight_ptr + c, mask=c < HIDDEN, other=0.0).to(tl.float32)
        tl.store(x_row + c, x * inv_rms_x * weight, mask=c < HIDDEN)

    square = stream[:, None] * N + stream[None, :]
    comb_logits = tl.sum(
        tl.load(
            partial_mix_ptr + at[:, None, None] + 2 * N + square[None, :, :], mask=split_ok[:, None, None], other=0.0
        ),
        axis=0,
    )
    comb_base = tl.load(base_ptr + 2 * N + square).to(tl.float32)
    comb_logits = comb_logits * inv_rms * tl.load(scale_ptr + 2).to(tl.float32) + comb_base
    tl.store(comb_ptr + token * N * N + square, _doubly_stochastic(comb_logits, sinkhorn_iters, hc_eps))


@triton.jit
def _collapse(stream_rows, pre, chunk, HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr, dtype: tl.constexpr):
    """``sum_j pre[j] * streams[j, chunk ..]`` rounded to ``dtype``."""
    c = chunk + tl.arange(0, BLOCK_H)
    streams = tl.load(stream_rows + c[None, :], mask=(c < HIDDEN)[None, :], other=0.0).to(tl.float32)
    return tl.sum(pre[:, None] * streams, axis=0).to(dtype)


@triton.jit
def _sum_partials(partial_mix_ptr, at, column, split_ok):
    """``sum over splits of partial_mix[split, token, column]`` (``at`` locates each split's row)."""
    values = tl.load(partial_mix_ptr + at[:, None] + column[None, :], mask=split_ok[:, None], other=0.0)
    return tl.sum(values, axis=0)


@triton.jit
def _doubly_stochastic(logits, iters, eps):
    """Row softmax plus ``eps``, then alternate column and row normalisation (columns first)."""
    weights = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    matrix = weights / tl.sum(weights, axis=1)[:, None] + eps
    matrix = matrix / (tl.sum(matrix, axis=0)[None, :] + eps)
    for _ in range(iters - 1):
        matrix = matrix / (tl.sum(matrix, axis=1)[:, None] + eps)
        matrix = matrix / (tl.sum(matrix, axis=0)[None, :] + eps)
    return matrix


@dataclass(frozen=True)
class MixingWeights:
    """One mHC's parameters (``hc_{attn,ffn}_{fn,base,scale}``) and constants."""

    fn: torch.Tensor  # [(2 + n) * n, n * hidden]
    base: torch.Tensor  # [(2 + n) * n]
    scale: torch.Tensor  # [3]: pre, post, comb
    sinkhorn_iters: int
    hc_eps: float
    norm_eps: float  # of the RMS normalisation of the flattened streams


@dataclass(frozen=True)
class _Partials:
    """What the partials pass leaves for the collapse: per channel split, per token."""

    splits: int
    mix: torch.Tensor  # [splits, tokens, MIX_COLUMNS_PAD] float32
    sumsq: torch.Tensor  # [splits, tokens] float32


def fused_post_pre(
    output: torch.Tensor,
    streams: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    mixing: MixingWeights,
    norm_weight: torch.Tensor,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sublayer's post and the next one's pre: ``(new streams, normed input, post, comb)``."""
    streams = streams.contiguous()
    new_streams = torch.empty_like(streams)
    partials = _launch_partials(output, streams, post, comb, new_streams, mixing)
    return (new_streams, *_launch_collapse(new_streams, partials, mixing, norm_weight, norm_eps))


def fused_pre(
    streams: torch.Tensor, mixing: MixingWeights, norm_weight: torch.Tensor, norm_eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A sublayer's pre with its input norm: ``(normed input, post, comb)``."""
    streams = streams.contiguous()
    partials = _launch_partials(None, streams, None, None, None, mixing)
    return _launch_collapse(streams, partials, mixing, norm_weight, norm_eps)


def fused_post(output: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """A sublayer's post alone (the last one, before the head): the new streams."""
    streams = streams.contiguous()
    new_streams = torch.empty_like(streams)
    _launch_partials(output, streams, post, comb, new_streams, None)
    return new_streams


def _launch_partials(
    output: torch.Tensor | None,
    streams: torch.Tensor,
    post: torch.Tensor | None,
    comb: torch.Tensor | None,
    new_streams: torch.Tensor | None,
    mixing: MixingWeights | None,
) -> _Partials | None:
    tokens, n, hidden = streams.shape
    if n != STREAMS:
        raise ValueError(f"the fused mHC kernels are written for {STREAMS} streams (hc_mult); got {n}")
    tiles = triton.cdiv(hidden, BLOCK_CHANNELS)
    token_blocks = triton.cdiv(tokens, BLOCK_TOKENS)
    tiles_per_split = triton.cdiv(tiles, max(1, min(tiles, PROGRAMS_WANTED // max(1, token_blocks))))
    splits = triton.cdiv(tiles, tiles_per_split)
    partials, mixes, fn, dot_in_fp32 = None, 1, streams, True
    if mixing is not None:
        mixes = (2 + n) * n
        if tuple(mixing.fn.shape) != (mixes, n * hidden):
            raise ValueError(
                f"mHC fn is {tuple(mixing.fn.shape)}; streams {tuple(streams.shape)} need {(mixes, n * hidden)}"
            )
        fn = mixing.fn.contiguous()
        partials = _Partials(
            splits,
            streams.new_empty((splits, tokens, MIX_COLUMNS_PAD), dtype=torch.float32),
            streams.new_empty((splits, tokens), dtype=torch.float32),
        )
        # The interpreter multiplies bf16 bit patterns as integers, so off the GPU the dot
        # runs in float32; bf16 products are exact in float32 either way.
        dot_in_fp32 = INTERPRETED or not (fn.dtype == streams.dtype == torch.bfloat16)
    if tokens == 0:
        return partials
    placeholder = streams  # for pointer arguments this variant never reads
    apply_post = output is not None
    _post_and_mix_partials[(token_blocks, splits)](
        output.contiguous() if apply_post else placeholder,
        streams,
        post.contiguous() if apply_post else placeholder,
        comb.contiguous() if apply_post else placeholder,
        new_streams if apply_post else placeholder,
        fn,
        partials.mix if partials is not None else placeholder,
        partials.sumsq if partials is not None else placeholder,
        tokens,
        hidden,
        tiles_per_split,
        MIXES=mixes,
        MIX_PAD=MIX_COLUMNS_PAD,
        BLOCK_T=BLOCK_TOKENS,
        BLOCK_C=BLOCK_CHANNELS,
        APPLY_POST=apply_post,
        MIX=partials is not None,
        DOT_IN_FP32=dot_in_fp32,
    )
    return partials


def _launch_collapse(
    streams: torch.Tensor, partials: _Partials, mixing: MixingWeights, norm_weight: torch.Tensor, norm_eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tokens, n, hidden = streams.shape
    x = streams.new_empty((tokens, hidden))
    post = streams.new_empty((tokens, n), dtype=torch.float32)
    comb = streams.new_empty((tokens, n, n), dtype=torch.float32)
    if tokens == 0:
        return x, post, comb
    _gates_and_collapse[(tokens,)](
        partials.mix,
        partials.sumsq,
        mixing.base.contiguous(),
        mixing.scale.contiguous(),
        streams,
        norm_weight.contiguous(),
        x,
        post,
        comb,
        tokens,
        partials.splits,
        mixing.sinkhorn_iters,
        mixing.hc_eps,
        mixing.norm_eps,
        norm_eps,
        HIDDEN=hidden,
        N=n,
        MIX_PAD=MIX_COLUMNS_PAD,
        SPLITS_PAD=triton.next_power_of_2(partials.splits),
        BLOCK_H=min(COLLAPSE_CHANNELS, triton.next_power_of_2(hidden)),
    )
    return x, post, comb
