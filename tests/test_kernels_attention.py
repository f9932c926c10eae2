"""The sparse decode attention kernel against a float64 torch reference, under Triton's interpreter
(in a process of their own: see ``kernel_testing``).

Fresh random inputs per case; outputs start as NaN (an element the kernel never writes
fails the check); row lengths are odd, empty and full; the entries are split across
programs in some cases (partial softmax states merged by the second kernel).
"""

from __future__ import annotations

import pytest
import torch
from kernel_testing import interpreted_only, launcher_only, poison_allocations, relative_error, run_under_interpreter

from sglang_dsv4.config import parse_config
from sglang_dsv4.kernels.kv_format import Fp8EntryRows
from sglang_dsv4.model.attention import Attention
from sglang_dsv4.model.rope import Rotary, apply_rope
from sglang_dsv4.tiny import TINY_CONFIG


@launcher_only
def test_attention_kernel_under_the_interpreter():
    run_under_interpreter(__file__)


@pytest.fixture(scope="module")
def kernels():
    from sglang_dsv4.kernels import attention

    return attention


def random_selection(kernels, rows: int, width: int, head_dim: int, dtype: torch.dtype, generator):
    pool_rows = 3 * width + 1
    pool = torch.randn(pool_rows, head_dim, generator=generator).to(dtype)
    indices = torch.randint(0, pool_rows, (rows, width), generator=generator, dtype=torch.int32)
    lengths = torch.randint(0, width + 1, (rows,), generator=generator, dtype=torch.int32)
    lengths[0], lengths[-1] = 0, width  # an empty and a full selection
    return kernels.KVSelection(pool, indices, lengths)


def widened(kernels, selection):
    return kernels.KVSelection(selection.pool.double(), selection.indices, selection.lengths)


# rows, heads, head_dim, rope_dim, window width, compressed width, dtype, splits
CASES = [
    (3, 4, 64, 16, 9, 21, torch.float32, 1),
    (5, 4, 64, 16, 7, 45, torch.float32, 3),
    (2, 20, 128, 32, 33, 70, torch.bfloat16, 1),
    (4, 16, 64, 64, 17, 100, torch.bfloat16, 2),
    (3, 64, 64, 16, 5, 13, torch.bfloat16, None),
    (1, 16, 64, 16, 40, 100, torch.bfloat16, None),  # a batch of one on the H200: split by latency, 3 ways
]
H200_MULTIPROCESSORS = 132


@interpreted_only
@pytest.mark.parametrize("rows, heads, head_dim, rope_dim, window_width, compressed_width, dtype, splits", CASES)
def test_attention_matches_float64_reference(
    kernels, monkeypatch, rows, heads, head_dim, rope_dim, window_width, compressed_width, dtype, splits
):
    generator = torch.Generator().manual_seed(hash((rows, heads, head_dim, window_width)) % 2**31)
    q = torch.randn(rows, heads, head_dim, generator=generator).to(dtype)
    window = random_selection(kernels, rows, window_width, head_dim, dtype, generator)
    compressed = random_selection(kernels, rows, compressed_width, head_dim, dtype, generator)
    compressed.lengths[0] = compressed_width  # rows with only window entries and only compressed ones
    sink = torch.randn(heads, generator=generator)
    angles = torch.rand(rows, rope_dim // 2, generator=generator) * 6
    cos, sin = angles.cos(), angles.sin()
    poison_allocations(monkeypatch)
    monkeypatch.setattr(kernels, "_multiprocessors", lambda device: H200_MULTIPROCESSORS)  # splits=None: as there

    out = kernels.sparse_decode_attention(q, window, compressed, sink, cos, sin, scale=head_dim**-0.5, splits=splits)

    expected = kernels.sparse_decode_attention_reference(
        q.double(),
        widened(kernels, window),
        widened(kernels, compressed),
        sink.double(),
        cos.double(),
        sin.double(),
        scale=head_dim**-0.5,
    )
    assert relative_error(out, expected) < (1e-5 if dtype == torch.float32 else 1e-2)


def fp8_selection(kernels, row_format: Fp8EntryRows, rows: int, width: int, generator):
    """A selection of FP8 entry rows (scales far apart), and the same rows decoded to float64 values."""
    values = random_selection(kernels, rows, width, row_format.dim, torch.float32, generator)
    values.pool[1:] *= torch.logspace(-3, 2, values.pool.shape[0] - 1)[:, None]
    stored = kernels.KVSelection(row_format.encode(values.pool), values.indices, values.lengths, row_format)
    decoded = kernels.KVSelection(row_format.decode(stored.pool, torch.float64), values.indices, values.lengths)
    return stored, decoded


@interpreted_only
@pytest.mark.parametrize(
    ("heads", "head_dim", "rope_dim", "dtype", "splits", "fp8_window"),
    [
        (4, 64, 16, torch.float32, 1, False),
        (4, 128, 64, torch.float32, 3, True),
        (16, 64, 16, torch.bfloat16, 2, True),
        (4, 64, 16, torch.float32, 2, True),
    ],
)
def test_fp8_rows_dequantized_in_the_kernel_match_the_torch_path(
    kernels, monkeypatch, heads, head_dim, rope_dim, dtype, splits, fp8_window
):
    """FP8 entry rows (a partial scale block where ``head_dim - rope_dim`` is not a multiple of 64) in the
    compressed pool, and in the window's too (as the batched core stages them), against the torch path's
    attention over the same rows, decoded."""
    rows, generator = 5, torch.Generator().manual_seed(head_dim + heads + splits)
    row_format = Fp8EntryRows(head_dim, rope_dim)
    q = torch.randn(rows, heads, head_dim, generator=generator).to(dtype)
    if fp8_window:
        window, window_decoded = fp8_selection(kernels, row_format, rows, 9, generator)
    else:
        window = random_selection(kernels, rows, 9, head_dim, dtype, generator)
        window_decoded = widened(kernels, window)
    compressed, compressed_decoded = fp8_selection(kernels, row_format, rows, 40, generator)
    sink = torch.randn(heads, generator=generator)
    angles = torch.rand(rows, rope_dim // 2, generator=generator) * 6
    cos, sin = angles.cos(), angles.sin()
    poison_allocations(monkeypatch)

    out = kernels.sparse_decode_attention(q, window, compressed, sink, cos, sin, scale=head_dim**-0.5, splits=splits)

    expected = kernels.sparse_decode_attention_reference(
        q.double(), window_decoded, compressed_decoded, sink.double(), cos.double(), sin.double(),
        scale=head_dim**-0.5,
    )  # fmt: skip
    assert relative_error(out, expected) < (1e-5 if dtype == torch.float32 else 1e-2)


@interpreted_only
@pytest.mark.parametrize("splits", [1, 2])
def test_a_sink_in_the_models_dtype_reads_as_its_float32_cast(kernels, splits):
    """The served step hands the kernel the loaded bfloat16 sinks (no cast launched): the output is bitwise the one
    of the same sinks cast to float32 first, with and without the merge of split partials."""
    generator = torch.Generator().manual_seed(11)
    q = torch.randn(3, 16, 64, generator=generator).to(torch.bfloat16)
    window = random_selection(kernels, 3, 9, 64, torch.bfloat16, generator)
    compressed = random_selection(kernels, 3, 21, 64, torch.bfloat16, generator)
    sink = (torch.randn(16, generator=generator) * 3).to(torch.bfloat16)
    angles = torch.rand(3, 8, generator=generator) * 6
    cos, sin = angles.cos(), angles.sin()

    def attend(sink: torch.Tensor) -> torch.Tensor:
        return kernels.sparse_decode_attention(q, window, compressed, sink, cos, sin, scale=0.125, splits=splits)

    assert torch.equal(attend(sink), attend(sink.float()))


@interpreted_only
def test_a_row_with_no_entries_reads_only_the_sink(kernels):
    generator = torch.Generator().manual_seed(7)
    q = torch.randn(2, 4, 64, generator=generator)
    empty = kernels.KVSelection(
        torch.randn(3, 64, generator=generator), torch.zeros(2, 5, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    )
    angles = torch.rand(2, 8, generator=generator)
    out = kernels.sparse_decode_attention(q, empty, empty, torch.randn(4), angles.cos(), angles.sin(), scale=0.125)
    assert torch.equal(out, torch.zeros_like(out))


@interpreted_only
def test_network_form_matches_the_models_attend(kernels):
    """``attend_visible`` (what the network calls on CUDA) against ``Attention._attend`` plus the inverse rope."""
    config = parse_config(dict(TINY_CONFIG))
    rotary = Rotary(config.rope_head_dim, config.rope_theta, None)
    attention = Attention(config, 0, rotary, rotary)
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        attention.attn_sink.copy_(torch.randn(config.num_heads, generator=generator))
    rows, raw, entries = 6, 19, 23
    q = torch.randn(rows, config.num_heads, config.head_dim, generator=generator)
    keys = torch.randn(raw + entries, config.head_dim, generator=generator)
    visible = torch.rand(rows, raw + entries, generator=generator) < 0.6
    visible[0] = False
    cos, sin = rotary.cos_sin(torch.arange(100, 100 + rows))

    out = kernels.attend_visible(q, keys, raw, visible, attention.attn_sink, cos, sin, scale=config.head_dim**-0.5)

    with torch.no_grad():
        expected = apply_rope(attention._attend(q, keys, visible), cos, sin, inverse=True)
    assert relative_error(out, expected) < 1e-5
