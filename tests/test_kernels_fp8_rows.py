"""DeepSeek's FP8 rows in Triton against the torch codec (:mod:`sglang_dsv4.kernels.kv_format`), bitwise: the
in-register decode (:mod:`sglang_dsv4.kernels.fp8_rows`) over every finite E4M3 code, and the one-launch encode
(:mod:`sglang_dsv4.kernels.fp8_encode`) over values of every magnitude and every rounding tie.

Under Triton's interpreter here (in a process of its own: see ``kernel_testing``); where a GPU is, the same tests
run the compiled kernels on it (``python -m pytest --noconftest tests/test_kernels_fp8_rows.py`` on a CUDA host:
the hardware conversion of ``tl.float8e4nv``, and the rows' words loaded at their alignment).
"""

from __future__ import annotations

import pytest
import torch
from kernel_testing import IN_INTERPRETER, launcher_only, run_under_interpreter

from sglang_dsv4.kernels.kv_format import FP8, REFERENCE_KEY_ROW_ALIGNMENT, Fp8EntryRows, Fp8KeyRows

ON_GPU = not IN_INTERPRETER and torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
runs_kernels = pytest.mark.skipif(not (IN_INTERPRETER or ON_GPU), reason="runs interpreted or on a GPU")
FINITE_CODES = torch.tensor([code for code in range(256) if code & 0x7F != 0x7F], dtype=torch.uint8)  # no NaNs


@launcher_only
def test_fp8_row_decode_under_the_interpreter():
    run_under_interpreter(__file__)


def decoded_in_kernel(stored: torch.Tensor, row_format: Fp8EntryRows | Fp8KeyRows) -> torch.Tensor:
    """Float32 values ``[rows, dim]`` of stored rows, decoded by the kernels' row readers."""
    from sglang_dsv4.kernels.fp8_rows import decode_fp8_rows

    rows = torch.arange(stored.shape[0], device=stored.device)
    return decode_fp8_rows(stored, rows, row_format, torch.float32)


def every_code(row_format: Fp8EntryRows | Fp8KeyRows, rows: int, seed: int) -> torch.Tensor:
    """Stored rows ``[rows, row_bytes]`` from random values of very different magnitudes, whose FP8 bytes are then
    replaced by every finite E4M3 code in turn (the scales stay the encoder's: powers of two far apart)."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, row_format.dim, generator=generator) * torch.logspace(-6, 6, rows)[:, None]
    stored = row_format.encode(values)
    fp8_bytes = row_format.nope_dim if isinstance(row_format, Fp8EntryRows) else row_format.dim
    codes = FINITE_CODES.repeat(-(-rows * fp8_bytes // len(FINITE_CODES)))[: rows * fp8_bytes]
    stored[:, :fp8_bytes] = codes.view(rows, fp8_bytes)
    return stored


@runs_kernels
@pytest.mark.parametrize(("dim", "rope_dim"), [(512, 64), (64, 16), (128, 64)])
def test_entry_rows_decoded_in_the_kernel_equal_the_codec_bitwise(dim: int, rope_dim: int):
    """V4's 584-byte rows (8-byte aligned), and small configs' 82- and 200-byte rows (a partial scale block)."""
    row_format = Fp8EntryRows(dim, rope_dim)
    stored = every_code(row_format, 37, seed=dim + rope_dim).to(DEVICE)
    assert torch.equal(decoded_in_kernel(stored, row_format), row_format.decode(stored, torch.float32))


@runs_kernels
@pytest.mark.parametrize(("dim", "alignment"), [(128, 16), (32, 16), (128, REFERENCE_KEY_ROW_ALIGNMENT)])
def test_key_rows_decoded_in_the_kernel_equal_the_codec_bitwise(dim: int, alignment: int):
    row_format = Fp8KeyRows(dim, alignment)
    stored = every_code(row_format, 41, seed=dim).to(DEVICE)
    assert torch.equal(decoded_in_kernel(stored, row_format), row_format.decode(stored, torch.float32))


@runs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("row_format", [Fp8EntryRows(512, 64), Fp8KeyRows(128)], ids=repr)
def test_rows_gathered_from_a_pool_decode_to_the_codecs_values_at_those_rows(row_format, dtype):
    """A prefill stages the rows it reads decoded (``decode_fp8_rows``): any rows, in any order, repeated."""
    from sglang_dsv4.kernels.fp8_rows import decode_fp8_rows

    pool = every_code(row_format, 29, seed=3).to(DEVICE)
    generator = torch.Generator().manual_seed(5)
    rows = torch.cat([torch.randperm(len(pool), generator=generator), torch.tensor([0, 0, 7])]).to(DEVICE)
    assert torch.equal(decode_fp8_rows(pool, rows, row_format, dtype), row_format.decode(pool[rows], dtype))


def values_to_encode(row_format: Fp8EntryRows | Fp8KeyRows, seed: int) -> torch.Tensor:
    """Rows of very different magnitudes, an all-zero row, negative zeros, and rows of every E4M3 rounding tie:
    the midpoints between neighbouring codes (either sign), each block held at a scale of 1 by a value of 448."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(24, row_format.dim, generator=generator) * torch.logspace(-9, 9, 24)[:, None]
    values[0], values[1, ::2] = 0.0, -0.0
    magnitudes = FINITE_CODES[FINITE_CODES < 0x7F].view(FP8).float()
    midpoints = (magnitudes[:-1] + magnitudes[1:]) / 2
    ties = torch.cat([midpoints, -midpoints]).repeat(-(-10 * row_format.dim // (2 * len(midpoints))))
    ties = ties[: 10 * row_format.dim].view(10, row_format.dim)
    ties[:, ::64] = 448.0  # one in every scale block (entries 64 values a block, keys 128)
    return torch.cat([values, ties])


@runs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "row_format",
    [
        Fp8EntryRows(512, 64),
        Fp8EntryRows(64, 16),
        Fp8EntryRows(128, 64),
        Fp8KeyRows(128),
        Fp8KeyRows(128, REFERENCE_KEY_ROW_ALIGNMENT),
        Fp8KeyRows(256),
    ],
    ids=repr,
)
def test_rows_encoded_in_one_launch_equal_the_codec_byte_for_byte(row_format, dtype):
    from sglang_dsv4.kernels.fp8_encode import encode_fp8_rows

    values = values_to_encode(row_format, seed=row_format.dim).to(dtype).to(DEVICE)
    assert torch.equal(encode_fp8_rows(values, row_format), row_format.encode(values))


@runs_kernels
@pytest.mark.parametrize("row_format", [Fp8EntryRows(512, 64), Fp8KeyRows(128)], ids=repr)
def test_rows_encoded_into_a_pool_are_the_codecs_at_their_rows_and_nothing_else_changes(row_format):
    """A decode step's rows go straight to their pool rows (``encode_fp8_rows_into``), in any order."""
    from sglang_dsv4.kernels.fp8_encode import encode_fp8_rows_into

    values = values_to_encode(row_format, seed=7).to(torch.bfloat16).to(DEVICE)
    generator = torch.Generator().manual_seed(11)
    pool = torch.randint(0, 256, (3 * len(values), row_format.row_bytes), dtype=torch.uint8, generator=generator)
    pool, rows = pool.to(DEVICE), torch.randperm(len(pool), generator=generator)[: len(values)].to(DEVICE)
    expected = pool.clone()
    expected[rows] = row_format.encode(values)
    encode_fp8_rows_into(values, row_format, pool, rows)
    assert torch.equal(pool, expected)
