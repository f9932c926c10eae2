"""The batched attention backend SGLang calls: :mod:`.batched` driven by SGLang's forward batch.

``init_forward_metadata`` turns the forward batch into a :class:`~.batched.BatchPlan` (plain
rows, starts, lengths and the checkpoints the forward fills) and builds the forward's index
tensors once; every layer's :meth:`BatchedBackend.attend` then runs the batched core.
"""

from __future__ import annotations

import torch
from sglang.srt.model_executor.forward_batch_info import ForwardBatch

from ..memory_pool.pool import V4KVPool
from ..model.attention import Attention
from . import batched
from .pool_bound import V4PoolBackend
from .torch_reference import request_spans

NAME = "dsv4_batched"


class BatchedBackend(V4PoolBackend):
    name = NAME

    def __init__(self, model_runner):
        super().__init__(model_runner)
        self.index: batched.ForwardIndex | None = None

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        pool = self.token_to_kv_pool
        plan = batch_plan(pool, forward_batch)
        self.index = batched.build_index(plan, pool.tables, pool.config, pool.device)

    def attend(self, attention: Attention, layer: int, x: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        """Attention output ``[tokens, hidden]`` of the batch's new tokens ``x [tokens, hidden]``."""
        if self.index is None:
            raise RuntimeError(f"{NAME}: attend before init_forward_metadata")
        if x.shape[0] == 0:
            return torch.empty_like(x)
        return attention.project_out(batched.attend(attention, layer, x, self.index, self.token_to_kv_pool))


def batch_plan(pool: V4KVPool, forward_batch: ForwardBatch) -> batched.BatchPlan:
    """The forward's requests and the checkpoints it fills, as plain values."""
    spans = request_spans(forward_batch)
    snapshots = [
        batched.Snapshot(i, checkpoint.position, checkpoint.record)
        for i, span in enumerate(spans)
        for checkpoint in pool.snapshots_between(span.request, span.start, span.start + span.length)
    ]
    return batched.BatchPlan([s.request for s in spans], [s.start for s in spans], [s.length for s in spans], snapshots)
