"""A step's queries normalised and roped in one launch: the attention's and the indexer's.

Query ``q [tokens, heads, head_dim]`` is each head's row scaled to unit root-mean-square (the attention's; the
indexer's queries are not normalised), then its trailing ``2 * rope_pairs`` channels rotated in interleaved pairs by
``cos, sin [tokens, rope_pairs]`` (float32), as :func:`~sglang_dsv4.model.norms.rms_normalize` and
:func:`~sglang_dsv4.model.rope.apply_rope` do in torch in about 18 launches (the float32 casts, the mean, the rsqrt,
the products, the pairs' stack and the ``cat``). One program a (token, head) row; the scale is rounded to the
row's dtype and the product too, as the torch path computes them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def normalize_rope_queries(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float | None) -> torch.Tensor:
    """``q`` normalised over its last dim (none where ``eps`` is None), then roped at ``cos, sin``: a new tensor
    of ``q``'s shape and dtype."""
    tokens, heads, head_dim = q.shape
    rope_pairs = cos.shape[-1]
    if q.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("q, cos and sin must have a contiguous last dim")
    if rope_pairs & (rope_pairs - 1) or 2 * rope_pairs > head_dim or cos.shape != sin.shape or cos.shape[0] != tokens:
        raise ValueError(f"cos/sin must be [{tokens}, a power of two <= {head_dim // 2}], got {tuple(cos.shape)}")
    out = torch.empty(tokens, heads, head_dim, dtype=q.dtype, device=q.device)
    if tokens == 0:
        return out
    block_dim = triton.next_power_of_2(head_dim)
    _normalize_rope_kernel[(tokens, heads)](
        q, q.stride(0), q.stride(1), out, cos, sin, cos.stride(0), sin.stride(0), 0.0 if eps is None else eps,
        HEAD_DIM=head_dim, ROPE_PAIRS=rope_pairs, BLOCK_DIM=block_dim, NORMALIZE=eps is not None,
        num_warps=max(1, min(4, block_dim // 128)),
    )  # fmt: skip
    return out


@triton.jit
def _normalize_rope_kernel(
    q_ptr, q_token_stride, q_head_stride, out_ptr, cos_ptr, sin_ptr, cos_stride, sin_stride, eps,
    HEAD_DIM: tl.constexpr, ROPE_PAIRS: tl.constexpr, BLOCK_DIM: tl.constexpr, NORMALIZE: tl.constexpr,
):  # fmt: skip
    token, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    row = q_ptr + token * q_token_stride + head * q_head_stride
    out_row = out_ptr + (token * tl.num_programs(1) + head) * HEAD_DIM
    nope_dims: tl.constexpr = HEAD_DIM - 2 * ROPE_PAIRS
    dims = tl.arange(0, BLOCK_DIM)
    x = tl.load(row + dims, mask=dims < HEAD_DIM, other=0.0)
    scale = 1.0
    if NORMALIZE:
        values = x.to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(values * values, 0) / HEAD_DIM + eps)
        scale = inv_rms.to(x.dtype).to(tl.float32)
    normed = (x.to(tl.float32) * scale).to(x.dtype)
    tl.store(out_row + dims, normed, mask=dims < nope_dims)
    pairs = tl.arange(0, ROPE_PAIRS)
    even_at, odd_at = nope_dims + 2 * pairs, nope_dims + 2 * pairs + 1
    even = (tl.load(row + even_at).to(tl.float32) * scale).to(x.dtype).to(tl.float32)
    odd = (tl.load(row + odd_at).to(tl.float32) * scale).to(x.dtype).to(tl.float32)
    cos = tl.load(cos_ptr + token * cos_stride + pairs)
    sin = tl.load(sin_ptr + token * sin_stride + pairs)
    tl.store(out_row + even_at, (even * cos - odd * sin).to(x.dtype))
    tl.store(out_row + odd_at, (odd * cos + even * sin).to(x.dtype))
