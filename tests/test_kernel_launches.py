"""Every Triton kernel's launch at the shipped configs' dims, in every dtype the server accepts, fits the H200.

No GPU needed: Triton compiles each launch for sm_90 (its own ptxas) instead of running it, and the test
reads the shared memory the compiled kernel asks (``metadata.shared``) against the H200's 232,448 B a block.
The launches are the package's own wrappers called with CPU tensors of V4-Flash's and V4-Pro's dims, so the
tiles are the ones the wrappers choose (``kernels/attention.py``'s :func:`launch_shape` in float32 among them).
Compiling takes minutes on two cores; the compiled kernels stay in Triton's cache for later runs.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from sglang_dsv4.config import named_config
from sglang_dsv4.kernels.attention import H200_SHARED_MEMORY
from sglang_dsv4.kernels.hopper_compile import CompiledForHopper

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MODELS = ("flash", "pro")


@pytest.fixture(scope="module")
def hopper() -> Iterator[CompiledForHopper]:
    pytest.importorskip("triton.backends.nvidia")
    with CompiledForHopper() as compiling:
        yield compiling


def assert_fits(hopper: CompiledForHopper, before: int, expected_kernels: int) -> None:
    compiled = hopper.new_since(before)
    assert len(compiled) >= expected_kernels, f"expected {expected_kernels} launches, compiled {[name for name, _ in compiled]}"
    for name, kernel in compiled:
        shared = kernel.metadata.shared
        assert shared <= H200_SHARED_MEMORY, f"{name} asks {shared} B of shared memory"


@pytest.mark.parametrize("fp8_rows", [False, True], ids=["values", "fp8-rows"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("model", MODELS)
def test_sparse_attention_fits_in_every_dtype(hopper, model, dtype, fp8_rows):
    """Pools of values, and DeepSeek's FP8 rows in both the window and the compressed pool (``--kv-cache-dtype
    fp8_e4m3``: dequantized in-register)."""
    from sglang_dsv4.kernels.attention import sparse_decode_attention
    from sglang_dsv4.kernels.kv_format import Fp8EntryRows
    from sglang_dsv4.kernels.selection import KVSelection

    config = named_config(model)
    heads, dim = config.num_heads, config.head_dim
    q = torch.zeros(2, heads, dim, dtype=dtype)
    row_format = Fp8EntryRows(dim, config.rope_head_dim) if fp8_rows else None
    pool = row_format.empty(4, "cpu") if fp8_rows else torch.zeros(4, dim, dtype=dtype)
    rows = KVSelection(pool, torch.zeros(2, 8, dtype=torch.int32), torch.ones(2, dtype=torch.int32), row_format)
    cos = sin = torch.zeros(2, config.rope_head_dim // 2)
    before = len(hopper.compiled)
    for splits in (1, 2):  # the kernel, then with the merge of split partials
        sparse_decode_attention(q, rows, rows, torch.zeros(heads), cos, sin, scale=0.1, splits=splits)
    assert_fits(hopper, before, 3)


@pytest.mark.parametrize("fp8_keys", [False, True], ids=["values", "fp8-keys"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("model", MODELS)
def test_indexer_scoring_fits_in_every_dtype(hopper, model, dtype, fp8_keys):
    from sglang_dsv4.kernels.indexer import index_scores
    from sglang_dsv4.kernels.kv_format import Fp8KeyRows

    config = named_config(model)
    q = torch.zeros(2, config.index_n_heads, config.index_head_dim, dtype=dtype)
    keys_format = Fp8KeyRows(config.index_head_dim) if fp8_keys else None
    keys = keys_format.empty(8, "cpu") if fp8_keys else torch.zeros(8, config.index_head_dim, dtype=dtype)
    lengths = torch.full((2,), 8, dtype=torch.int32)
    before = len(hopper.compiled)
    table = torch.zeros(2, 8, dtype=torch.int32)
    weights = torch.zeros(2, config.index_n_heads)
    index_scores(q, weights, keys, lengths, scale=0.1, table=table, keys_format=keys_format)
    requests_table = torch.zeros(3, 8, dtype=torch.int64)  # the served form: the requests' rows, read by token
    index_scores(
        q, weights, keys, lengths, scale=0.1, table=requests_table, table_row=torch.tensor([2, 0]),
        keys_format=keys_format,
    )  # fmt: skip
    assert_fits(hopper, before, 2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("model", MODELS)
def test_fp8_row_encode_and_decode_fit_in_every_dtype(hopper, model, dtype):
    """The one-launch encode of FP8 entry rows (window rows, compressed entries) and indexer-key rows, returned
    and written into a pool's rows, and the decode of a pool's rows (a prefill's staging)."""
    from sglang_dsv4.kernels.fp8_encode import encode_fp8_rows, encode_fp8_rows_into
    from sglang_dsv4.kernels.fp8_rows import decode_fp8_rows
    from sglang_dsv4.kernels.kv_format import Fp8EntryRows, Fp8KeyRows

    config = named_config(model)
    before = len(hopper.compiled)
    rows = torch.arange(3)
    for row_format in (Fp8EntryRows(config.head_dim, config.rope_head_dim), Fp8KeyRows(config.index_head_dim)):
        values = torch.zeros(3, row_format.dim, dtype=dtype)
        encode_fp8_rows(values, row_format)
        encode_fp8_rows_into(values, row_format, row_format.empty(4, "cpu"), rows)
        decode_fp8_rows(row_format.empty(4, "cpu"), rows, row_format, dtype)
    assert_fits(hopper, before, 6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("model", MODELS)
def test_norm_and_rope_fit_in_every_dtype(hopper, model, dtype):
    """The attention's queries (normalised), its KV row (normalised with the weight) and the indexer's queries
    (roped only) at the config's heads and dims."""
    from sglang_dsv4.kernels.norm_rope import normalize_rope

    config = named_config(model)
    cos = sin = torch.zeros(2, config.rope_head_dim // 2)
    before = len(hopper.compiled)
    normalize_rope(torch.zeros(2, config.num_heads, config.head_dim, dtype=dtype), cos, sin, 1e-6)
    kv, weight = torch.zeros(2, 1, config.head_dim, dtype=dtype), torch.ones(config.head_dim, dtype=dtype)
    normalize_rope(kv, cos, sin, 1e-6, weight)
    normalize_rope(torch.zeros(2, config.index_n_heads, config.index_head_dim, dtype=dtype), cos, sin, None)
    assert_fits(hopper, before, 3)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("model", MODELS)
def test_low_rank_query_norm_fits_in_every_dtype(hopper, model, dtype):
    """The attention's ``q_norm`` alone (the norm and rope kernel with no rope) at the config's ``q_lora_rank``."""
    from sglang_dsv4.kernels.norm_rope import rms_norm

    config = named_config(model)
    before = len(hopper.compiled)
    rms_norm(torch.zeros(2, config.q_lora_rank, dtype=dtype), 1e-6, torch.ones(config.q_lora_rank, dtype=dtype))
    assert_fits(hopper, before, 1)


@pytest.mark.parametrize("width", [2049, 16384, 32769])
def test_top_k_fits_at_decode_widths(hopper, width):
    """The three-launch top-k, and the select the step's rule takes at the width (writing slots, and writing entry
    rows and counts, at both warp counts it picks): the whole-row select up to its widest rule width, the wide-row
    select at a 128K context's 32,769 scores; k = 512."""
    from sglang_dsv4.kernels import topk

    scores, lengths = torch.zeros(2, width), torch.full((2,), width, dtype=torch.int32)
    table, table_row = torch.zeros(3, width, dtype=torch.int64), torch.tensor([2, 0])
    before = len(hopper.compiled)
    topk.top_k(scores, lengths, 512)
    if width <= 16384:
        topk.whole_row_top_k(scores, lengths, 512)
        topk.whole_row_top_k_rows(scores, lengths, 512, table, table_row)
    else:
        topk.wide_row_top_k(scores, lengths, 512, num_warps=16)
        topk.wide_row_top_k_rows(scores, lengths, 512, table, table_row, num_warps=8)
    assert_fits(hopper, before, 5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("model", MODELS)
def test_compressor_decode_fits_in_every_dtype(hopper, model, dtype):
    """Every compressor of the config: each ratio's, and the indexer's; returning its entries, and the served
    step's one launch writing the entry rows and records too, in the projections' dtype and as FP8 rows."""
    from sglang_dsv4.kernels.compressor import CompressorWeights, DecodeRecords, compress_decode, compress_decode_into
    from sglang_dsv4.kernels.kv_format import Fp8EntryRows, Fp8KeyRows

    config = named_config(model)
    before = len(hopper.compiled)
    kinds = {(config.csa_rate, config.head_dim), (config.hca_rate, config.head_dim), (config.csa_rate, config.index_head_dim)}
    for ratio, dim in kinds:
        overlapping = ratio == config.csa_rate
        series = 2 if overlapping else 1
        weights = CompressorWeights(
            ape=torch.zeros(ratio, series * dim, dtype=dtype),
            norm_weight=torch.ones(dim, dtype=dtype),
            norm_eps=1e-6,
            inv_freq=torch.ones(config.rope_head_dim // 2),
            ratio=ratio,
            overlapping=overlapping,
        )
        projected = torch.zeros(2, series * dim, dtype=dtype)
        state = torch.zeros(3, 3 if overlapping else 1, 3, dim)
        positions, rows = torch.tensor([5, 9]), torch.tensor([1, 2])
        compress_decode(projected, projected, positions, state, rows, weights)
        records = DecodeRecords(torch.zeros_like(state), torch.zeros_like(state), torch.tensor([0, 2]))
        entries = torch.zeros(4, dim, dtype=dtype)
        compress_decode_into(projected, projected, positions, state, rows, weights, records, entries, rows)
        keys = dim == config.index_head_dim
        stored_as = Fp8KeyRows(dim) if keys else Fp8EntryRows(dim, config.rope_head_dim)
        entries = stored_as.empty(4, "cpu")
        compress_decode_into(projected, projected, positions, state, rows, weights, records, entries, rows, stored_as)
    assert_fits(hopper, before, 3 * len(kinds))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("model", MODELS)
def test_compressor_pair_decode_fits_in_every_dtype(hopper, model, dtype):
    """A ratio-4 layer's compressor and its indexer's in one decode launch, at the config's dims, their entries in
    the projections' dtype and as FP8 rows."""
    from sglang_dsv4.kernels.compressor import CompressorWeights, DecodeInto, DecodeRecords, compress_decode_pair_into
    from sglang_dsv4.kernels.kv_format import Fp8EntryRows, Fp8KeyRows

    config = named_config(model)
    positions = torch.zeros(2, dtype=torch.int64)

    def step(dim: int, stored_as=None) -> DecodeInto:
        state = torch.zeros(3, 3, 3, dim)
        weights = CompressorWeights(
            torch.zeros(config.csa_rate, 2 * dim, dtype=dtype), torch.ones(dim, dtype=dtype), 1e-6,
            torch.ones(config.rope_head_dim // 2), config.csa_rate, True,
        )  # fmt: skip
        rows = torch.zeros(2, dtype=torch.int64)
        projections = torch.zeros(2, 2 * dim, dtype=dtype)
        records = DecodeRecords(state, state, rows)
        entries = torch.zeros(3, dim, dtype=dtype) if stored_as is None else stored_as.empty(3, "cpu")
        return DecodeInto(projections, projections, state, rows, weights, records, entries, rows, stored_as)

    before = len(hopper.compiled)
    compress_decode_pair_into(positions, step(config.head_dim), step(config.index_head_dim))
    entries_as, keys_as = Fp8EntryRows(config.head_dim, config.rope_head_dim), Fp8KeyRows(config.index_head_dim)
    compress_decode_pair_into(positions, step(config.head_dim, entries_as), step(config.index_head_dim, keys_as))
    assert_fits(hopper, before, 2)
    assert [name for name, _ in hopper.new_since(before)] == ["_compress_decode_pair"] * 2


@pytest.mark.parametrize("model", MODELS)
def test_chosen_entry_rows_fit(hopper, model):
    """The indexer's choice mapped to entry rows (integers only: no dtype to vary) at the config's top-k."""
    from sglang_dsv4.kernels.chosen_rows import chosen_entry_rows

    config = named_config(model)
    before = len(hopper.compiled)
    table = torch.zeros(3, 8193, dtype=torch.int64)
    chosen_entry_rows(table, torch.tensor([1, 2]), torch.zeros(2, config.index_topk, dtype=torch.int64))
    assert_fits(hopper, before, 1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("model", MODELS)
def test_mhc_fits_in_every_dtype(hopper, model, dtype):
    from sglang_dsv4.kernels.mhc import MixingWeights, fused_post, fused_post_pre

    config = named_config(model)
    streams, hidden = config.hc_mult, config.hidden_size
    mixing = MixingWeights(
        torch.zeros((2 + streams) * streams, streams * hidden),
        torch.zeros((2 + streams) * streams),
        torch.ones(3),
        config.hc_sinkhorn_iters,
        config.hc_eps,
        config.rms_norm_eps,
    )
    tokens = 2
    output, state = torch.zeros(tokens, hidden, dtype=dtype), torch.zeros(tokens, streams, hidden, dtype=dtype)
    post, comb = torch.zeros(tokens, streams), torch.zeros(tokens, streams, streams)
    before = len(hopper.compiled)
    fused_post_pre(output, state, post, comb, mixing, torch.ones(hidden, dtype=dtype), config.rms_norm_eps)
    fused_post(output, state, post, comb)
    assert_fits(hopper, before, 2)
