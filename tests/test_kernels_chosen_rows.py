"""The chosen entry rows in one launch (``kernels/chosen_rows.py``) against the torch path it replaces
(:func:`sglang_dsv4.kernels.sparse_torch.chosen_entry_rows`), under Triton's interpreter (in a process of its own:
see ``kernel_testing``)."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import interpreted_only, launcher_only, run_under_interpreter

from sglang_dsv4.kernels import sparse_torch


@launcher_only
def test_chosen_rows_kernel_under_the_interpreter():
    run_under_interpreter(__file__)


@interpreted_only
@pytest.mark.parametrize("k", [8, 12])
def test_chosen_rows_equal_the_torch_path(k):
    """Tokens of several requests (two sharing a table row), choices full, partial and empty, blocks in any order;
    ``k`` a power of two and not."""
    from sglang_dsv4.kernels.chosen_rows import chosen_entry_rows

    generator = torch.Generator().manual_seed(k)
    table = torch.randint(1, 10_000, (5, 40), generator=generator)
    table_row = torch.tensor([3, 0, 3, 4, 1])
    counts = [k, 3, 0, 1, k - 1]
    chosen = torch.full((5, k), -1, dtype=torch.int64)
    for token, count in enumerate(counts):
        chosen[token, :count] = torch.randperm(40, generator=generator)[:count]
    rows, selected = chosen_entry_rows(table, table_row, chosen)
    expected_rows, expected_selected = sparse_torch.chosen_entry_rows(table, table_row, chosen)
    assert rows.dtype == selected.dtype == torch.int32
    assert torch.equal(selected, expected_selected) and selected.tolist() == counts
    assert torch.equal(rows, expected_rows)
