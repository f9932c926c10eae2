"""DeepSeek's FP8 rows (:mod:`.kv_format`) read inside Triton kernels: the in-register half of the format, and
:func:`decode_fp8_rows`, the launch that gathers pool rows and stores their values (a prefill's staging).

The kernels load a row's bytes and rebuild its values exactly (an E4M3 value times a power of two, a bf16
value). An E4M3 byte is bit-cast to ``tl.float8e4nv`` and converted to float32 (the hardware conversion on
CUDA; Triton's interpreter converts every finite code alike, and the format never stores the NaN codes 0x7f /
0xff). The compiler must know each row's alignment (8 bytes for V4's 584-byte entries, 16 for the pools' 144-byte
keys, 4 for the reference's 132-byte ones) to load a row's bytes in words that wide rather than one at a time: a
key row's start is computed here from a constexpr stride (``ROW_BYTES``, the format's row size: the pools' rows
are contiguous); an entry row's start is the caller's, which computes it alike or states its alignment
(``tl.multiple_of``). A row's scales are loaded once each, not once per value (the row read as ``[rows, blocks,
block]``); an entry's rope values through a bf16 pointer, a key's scales through a float32 one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kv_format import Fp8EntryRows, Fp8KeyRows

DECODED_ROWS_PER_PROGRAM = 16


@triton.jit
def _power_of_two(biased_exponent):
    """``2**(biased_exponent - 127)`` exactly, as float32 (int32 ``biased_exponent`` in 1 .. 254)."""
    return (biased_exponent << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_value(codes):
    """The float32 value of E4M3 bytes (uint8 ``codes``)."""
    return codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def fp8_entry_rows(
    row_starts, valid, HEAD_DIM: tl.constexpr, NOPE_DIM: tl.constexpr, SCALE_OFFSET: tl.constexpr
):  # fmt: skip
    """Rows ``[BLOCK_N, HEAD_DIM]`` float32 of FP8 entry rows (``row_starts [BLOCK_N]``: each row's first byte):
    ``e4m3 * 2**(scale byte - 127)`` for the nope channels (one scale byte per 64), the bf16 values for the rope
    channels. Exact.

    Read as ``[BLOCK_N, blocks, 64]`` (one scale a block, loaded once): the FP8 bytes, each row's scale bytes, and
    its rope values, which lie in the last block (``rope_dim <= 64``, as the attention's wrapper checks)."""
    BLOCKS: tl.constexpr = (HEAD_DIM + 63) // 64
    WIDTH: tl.constexpr = HEAD_DIM // BLOCKS
    ROPE_DIM: tl.constexpr = HEAD_DIM - NOPE_DIM
    block = tl.arange(0, BLOCKS)[None, :, None]
    within = tl.arange(0, WIDTH)[None, None, :]
    columns = block * WIDTH + within
    row_bytes = row_starts[:, None, None]
    ok = valid[:, None, None]
    fp8 = tl.load(row_bytes + columns, mask=ok & (columns < NOPE_DIM), other=0)
    exponents = tl.load(row_bytes + SCALE_OFFSET + block, mask=ok & (block * WIDTH < NOPE_DIM), other=127)
    rope_column = within - (WIDTH - ROPE_DIM)  # the last block's trailing ROPE_DIM columns
    rope_values = (row_bytes + NOPE_DIM).to(tl.pointer_type(tl.bfloat16)) + rope_column
    rope = tl.load(rope_values, mask=ok & (rope_column >= 0), other=0.0).to(tl.float32)
    values = tl.where(columns < NOPE_DIM, _e4m3_value(fp8) * _power_of_two(exponents.to(tl.int32)), rope)
    return tl.reshape(values, (row_starts.shape[0], HEAD_DIM))


@triton.jit
def fp8_key_rows(
    rows_ptr, rows, valid, DIM: tl.constexpr, SCALE_OFFSET: tl.constexpr, ROW_BYTES: tl.constexpr, dtype: tl.constexpr
):  # fmt: skip
    """FP8 indexer-key rows (bytes, ``ROW_BYTES`` apart; one float32 scale per 128 values) as ``(values [BLOCK,
    DIM] in dtype, scale [BLOCK] float32)`` whose product ``values * scale[:, None]`` is the rows' values: while a
    key is one scale block (``DIM <= 128``, V4's keys) the E4M3 values themselves and each row's scale, which the
    caller applies to its dot products (exact: a power of two); else the values scaled and a scale of 1."""
    BLOCKS: tl.constexpr = (DIM + 127) // 128
    WIDTH: tl.constexpr = DIM // BLOCKS
    block = tl.arange(0, BLOCKS)[None, :, None]
    columns = block * WIDTH + tl.arange(0, WIDTH)[None, None, :]
    row_bytes = rows_ptr + rows[:, None, None] * ROW_BYTES
    ok = valid[:, None, None]
    codes = tl.load(row_bytes + columns, mask=ok, other=0).to(tl.float8e4nv, bitcast=True)
    scales = tl.load((row_bytes + SCALE_OFFSET).to(tl.pointer_type(tl.float32)) + block, mask=ok, other=0.0)
    if BLOCKS == 1:
        return tl.reshape(codes.to(dtype), (rows.shape[0], DIM)), tl.reshape(scales, (rows.shape[0],))
    values = tl.reshape((codes.to(tl.float32) * scales).to(dtype), (rows.shape[0], DIM))
    return values, tl.full((rows.shape[0],), 1.0, tl.float32)


def decode_fp8_rows(
    pool: torch.Tensor, rows: torch.Tensor, row_format: Fp8EntryRows | Fp8KeyRows, dtype: torch.dtype
) -> torch.Tensor:
    """The values ``[len(rows), dim]`` in ``dtype`` of ``pool[rows]`` (``pool [*, row_bytes]`` uint8, contiguous;
    ``dim`` a power of two): ``row_format.decode(pool[rows], dtype)`` in one launch, bitwise (the values are exact in
    float32, and rounded to ``dtype`` once)."""
    dim = row_format.dim
    if pool.dim() != 2 or pool.shape[1] != row_format.row_bytes or not pool.is_contiguous():
        raise ValueError(f"a pool of rows is [*, {row_format.row_bytes}] contiguous, not {tuple(pool.shape)}")
    if dim & (dim - 1):
        raise ValueError(f"rows of {dim} values: a power of two is decoded here")
    out = torch.empty(rows.shape[0], dim, dtype=dtype, device=pool.device)
    if rows.shape[0] == 0:
        return out
    entries = isinstance(row_format, Fp8EntryRows)
    _decode_kernel[(triton.cdiv(rows.shape[0], DECODED_ROWS_PER_PROGRAM),)](
        pool, rows, out, rows.shape[0], DIM=dim, ENTRIES=entries, NOPE_DIM=row_format.nope_dim if entries else 0,
        SCALE_OFFSET=row_format.scale_offset, ROW_BYTES=row_format.row_bytes, BLOCK=DECODED_ROWS_PER_PROGRAM,
    )  # fmt: skip
    return out


@triton.jit
def _decode_kernel(
    pool, rows_ptr, out_ptr, count, DIM: tl.constexpr, ENTRIES: tl.constexpr, NOPE_DIM: tl.constexpr,
    SCALE_OFFSET: tl.constexpr, ROW_BYTES: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """``BLOCK`` of the listed rows a program: their values, stored in ``out_ptr``'s dtype."""
    slots = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = slots < count
    rows = tl.load(rows_ptr + slots, mask=valid, other=0).to(tl.int64)
    if ENTRIES:
        values = fp8_entry_rows(pool + rows * ROW_BYTES, valid, DIM, NOPE_DIM, SCALE_OFFSET)
    else:
        codes, scales = fp8_key_rows(pool, rows, valid, DIM, SCALE_OFFSET, ROW_BYTES, tl.float32)
        values = codes * scales[:, None]
    out = out_ptr + slots.to(tl.int64)[:, None] * DIM + tl.arange(0, DIM)[None, :]
    tl.store(out, values.to(out_ptr.dtype.element_ty), mask=valid[:, None])
