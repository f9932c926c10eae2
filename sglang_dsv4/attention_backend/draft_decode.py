"""The MTP layer's draft steps under SGLang's EAGLE (topk 1): a chain of one-token forwards on a copy of its state.

SGLang's draft worker runs ``speculative_num_steps - 1`` decode forwards of the draft model after the draft
extend gave the first draft: step ``i`` reads draft ``i + 1`` at position ``P + i`` (``P``: the request's
position, whose token the target has not read yet) with the previous step's streams. It calls
:meth:`DraftDecodeBackend.init_forward_metadata` once, then runs step ``i`` with
``attn_backends[i]`` as the forward's backend.

The steps' tokens are guesses the verify may reject, so they write nothing to the pool: each request's MTP
layer state at ``P`` is loaded from the pool once (at the first step) and advanced by the steps in that copy
(what :func:`sglang_dsv4.model.speculative.speculative_decode` drafts on). The draft extend after the verify
writes the accepted positions' rows (:func:`~.torch_reference.request_spans`).
"""

from __future__ import annotations

import torch
from sglang.srt.model_executor.forward_batch_info import ForwardBatch

from ..model.attention import Attention
from ..model.state import LayerState
from .pool_bound import V4PoolBackend


class DraftDecodeBackend(V4PoolBackend):
    """SGLang's multi-step draft backend: the chain's steps, sharing one copy of each request's state."""

    name = "dsv4_draft_decode"

    def __init__(self, model_runner, steps: int):
        super().__init__(model_runner)
        self.attn_backends = [DraftStep(model_runner, self, step) for step in range(steps - 1)]
        self.requests: list[tuple[int, int]] = []
        self.states: list[LayerState] = []

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """A new chain: each request's row and position ``P``; its state is loaded at the first step."""
        self.requests = list(
            zip(forward_batch.req_pool_indices.tolist(), forward_batch.positions.tolist(), strict=True)
        )
        self.states = []

    def attend(
        self, attention: Attention, layer: int, x: torch.Tensor, forward_batch: ForwardBatch, step: int = 0
    ) -> torch.Tensor:
        """Step ``step``'s attention output ``[requests, hidden]``, one token per request at ``P + step``."""
        if step == 0:
            storage = self.token_to_kv_pool.storage
            self.states = [storage.load(layer, row, start, x.dtype) for row, start in self.requests]
        out = torch.zeros_like(x)
        for i, ((_, start), state) in enumerate(zip(self.requests, self.states, strict=True)):
            out[i : i + 1] = attention(x[i : i + 1], start + step, state)
        return out


class DraftStep(V4PoolBackend):
    """Step ``step`` of the chain, as the forward's attention backend."""

    name = "dsv4_draft_step"

    def __init__(self, model_runner, chain: DraftDecodeBackend, step: int):
        super().__init__(model_runner)
        self.chain, self.step = chain, step

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Nothing per step: the chain's metadata is set once for every step."""

    def attend(self, attention: Attention, layer: int, x: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        return self.chain.attend(attention, layer, x, forward_batch, self.step)
