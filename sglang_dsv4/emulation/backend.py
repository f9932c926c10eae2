"""The attention backend under emulation: the batched backend's host work, no attention.

Before each forward SGLang has the backend read the batch (``init_forward_metadata``): the request tables
brought up to date, the forward's plan and checkpoints, its index tensors built. That is host work the
scheduler's thread does on a GPU too, so it runs as the batched backend runs it. The emulated model never calls
:meth:`EmulatedBackend.attend`: the rows have no width and there is nothing to attend to.
"""

from __future__ import annotations

from ..attention_backend.batched_backend import BatchedBackend

NAME = "dsv4_emulated"


class EmulatedBackend(BatchedBackend):
    name = NAME

    def attend(self, attention, layer, x, forward_batch):
        raise RuntimeError(f"{NAME}: an emulated forward attends to nothing (its model does not call attend)")
