"""DeepSeek's FP8 rows (:mod:`.kv_format`) read inside Triton kernels: the in-register half of the format.

The kernels load a row's bytes and rebuild its values exactly (an E4M3 value times a power of two, a bf16
value) with integer operations and bit casts only, so the same code runs compiled and under the interpreter.
An indexer key's float32 scale is loaded whole, through a float32 pointer (the rows and the scale's offset are
multiples of 4 bytes, :mod:`.kv_format`): four byte loads per value took the ratio-4 core over twice as long.
An entry's bf16 rope values stay two byte loads: through a bf16 pointer the ratio-128 core measured 2x slower
(benchmarks/NOTES.md, issue 30).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _power_of_two(biased_exponent):
    """``2**(biased_exponent - 127)`` exactly, as float32 (int32 ``biased_exponent`` in 1 .. 254)."""
    return (biased_exponent << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_value(bits):
    """The float32 value of E4M3 bytes (int32 ``bits``): ``(8 + m) * 2**(e - 10)``, and ``m * 2**-9`` for ``e = 0``."""
    exponent = (bits >> 3) & 15
    mantissa = (bits & 7).to(tl.float32)
    normal = (8.0 + mantissa) * _power_of_two(tl.maximum(exponent, 1) + 117)
    magnitude = tl.where(exponent > 0, normal, mantissa * 0.001953125)
    return tl.where((bits & 128) != 0, -magnitude, magnitude)


@triton.jit
def fp8_entry_rows(
    rows_ptr, rows, row_stride, valid, HEAD_DIM: tl.constexpr, NOPE_DIM: tl.constexpr, SCALE_OFFSET: tl.constexpr
):
    """Rows ``[BLOCK_N, HEAD_DIM]`` float32 of FP8 entry rows (bytes): ``e4m3 * 2**(scale byte - 127)`` for the
    nope channels (one scale byte per 64), the bf16 values for the rope channels. Byte loads only, exact."""
    columns = tl.arange(0, HEAD_DIM)[None, :]
    row_bytes = rows_ptr + rows[:, None] * row_stride
    nope, rope = valid[:, None] & (columns < NOPE_DIM), valid[:, None] & (columns >= NOPE_DIM)
    fp8 = tl.load(row_bytes + columns, mask=nope, other=0).to(tl.int32)
    scale = _power_of_two(tl.load(row_bytes + SCALE_OFFSET + columns // 64, mask=nope, other=127).to(tl.int32))
    low = tl.load(row_bytes + NOPE_DIM + 2 * (columns - NOPE_DIM), mask=rope, other=0).to(tl.int32)
    high = tl.load(row_bytes + NOPE_DIM + 2 * (columns - NOPE_DIM) + 1, mask=rope, other=0).to(tl.int32)
    bf16 = ((high << 24) | (low << 16)).to(tl.float32, bitcast=True)
    return tl.where(columns < NOPE_DIM, _e4m3_value(fp8) * scale, bf16)


@triton.jit
def fp8_key_rows(rows_ptr, rows, row_stride, valid, DIM: tl.constexpr, SCALE_OFFSET: tl.constexpr):
    """Rows ``[BLOCK, DIM]`` float32 of FP8 indexer-key rows (bytes): ``e4m3 * scale``, one float32 scale per 128."""
    columns = tl.arange(0, DIM)[None, :]
    row_bytes = rows_ptr + rows[:, None] * row_stride
    mask = valid[:, None] & (columns < DIM)
    fp8 = tl.load(row_bytes + columns, mask=mask, other=0).to(tl.int32)
    scales = (row_bytes + SCALE_OFFSET).to(tl.pointer_type(tl.float32))
    return _e4m3_value(fp8) * tl.load(scales + columns // 128, mask=mask, other=0.0)
