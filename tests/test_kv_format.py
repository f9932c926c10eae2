"""The KV row formats: DeepSeek's FP8 layout against a transcription of it, value by value and byte by byte."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_dsv4.kernels.kv_format import (
    REFERENCE_KEY_ROW_ALIGNMENT,
    Fp8EntryRows,
    Fp8KeyRows,
    PlainRows,
    pool_formats,
)


def _fp8(value: float) -> float:
    return torch.tensor(value, dtype=torch.float32).to(torch.float8_e4m3fn).float().item()


def _power_of_two_scale(block: list[float]) -> int:
    """The layout's scale exponent of one block: ceil(log2(max|x| / 448))."""
    return math.ceil(math.log2(max(max(abs(v) for v in block), 1e-8) / 448))


def _transcribed(values: list[float], block: int) -> tuple[list[float], list[int]]:
    """FP8 E4M3 of each value over its block's power-of-two scale, times that scale; and the exponents."""
    decoded, exponents = [], []
    for first in range(0, len(values), block):
        chunk = values[first : first + block]
        exponent = _power_of_two_scale(chunk)
        exponents.append(exponent)
        decoded += [_fp8(v / 2.0**exponent) * 2.0**exponent for v in chunk]
    return decoded, exponents


def _rows(count: int, dim: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    # Rows of very different magnitudes, one all zero, one with a block whose maximum is 448 times a power of two.
    rows = torch.randn(count, dim, generator=generator) * torch.logspace(-4, 3, count)[:, None]
    rows[0] = 0
    rows[1, :8] = torch.tensor([448.0 * 2**-5, 1.0, -3.0, 0.5, 2.0, 7.0, -1.5, 0.25])
    return rows


@pytest.mark.parametrize(("dim", "rope_dim"), [(512, 64), (64, 16), (24, 8)])
def test_entry_rows_store_fp8_with_ue8m0_scales_and_rope_in_bf16(dim: int, rope_dim: int):
    layout = Fp8EntryRows(dim, rope_dim)
    values = _rows(12, dim, seed=dim)
    stored = layout.encode(values)
    decoded = layout.decode(stored, torch.float32)
    nope = dim - rope_dim
    for row, value in enumerate(values.tolist()):
        expected, exponents = _transcribed(value[:nope], 64)
        assert decoded[row, :nope].tolist() == expected
        scale_bytes = stored[row, nope + 2 * rope_dim : nope + 2 * rope_dim + len(exponents)]
        assert [b - 127 for b in scale_bytes.tolist()] == exponents  # UE8M0: the power of two's exponent
    rope = values[:, nope:].to(torch.bfloat16)
    assert torch.equal(decoded[:, nope:], rope.float())  # the rope dims are bf16, nothing else
    assert torch.equal(stored[:, nope : nope + 2 * rope_dim].contiguous().view(torch.bfloat16), rope)


def test_v4_rows_have_the_reference_sizes_and_our_keys_end_on_16_bytes():
    formats = pool_formats(torch.float8_e4m3fn, head_dim=512, rope_dim=64, index_head_dim=128)
    assert formats.entries.row_bytes == 448 + 64 * 2 + 7 + 1
    assert formats.indexer_keys.row_bytes == 128 + 4 + 12  # padded to 16-byte rows
    reference = pool_formats(torch.float8_e4m3fn, 512, 64, 128, key_row_alignment=REFERENCE_KEY_ROW_ALIGNMENT)
    assert reference.indexer_keys.row_bytes == 128 + 4


def test_a_padded_key_row_holds_the_reference_row_and_zeros():
    values = _rows(6, 128, seed=5)
    padded, reference = Fp8KeyRows(128), Fp8KeyRows(128, REFERENCE_KEY_ROW_ALIGNMENT)
    stored = padded.encode(values)
    assert torch.equal(stored[:, :132], reference.encode(values))
    assert not stored[:, 132:].any()
    assert torch.equal(padded.decode(stored, torch.float32), reference.decode(stored[:, :132], torch.float32))


@pytest.mark.parametrize("dim", [128, 32, 200])
def test_indexer_keys_store_fp8_with_a_power_of_two_float32_scale_per_128(dim: int):
    layout = Fp8KeyRows(dim)
    values = _rows(12, dim, seed=dim)
    stored = layout.encode(values)
    decoded = layout.decode(stored, torch.float32)
    for row, value in enumerate(values.tolist()):
        expected, exponents = _transcribed(value, 128)
        assert decoded[row].tolist() == expected
        scales = stored[row, layout.scale_offset : layout.scales_end].contiguous().view(torch.float32).tolist()
        assert scales == [2.0**e for e in exponents]


def test_a_stored_row_reads_back_as_itself():
    """What a reader gets is what the next writer stores: a warm turn re-stores nothing else."""
    for layout in (Fp8EntryRows(64, 16), Fp8KeyRows(32)):
        once = layout.round_trip(_rows(20, layout.dim, seed=3))
        assert torch.equal(layout.round_trip(once), once)


def test_plain_formats_store_the_kv_dtype():
    formats = pool_formats(torch.bfloat16, head_dim=64, rope_dim=16, index_head_dim=32)
    assert formats.entries == PlainRows(64, torch.bfloat16) and not formats.quantized
    values = _rows(4, 64, seed=1)
    assert torch.equal(formats.entries.round_trip(values), values.to(torch.bfloat16).float())
    with pytest.raises(ValueError, match="float8_e5m2"):
        pool_formats(torch.float8_e5m2, 64, 16, 32)
