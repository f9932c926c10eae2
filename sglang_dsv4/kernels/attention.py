"""Sparse decode attention over two KV pools, in Triton.

Each query row (one decode token of one request) reads some rows of the sliding-window
pool (raw KV) and some rows of the compressed pool (the entries its indexer selected in
ratio-4 layers, every complete entry in ratio-128 layers). Keys double as values: the
attention is multi-query with one KV head of ``head_dim`` channels shared by all query
heads. One online softmax runs over both pools and the per-head attention sink; the
output's trailing ``rope_dim`` channels get the inverse rope at the query's position
(the values carry their keys' rope). Semantics: :meth:`sglang_dsv4.model.attention.Attention._attend`
followed by the inverse rope; :func:`sparse_decode_attention_reference` states them in torch.

Either pool's rows may be DeepSeek's FP8 rows (``--kv-cache-dtype fp8_e4m3``,
:class:`~.kv_format.Fp8EntryRows`): the kernel loads their bytes and dequantizes them in-register
(:mod:`.fp8_rows`).

Index buffers have a fixed width per call and a length per row, so one launch serves
rows of different lengths and can be captured in a CUDA graph. A program handles one
row and a block of heads; when rows times head blocks are too few to fill the GPU
(small batches, long ratio-128 lists) the entries are split across programs whose
partial softmax states a second kernel merges.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .fp8_rows import fp8_entry_rows
from .interpreter import INTERPRETED, dot
from .kv_format import ENTRY_SCALE_BLOCK, Fp8EntryRows, PlainRows
from .selection import KVSelection
from .sparse_torch import sparse_decode_attention_reference  # noqa: F401  (the kernel's oracle)

LOG2E = 1.4426950408889634
MERGE_BLOCK_HEADS = 16  # small blocks: the merge is a pure stream, and many programs keep it wide


@dataclass(frozen=True)
class LaunchShape:
    """Tile sizes of the attention kernel; the defaults suit the H200 in bf16 (see benchmarks/NOTES.md)."""

    block_heads: int = 64
    block_entries: int = 64
    num_warps: int = 8
    num_stages: int = 2

    def shared_bytes(self, dtype: torch.dtype, head_dim: int) -> int:
        """Shared memory the tile asks, as Triton lays it out for sm_90: the query block and each stage's
        entry tile (an upper bound: measured 196,608 B in bf16 and 135,296 B in float32 at 32 x 32, 512 dims)."""
        return (self.block_heads + self.num_stages * self.block_entries) * head_dim * dtype.itemsize


# Tried in order, the first whose shared memory the device holds: the H200's bf16 tile, then a half-size one
# (float32 at V4's 512 dims asks 278,784 B in the first, over the H200's 232,448).
LAUNCH_SHAPES = (LaunchShape(), LaunchShape(block_heads=32, block_entries=32))
H200_SHARED_MEMORY = 232_448  # bytes a block may use (the CPU's interpreter has no limit; kernels are sized for this)


def launch_shape(dtype: torch.dtype, head_dim: int, device: torch.device) -> LaunchShape:
    """The first of ``LAUNCH_SHAPES`` whose shared memory fits a block on ``device``."""
    limit = H200_SHARED_MEMORY
    if device.type == "cuda":
        limit = torch.cuda.get_device_properties(device).shared_memory_per_block_optin
    for shape in LAUNCH_SHAPES:
        if shape.shared_bytes(dtype, head_dim) <= limit:
            return shape
    raise ValueError(f"no attention tile fits {limit} B of shared memory at {head_dim} dims in {dtype}")


def sparse_decode_attention(
    q: torch.Tensor,
    window: KVSelection,
    compressed: KVSelection,
    sink: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    scale: float,
    splits: int | None = None,
    launch: LaunchShape | None = None,
) -> torch.Tensor:
    """Attention output ``[rows, heads, head_dim]`` in ``q``'s dtype.

    ``q`` is ``[rows, heads, head_dim]`` (normalised and roped); ``sink`` ``[heads]`` in any float dtype (read as
    float32); ``cos`` / ``sin`` ``[rows, rope_dim // 2]`` float32 at each query's position;
    ``scale`` multiplies the logits. ``splits`` (entries split across programs) is
    chosen from the shape when ``None``.
    """
    rows, heads, head_dim = q.shape
    rope_dim = 2 * cos.shape[-1]
    _check_inputs(q, window, compressed, sink, cos, sin)
    launch = launch or launch_shape(q.dtype, head_dim, q.device)
    block_heads = min(launch.block_heads, max(16, triton.next_power_of_2(heads)))
    head_blocks = triton.cdiv(heads, block_heads)
    width = window.indices.shape[1] + compressed.indices.shape[1]
    if splits is None:
        splits = choose_splits(rows * head_blocks, width, heads, q.device)
    out = torch.empty_like(q)
    if rows == 0:
        return out
    partial_acc = partial_stats = out  # unused unless split
    if splits > 1:
        partial_acc = torch.empty(rows, splits, heads, head_dim, dtype=torch.float32, device=q.device)
        partial_stats = torch.empty(rows, splits, heads, 2, dtype=torch.float32, device=q.device)
    precision = "ieee" if q.dtype == torch.float32 or INTERPRETED else "tf32"
    window_fp8, compressed_fp8 = (isinstance(part.row_format, Fp8EntryRows) for part in (window, compressed))
    fp8_rows = _fp8_format(window, compressed) or Fp8EntryRows(head_dim, 0)  # its offsets unused
    compressed_start, row_alignment = _fp8_rows_start(window, compressed)
    # Head blocks vary fastest, so the programs sharing a row's entries run together and meet them in the L2.
    _sparse_attention_kernel[(head_blocks, rows, splits)](
        q, q.stride(0), q.stride(1),
        window.pool, window.pool.stride(0), window.indices, window.indices.stride(0), window.lengths,
        compressed.pool, compressed_start, compressed.pool.stride(0), compressed.indices,
        compressed.indices.stride(0), compressed.lengths,
        sink, cos, sin, cos.stride(0),
        out, out.stride(0), out.stride(1),
        partial_acc, partial_stats,
        heads, scale * LOG2E,
        HEAD_DIM=head_dim, ROPE_DIM=rope_dim, BLOCK_H=block_heads, BLOCK_N=launch.block_entries, SPLITS=splits,
        DOT_PRECISION=precision, UPCAST_DOT=INTERPRETED,
        WINDOW_FP8=window_fp8, COMPRESSED_FP8=compressed_fp8, NOPE_DIM=fp8_rows.nope_dim,
        SCALE_OFFSET=fp8_rows.scale_offset, ROW_BYTES=fp8_rows.row_bytes,
        ROW_ALIGNMENT=row_alignment,
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )  # fmt: skip
    if splits > 1:
        _merge_splits_kernel[(rows, triton.cdiv(heads, MERGE_BLOCK_HEADS))](
            partial_acc, partial_stats, sink, cos, sin, cos.stride(0), out, out.stride(0), out.stride(1), heads,
            HEAD_DIM=head_dim, ROPE_DIM=rope_dim, BLOCK_H=MERGE_BLOCK_HEADS, SPLITS=splits, num_warps=4,
        )  # fmt: skip
    return out


def attend_visible(
    q: torch.Tensor,
    keys: torch.Tensor,
    raw_count: int,
    visible: torch.Tensor,
    sink: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    scale: float,
) -> torch.Tensor:
    """The network's form of the call: one key tensor and a visibility mask.

    ``keys`` holds the raw window KV (its first ``raw_count`` rows) and then the
    compressed entries; ``visible [rows, len(keys)]`` marks what each query reads.
    """
    window = _selection_of_mask(keys[:raw_count], visible[:, :raw_count])
    compressed = _selection_of_mask(keys[raw_count:], visible[:, raw_count:])
    return sparse_decode_attention(q, window, compressed, sink.contiguous(), cos, sin, scale=scale)


def _selection_of_mask(pool: torch.Tensor, visible: torch.Tensor) -> KVSelection:
    """Each row's visible positions first (in order), then the rest; its length is how many are visible."""
    if pool.shape[0] == 0:  # nothing to read, but the kernel wants real buffers
        pool = pool.new_zeros(1, pool.shape[1])
        visible = visible.new_zeros(visible.shape[0], 1)
    indices = torch.argsort(visible.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return KVSelection(pool, indices, visible.sum(-1, dtype=torch.int32))


# At most this many entries a split when the grid is small (one 64-entry tile or less: measured on the H200).
LATENCY_SPLIT_ENTRIES = 48


def choose_splits(programs: int, width: int, heads: int, device: torch.device) -> int:
    """How many programs share one row's entries.

    Enough to give every multiprocessor about two programs. While the grid is small (at most
    one program per eight multiprocessors: a decode batch of a few requests) a program's time
    is the latency of its tiles, one after another, so each split takes about
    ``LATENCY_SPLIT_ENTRIES`` entries (at batch 1 and 8 on the H200: 20-35% faster than the
    byte rule below, which kept up to 320 entries in one program). Otherwise never so many
    that the float32 partial outputs (``heads * head_dim * 8`` bytes per split, written and
    read back) outweigh the ``width * head_dim * 2`` bytes of bf16 entries they split.
    """
    multiprocessors = _multiprocessors(device)
    wanted = math.ceil(2 * multiprocessors / max(programs, 1))
    if 8 * programs <= multiprocessors:
        affordable = math.ceil(width / LATENCY_SPLIT_ENTRIES)
    else:
        affordable = max(1, width // (4 * heads))
    return max(1, min(wanted, affordable, 64))


def _multiprocessors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _check_inputs(
    q: torch.Tensor,
    window: KVSelection,
    compressed: KVSelection,
    sink: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    rows, heads, head_dim = q.shape
    if q.stride(2) != 1:
        raise ValueError("q's last dim must be contiguous")
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
    if 2 * cos.shape[-1] > head_dim or cos.shape != sin.shape or cos.shape[0] != rows:
        raise ValueError(f"cos/sin must be [rows={rows}, rope_dim // 2]; got {tuple(cos.shape)}, {tuple(sin.shape)}")
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        raise ValueError("cos and sin must share one layout with a contiguous last dim")
    if sink.shape != (heads,) or not sink.is_floating_point() or not sink.is_contiguous():
        raise ValueError(f"sink must be contiguous floats [{heads}], got {sink.dtype} {tuple(sink.shape)}")
    formats = {part.row_format for part in (window, compressed) if isinstance(part.row_format, Fp8EntryRows)}
    if len(formats) > 1:
        raise ValueError(f"the window's and the compressed pool's FP8 rows differ: {formats}")
    for name, part in (("window", window), ("compressed", compressed)):
        if part.row_format is not None and not isinstance(part.row_format, PlainRows | Fp8EntryRows):
            raise ValueError(f"{name} rows are stored as {part.row_format}: the kernel reads values or FP8 entry rows")
        width, dtype = _stored_row(part, head_dim, q.dtype)
        if part.pool.dim() != 2 or part.pool.shape[1] != width or part.pool.stride(1) != 1:
            raise ValueError(f"{name} pool must be [rows, {width}] with contiguous rows")
        if dtype == torch.uint8 and part.pool.stride(0) != width:
            raise ValueError(f"{name} pool's FP8 rows must lie {width} bytes apart (the kernel's constexpr stride)")
        if part.pool.dtype != dtype:
            raise ValueError(f"{name} pool is {part.pool.dtype}, its rows want {dtype} (q is {q.dtype})")
        if part.indices.dtype != torch.int32 or part.indices.shape[0] != rows or part.indices.stride(1) != 1:
            raise ValueError(f"{name} indices must be int32 [{rows}, width] with a contiguous last dim")
        if part.lengths.dtype != torch.int32 or part.lengths.shape != (rows,):
            raise ValueError(f"{name} lengths must be int32 [{rows}]")


def _fp8_rows_start(window: KVSelection, compressed: KVSelection) -> tuple[int, int]:
    """Where the compressed pool's FP8 rows start, in bytes after the window pool's, and the largest power of two
    (at most 16) that divides every row's start counted from there, where both pools hold FP8 rows (else 0, 1).

    The kernel reads both pools' rows in one pass through the window pool's pointer and tells the compiler the
    rows' alignment, which it loses where a tile picks each row's pool (and then loads the rows a byte at a time,
    outside the pipelined copies)."""
    formats = {type(part.row_format) for part in (window, compressed)}
    if formats != {Fp8EntryRows}:
        return 0, 1
    start = compressed.pool.data_ptr() - window.pool.data_ptr()
    return start, math.gcd(window.pool.stride(0), compressed.pool.stride(0), start, 16)


def _fp8_format(window: KVSelection, compressed: KVSelection) -> Fp8EntryRows | None:
    """The FP8 entry rows either pool stores (both the same where both do), or None."""
    return next((p.row_format for p in (window, compressed) if isinstance(p.row_format, Fp8EntryRows)), None)


def _stored_row(part: KVSelection, head_dim: int, dtype: torch.dtype) -> tuple[int, torch.dtype]:
    """Width and dtype of a pool's rows: FP8 entry rows are bytes, any other row ``head_dim`` values in ``dtype``."""
    if isinstance(part.row_format, Fp8EntryRows):
        if part.row_format.dim != head_dim:
            raise ValueError(f"FP8 rows of {part.row_format.dim} values for a head_dim of {head_dim}")
        if part.row_format.rope_dim > ENTRY_SCALE_BLOCK:
            rope_dim = part.row_format.rope_dim
            raise ValueError(f"an FP8 row's rope dims are read in its last scale block: at most 64, got {rope_dim}")
        return part.row_format.row_bytes, torch.uint8
    return head_dim, dtype


@triton.jit
def _attend_entries(
    q, m_i, l_i, acc, pool, row_stride, index, compressed_start, compressed_index, n_window, start, end, scale_log2,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    FP8_ROWS: tl.constexpr, NOPE_DIM: tl.constexpr, SCALE_OFFSET: tl.constexpr, ROW_BYTES: tl.constexpr,
    BOTH_POOLS: tl.constexpr, ROW_ALIGNMENT: tl.constexpr,
):  # fmt: skip
    """Fold list slots ``start .. end - 1`` into the online softmax state ``(m_i, l_i, acc)`` (base-2 logits).

    Slot ``s`` is the row ``index[s]`` of the pool at ``pool`` (rows ``row_stride`` elements apart). With
    ``FP8_ROWS`` the rows are DeepSeek's FP8 rows (:class:`~.kv_format.Fp8EntryRows`, ``ROW_BYTES`` apart),
    dequantized here into ``q``'s dtype (exactly: an E4M3 value times a power of two, a bf16 value). With
    ``BOTH_POOLS`` (FP8 rows in both) the list is the window's rows, then the compressed pool's: a slot ``s >=
    n_window`` is the compressed pool's row ``compressed_index[s - n_window]``, that pool starting
    ``compressed_start`` bytes after ``pool``; a tile may hold rows of both, and every row starts a multiple of
    ``ROW_ALIGNMENT`` bytes after ``pool``."""
    columns = tl.arange(0, HEAD_DIM)
    for first in range(start, end, BLOCK_N):
        slots = first + tl.arange(0, BLOCK_N)
        valid = slots < end
        if BOTH_POOLS:
            in_window = slots < n_window
            rows = tl.load(index + slots, mask=valid & in_window, other=0).to(tl.int64)
            compressed_rows = tl.load(compressed_index + (slots - n_window), mask=valid & ~in_window, other=0)
            offsets = tl.where(in_window, rows, compressed_rows.to(tl.int64)) * ROW_BYTES
            offsets = tl.where(in_window, offsets, compressed_start + offsets)
            # The compiler loses the rows' alignment through the choice of pool (and then loads a byte at a time).
            row_starts = pool + tl.multiple_of(offsets, ROW_ALIGNMENT)
        else:
            rows = tl.load(index + slots, mask=valid, other=0).to(tl.int64)
            row_starts = pool + rows * (ROW_BYTES if FP8_ROWS else row_stride)
        if FP8_ROWS:
            kv = fp8_entry_rows(row_starts, valid, HEAD_DIM, NOPE_DIM, SCALE_OFFSET).to(q.dtype)
        else:
            kv = tl.load(row_starts[:, None] + columns[None, :], mask=valid[:, None], other=0.0)
        logits = dot(q, tl.trans(kv), DOT_PRECISION, UPCAST_DOT) * scale_log2
        logits = tl.where(valid[None, :], logits, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(logits, 1))
        correction = tl.exp2(m_i - m_new)
        probs = tl.exp2(logits - m_new[:, None])
        l_i = l_i * correction + tl.sum(probs, 1)
        acc = acc * correction[:, None] + dot(probs.to(kv.dtype), kv, DOT_PRECISION, UPCAST_DOT)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _store_with_inverse_rope(
    values, out_ptr, out_row_stride, out_head_stride, row, heads, head_ok, cos_ptr, sin_ptr, rope_row_stride,
    HEAD_DIM: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """Store ``values [BLOCK_H, HEAD_DIM]`` (float32) with its trailing rope pairs rotated back."""
    pairs = tl.reshape(values, (BLOCK_H, HEAD_DIM // 2, 2))
    even, odd = tl.split(pairs)
    pair = tl.arange(0, HEAD_DIM // 2)
    rope_pair = pair - (HEAD_DIM - ROPE_DIM) // 2
    is_rope = rope_pair >= 0
    cos = tl.load(cos_ptr + row * rope_row_stride + rope_pair, mask=is_rope, other=1.0)[None, :]
    sin = tl.load(sin_ptr + row * rope_row_stride + rope_pair, mask=is_rope, other=0.0)[None, :]
    rotated = tl.join(even * cos + odd * sin, odd * cos - even * sin)
    values = tl.reshape(rotated, (BLOCK_H, HEAD_DIM))
    columns = tl.arange(0, HEAD_DIM)
    pointers = out_ptr + row * out_row_stride + heads[:, None] * out_head_stride + columns[None, :]
    tl.store(pointers, values.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])


@triton.jit
def _sparse_attention_kernel(
    q_ptr, q_row_stride, q_head_stride,
    window_kv, window_kv_stride, window_index, window_index_stride, window_lengths,
    compressed_kv, compressed_start, compressed_kv_stride, compressed_index, compressed_index_stride,
    compressed_lengths, sink_ptr, cos_ptr, sin_ptr, rope_row_stride,
    out_ptr, out_row_stride, out_head_stride,
    partial_acc, partial_stats,
    num_heads, scale_log2,
    HEAD_DIM: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    WINDOW_FP8: tl.constexpr, COMPRESSED_FP8: tl.constexpr, NOPE_DIM: tl.constexpr, SCALE_OFFSET: tl.constexpr,
    ROW_BYTES: tl.constexpr, ROW_ALIGNMENT: tl.constexpr,
):  # fmt: skip
    heads = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    row = tl.program_id(1)
    split = tl.program_id(2)
    head_ok = heads < num_heads
    columns = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + row * q_row_stride + heads[:, None] * q_head_stride + columns[None, :], mask=head_ok[:, None], other=0.0
    )
    # The list this row reads: its window rows, then its compressed rows; a split takes one span of it.
    n_window = tl.load(window_lengths + row)
    total = n_window + tl.load(compressed_lengths + row)
    span = tl.cdiv(tl.cdiv(total, SPLITS), BLOCK_N) * BLOCK_N
    start = split * span
    end = tl.minimum(start + span, total)
    # The sink starts the softmax: running max = sink, and its weight exp(0) = 1 counted once.
    m_i = tl.load(sink_ptr + heads, mask=head_ok, other=0.0).to(tl.float32) * 1.4426950408889634
    l_i = tl.full((BLOCK_H,), 1.0 if SPLITS == 1 else 0.0, tl.float32)
    acc = tl.zeros((BLOCK_H, HEAD_DIM), tl.float32)
    window_index += row * window_index_stride
    compressed_index += row * compressed_index_stride
    # One pass over the list where both pools hold FP8 rows (two inlined passes spill registers: at V4's dims 1,528
    # B a thread against 168); else a pass over each pool's part (over bf16 rows, one pass was slower).
    if WINDOW_FP8 and COMPRESSED_FP8:
        m_i, l_i, acc = _attend_entries(
            q, m_i, l_i, acc, window_kv, window_kv_stride, window_index, compressed_start, compressed_index,
            n_window, start, end, scale_log2, HEAD_DIM, BLOCK_N, DOT_PRECISION, UPCAST_DOT,
            True, NOPE_DIM, SCALE_OFFSET, ROW_BYTES, True, ROW_ALIGNMENT,
        )  # fmt: skip
    else:
        m_i, l_i, acc = _attend_entries(
            q, m_i, l_i, acc, window_kv, window_kv_stride, window_index, 0, window_index, 0,
            start, tl.minimum(end, n_window), scale_log2, HEAD_DIM, BLOCK_N, DOT_PRECISION, UPCAST_DOT,
            WINDOW_FP8, NOPE_DIM, SCALE_OFFSET, ROW_BYTES, False, 1,
        )  # fmt: skip
        m_i, l_i, acc = _attend_entries(
            q, m_i, l_i, acc, compressed_kv, compressed_kv_stride, compressed_index, 0, compressed_index, 0,
            tl.maximum(start - n_window, 0), tl.maximum(end - n_window, 0), scale_log2,
            HEAD_DIM, BLOCK_N, DOT_PRECISION, UPCAST_DOT, COMPRESSED_FP8, NOPE_DIM, SCALE_OFFSET, ROW_BYTES, False, 1,
        )  # fmt: skip
    if SPLITS == 1:
        _store_with_inverse_rope(
            acc / l_i[:, None], out_ptr, out_row_stride, out_head_stride, row, heads, head_ok,
            cos_ptr, sin_ptr, rope_row_stride, HEAD_DIM, ROPE_DIM, BLOCK_H,
        )  # fmt: skip
    else:
        slot = (row * SPLITS + split) * num_heads + heads
        tl.store(partial_acc + slot[:, None] * HEAD_DIM + columns[None, :], acc, mask=head_ok[:, None])
        tl.store(partial_stats + slot * 2, m_i, mask=head_ok)
        tl.store(partial_stats + slot * 2 + 1, l_i, mask=head_ok)


@triton.jit
def _merge_splits_kernel(
    partial_acc, partial_stats, sink_ptr, cos_ptr, sin_ptr, rope_row_stride, out_ptr, out_row_stride,
    out_head_stride, num_heads,
    HEAD_DIM: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_H: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
    """Merge the splits' softmax states of one row and head block, add the sink, store."""
    row = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    columns = tl.arange(0, HEAD_DIM)
    sink = tl.load(sink_ptr + heads, mask=head_ok, other=0.0).to(tl.float32) * 1.4426950408889634
    peak = sink
    for split in range(SPLITS):
        slot = (row * SPLITS + split) * num_heads + heads
        peak = tl.maximum(peak, tl.load(partial_stats + slot * 2, mask=head_ok, other=0.0))
    total = tl.exp2(sink - peak)
    acc = tl.zeros((BLOCK_H, HEAD_DIM), tl.float32)
    for split in range(SPLITS):
        slot = (row * SPLITS + split) * num_heads + heads
        weight = tl.exp2(tl.load(partial_stats + slot * 2, mask=head_ok, other=0.0) - peak)
        total += weight * tl.load(partial_stats + slot * 2 + 1, mask=head_ok, other=0.0)
        part = tl.load(partial_acc + slot[:, None] * HEAD_DIM + columns[None, :], mask=head_ok[:, None], other=0.0)
        acc += weight[:, None] * part
    _store_with_inverse_rope(
        acc / total[:, None], out_ptr, out_row_stride, out_head_stride, row, heads, head_ok,
        cos_ptr, sin_ptr, rope_row_stride, HEAD_DIM, ROPE_DIM, BLOCK_H,
    )  # fmt: skip
