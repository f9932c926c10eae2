"""Which rows of a KV pool each query reads: the index form every sparse attention here takes."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVSelection:
    """The rows of one KV pool that each query reads: ``pool[indices[r, :lengths[r]]]``.

    ``pool`` is ``[pool_rows, head_dim]``; ``indices`` ``[rows, width]`` int32 (entries
    past a row's length are never read); ``lengths`` ``[rows]`` int32.
    """

    pool: torch.Tensor
    indices: torch.Tensor
    lengths: torch.Tensor
