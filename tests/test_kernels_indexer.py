"""Indexer scoring and the exact top-k kernels against torch, under Triton's interpreter
(in a process of their own: see ``kernel_testing``).

Scores are compared with a float64 reference; top-k results must be exactly
``torch.topk``'s set (scores are random floats, so ties arise only where a case makes
them on purpose). Outputs start poisoned (NaN scores, ``-7`` slots), so an element no
kernel wrote shows up. Cases cover odd widths and lengths, empty rows and rows shorter
than k, every path of the select (kept candidates in registers or in several chunks,
and streaming the row when the threshold fails), and the temporal variant with a good,
a stale and a useless previous selection.
"""

from __future__ import annotations

import pytest
import torch
from kernel_testing import interpreted_only, launcher_only, poison_allocations, relative_error, run_under_interpreter

from sglang_dsv4.config import parse_config
from sglang_dsv4.kernels.kv_format import REFERENCE_KEY_ROW_ALIGNMENT, Fp8KeyRows
from sglang_dsv4.model.indexer import Indexer
from sglang_dsv4.model.rope import ForwardRope, Rotary
from sglang_dsv4.tiny import TINY_CONFIG

UNWRITTEN = -7


@launcher_only
def test_indexer_kernels_under_the_interpreter():
    run_under_interpreter(__file__)


@pytest.fixture(scope="module")
def indexer():
    from sglang_dsv4.kernels import indexer

    return indexer


@pytest.fixture(scope="module")
def topk():
    from sglang_dsv4.kernels import topk

    return topk


@pytest.fixture
def poisoned(monkeypatch):
    """NaN floats (``new_empty`` / ``empty_like``) and ``UNWRITTEN`` ints (``torch.empty``) in every new tensor."""
    poison_allocations(monkeypatch)
    empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        tensor = empty(*args, **kwargs)
        return tensor.fill_(float("nan") if tensor.is_floating_point() else UNWRITTEN)

    monkeypatch.setattr(torch, "empty", poisoned_empty)


def assert_same_sets(chosen: torch.Tensor, scores: torch.Tensor, lengths: torch.Tensor, k: int) -> None:
    """Row by row: the chosen slots are distinct, visible, as many as ``min(k, length)`` and the top ones."""
    assert not (chosen == UNWRITTEN).any(), "an output slot was never written"
    for row in range(chosen.shape[0]):
        count = min(k, int(lengths[row]))
        picked = chosen[row, :count].long()
        assert (chosen[row, count:] == -1).all()
        assert len(set(picked.tolist())) == count and (picked >= 0).all() and (picked < lengths[row]).all()
        expected = scores[row, : int(lengths[row])].topk(count).values
        assert torch.equal(scores[row, picked].sort().values, expected.sort().values)


# rows, heads, dim, pool rows, width, dtype, with a table
SCORE_CASES = [(3, 32, 32, 50, 41, torch.float32, True), (4, 20, 64, 300, 257, torch.bfloat16, True)]


@interpreted_only
@pytest.mark.parametrize("rows, heads, dim, pool_rows, width, dtype, with_table", SCORE_CASES)
def test_scores_match_float64_reference(indexer, poisoned, rows, heads, dim, pool_rows, width, dtype, with_table):
    generator = torch.Generator().manual_seed(rows * 1000 + width)
    q = torch.randn(rows, heads, dim, generator=generator).to(dtype)
    weights = torch.randn(rows, heads, generator=generator)
    keys = torch.randn(pool_rows, dim, generator=generator).to(dtype)
    table = torch.randint(0, pool_rows, (rows, width), generator=generator, dtype=torch.int32)
    lengths = torch.randint(1, width, (rows,), generator=generator, dtype=torch.int32)
    lengths[0], lengths[-1] = 0, width

    scores = indexer.index_scores(q, weights, keys, lengths, scale=dim**-0.5, table=table)

    expected = indexer.index_scores_reference(
        q.double(), weights.double(), keys.double(), lengths, scale=dim**-0.5, table=table
    )
    visible = torch.isfinite(expected)
    assert torch.equal(torch.isneginf(scores), ~visible)
    assert relative_error(scores[visible], expected[visible]) < 1e-5


@interpreted_only
@pytest.mark.parametrize(
    ("dim", "dtype", "alignment"),
    [(32, torch.float32, 16), (256, torch.float32, 16), (64, torch.bfloat16, 16), (128, torch.float32, 4)],
)
def test_scores_of_fp8_key_rows_dequantized_in_the_kernel_match_the_reference(
    indexer, poisoned, dim, dtype, alignment
):
    """FP8 key rows (one float32 scale per 128 values: two blocks at 256), padded to 16-byte rows as the pools
    store them or as the reference's 4-byte ones, against the torch scores of the same rows, decoded."""
    generator = torch.Generator().manual_seed(dim)
    rows, heads, pool_rows, width = 3, 32, 60, 41
    row_format = Fp8KeyRows(dim, alignment)
    q = torch.randn(rows, heads, dim, generator=generator).to(dtype)
    weights = torch.randn(rows, heads, generator=generator)
    values = torch.randn(pool_rows, dim, generator=generator) * torch.logspace(-3, 2, pool_rows)[:, None]
    keys = row_format.encode(values)
    table = torch.randint(0, pool_rows, (rows, width), generator=generator, dtype=torch.int32)
    lengths = torch.tensor([0, 17, width], dtype=torch.int32)

    scores = indexer.index_scores(q, weights, keys, lengths, scale=dim**-0.5, table=table, keys_format=row_format)

    decoded = row_format.decode(keys, torch.float64)
    expected = indexer.index_scores_reference(
        q.double(), weights.double(), decoded, lengths, scale=dim**-0.5, table=table
    )
    visible = torch.isfinite(expected)
    assert torch.equal(torch.isneginf(scores), ~visible)
    assert relative_error(scores[visible], expected[visible]) < (1e-5 if dtype == torch.float32 else 1e-2)


@interpreted_only
@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64])
def test_scores_through_table_rows_equal_the_scores_of_the_gathered_table(indexer, poisoned, table_dtype):
    """Each row reading its request's table row where it lies (``table_row``; the served table is int64) scores as
    the same rows gathered into a table of its own."""
    generator = torch.Generator().manual_seed(11)
    q, weights = torch.randn(5, 16, 32, generator=generator), torch.randn(5, 16, generator=generator)
    keys = torch.randn(90, 32, generator=generator)
    table = torch.randint(0, 90, (3, 70), generator=generator).to(table_dtype)
    table_row = torch.tensor([2, 0, 2, 1, 0])
    lengths = torch.tensor([70, 0, 33, 1, 69], dtype=torch.int32)
    gathered = table[table_row].to(torch.int32)
    by_row = indexer.index_scores(q, weights, keys, lengths, scale=0.2, table=table, table_row=table_row)
    assert torch.equal(by_row, indexer.index_scores(q, weights, keys, lengths, scale=0.2, table=gathered))


@interpreted_only
def test_scores_without_a_table_read_the_pool_in_order(indexer):
    generator = torch.Generator().manual_seed(3)
    q, weights = torch.randn(2, 16, 32, generator=generator), torch.randn(2, 16, generator=generator)
    keys = torch.randn(37, 32, generator=generator)
    lengths = torch.tensor([37, 20], dtype=torch.int32)
    in_order = torch.arange(37, dtype=torch.int32).expand(2, -1).contiguous()
    plain = indexer.index_scores(q, weights, keys, lengths, scale=0.2)
    assert torch.equal(plain, indexer.index_scores(q, weights, keys, lengths, scale=0.2, table=in_order))


@interpreted_only
@pytest.mark.parametrize("magnitude", [1e-7, 1.0, 3e6])
def test_scores_of_fp8_keys_against_bf16_queries_in_fp16_operands(indexer, poisoned, magnitude):
    """bf16 queries over FP8 keys go through fp16 operands, each query row scaled by a power of two into fp16's
    range: exact operands, so the scores are the float64 reference's to float32 accumulation, at query magnitudes
    that would underflow or overflow fp16 unscaled (a component spread of 2**-12 within each row)."""
    generator = torch.Generator().manual_seed(int(magnitude * 1e7) % 1000)
    rows, heads, dim, pool_rows, width = 3, 16, 128, 50, 37
    row_format = Fp8KeyRows(dim)
    spread = torch.exp2(-12 * torch.rand(rows, heads, dim, generator=generator))
    q = (torch.randn(rows, heads, dim, generator=generator) * spread * magnitude).to(torch.bfloat16)
    weights = torch.randn(rows, heads, generator=generator)
    keys = row_format.encode(torch.randn(pool_rows, dim, generator=generator))
    table = torch.randint(0, pool_rows, (rows, width), generator=generator, dtype=torch.int32)
    lengths = torch.tensor([width, 20, 0], dtype=torch.int32)

    scores = indexer.index_scores(q, weights, keys, lengths, scale=dim**-0.5, table=table, keys_format=row_format)

    decoded = row_format.decode(keys, torch.float64)
    expected = indexer.index_scores_reference(
        q.double(), weights.double(), decoded, lengths, scale=dim**-0.5, table=table
    )
    visible = torch.isfinite(expected)
    assert torch.equal(torch.isneginf(scores), ~visible)
    assert relative_error(scores[visible], expected[visible]) < 1e-5


# rows, width, k: short rows, rows shorter than k, widths past the sample and past one keeping block
TOPK_CASES = [(3, 50, 7), (4, 5003, 16), (2, 20011, 40), (3, 9000, 600)]


@interpreted_only
@pytest.mark.parametrize("rows, width, k", TOPK_CASES)
def test_top_k_is_torch_topk(topk, poisoned, rows, width, k):
    generator = torch.Generator().manual_seed(width + k)
    scores = torch.randn(rows, width, generator=generator)
    lengths = torch.randint(0, width + 1, (rows,), generator=generator, dtype=torch.int32)
    lengths[0], lengths[-1] = width, min(k, width) - 1  # a full row and one shorter than k
    assert_same_sets(topk.top_k(scores, lengths, k), scores, lengths, k)


# rows, width, k: rows shorter than k, odd widths, and the decode step's rows at V4's k (8K and 128K contexts)
WHOLE_ROW_CASES = [(3, 50, 7), (4, 5003, 16), (2, 2049, 512), (2, 32769, 512)]


@interpreted_only
@pytest.mark.parametrize("rows, width, k", WHOLE_ROW_CASES)
def test_whole_row_top_k_is_torch_topk(topk, poisoned, rows, width, k):
    generator = torch.Generator().manual_seed(width + k + 1)
    scores = torch.randn(rows, width, generator=generator)
    lengths = torch.randint(0, width + 1, (rows,), generator=generator, dtype=torch.int32)
    lengths[0], lengths[-1] = width, min(k, width) - 1  # a full row and one shorter than k
    assert_same_sets(topk.whole_row_top_k(scores, lengths, k), scores, lengths, k)


@interpreted_only
def test_whole_row_top_k_stopping_at_a_digit_every_key_of_which_is_taken(topk, poisoned):
    """Rows whose select stops early at different digits (150 each of 0, 1, 2 and 3: at k = 150 and 300 it stops
    on a prefix that is a taken score's whole key; clusters straddling the cut; the cut inside a run of equal
    scores) and rows whose only stop would be under the least key there is (scores near ``-float32 max``, the row
    no longer than k): still exactly ``torch.topk``'s set."""
    generator = torch.Generator().manual_seed(21)
    rows = [
        torch.arange(600)[torch.randperm(600, generator=generator)].div(150, rounding_mode="floor").float(),  # 0-3
        torch.randn(600, generator=generator).round(decimals=1),  # clusters of equal scores
        torch.cat([torch.full((300,), 0.5), torch.randn(300, generator=generator)]),  # the cut in a run
        torch.cat([torch.tensor([5.0, -3e38, -3e38]), torch.full((597,), float("nan"))]),  # length 3, k >= 3
        torch.cat([torch.tensor([-3e38, 2.0, -3e38, -1e37]), torch.full((596,), float("nan"))]),
    ]
    scores = torch.stack(rows)
    lengths = torch.tensor([600, 600, 600, 3, 4], dtype=torch.int32)
    for k in (3, 4, 100, 150, 299, 300, 301):
        assert_same_sets(topk.whole_row_top_k(scores, lengths, k), scores, lengths, k)


@interpreted_only
@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64])
def test_whole_row_top_k_rows_write_the_tables_rows_at_the_chosen_slots(topk, poisoned, table_dtype):
    """The same select writing ``table[table_row[r], slot]`` and the count, rows shorter than k and empty ones
    among them."""
    generator = torch.Generator().manual_seed(4)
    rows, width, k = 5, 2049, 512
    scores = torch.randn(rows, width, generator=generator)
    lengths = torch.tensor([width, 0, 511, 512, 1700], dtype=torch.int32)
    table = torch.randint(0, 10**6, (3, width + 5), generator=generator).to(table_dtype)
    table_row = torch.tensor([1, 0, 2, 2, 0])
    chosen = topk.whole_row_top_k(scores, lengths, k)
    entry_rows, counts = topk.whole_row_top_k_rows(scores, lengths, k, table, table_row)
    assert_same_sets(chosen, scores, lengths, k)
    assert counts.dtype == torch.int32 and counts.tolist() == lengths.clamp(max=k).tolist()
    expected = torch.where(chosen >= 0, table[table_row[:, None], chosen.clamp(min=0).long()], -1).to(torch.int32)
    assert entry_rows.dtype == torch.int32 and torch.equal(entry_rows, expected)


@interpreted_only
def test_whole_row_top_k_of_equal_and_empty_rows(topk, poisoned):
    """Every score equal (k of the ties, distinct slots) and a row of length 0 (all -1)."""
    scores = torch.zeros(3, 3000)
    lengths = torch.tensor([3000, 2999, 0], dtype=torch.int32)
    assert_same_sets(topk.whole_row_top_k(scores, lengths, 16), scores, lengths, 16)


@interpreted_only
def test_whole_row_top_k_takes_the_earliest_ties_as_the_torch_paths_do(topk, poisoned):
    """Scores tied at the k-th place (the indexer's exact zeros): the decode select takes the same slots as the
    torch top-k of the CPU path and of the network (:func:`.sparse_torch.top_k_earliest_ties`), the earliest."""
    from sglang_dsv4.kernels.sparse_torch import top_k_earliest_ties

    generator = torch.Generator().manual_seed(9)
    scores = torch.randn(2, 300, generator=generator).relu()  # about half of each row exactly 0
    lengths = torch.tensor([300, 251], dtype=torch.int32)
    k = int((scores[:, :251] > 0).sum(-1).max()) + 20  # every row's k-th place is a tie at 0
    chosen = topk.whole_row_top_k(scores, lengths, k)
    visible = torch.arange(300)[None, :] < lengths[:, None]
    _, expected = top_k_earliest_ties(scores.masked_fill(~visible, float("-inf")), k)
    for mine, theirs in zip(chosen, expected, strict=True):
        assert sorted(mine.tolist()) == sorted(theirs.tolist())


@interpreted_only
def test_top_k_with_every_score_equal_takes_k_distinct_slots(topk, poisoned):
    scores = torch.zeros(2, 3000)
    lengths = torch.tensor([3000, 2999], dtype=torch.int32)
    assert_same_sets(topk.top_k(scores, lengths, 16), scores, lengths, 16)


@interpreted_only
def test_top_k_with_candidates_crowded_into_one_block(topk, poisoned):
    """Many high scores in one keeping block: the select reads its kept candidates in several chunks."""
    generator = torch.Generator().manual_seed(5)
    width = 300_000
    scores = torch.randn(1, width, generator=generator)
    scores[0, 1024 * 10 : 1024 * 10 + 200] += 6.0
    lengths = torch.tensor([width], dtype=torch.int32)
    assert_same_sets(topk.top_k(scores, lengths, 64), scores, lengths, 64)


def assert_earliest_ties(chosen: torch.Tensor, scores: torch.Tensor, lengths: torch.Tensor, k: int) -> None:
    """Row by row: the chosen slots are the torch top-k's with the earliest of equal scores
    (:func:`.sparse_torch.top_k_earliest_ties`), then ``-1``."""
    from sglang_dsv4.kernels.sparse_torch import top_k_earliest_ties

    assert not (chosen == UNWRITTEN).any(), "an output slot was never written"
    for row in range(chosen.shape[0]):
        length = int(lengths[row])
        count = min(k, length)
        assert (chosen[row, count:] == -1).all(), f"row {row}"
        _, expected = top_k_earliest_ties(scores[row : row + 1, :length], count)
        assert sorted(chosen[row, :count].tolist()) == sorted(expected[0].tolist()), f"row {row}"


def tied_rows(generator: torch.Generator, rows: int, width: int, k: int) -> torch.Tensor:
    """Rows that tie at the k-th place: small integers; ReLU'd scores with fewer than k positive (a tie at 0
    across the row); all equal; random floats with a run of equal high scores."""
    kinds = [
        torch.randint(0, 4, (width,), generator=generator).float(),
        torch.rand(width, generator=generator) * (torch.rand(width, generator=generator) < k / (3 * width)),
        torch.zeros(width),
        torch.cat([torch.randn(width // 2, generator=generator), torch.full((width - width // 2,), 9.0)]),
    ]
    return torch.stack([kinds[row % len(kinds)] for row in range(rows)])


# rows, width, k, the select's chunk, its candidate places (None: the shipped rule): past one chunk and within it;
# the candidates in registers, overflowing (a row of ties: the threshold is the k-th score) and fewer places than k
# (the select streams over the row); V4's k at a 128K row's width.
WIDE_ROW_CASES = [
    (4, 5003, 16, 4096, None),
    (4, 3001, 40, 256, None),
    (4, 3001, 24, 256, 16),
    (2, 3001, 300, 1024, None),
    (2, 32769, 512, 4096, None),
]


@interpreted_only
@pytest.mark.parametrize("rows, width, k, chunk, candidates", WIDE_ROW_CASES)
def test_wide_row_top_k_takes_the_earliest_ties(topk, poisoned, monkeypatch, rows, width, k, chunk, candidates):
    """The wide-row select on random rows (rows shorter than k, empty) and on rows built to tie: the torch top-k's
    choice with the earliest of equal scores, on every path."""
    monkeypatch.setattr(topk, "WIDE_CHUNK", chunk)
    if candidates is not None:
        shape = topk.wide_row_shape
        monkeypatch.setattr(topk, "wide_row_shape", lambda k: (shape(k)[0], candidates))
    generator = torch.Generator().manual_seed(width + k)
    scores = torch.cat([torch.randn(rows, width, generator=generator), tied_rows(generator, rows, width, k)])
    lengths = torch.randint(k, width + 1, (2 * rows,), generator=generator, dtype=torch.int32)
    lengths[0], lengths[1], lengths[rows] = width, min(k, width) - 1, width
    if rows > 2:
        lengths[2] = 0
    assert_earliest_ties(topk.wide_row_top_k(scores, lengths, k), scores, lengths, k)


@interpreted_only
@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64])
def test_wide_row_top_k_rows_write_the_tables_rows_at_the_chosen_slots(topk, poisoned, monkeypatch, table_dtype):
    """The wide-row select writing ``table[table_row[r], slot]`` and the count, through each of its paths."""
    monkeypatch.setattr(topk, "WIDE_CHUNK", 512)
    generator = torch.Generator().manual_seed(6)
    width, k = 2049, 64
    scores = torch.cat([torch.randn(3, width, generator=generator), tied_rows(generator, 4, width, k)])
    lengths = torch.tensor([width, 0, 63, width, width, 2000, 1999], dtype=torch.int32)
    table = torch.randint(0, 10**6, (3, width + 5), generator=generator).to(table_dtype)
    table_row = torch.tensor([1, 0, 2, 2, 0, 1, 1])
    chosen = topk.wide_row_top_k(scores, lengths, k)
    entry_rows, counts = topk.wide_row_top_k_rows(scores, lengths, k, table, table_row)
    assert_earliest_ties(chosen, scores, lengths, k)
    assert counts.dtype == torch.int32 and counts.tolist() == lengths.clamp(max=k).tolist()
    expected = torch.where(chosen >= 0, table[table_row[:, None], chosen.clamp(min=0).long()], -1).to(torch.int32)
    assert entry_rows.dtype == torch.int32 and torch.equal(entry_rows, expected)


@interpreted_only
def test_three_launch_and_temporal_top_k_take_the_earliest_ties(topk, poisoned):
    """The three-launch top-k and its temporal variant on rows built to tie (within one keeping block's segment,
    and crowded into one block so that the select reads its candidates in several chunks): the earliest ties."""
    generator = torch.Generator().manual_seed(8)
    rows, width, k = 4, 5003, 16
    scores = tied_rows(generator, rows, width, k)
    lengths = torch.tensor([width, width - 7, 4000, width], dtype=torch.int32)
    assert_earliest_ties(topk.top_k(scores, lengths, k), scores, lengths, k)
    previous = topk.top_k_reference(torch.randn(rows, width, generator=generator), lengths, k)
    assert_earliest_ties(topk.temporal_top_k(scores, lengths, k, previous), scores, lengths, k)
    crowded = torch.randn(1, 300_000, generator=generator)
    crowded[0, 1024 * 11 - 124 : 1024 * 11 + 76] = 6.0  # 200 equal scores over two keeping blocks, the top 100 ...
    lengths = torch.tensor([300_000], dtype=torch.int32)  # ... all in the first
    assert_earliest_ties(topk.top_k(crowded, lengths, 100), crowded, lengths, 100)


@interpreted_only
@pytest.mark.parametrize("previous_kind", ["last step", "stale", "useless"])
def test_temporal_top_k_is_torch_topk_whatever_the_previous_selection(topk, poisoned, previous_kind):
    generator = torch.Generator().manual_seed(len(previous_kind))
    rows, width, k = 3, 12001, 32
    before = torch.randn(rows, width, generator=generator)
    lengths = torch.tensor([width, width - 4, 30], dtype=torch.int32)
    previous = topk.top_k_reference(before, lengths - 1, k)
    if previous_kind == "stale":
        previous = topk.top_k_reference(torch.randn(rows, width, generator=generator), lengths, k)
    elif previous_kind == "useless":
        previous = torch.full((rows, k), -1, dtype=torch.int32)
    scores = before + 0.1 * torch.randn(rows, width, generator=generator)
    assert_same_sets(topk.temporal_top_k(scores, lengths, k, previous), scores, lengths, k)


def force_top_k(indexer, monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """Make :func:`exact_top_k` take ``path`` at any size: ``whole_row``, ``wide_row`` or ``three_launch``."""
    if path != "whole_row":
        monkeypatch.setattr(indexer, "WHOLE_ROW_TOP_K_MAX_WIDTH", -1)
    if path == "three_launch":
        monkeypatch.setattr(indexer, "WIDE_ROW_TOP_K_MAX_WIDTH", -1)


@interpreted_only
@pytest.mark.parametrize("path", ["whole_row", "wide_row", "three_launch"])
def test_network_selection_matches_the_models_torch_path(indexer, monkeypatch, path):
    """``select_visible`` (what the indexer runs on CUDA), through each Triton top-k, against ``Indexer.select``."""
    config = parse_config(dict(TINY_CONFIG))
    module = Indexer(config, Rotary(config.rope_head_dim, config.compress_rope_theta, config.yarn))
    generator = torch.Generator().manual_seed(13)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    length = 9
    positions = torch.arange(200, 200 + length)
    x = torch.randn(length, config.hidden_size, generator=generator)
    q_residual = torch.randn(length, config.q_lora_rank, generator=generator)
    state = module.compressor.new_state(torch.float32, "cpu")
    state.entries = torch.randn(60, config.index_head_dim, generator=generator)
    visible = torch.arange(60)[None, :] < torch.tensor([10, 14, 17, 22, 30, 41, 49, 55, 60])[:, None]
    force_top_k(indexer, monkeypatch, path)

    with torch.no_grad():
        rope = ForwardRope.at(positions, (module.rotary,))
        q, head_weights = module.queries(x, q_residual, rope)
        chosen = indexer.select_visible(
            q, head_weights, state.entries, visible, module.topk, scale=module.head_dim**-0.5
        )
        expected = module.select(x, q_residual, rope, state, visible)
    assert visible.sum(-1).max() > module.topk
    assert torch.equal(chosen, expected)


@interpreted_only
# One row tile, and two (the second partial); each tile's top-k by the whole-row select (the rule at these
# widths), or forced: the wide-row select, the three-launch Triton top-k.
@pytest.mark.parametrize(
    "rows,k,top_k_path,fp8_keys",
    [
        (7, 6, "whole_row", False),
        (300, 4, "whole_row", False),
        (7, 6, "wide_row", False),
        (300, 4, "wide_row", False),
        (7, 6, "three_launch", False),
        (7, 6, "whole_row", True),
    ],
)
def test_batched_chosen_entries_kernel_path_equals_the_streamed_torch_top_k(
    indexer, monkeypatch, rows, k, top_k_path, fp8_keys, poisoned
):
    """:func:`.dispatch.chosen_entries_triton` (scores read through the requests' int64 table, the top-k written as
    entry rows) against the CPU path: the streamed torch top-k, its blocks mapped through the table."""
    from sglang_dsv4.kernels import sparse_torch
    from sglang_dsv4.kernels.dispatch import chosen_entries_triton

    force_top_k(indexer, monkeypatch, top_k_path)

    heads, dim, pool_rows, blocks = 8, 32, 100, 37
    torch.manual_seed(rows)
    # Distinct pool rows within a table row: no equal scores, whose order at the k-th place is not set.
    keys = torch.randn(pool_rows, dim)
    table = torch.stack([torch.randperm(pool_rows)[:blocks] for _ in range(3)])
    table_row = torch.randint(0, 3, (rows,))
    lengths = torch.randint(0, blocks + 1, (rows,)).int()
    lengths[:4] = torch.tensor([0, 1, k, blocks], dtype=torch.int32)  # empty, shorter than k, exactly k, full
    q, weights = torch.randn(rows, heads, dim), torch.rand(rows, heads)
    keys_format = Fp8KeyRows(dim) if fp8_keys else None  # the pool's rows FP8: both paths read them decoded
    args = (q, weights, keys if keys_format is None else keys_format.encode(keys), table, table_row, lengths, k)
    entry_rows, counts = chosen_entries_triton(*args, scale=0.2, keys_format=keys_format)
    chosen = sparse_torch.streamed_top_k(*args, scale=0.2, keys_format=keys_format)
    expected_rows, expected_counts = sparse_torch.chosen_entry_rows(table, table_row, chosen)
    assert entry_rows.dtype == counts.dtype == torch.int32 and entry_rows.shape == expected_rows.shape
    assert torch.equal(counts, expected_counts)
    for row, count in enumerate(counts.tolist()):
        assert sorted(entry_rows[row, :count].tolist()) == sorted(expected_rows[row, :count].tolist()), f"row {row}"
