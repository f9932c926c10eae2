"""The one place that chooses between this package's Triton kernels and their torch implementations.

:func:`uses_triton` is the choice: the Triton kernels (and torch's CUDA grouped GEMM) for tensors
on a CUDA device, the batched torch implementations everywhere else. Every caller that has both
asks it, here for the tensor-level operations and in :mod:`sglang_dsv4.model.kernel_calls` for
the network's modules; no other file checks a device. The kernel modules (and Triton) are
imported only on the CUDA path, so CPU hosts never need them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import sparse_torch
from .kv_format import RowFormat
from .selection import KVSelection


def uses_triton(tensor: torch.Tensor) -> bool:
    """Whether operations on ``tensor`` run the Triton kernels: on a CUDA device."""
    return tensor.device.type == "cuda"


def sparse_attention(
    q: torch.Tensor,
    window: KVSelection,
    compressed: KVSelection,
    sink: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    scale: float,
) -> torch.Tensor:
    """One softmax over each row's window rows, compressed rows and the sink, inverse rope on the
    output: ``[rows, heads, head_dim]`` (:func:`.sparse_torch.sparse_decode_attention_reference`)."""
    if uses_triton(q):
        from .attention import sparse_decode_attention

        return sparse_decode_attention(q, window, compressed, sink.contiguous(), cos, sin, scale=scale)
    return sparse_torch.sparse_attention(q, window, compressed, sink, cos, sin, scale=scale)


# Query rows scored at once on the Triton path: its scores are [rows, context / 4] float32 (256 MiB at 1M).
INDEX_ROW_TILE = 256


def index_top_k(
    q: torch.Tensor,
    head_weights: torch.Tensor,
    keys: torch.Tensor,
    table: torch.Tensor,
    table_row: torch.Tensor,
    lengths: torch.Tensor,
    k: int,
    *,
    scale: float,
    tile_owners: list[int],
    keys_format: RowFormat | None = None,
) -> torch.Tensor:
    """The indexer's ``k`` best key slots of each query row, ``[rows, k]`` int64, then ``-1``
    (:func:`.sparse_torch.streamed_top_k`, whose arguments these are). The slots come best first
    except from the Triton top-k, whose order is not set: callers use them as a set."""
    if uses_triton(q):
        return index_top_k_triton(
            q, head_weights, keys, table, table_row, lengths, k, scale=scale, keys_format=keys_format
        )
    return sparse_torch.streamed_top_k(
        q, head_weights, keys, table, table_row, lengths, k, scale=scale, tile_owners=tile_owners,
        keys_format=keys_format,
    )  # fmt: skip


def index_top_k_triton(
    q: torch.Tensor,
    head_weights: torch.Tensor,
    keys: torch.Tensor,
    table: torch.Tensor,
    table_row: torch.Tensor,
    lengths: torch.Tensor,
    k: int,
    *,
    scale: float,
    keys_format: RowFormat | None = None,
) -> torch.Tensor:
    """:func:`index_top_k` through the Triton scoring kernel, ``INDEX_ROW_TILE`` rows at a time, then
    the exact top-k of each tile's scores (:func:`.indexer.exact_top_k`: a Triton top-k where one
    measured faster than ``torch.topk``, benchmarks/NOTES.md)."""
    from .indexer import exact_top_k, index_scores

    weights, chosen = head_weights.float().contiguous(), []
    for first in range(0, q.shape[0], INDEX_ROW_TILE):
        tile = slice(first, first + INDEX_ROW_TILE)
        rows_table = table[table_row[tile]].to(torch.int32)
        scores = index_scores(
            q[tile], weights[tile], keys, lengths[tile], scale=scale, table=rows_table, keys_format=keys_format
        )
        chosen.append(exact_top_k(scores, lengths[tile], k).long())
    return torch.cat(chosen) if chosen else torch.empty(0, k, dtype=torch.int64, device=q.device)


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
    if uses_triton(x) and x.dtype == torch.bfloat16:
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
