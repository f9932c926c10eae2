"""The pool rows of an indexer's choice, in one launch: what a ratio-4 layer's attention reads.

Token ``t`` chose blocks ``chosen[t, :]`` (best first, then -1); its request's entry-table row is
``table[table_row[t]]``. Its selection is the entry rows of the chosen blocks, ``table[table_row[t], chosen[t, j]]``
as int32 (``table[table_row[t], 0]`` past the choice, never read), and how many it chose. The torch path,
:func:`.sparse_torch.chosen_entry_rows`, takes five launches for the same (clamp, gather, compare, count, cast).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def chosen_entry_rows(
    table: torch.Tensor, table_row: torch.Tensor, chosen: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows [tokens, k] int32, counts [tokens] int32)``, as :func:`.sparse_torch.chosen_entry_rows`."""
    tokens, k = chosen.shape
    rows = torch.empty(tokens, k, dtype=torch.int32, device=chosen.device)
    counts = torch.empty(tokens, dtype=torch.int32, device=chosen.device)
    if tokens == 0:
        return rows, counts
    _chosen_rows_kernel[(tokens,)](
        table, table.stride(0), table_row, chosen, chosen.stride(0), rows, counts,
        K=k, BLOCK=triton.next_power_of_2(k), num_warps=4,
    )  # fmt: skip
    return rows, counts


@triton.jit
def _chosen_rows_kernel(
    table_ptr, table_stride, table_row_ptr, chosen_ptr, chosen_stride, rows_ptr, counts_ptr,
    K: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    j = tl.arange(0, BLOCK)
    inside = j < K
    choice = tl.load(chosen_ptr + t.to(tl.int64) * chosen_stride + j, mask=inside, other=-1)
    table_row = tl.load(table_row_ptr + t).to(tl.int64)
    rows = tl.load(table_ptr + table_row * table_stride + tl.maximum(choice, 0), mask=inside, other=0)
    tl.store(rows_ptr + t.to(tl.int64) * K + j, rows.to(tl.int32), mask=inside)
    tl.store(counts_ptr + t, tl.sum((choice >= 0).to(tl.int32), 0))
