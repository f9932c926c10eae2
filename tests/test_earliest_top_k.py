"""The CPU indexer's exact top-k (:mod:`sglang_dsv4.kernels.sparse_torch`) against an independent oracle: each row's
slots sorted by ``(-score, slot)`` in Python, the first ``k`` taken — the k largest, the earliest of equal scores,
best first. Inputs are built to tie: small integer scores, all-equal rows, ties across the k-th place, rows shorter
than k, masked (``-inf``) slots."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_dsv4.kernels import sparse_torch
from sglang_dsv4.kernels.sparse_torch import earliest_top_k_slots, streamed_top_k, top_k_earliest_ties

MASKED = -math.inf


def best_first_by_sort(row: list[float], k: int) -> list[int]:
    """The first ``k`` slots of ``row`` in the order ``(-score, slot)``: the oracle."""
    return sorted(range(len(row)), key=lambda slot: (-row[slot], slot))[:k]


# Scores from a handful of values (ties everywhere), now and then masked; some rows all one value.
tied_rows = st.integers(0, 40).flatmap(
    lambda width: st.lists(
        st.one_of(
            st.lists(st.sampled_from([0.0, 1.0, 2.0, 3.0, MASKED]), min_size=width, max_size=width),
            st.sampled_from([0.0, MASKED]).map(lambda value: [value] * width),
        ),
        min_size=1,
        max_size=5,
    )
)


@settings(max_examples=300, deadline=None)
@given(rows=tied_rows, k=st.integers(0, 45))
def test_top_k_earliest_ties_equals_a_sort_by_score_then_slot(rows, k):
    scores = torch.tensor(rows, dtype=torch.float32).view(len(rows), -1)
    values, slots = top_k_earliest_ties(scores, k)
    for row, row_values, row_slots in zip(rows, values.tolist(), slots.tolist(), strict=True):
        expected = best_first_by_sort(row, k)
        assert row_slots == expected
        assert row_values == [row[slot] for slot in expected]


@settings(max_examples=300, deadline=None)
@given(rows=tied_rows, k=st.integers(0, 45))
def test_earliest_top_k_slots_are_the_sorts_choice_in_slot_order(rows, k):
    scores = torch.tensor(rows, dtype=torch.float32).view(len(rows), -1)
    chosen = earliest_top_k_slots(scores, k)
    assert chosen.dtype == torch.int64 and chosen.shape == (len(rows), min(k, scores.shape[1]))
    for row, row_slots in zip(rows, chosen.tolist(), strict=True):
        assert row_slots == sorted(best_first_by_sort(row, k))


def test_earliest_top_k_slots_ranks_nan_above_every_number_as_the_stable_sort_does():
    nan, inf = math.nan, math.inf
    scores = torch.tensor([[1.0, nan, 1.0, inf, nan, 1.0], [2.0, 2.0, 0.0, 1.0, 2.0, 0.0]])
    expected = scores.argsort(dim=-1, descending=True, stable=True)[:, :3].sort(dim=-1).values
    assert torch.equal(earliest_top_k_slots(scores, 3), expected)
    assert earliest_top_k_slots(scores, 3).tolist() == [[1, 3, 4], [0, 1, 4]]


@settings(max_examples=150, deadline=None)
@given(
    pool_values=st.lists(st.integers(-2, 3), min_size=1, max_size=60),
    requests=st.lists(st.tuples(st.integers(0, 60), st.integers(1, 3)), min_size=1, max_size=4),
    k=st.integers(1, 20),
    key_tile=st.sampled_from([1, 3, 7, 1024]),
    seed=st.integers(0, 2**16),
)
def test_streamed_top_k_equals_a_sort_by_score_then_slot(pool_values, requests, k, key_tile, seed):
    """Tiles of any width merged into the running top-k keep the earliest of equal scores and the best first:
    one head, one nonzero dimension, so a key's score is ``ReLU(its value)`` exactly, ties wherever values repeat
    or are negative (score 0). Each request reads its own permutation of the pool (its table row) up to its length,
    with one or more query rows."""
    generator = torch.Generator().manual_seed(seed)
    width = max(length for length, _ in requests)
    keys = torch.zeros(len(pool_values), 2)
    keys[:, 0] = torch.tensor(pool_values, dtype=torch.float32)
    table = torch.stack([torch.randint(0, len(pool_values), (width,), generator=generator) for _ in requests])
    table_row = torch.tensor([request for request, (_, queries) in enumerate(requests) for _ in range(queries)])
    lengths = torch.tensor([requests[request][0] for request in table_row.tolist()], dtype=torch.int32)
    q = torch.tensor([1.0, 0.0]).expand(len(table_row), 1, 2)
    weights = torch.ones(len(table_row), 1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sparse_torch, "KEY_TILE", key_tile)
        chosen = streamed_top_k(q, weights, keys, table, table_row, lengths, k, scale=1.0)
    for row, request in enumerate(table_row.tolist()):
        length = requests[request][0]
        row_scores = [max(pool_values[slot], 0) * 1.0 for slot in table[request, :length].tolist()]
        expected = best_first_by_sort(row_scores, k)
        assert chosen[row].tolist() == expected + [-1] * (k - len(expected)), row
