"""DeepSeek's FP8 rows (:mod:`.kv_format`) written by one Triton launch: the write half of the format on CUDA.

``encode_fp8_rows(values, row_format)`` equals ``row_format.encode(values)`` byte for byte, and
``encode_fp8_rows_into(values, row_format, pool, rows)`` writes the same bytes to ``pool[rows]`` (no copy after
it: a decode step's window row and compressed entries go straight to their pool): each block's scale
exponent is ``ceil(log2(max|x_b| / 448))`` from the float32 bits of the correctly rounded quotient (what
``torch.frexp`` gives the torch codec), the values are scaled by that power of two exactly, clamped to +-448 and
rounded to E4M3 to nearest even (:func:`_e4m3_code`), the rope values rounded to bf16 (likewise), and the
padding bytes zero (:func:`store_fp8_rows`, which the compressor's kernel stores its FP8 entries with too). The
roundings are integer operations, so the same code runs compiled and under Triton's
interpreter (whose casts round otherwise); a step writes a few rows, so launches bind, not arithmetic: the torch
codec takes a dozen launches a batch of rows, this one (benchmarks/NOTES.md, issue 30).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kv_format import AMAX_FLOOR, ENTRY_SCALE_BLOCK, FP8_MAX, KEY_SCALE_BLOCK, UE8M0_BIAS, Fp8EntryRows, Fp8KeyRows

ROWS_PER_PROGRAM = 4
_FP8_MAX, _AMAX_FLOOR, _UE8M0_BIAS = tl.constexpr(FP8_MAX), tl.constexpr(AMAX_FLOOR), tl.constexpr(UE8M0_BIAS)


def encode_fp8_rows(values: torch.Tensor, row_format: Fp8EntryRows | Fp8KeyRows) -> torch.Tensor:
    """Stored rows ``[n, row_bytes]`` uint8 of ``values [n, dim]`` (any float dtype; ``dim`` a power of two)."""
    out = torch.empty(values.shape[0], row_format.row_bytes, dtype=torch.uint8, device=values.device)
    _launch(values, row_format, out, None)
    return out


def encode_fp8_rows_into(
    values: torch.Tensor, row_format: Fp8EntryRows | Fp8KeyRows, pool: torch.Tensor, rows: torch.Tensor
) -> None:
    """``pool[rows[i]] = row_format.encode(values)[i]``: ``pool [*, row_bytes]`` uint8, ``rows [n]`` int64."""
    if pool.dim() != 2 or pool.shape[1] != row_format.row_bytes or not pool.is_contiguous():
        raise ValueError(f"a pool of rows is [*, {row_format.row_bytes}] contiguous, not {tuple(pool.shape)}")
    if rows.shape != values.shape[:1]:
        raise ValueError(f"{values.shape[0]} rows of values for {tuple(rows.shape)} pool rows")
    _launch(values, row_format, pool, rows)


def _launch(
    values: torch.Tensor, row_format: Fp8EntryRows | Fp8KeyRows, out: torch.Tensor, out_rows: torch.Tensor | None
) -> None:
    rows, dim = values.shape
    if dim != row_format.dim or dim & (dim - 1):
        raise ValueError(f"values of {dim} dims for rows of {row_format.dim}: a power of two is encoded here")
    values = values.contiguous()
    if rows == 0:
        return
    entries = isinstance(row_format, Fp8EntryRows)
    block = ENTRY_SCALE_BLOCK if entries else KEY_SCALE_BLOCK
    blocks = -(-dim // block)
    _encode_kernel[(triton.cdiv(rows, ROWS_PER_PROGRAM),)](
        values, out, out if out_rows is None else out_rows, rows, SCATTER=out_rows is not None,
        DIM=dim, NOPE_DIM=row_format.nope_dim if entries else dim, BLOCKS=blocks, WIDTH=dim // blocks,
        SCALES=row_format.scales, SCALE_OFFSET=row_format.scale_offset, ROW_BYTES=row_format.row_bytes,
        FLOAT32_SCALES=not entries, PADDING_WIDTH=triton.next_power_of_2(max(_padding_bytes(row_format), 1)),
        BLOCK_R=ROWS_PER_PROGRAM, num_warps=4,
    )  # fmt: skip


def _padding_bytes(row_format: Fp8EntryRows | Fp8KeyRows) -> int:
    """The bytes after a row's scales: an entry's odd byte, a key row's padding to its alignment."""
    scale_bytes = row_format.scales * (1 if isinstance(row_format, Fp8EntryRows) else 4)
    return row_format.row_bytes - row_format.scale_offset - scale_bytes


@triton.jit
def _ceil_log2(x):
    """``ceil(log2(x))`` exactly, int32, for positive normal float32 ``x``: its exponent, plus one unless ``x`` is
    a power of two."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits >> 23) & 255) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def _round_half_even(x):
    """``x`` rounded to the nearest integer, ties to even (float32 ``0 <= x < 2**22``: the float32 sum rounds)."""
    return (x + 12582912.0) - 12582912.0


@triton.jit
def _e4m3_code(x):
    """The E4M3 byte (uint8) of float32 ``x``, ``|x| <= 448``, rounded to nearest even, in integer and exact float
    operations: Triton's interpreter rounds the cast wrongly where it carries into the exponent (31.94 to 16)."""
    bits = x.to(tl.int32, bitcast=True)
    magnitude = tl.abs(x)
    exponent = tl.maximum(((magnitude.to(tl.int32, bitcast=True) >> 23) & 255) - 127, -6)  # floor(log2), >= -6
    steps = _round_half_even(magnitude * ((130 - exponent) << 23).to(tl.float32, bitcast=True))  # |x| / 2**(e-3)
    # A normal value: ((e + 7) << 3) + steps - 8, carrying into the exponent; below 2**-6, steps of 2**-9 alone.
    code = tl.where(magnitude < 0.015625, steps, (exponent + 6) * 8 + steps.to(tl.int32)).to(tl.int32)
    return (code | ((bits >> 24) & 128)).to(tl.uint8)


@triton.jit
def _bf16_bits(x):
    """The bf16 bits (uint16) of finite float32 ``x``, rounded to nearest even in integer operations (the
    interpreter's cast truncates)."""
    bits = x.to(tl.int32, bitcast=True)
    return (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF).to(tl.uint16)


@triton.jit
def _encode_kernel(
    values_ptr, out_ptr, out_rows_ptr, rows_count, SCATTER: tl.constexpr,
    DIM: tl.constexpr, NOPE_DIM: tl.constexpr, BLOCKS: tl.constexpr, WIDTH: tl.constexpr,
    SCALES: tl.constexpr, SCALE_OFFSET: tl.constexpr, ROW_BYTES: tl.constexpr, FLOAT32_SCALES: tl.constexpr,
    PADDING_WIDTH: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """``BLOCK_R`` rows of ``values`` a program, row ``r`` stored at ``out`` row ``r``, or with ``SCATTER`` at row
    ``out_rows[r]`` (:func:`store_fp8_rows`)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = (rows < rows_count)[:, None, None]
    columns = tl.arange(0, BLOCKS)[None, :, None] * WIDTH + tl.arange(0, WIDTH)[None, None, :]
    values = tl.load(values_ptr + rows[:, None, None].to(tl.int64) * DIM + columns, mask=ok, other=0.0)
    if SCATTER:
        out_rows = tl.load(out_rows_ptr + rows, mask=rows < rows_count, other=0).to(tl.int64)
    else:
        out_rows = rows.to(tl.int64)
    store_fp8_rows(
        out_ptr + out_rows * ROW_BYTES, values.to(tl.float32), ok,
        NOPE_DIM, WIDTH, SCALES, SCALE_OFFSET, ROW_BYTES, FLOAT32_SCALES, PADDING_WIDTH,
    )  # fmt: skip


@triton.jit
def store_fp8_rows(
    row_starts, values, ok, NOPE_DIM: tl.constexpr, WIDTH: tl.constexpr, SCALES: tl.constexpr,
    SCALE_OFFSET: tl.constexpr, ROW_BYTES: tl.constexpr, FLOAT32_SCALES: tl.constexpr, PADDING_WIDTH: tl.constexpr,
):  # fmt: skip
    """Rows of float32 ``values [rows, blocks, WIDTH]`` stored at ``row_starts [rows]`` (each row's first byte)
    where ``ok [rows, 1, 1]``: the FP8 codes of the first ``NOPE_DIM`` columns with one scale a block
    of ``WIDTH`` (a UE8M0 byte, or a float32 with ``FLOAT32_SCALES``), the rest (an entry's rope) in bf16 after
    them, and the padding bytes after the scales zero (``PADDING_WIDTH``: a power of two at least their count)."""
    block = tl.arange(0, values.shape[1])[None, :, None]
    columns = block * WIDTH + tl.arange(0, WIDTH)[None, None, :]
    nope = columns < NOPE_DIM
    amax = tl.maximum(tl.max(tl.where(nope, tl.abs(values), 0.0), axis=2), _AMAX_FLOOR)  # [rows, blocks]
    exponents = _ceil_log2(tl.fdiv(amax, _FP8_MAX, ieee_rounding=True))[:, :, None]
    inverse = ((127 - exponents) << 23).to(tl.float32, bitcast=True)  # 2**-e, exact
    scaled = tl.minimum(tl.maximum(values * inverse, -_FP8_MAX), _FP8_MAX)
    row_bytes = row_starts[:, None, None]
    tl.store(row_bytes + columns, _e4m3_code(scaled), mask=ok & nope)
    has_values = ok & (block * WIDTH < NOPE_DIM)
    if FLOAT32_SCALES:
        scales = (row_bytes + SCALE_OFFSET).to(tl.pointer_type(tl.float32)) + block
        tl.store(scales, (exponents + 127 << 23).to(tl.float32, bitcast=True), mask=has_values)
    else:
        tl.store(row_bytes + SCALE_OFFSET + block, (exponents + _UE8M0_BIAS).to(tl.uint8), mask=has_values)
        rope = (row_bytes + NOPE_DIM).to(tl.pointer_type(tl.uint16)) + (columns - NOPE_DIM)
        tl.store(rope, _bf16_bits(values), mask=ok & ~nope)
    PADDING: tl.constexpr = ROW_BYTES - SCALE_OFFSET - SCALES * (4 if FLOAT32_SCALES else 1)
    if PADDING > 0:  # an entry row's odd byte after its scales, a key row's bytes up to its alignment
        padding = tl.arange(0, PADDING_WIDTH)[None, :, None]
        zeros = tl.zeros((values.shape[0], PADDING_WIDTH, 1), tl.uint8)
        tl.store(row_bytes + ROW_BYTES - PADDING + padding, zeros, mask=ok & (padding < PADDING))
