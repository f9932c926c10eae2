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

In a CUDA graph the copy is the batched core's instead (:class:`~.batched.DraftChain`), through SGLang's graph
hooks in the order its draft graph runner calls them: ``init_cuda_graph_state`` once, then per capture and per
replay ``init_forward_metadata_out_graph`` (host: the request tables to the device) and
``init_forward_metadata_in_graph`` (device only, recorded in the graph: each request's window rows before ``P``
copied from the pool into scratch rows of fixed shape, and every step's index), before the steps run in the graph.
The scratch holds a window-only layer's state (the MTP layer's, as the releases have it): a compressed MTP layer
would read entries of blocks the steps complete from the pool, so its draft steps run eagerly only
(:func:`sglang_dsv4.speculation.check_speculation` refuses them where graphs are captured).
"""

from __future__ import annotations

import torch
from sglang.srt.model_executor.forward_batch_info import ForwardBatch

from ..model.attention import Attention
from ..model.state import LayerState
from . import batched
from .pool_bound import V4PoolBackend


class DraftDecodeBackend(V4PoolBackend):
    """SGLang's multi-step draft backend: the chain's steps, sharing one copy of each request's state."""

    name = "dsv4_draft_decode"

    def __init__(self, model_runner, steps: int):
        super().__init__(model_runner)
        self.attn_backends = [DraftStep(model_runner, self, step) for step in range(steps - 1)]
        self.requests: list[tuple[int, int]] = []
        self.states: list[LayerState] = []
        self.graph_chain: batched.DraftChain | None = None
        # The steps' indexes over the graph chain's scratch (None: the eager chain runs).
        self.step_indexes: list[batched.ForwardIndex] | None = None

    @property
    def layer(self) -> int:
        """The MTP layer's number in the pool (after the target's layers)."""
        return self.token_to_kv_pool.storage.config.num_layers

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """A new chain: each request's row and position ``P``; its state is loaded at the first step."""
        self.requests = list(
            zip(forward_batch.req_pool_indices.tolist(), forward_batch.positions.tolist(), strict=True)
        )
        self.states = []
        self.step_indexes = None

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Scratch rows and step indexes for graphs of up to ``max_bs`` requests, one draft each (topk 1)."""
        storage = self.token_to_kv_pool.storage
        kind = storage.config.layer_kind(self.layer)
        if max_num_tokens != max_bs or kind != "window":
            raise ValueError(
                f"{self.name}: CUDA graphs of the draft steps of a {kind} MTP layer, {max_num_tokens} tokens for "
                f"{max_bs} requests; they run a window-only MTP layer's chain, one token per request"
            )
        self.graph_chain = batched.DraftChain(
            max_bs, len(self.attn_backends), storage.config, storage.formats, storage.device
        )

    def init_forward_metadata_out_graph(self, forward_batch: ForwardBatch, in_capture: bool = False) -> None:
        """Host side: the device's request tables up to date (the rows before ``P`` that the graph copies)."""
        self.token_to_kv_pool.storage.tables.flush()

    def init_forward_metadata_in_graph(self, forward_batch: ForwardBatch) -> None:
        """Device side: the padded batch's window rows before ``P`` into the scratch, the steps' indexes."""
        if self.graph_chain is None:
            raise RuntimeError(f"{self.name}: a CUDA-graph metadata hook before init_cuda_graph_state")
        storage = self.token_to_kv_pool.storage
        self.step_indexes = self.graph_chain.begin(
            forward_batch.req_pool_indices,
            forward_batch.positions,
            storage.window[self.layer],
            storage.tables.on_device.window_table,
        )

    def attend(
        self, attention: Attention, layer: int, x: torch.Tensor, forward_batch: ForwardBatch, step: int = 0
    ) -> torch.Tensor:
        """Step ``step``'s attention output ``[requests, hidden]``, one token per request at ``P + step``."""
        if self.step_indexes is not None:
            index, scratch = self.step_indexes[step], self.graph_chain.storage
            return attention.project_out(batched.attend(attention, 0, x, index, scratch))
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

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """What SGLang's draft graph runner pads its batches with (:meth:`get_cpu_graph_seq_len_fill_value`)."""
        return self.get_cpu_graph_seq_len_fill_value()

    def attend(self, attention: Attention, layer: int, x: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        return self.chain.attend(attention, layer, x, forward_batch, self.step)
