"""A step's queries and its KV row normalised and roped, one launch for each.

Rows ``x [tokens, heads, head_dim]`` are each scaled to unit root-mean-square over ``head_dim`` (the attention's
queries, as :func:`~sglang_dsv4.model.norms.rms_normalize`), or scaled so and multiplied by a learned ``weight``
(the KV row, ``heads`` 1, as :class:`~sglang_dsv4.model.norms.RMSNorm`), or not at all (the indexer's queries);
then their trailing ``2 * rope_pairs`` channels are rotated in interleaved pairs by ``cos, sin [tokens, rope_pairs]``
(float32), as :func:`~sglang_dsv4.model.rope.apply_rope`. The torch path takes 10 launches for the rope (the float32
casts, four products, the pairs' stack, the ``cat``) and 7 (unit) or 9 (weighted) for the norm. One program a
(token, head) row; every rounding to the row's dtype happens where the torch path rounds. :func:`rms_norm` is the
weighted norm alone over rows ``[tokens, dim]`` (the queries' low-rank ``q_norm``), the same kernel with no rope.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def normalize_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float | None, weight: torch.Tensor | None = None
) -> torch.Tensor:
    """``x`` normalised over its last dim (none where ``eps`` is None; times ``weight [head_dim]``, in ``x``'s dtype,
    where given), then roped at ``cos, sin``: a new tensor of ``x``'s shape and dtype."""
    tokens, heads, head_dim = x.shape
    rope_pairs = cos.shape[-1]
    if x.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("x, cos and sin must have a contiguous last dim")
    if rope_pairs & (rope_pairs - 1) or 2 * rope_pairs > head_dim or cos.shape != sin.shape or cos.shape[0] != tokens:
        raise ValueError(f"cos/sin must be [{tokens}, a power of two <= {head_dim // 2}], got {tuple(cos.shape)}")
    if weight is not None and (eps is None or weight.shape != (head_dim,) or weight.dtype != x.dtype):
        raise ValueError(f"a weight needs eps and {x.dtype} [{head_dim}], got {weight.dtype} {tuple(weight.shape)}")
    out = torch.empty(tokens, heads, head_dim, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    block_dim = triton.next_power_of_2(head_dim)
    _normalize_rope_kernel[(tokens, heads)](
        x, x.stride(0), x.stride(1), out, x if weight is None else weight.contiguous(),
        cos, sin, cos.stride(0), sin.stride(0), 0.0 if eps is None else eps,
        HEAD_DIM=head_dim, ROPE_PAIRS=rope_pairs, BLOCK_DIM=block_dim,
        NORMALIZE=eps is not None, WEIGHTED=weight is not None, num_warps=max(1, min(4, block_dim // 128)),
    )  # fmt: skip
    return out


def rms_norm(x: torch.Tensor, eps: float, weight: torch.Tensor) -> torch.Tensor:
    """Rows ``x [tokens, dim]`` scaled to unit root-mean-square, times ``weight [dim]`` (in ``x``'s dtype), as
    :class:`~sglang_dsv4.model.norms.RMSNorm`: a new tensor of ``x``'s shape and dtype, one launch."""
    tokens, dim = x.shape
    if x.stride(-1) != 1:
        raise ValueError("x must have a contiguous last dim")
    if weight.shape != (dim,) or weight.dtype != x.dtype:
        raise ValueError(f"the weight must be {x.dtype} [{dim}], got {weight.dtype} {tuple(weight.shape)}")
    out = torch.empty(tokens, dim, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    block_dim = triton.next_power_of_2(dim)
    _normalize_rope_kernel[(tokens, 1)](
        x, x.stride(0), 0, out, weight.contiguous(), x, x, 0, 0, eps,
        HEAD_DIM=dim, ROPE_PAIRS=0, BLOCK_DIM=block_dim, NORMALIZE=True, WEIGHTED=True,
        num_warps=max(1, min(4, block_dim // 128)),
    )  # fmt: skip
    return out


@triton.jit
def _normalized(x, inv_rms, weight, NORMALIZE: tl.constexpr, WEIGHTED: tl.constexpr):
    """``x`` scaled by ``inv_rms`` (and ``weight``), in ``x``'s dtype, rounded where the torch path rounds: unit
    scale rounded to the dtype, then the product (``rms_normalize``); or the float32 product rounded, then the
    weight's product rounded (``RMSNorm``)."""
    if not NORMALIZE:
        return x
    if WEIGHTED:
        normed = (x.to(tl.float32) * inv_rms).to(x.dtype)
        return (weight.to(tl.float32) * normed.to(tl.float32)).to(x.dtype)
    return (x.to(tl.float32) * inv_rms.to(x.dtype).to(tl.float32)).to(x.dtype)


@triton.jit
def _normalize_rope_kernel(
    x_ptr, x_token_stride, x_head_stride, out_ptr, weight_ptr, cos_ptr, sin_ptr, cos_stride, sin_stride, eps,
    HEAD_DIM: tl.constexpr, ROPE_PAIRS: tl.constexpr, BLOCK_DIM: tl.constexpr,
    NORMALIZE: tl.constexpr, WEIGHTED: tl.constexpr,
):  # fmt: skip
    token, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    row = x_ptr + token * x_token_stride + head * x_head_stride
    out_row = out_ptr + (token * tl.num_programs(1) + head) * HEAD_DIM
    nope_dims: tl.constexpr = HEAD_DIM - 2 * ROPE_PAIRS
    dims = tl.arange(0, BLOCK_DIM)
    x = tl.load(row + dims, mask=dims < HEAD_DIM, other=0.0)
    inv_rms = 1.0
    if NORMALIZE:
        values = x.to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(values * values, 0) / HEAD_DIM + eps)
    weight = tl.load(weight_ptr + dims, mask=(dims < HEAD_DIM) & WEIGHTED, other=0.0)
    tl.store(out_row + dims, _normalized(x, inv_rms, weight, NORMALIZE, WEIGHTED), mask=dims < nope_dims)
    if ROPE_PAIRS > 0:
        _store_roped(row, out_row, weight_ptr, cos_ptr + token * cos_stride, sin_ptr + token * sin_stride, inv_rms,
                     nope_dims, ROPE_PAIRS, NORMALIZE, WEIGHTED)  # fmt: skip


@triton.jit
def _store_roped(
    row, out_row, weight_ptr, cos_ptr, sin_ptr, inv_rms, nope_dims: tl.constexpr,
    ROPE_PAIRS: tl.constexpr, NORMALIZE: tl.constexpr, WEIGHTED: tl.constexpr,
):  # fmt: skip
    """The row's trailing ``2 * ROPE_PAIRS`` channels normalised as the others, rotated at the token's ``cos, sin``."""
    pairs = tl.arange(0, ROPE_PAIRS)
    even_at, odd_at = nope_dims + 2 * pairs, nope_dims + 2 * pairs + 1
    even_weight = tl.load(weight_ptr + even_at, mask=WEIGHTED, other=0.0)
    odd_weight = tl.load(weight_ptr + odd_at, mask=WEIGHTED, other=0.0)
    even = _normalized(tl.load(row + even_at), inv_rms, even_weight, NORMALIZE, WEIGHTED).to(tl.float32)
    odd = _normalized(tl.load(row + odd_at), inv_rms, odd_weight, NORMALIZE, WEIGHTED).to(tl.float32)
    cos = tl.load(cos_ptr + pairs)
    sin = tl.load(sin_ptr + pairs)
    tl.store(out_row + even_at, (even * cos - odd * sin).to(out_row.dtype.element_ty))
    tl.store(out_row + odd_at, (odd * cos + even * sin).to(out_row.dtype.element_ty))
