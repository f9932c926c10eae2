"""The lightning indexer's scoring in Triton, and the selection it feeds.

Each query row scores every indexer key it can see:
``score[j] = sum_h w_h * ReLU(q_h . k_j) * scale`` with per-row head weights ``w``
(``weights_proj(x) / sqrt(index_n_heads)``) and ``scale = index_head_dim ** -0.5``;
the dot products accumulate in float32 (:meth:`sglang_dsv4.model.indexer.Indexer.scores`).
Keys are rows of a pool, found through a table of fixed width (a row of its own per query
row, or its request's row; without a table, the pool's rows in order); a row's keys past its
length score ``-inf``. The top-k over the scores is :mod:`.topk`; in the served step it writes
the chosen keys' table entries (:func:`top_k_entry_rows`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8_rows import fp8_key_rows
from .interpreter import INTERPRETED, dot
from .kv_format import Fp8KeyRows, RowFormat
from .topk import (
    temporal_top_k,
    top_k,
    whole_row_top_k,
    whole_row_top_k_rows,
    wide_row_top_k,
    wide_row_top_k_rows,
)


# FP8 keys without software pipelining: their bytes go from the load to the conversion in registers rather than
# through a shared-memory stage first (1,139 -> 1,003 µs at batch 256, 128K on the H200), and against bf16 queries
# in fp16 operands (:func:`_fp16_queries`; -17% more there): NOTES "FP8 indexer scoring profiled".
FP8_KEYS_LAUNCH = {"num_stages": 1}


def index_scores(
    q: torch.Tensor,
    head_weights: torch.Tensor,
    keys: torch.Tensor,
    lengths: torch.Tensor,
    *,
    scale: float,
    table: torch.Tensor | None = None,
    table_row: torch.Tensor | None = None,
    keys_format: RowFormat | None = None,
) -> torch.Tensor:
    """Scores ``[rows, width]`` float32 of each query row against its keys.

    ``q`` is ``[rows, heads, dim]``; ``head_weights`` ``[rows, heads]`` float32; ``keys``
    ``[pool_rows, dim]``, or FP8 key rows (bytes) with ``keys_format`` an :class:`~.kv_format.Fp8KeyRows`,
    dequantized in-register; ``lengths`` ``[rows]`` int32. ``table`` ``[rows, width]`` int32 or int64
    maps a row's key slot to a pool row (its row stride may be 0: queries of one request
    share a table), or with ``table_row`` ``[rows]`` row ``r`` reads ``table[table_row[r]]`` (a forward's
    requests' rows, read where they lie); without a table slot ``j`` is pool row ``j`` and ``width = pool_rows``.
    """
    rows, heads, dim = q.shape
    fp8 = isinstance(keys_format, Fp8KeyRows)
    _check_inputs(q, head_weights, keys, lengths, table, table_row, keys_format if fp8 else None)
    width = keys.shape[0] if table is None else table.shape[1]
    scores = q.new_empty((rows, width), dtype=torch.float32)
    if rows == 0 or width == 0:
        return scores
    block_keys, tiles = 128, 4
    grid = (rows, triton.cdiv(width, block_keys * tiles))
    table_arg = lengths if table is None else table
    _index_scores_kernel[grid](
        q, q.stride(0), q.stride(1), head_weights, head_weights.stride(0), keys, keys.stride(0),
        table_arg, 0 if table is None else table.stride(0), lengths if table_row is None else table_row,
        lengths, scores, scores.stride(0), width, scale,
        HEADS=heads, BLOCK_HEADS=max(16, triton.next_power_of_2(heads)), DIM=dim, BLOCK_KEYS=block_keys,
        TILES=tiles, HAS_TABLE=table is not None, TABLE_ROWS=table_row is not None, KEYS_FP8=fp8,
        FP16_OPERANDS=fp8 and q.dtype == torch.bfloat16 and keys_format.scales == 1,  # keys of one scale block
        SCALE_OFFSET=keys_format.scale_offset if fp8 else 0,
        ROW_BYTES=keys_format.row_bytes if fp8 else 0,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 or INTERPRETED else "tf32", UPCAST_DOT=INTERPRETED,
        num_warps=4, **FP8_KEYS_LAUNCH if fp8 else {},
    )  # fmt: skip
    return scores


def index_scores_reference(
    q: torch.Tensor,
    head_weights: torch.Tensor,
    keys: torch.Tensor,
    lengths: torch.Tensor,
    *,
    scale: float,
    table: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same scores in torch (gather, float32 or the inputs' wider dtype)."""
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    if table is None:
        gathered = keys.to(compute).expand(q.shape[0], -1, -1)
    else:
        gathered = keys[table.long().clamp(0, keys.shape[0] - 1)].to(compute)
    dots = torch.einsum("rhd,rkd->rhk", q.to(compute), gathered).relu() * scale
    scores = torch.einsum("rhk,rh->rk", dots, head_weights.to(compute))
    visible = torch.arange(scores.shape[1], device=q.device)[None, :] < lengths[:, None]
    return scores.masked_fill(~visible, float("-inf"))


def select_entries(
    q: torch.Tensor,
    head_weights: torch.Tensor,
    keys: torch.Tensor,
    lengths: torch.Tensor,
    k: int,
    *,
    scale: float,
    table: torch.Tensor | None = None,
    previous: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ``k`` best-scoring key slots of each row, ``[rows, k]`` int32 (see :func:`.topk.top_k`).

    With ``previous`` (the last step's selection of the same rows) the temporal variant
    runs; the set is the same either way.
    """
    scores = index_scores(q, head_weights, keys, lengths, scale=scale, table=table)
    if previous is None:
        return top_k(scores, lengths, k)
    return temporal_top_k(scores, lengths, k, previous)


# Measured on the H200 (benchmarks/NOTES.md, "Fixed costs of a small decode step" and "The wide-row select"): the
# one-launch whole-row select up to rows of 16K scores (3-4x torch.topk at the 2,049 of an 8K context), the
# one-launch wide-row select above that (2.0-3.3x torch.topk at the 32,769 of a 128K context, 1.3-1.7x the
# three-launch top-k), the three-launch Triton top-k from 65,537 (1.2-3.8x the wide-row select there). The
# boundary between the last two lies between the widths measured.
WHOLE_ROW_TOP_K_MAX_WIDTH = 1 << 14
WIDE_ROW_TOP_K_MAX_WIDTH = 3 << 14


def exact_top_k(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """Slots of the ``k`` largest of ``scores[r, :lengths[r]]``, ``[rows, k]`` int32, then ``-1``, of equal scores
    the earliest slots (:func:`.sparse_torch.top_k_earliest_ties`'s choice, in no set order): the whole-row
    Triton select up to ``WHOLE_ROW_TOP_K_MAX_WIDTH`` scores a row, the wide-row select up to
    ``WIDE_ROW_TOP_K_MAX_WIDTH``, the three-launch Triton top-k above. All exact and graph-capturable; the choice
    reads shapes only."""
    if scores.shape[1] <= WHOLE_ROW_TOP_K_MAX_WIDTH:
        return whole_row_top_k(scores, lengths, k)
    if scores.shape[1] <= WIDE_ROW_TOP_K_MAX_WIDTH:
        return wide_row_top_k(scores, lengths, k, num_warps=_wide_row_warps(scores))
    return top_k(scores, lengths, k)


def _wide_row_warps(scores: torch.Tensor) -> int:
    """16 warps while the rows leave multiprocessors idle, else 8 (the best of 4, 8 and 16 at 1, 64 and 256 rows of
    16K-256K scores on the H200)."""
    return 16 if scores.shape[0] < 128 else 8


def top_k_entry_rows(
    scores: torch.Tensor, lengths: torch.Tensor, k: int, table: torch.Tensor, table_row: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`exact_top_k` written as the rows its slots stand for, ``table[table_row[r], j]`` ``[rows, k]`` int32
    (then -1, or past the choice never read), and how many each row chose ``[rows]`` int32: the one-launch selects
    write both in their launch (:func:`.topk.whole_row_top_k_rows`, :func:`.topk.wide_row_top_k_rows`); the
    three-launch top-k's slots go through :func:`.chosen_rows.chosen_entry_rows`."""
    if scores.shape[1] <= WHOLE_ROW_TOP_K_MAX_WIDTH:
        return whole_row_top_k_rows(scores, lengths, k, table, table_row)
    if scores.shape[1] <= WIDE_ROW_TOP_K_MAX_WIDTH:
        return wide_row_top_k_rows(scores, lengths, k, table, table_row, num_warps=_wide_row_warps(scores))
    from .chosen_rows import chosen_entry_rows

    return chosen_entry_rows(table, table_row, exact_top_k(scores, lengths, k))


def select_visible(
    q: torch.Tensor, head_weights: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, k: int, *, scale: float
) -> torch.Tensor:
    """The network's form of the call: boolean ``[rows, len(keys)]``, the top-k of each row's visible keys.

    ``visible`` must mark a prefix of ``keys`` in every row (a query sees the entries of
    the blocks complete at its position).
    """
    lengths = visible.sum(-1, dtype=torch.int32)
    chosen = exact_top_k(index_scores(q, head_weights, keys, lengths, scale=scale), lengths, k)
    hits = torch.zeros(visible.shape, dtype=torch.int32, device=visible.device)
    hits.scatter_add_(1, chosen.clamp(min=0).long(), (chosen >= 0).to(torch.int32))
    return (hits > 0) & visible


def _check_inputs(
    q: torch.Tensor,
    head_weights: torch.Tensor,
    keys: torch.Tensor,
    lengths: torch.Tensor,
    table: torch.Tensor | None,
    table_row: torch.Tensor | None,
    fp8_keys: Fp8KeyRows | None,
) -> None:
    rows, heads, dim = q.shape
    if q.stride(2) != 1 or keys.stride(1) != 1:
        raise ValueError("q and keys need a contiguous last dim")
    if dim & (dim - 1) or dim < 16:
        raise ValueError(f"index head dim must be a power of two >= 16, got {dim}")
    width, dtype = (dim, q.dtype) if fp8_keys is None else (fp8_keys.row_bytes, torch.uint8)
    if fp8_keys is not None and fp8_keys.dim != dim:
        raise ValueError(f"FP8 key rows of {fp8_keys.dim} values for an index head dim of {dim}")
    if keys.dim() != 2 or keys.shape[1] != width or keys.dtype != dtype:
        raise ValueError(f"keys must be [pool_rows, {width}] in {dtype}, got {keys.dtype} {tuple(keys.shape)}")
    if fp8_keys is not None and keys.stride(0) != width:
        raise ValueError(f"FP8 key rows must lie {width} bytes apart (the kernel's constexpr stride)")
    if head_weights.shape != (rows, heads) or head_weights.dtype != torch.float32 or head_weights.stride(1) != 1:
        raise ValueError(f"head_weights must be float32 [{rows}, {heads}] with a contiguous last dim")
    if lengths.shape != (rows,) or lengths.dtype != torch.int32:
        raise ValueError(f"lengths must be int32 [{rows}]")
    if table_row is not None and (table is None or table_row.shape != (rows,)):
        raise ValueError(f"table_row needs a table and one entry a row [{rows}]")
    if table is not None:
        own_rows = table_row is None
        if table.dtype not in (torch.int32, torch.int64) or table.stride(1) != 1 or own_rows and table.shape[0] != rows:
            raise ValueError(f"table must be int32 or int64, last dim contiguous, [{rows}, width] without table_row")


@triton.jit
def _fp16_queries(q):
    """bf16 queries as fp16 times a power of two ``(q16, scale)``, ``q = q16 * scale``: the row scaled so that its
    largest magnitude lies in ``[2**14, 2**15)``, inside fp16's range, where fp16's 11 significant bits hold every
    bf16 value exactly; only components under ``2**-14`` of that scale lose bits (an error under ``2**-39`` of the
    largest)."""
    q32 = q.to(tl.float32)
    largest = tl.max(tl.max(tl.abs(q32), 1), 0)
    exponent = ((largest.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2(largest)), normal values
    shift = tl.where(largest > 0, tl.minimum(tl.maximum(exponent - 14, -100), 100), 0)
    down = ((127 - shift) << 23).to(tl.float32, bitcast=True)  # 2**-shift, exactly
    up = ((127 + shift) << 23).to(tl.float32, bitcast=True)
    return (q32 * down).to(tl.float16), up


@triton.jit
def _index_scores_kernel(
    q_ptr, q_row_stride, q_head_stride, weights_ptr, weights_row_stride, keys_ptr, keys_row_stride,
    table_ptr, table_row_stride, table_row_ptr, lengths_ptr, scores_ptr, scores_row_stride, width, scale,
    HEADS: tl.constexpr, BLOCK_HEADS: tl.constexpr, DIM: tl.constexpr, BLOCK_KEYS: tl.constexpr,
    TILES: tl.constexpr, HAS_TABLE: tl.constexpr, TABLE_ROWS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr, KEYS_FP8: tl.constexpr, SCALE_OFFSET: tl.constexpr, ROW_BYTES: tl.constexpr,
    FP16_OPERANDS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    heads = tl.arange(0, BLOCK_HEADS)
    head_ok = heads < HEADS
    channels = tl.arange(0, DIM)
    q = tl.load(
        q_ptr + row * q_row_stride + heads[:, None] * q_head_stride + channels[None, :],
        mask=head_ok[:, None],
        other=0.0,
    )
    weights = tl.load(weights_ptr + row * weights_row_stride + heads, mask=head_ok, other=0.0) * scale
    length = tl.load(lengths_ptr + row)
    if FP16_OPERANDS:
        q16, q_scale = _fp16_queries(q)
    table_row = row.to(tl.int64)
    if TABLE_ROWS:
        table_row = tl.load(table_row_ptr + row).to(tl.int64)
    for tile in range(TILES):
        slots = (tl.program_id(1) * TILES + tile) * BLOCK_KEYS + tl.arange(0, BLOCK_KEYS)
        visible = slots < length
        if HAS_TABLE:
            key_rows = tl.load(table_ptr + table_row * table_row_stride + slots, mask=visible, other=0).to(tl.int64)
        else:
            key_rows = slots.to(tl.int64)
        if FP16_OPERANDS:  # the E4M3 values in fp16 (one conversion a pair), against the row's fp16 queries
            k, key_scales = fp8_key_rows(keys_ptr, key_rows, visible, DIM, SCALE_OFFSET, ROW_BYTES, tl.float16)
            dots = dot(k, tl.trans(q16), DOT_PRECISION, UPCAST_DOT) * (key_scales * q_scale)[:, None]
        elif KEYS_FP8:  # the E4M3 values in q's dtype, each key's scale applied to its dot products
            k, key_scales = fp8_key_rows(keys_ptr, key_rows, visible, DIM, SCALE_OFFSET, ROW_BYTES, q.dtype)
            dots = dot(k, tl.trans(q), DOT_PRECISION, UPCAST_DOT) * key_scales[:, None]
        else:
            key_pointers = keys_ptr + key_rows[:, None] * keys_row_stride + channels[None, :]
            k = tl.load(key_pointers, mask=visible[:, None], other=0.0)
            dots = dot(k, tl.trans(q), DOT_PRECISION, UPCAST_DOT)  # [BLOCK_KEYS, BLOCK_HEADS], float32
        scores = tl.sum(tl.maximum(dots, 0.0) * weights[None, :], 1)
        scores = tl.where(visible, scores, float("-inf"))
        tl.store(scores_ptr + row * scores_row_stride + slots, scores, mask=slots < width)
