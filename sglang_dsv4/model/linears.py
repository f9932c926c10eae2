"""How the network builds its projections: whole on one process, or split over tensor-parallel ranks.

The network (:class:`~.network.DeepseekV4`) asks a :class:`Layers` for every projection by
its role, and never looks at the rank itself:

* ``replicated``: the whole weight on every rank (``wq_a``, ``wkv``, the indexer's ``wq_b``);
* ``column``: output rows split over the ranks, each computing its own slice (``wq_b``'s
  query heads, ``wo_a``'s output groups, the shared expert's ``w1`` / ``w3``);
* ``row``: input columns split, each rank producing a partial sum of the whole output
  (``wo_b``, the shared expert's ``w2``), summed once per sublayer where the mHC residual
  takes it (:class:`~.network.Residual`);
* ``sharded``: a parameter cut by its first dimension (the attention sinks, by head);
* ``embedding`` and ``head``: the vocabulary.

:class:`WholeLayers` is the torch reference (one process, plain ``nn.Linear``); the
served model passes SGLang's parallel layers (:mod:`.sglang_layers`). Every module's
parameter names are the release checkpoint's.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn


class Layers(Protocol):
    tp_size: int

    def replicated(self, inputs: int, outputs: int, name: str) -> nn.Module: ...

    def column(self, inputs: int, outputs: int, name: str, quantized: bool = True) -> nn.Module:
        """``quantized=False``: held in the model dtype whatever the checkpoint's quantization
        (a weight read directly, not through the layer's forward)."""
        ...

    def row(self, inputs: int, outputs: int, name: str) -> nn.Module: ...

    def sharded(self, size: int) -> nn.Parameter: ...

    def embedding(self, vocab: int, hidden: int, name: str) -> nn.Module: ...

    def head(self, vocab: int, hidden: int, name: str) -> nn.Module: ...


class WholeLayers:
    """Every weight whole in one process: ``nn.Linear`` / ``nn.Embedding``, nothing to reduce."""

    tp_size = 1

    def replicated(self, inputs: int, outputs: int, name: str) -> nn.Module:
        return nn.Linear(inputs, outputs, bias=False)

    def column(self, inputs: int, outputs: int, name: str, quantized: bool = True) -> nn.Module:
        return nn.Linear(inputs, outputs, bias=False)

    row = replicated

    def head(self, vocab: int, hidden: int, name: str) -> nn.Module:
        return nn.Linear(hidden, vocab, bias=False)

    def sharded(self, size: int) -> nn.Parameter:
        return nn.Parameter(torch.zeros(size))

    def embedding(self, vocab: int, hidden: int, name: str) -> nn.Module:
        return nn.Embedding(vocab, hidden)
