"""Which rows of a KV pool each query reads: the index form every sparse attention here takes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv_format import RowFormat


@dataclass(frozen=True)
class KVSelection:
    """The rows of one KV pool that each query reads: ``pool[indices[r, :lengths[r]]]``.

    ``pool`` is ``[pool_rows, head_dim]``, or its rows stored in ``row_format`` (None: the rows are
    the values); ``indices`` ``[rows, width]`` int32 (entries past a row's length are never read);
    ``lengths`` ``[rows]`` int32.
    """

    pool: torch.Tensor
    indices: torch.Tensor
    lengths: torch.Tensor
    row_format: RowFormat | None = None


def read_rows(
    pool: torch.Tensor, indices: torch.Tensor, row_format: RowFormat | None, dtype: torch.dtype
) -> torch.Tensor:
    """The values ``[*indices.shape, dim]`` in ``dtype`` of rows ``pool[indices]`` stored in ``row_format``."""
    rows = pool[indices]
    if row_format is None:
        return rows.to(dtype)
    return row_format.decode(rows, dtype).view(*indices.shape, row_format.dim)
