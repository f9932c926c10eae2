"""How KV rows are stored: in the KV dtype as they are, or in DeepSeek's FP8 serving layout.

A pool row holds one vector of ``dim`` values: a window row or a compressed entry (``head_dim``,
its trailing ``rope_dim`` channels roped), or an indexer key (``index_head_dim``). A
:class:`RowFormat` says how: :meth:`~RowFormat.encode` turns values into stored rows when a
pool is written, :meth:`~RowFormat.decode` turns stored rows back into values where they are
read, and the attention of a forward reads its own new rows as stored (:meth:`~RowFormat.round_trip`),
so that a turn resumed from the pools computes what a cold one does.

* :class:`PlainRows`: the values in the KV dtype (float32 or bfloat16), one element each.
* :class:`Fp8EntryRows` (``--kv-cache-dtype fp8_e4m3``; window rows and compressed entries): the
  ``nope = dim - rope_dim`` leading values in FP8 E4M3, each block of ``ENTRY_SCALE_BLOCK`` of them
  scaled by a power of two stored as one UE8M0 byte (its exponent + 127), the rope values in bfloat16::

      s_b = 2 ** ceil(log2(max|x_b| / 448)),   q_i = e4m3(x_i / s_b),   x_i ~ q_i * s_b   (i in block b)
      row = [ q_0 .. q_{nope-1} : e4m3 | rope : bf16 | exponent byte of each s_b | pad to 2 bytes ]

  584 bytes for V4's ``head_dim`` 512 with ``rope_dim`` 64 (448 + 128 + 7 + 1), upstream SGLang's V4 row.
* :class:`Fp8KeyRows` (indexer keys): every value FP8 E4M3, each block of ``KEY_SCALE_BLOCK`` scaled
  by a power of two (as above) stored as a float32::

      row = [ q_0 .. q_{dim-1} : e4m3 | pad to 4 bytes | s_b of each block : float32 | pad to row_alignment ]

  Our pools' rows end on ``KEY_ROW_ALIGNMENT`` (16) bytes: 144 bytes for V4's ``index_head_dim`` 128, so that
  every row's codes start 16-byte aligned and a kernel loads them in 16-byte words (a 132-byte row is loaded 4
  bytes at a time: benchmarks/NOTES.md, "FP8 indexer keys padded to 144 B"). DeepSeek's and upstream SGLang's
  rows end on 4 bytes (``REFERENCE_KEY_ROW_ALIGNMENT``): 132 bytes, the reference layout's.

A block is the last one's remainder where ``dim`` is not a multiple of its size (small test configs).
Power-of-two scales make the division exact, so an encode on any device rounds the same value once, to
nearest even, and a decode is exact (the Triton kernels read the bytes themselves: :mod:`.fp8_rows`).
Nothing here imports above ``kernels``, nor Triton.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest E4M3 value
ENTRY_SCALE_BLOCK = 64  # FP8 values per UE8M0 scale in an entry row
KEY_SCALE_BLOCK = 128  # FP8 values per float32 scale in an indexer key row
KEY_ROW_ALIGNMENT = 16  # our pools' indexer key rows: 16-byte loads of every row's codes
REFERENCE_KEY_ROW_ALIGNMENT = 4  # DeepSeek's (upstream SGLang's) indexer key rows: codes, then float32 scales
UE8M0_BIAS = 127
# The smallest block maximum a scale is computed from (upstream's): an all-zero block stores zeros.
AMAX_FLOOR = 1e-8


class RowFormat(Protocol):
    """How one pool's rows of ``dim`` values are stored."""

    dim: int

    @property
    def row_bytes(self) -> int:
        """Bytes of one stored row."""
        ...

    def empty(self, rows: int, device: torch.device | str) -> torch.Tensor:
        """A zeroed pool of ``rows`` stored rows."""
        ...

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        """Stored rows ``[n, ...]`` of values ``[n, dim]``."""
        ...

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Values ``[n, dim]`` in ``dtype`` of stored rows ``[n, ...]``."""
        ...

    def round_trip(self, values: torch.Tensor) -> torch.Tensor:
        """``decode(encode(values))`` in ``values``' dtype: what a reader of the pool gets."""
        ...


@dataclass(frozen=True)
class PlainRows:
    """Rows of ``dim`` values in ``dtype``."""

    dim: int
    dtype: torch.dtype

    @property
    def row_bytes(self) -> int:
        return self.dim * self.dtype.itemsize

    def empty(self, rows: int, device: torch.device | str) -> torch.Tensor:
        return torch.zeros(rows, self.dim, dtype=self.dtype, device=device)

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        return values.to(self.dtype)

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return rows.to(dtype)

    def round_trip(self, values: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(values), values.dtype)


@dataclass(frozen=True)
class Fp8EntryRows:
    """Window rows and compressed entries: FP8 with UE8M0 scales per ``ENTRY_SCALE_BLOCK``, rope in bf16."""

    dim: int
    rope_dim: int

    @property
    def nope_dim(self) -> int:
        return self.dim - self.rope_dim

    @property
    def scales(self) -> int:
        return _blocks(self.nope_dim, ENTRY_SCALE_BLOCK)

    @property
    def rope_offset(self) -> int:
        return self.nope_dim

    @property
    def scale_offset(self) -> int:
        return self.nope_dim + self.rope_dim * torch.bfloat16.itemsize

    @property
    def row_bytes(self) -> int:
        return _aligned(self.scale_offset + self.scales, torch.bfloat16.itemsize)

    def empty(self, rows: int, device: torch.device | str) -> torch.Tensor:
        return torch.zeros(rows, self.row_bytes, dtype=torch.uint8, device=device)

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        rows = values.new_zeros(values.shape[0], self.row_bytes, dtype=torch.uint8)
        quantized, exponents = _quantize(values[:, : self.nope_dim].float(), ENTRY_SCALE_BLOCK)
        rows[:, : self.rope_offset] = quantized.view(torch.uint8)
        rope = values[:, self.nope_dim :].to(torch.bfloat16).contiguous()
        rows[:, self.rope_offset : self.scale_offset] = rope.view(torch.uint8)
        rows[:, self.scale_offset : self.scale_offset + self.scales] = (exponents + UE8M0_BIAS).to(torch.uint8)
        return rows

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        rows = rows.reshape(-1, self.row_bytes)
        quantized = rows[:, : self.rope_offset].contiguous().view(FP8)
        exponents = rows[:, self.scale_offset : self.scale_offset + self.scales].float() - UE8M0_BIAS
        nope = _dequantize(quantized, torch.exp2(exponents), ENTRY_SCALE_BLOCK)
        rope = rows[:, self.rope_offset : self.scale_offset].contiguous().view(torch.bfloat16)
        return torch.cat([nope, rope.float()], dim=-1).to(dtype)

    def round_trip(self, values: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(values), values.dtype)


@dataclass(frozen=True)
class Fp8KeyRows:
    """Indexer keys: FP8 with a power-of-two float32 scale per ``KEY_SCALE_BLOCK``, rows padded to end on
    ``row_alignment`` bytes."""

    dim: int
    row_alignment: int = KEY_ROW_ALIGNMENT

    @property
    def scales(self) -> int:
        return _blocks(self.dim, KEY_SCALE_BLOCK)

    @property
    def scale_offset(self) -> int:
        return _aligned(self.dim, torch.float32.itemsize)

    @property
    def scales_end(self) -> int:
        return self.scale_offset + self.scales * torch.float32.itemsize

    @property
    def row_bytes(self) -> int:
        return _aligned(self.scales_end, self.row_alignment)

    def empty(self, rows: int, device: torch.device | str) -> torch.Tensor:
        return torch.zeros(rows, self.row_bytes, dtype=torch.uint8, device=device)

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        rows = values.new_zeros(values.shape[0], self.row_bytes, dtype=torch.uint8)
        quantized, exponents = _quantize(values.float(), KEY_SCALE_BLOCK)
        rows[:, : self.dim] = quantized.view(torch.uint8)
        scales = torch.exp2(exponents.float()).contiguous()
        rows[:, self.scale_offset : self.scales_end] = scales.view(torch.uint8)
        return rows

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        rows = rows.reshape(-1, self.row_bytes)
        quantized = rows[:, : self.dim].contiguous().view(FP8)
        scales = rows[:, self.scale_offset : self.scales_end].contiguous().view(torch.float32)
        return _dequantize(quantized, scales, KEY_SCALE_BLOCK).to(dtype)

    def round_trip(self, values: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(values), values.dtype)


@dataclass(frozen=True)
class PoolFormats:
    """The row formats of one V4 pool: window rows and compressed entries, and indexer keys."""

    entries: RowFormat
    indexer_keys: RowFormat

    @property
    def quantized(self) -> bool:
        return isinstance(self.entries, Fp8EntryRows)


def pool_formats(
    kv_dtype: torch.dtype,
    head_dim: int,
    rope_dim: int,
    index_head_dim: int,
    key_row_alignment: int = KEY_ROW_ALIGNMENT,
) -> PoolFormats:
    """The formats a pool of KV dtype ``kv_dtype`` stores: FP8 E4M3 means DeepSeek's layout (its indexer key rows
    padded to end on ``key_row_alignment`` bytes), a float dtype itself."""
    if kv_dtype == FP8:
        return PoolFormats(Fp8EntryRows(head_dim, rope_dim), Fp8KeyRows(index_head_dim, key_row_alignment))
    if not kv_dtype.is_floating_point or kv_dtype.itemsize < 2:
        raise ValueError(f"KV dtype {kv_dtype} has no V4 pool format: use float32, bfloat16 or float8_e4m3fn")
    return PoolFormats(PlainRows(head_dim, kv_dtype), PlainRows(index_head_dim, kv_dtype))


def _blocks(values: int, block: int) -> int:
    return -(-values // block)


def _aligned(offset: int, alignment: int) -> int:
    return -(-offset // alignment) * alignment


def _in_blocks(values: torch.Tensor, block: int) -> torch.Tensor:
    """``values [n, d]`` as ``[n, blocks, block]``, the last block padded with zeros."""
    blocks = _blocks(values.shape[1], block)
    return torch.nn.functional.pad(values, (0, blocks * block - values.shape[1])).view(values.shape[0], blocks, block)


def _quantize(values: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 values ``[n, d]`` and each block's power-of-two exponent ``[n, blocks]`` int32 of float32 ``values``."""
    blocked = _in_blocks(values, block)
    amax = blocked.abs().amax(dim=2).clamp_min(AMAX_FLOOR)
    exponents = _ceil_log2(amax / FP8_MAX)
    scaled = blocked * torch.exp2(-exponents.float())[:, :, None]
    quantized = scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8).flatten(1)[:, : values.shape[1]]
    return quantized, exponents


def _dequantize(quantized: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """Float32 values ``[n, d]`` of FP8 values ``[n, d]`` and their blocks' scales ``[n, blocks]``."""
    scaled = _in_blocks(quantized.float(), block) * scales[:, :, None]
    return scaled.flatten(1)[:, : quantized.shape[1]]


def _ceil_log2(x: torch.Tensor) -> torch.Tensor:
    """``ceil(log2(x))`` exactly, int32, for positive float32 ``x`` (``x = m * 2**e``, ``0.5 <= m < 1``)."""
    mantissa, exponent = torch.frexp(x)
    return (exponent - (mantissa == 0.5).to(exponent.dtype)).to(torch.int32)
