"""The batched attention backend SGLang calls: :mod:`.batched` driven by SGLang's forward batch.

``init_forward_metadata`` turns the forward batch into a :class:`~.batched.BatchPlan` (plain
rows, starts, lengths and the checkpoints the forward fills) and builds the forward's index
tensors once, on the device, from the device's request tables; every layer's
:meth:`BatchedBackend.attend` then runs the batched core. Every forward first brings the device's
request tables up to date (:meth:`~sglang_dsv4.memory_pool.request_tables.RequestTables.begin_forward`).

Decode in a CUDA graph goes through SGLang's graph hooks instead, in the order its decode graph
runner calls them: ``init_cuda_graph_state`` once, then per capture and per replay
``init_forward_metadata_out_graph`` (host: the request tables' changes and the pending checkpoints
to the device) and
``init_forward_metadata_in_graph`` (device only, recorded in the graph: the index of the padded
batch, from its ``req_pool_indices`` and ``seq_lens``, into buffers of stable address;
:class:`~.batched.DecodeGraphIndex`). Under speculation SGLang's runner captures the target's verify
batches instead (``--speculative-num-draft-tokens`` tokens per request from ``seq_lens``): the same hooks,
with :class:`~.batched.VerifyGraphIndex`, and in the graph each request's state copied to its first
rollback record before the layers (:meth:`~sglang_dsv4.memory_pool.storage.V4PoolStorage.begin_verify_rows`),
as :func:`rollback_snapshots` does eagerly.
"""

from __future__ import annotations

import torch
from sglang.srt.model_executor.forward_batch_info import ForwardBatch

from ..memory_pool.storage import V4PoolStorage
from ..model.attention import Attention
from ..prefix_cache.checkpoints import Checkpoints
from . import batched
from .pool_bound import V4PoolBackend
from .torch_reference import RequestSpan, request_spans

NAME = "dsv4_batched"


class BatchedBackend(V4PoolBackend):
    name = NAME

    def __init__(self, model_runner):
        super().__init__(model_runner)
        self.index: batched.ForwardIndex | None = None
        self.graph_index: batched.DecodeGraphIndex | batched.VerifyGraphIndex | None = None
        # The batch rows the spans cover, where they do not cover all (a draft-extend forward's accepted rows).
        self.covered: torch.Tensor | None = None

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        pool, storage = self.token_to_kv_pool, self.token_to_kv_pool.storage
        storage.tables.begin_forward()
        spans = request_spans(forward_batch)
        plan = batch_plan(pool.checkpoints, spans)
        mode = forward_batch.forward_mode
        if mode.is_target_verify():
            plan.snapshots.extend(rollback_snapshots(storage, spans))
        covered = covered_rows(spans, forward_batch.positions.shape[0])
        self.covered = None if covered is None else covered.to(storage.device)
        # Decode and verify batches run in CUDA graphs too: read as the graphs do, for the same floats. Other
        # forwards over FP8 rows decode the rows their tokens read once (batched.StagedEntries).
        graph_twin = mode.is_decode() or mode.is_target_verify()
        staged = storage.formats.quantized and not graph_twin
        tables, config = storage.tables.on_device, storage.config
        self.index = batched.build_index(plan, tables, config, storage.device, graph_twin, staged)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Buffers for graphs of up to ``max_bs`` requests of ``max_num_tokens // max_bs`` tokens each: one
        (decode) or the pool's verify tokens (SGLang captures only verify batches under speculation)."""
        storage = self.token_to_kv_pool.storage
        tables, config, device = storage.tables.on_device, storage.config, storage.device
        tokens_per_request = max_num_tokens // max_bs
        if tokens_per_request == 1:
            self.graph_index = batched.DecodeGraphIndex(max_bs, tables, config, device)
        elif tokens_per_request == storage.verify_tokens and max_num_tokens % max_bs == 0:
            self.graph_index = batched.VerifyGraphIndex(max_bs, tokens_per_request, tables, config, device)
        else:
            raise ValueError(
                f"{NAME}: CUDA graphs of {max_num_tokens} tokens for {max_bs} requests; this pool's graphs run one "
                f"token per request (decode) or {storage.verify_tokens} (a speculative verify)"
            )

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """Padded rows decode position 0 of request row 0, SGLang's padding row: every row they write is a
        padding row."""
        return self.get_cpu_graph_seq_len_fill_value()

    def init_forward_metadata_out_graph(self, forward_batch: ForwardBatch, in_capture: bool = False) -> None:
        pool = self.token_to_kv_pool
        pool.storage.tables.begin_forward()
        self._graph_index().stage_checkpoints(pool.checkpoints.pending)

    def init_forward_metadata_in_graph(self, forward_batch: ForwardBatch) -> None:
        self.covered = None
        graph_index, rows, seq_lens = self._graph_index(), forward_batch.req_pool_indices, forward_batch.seq_lens
        verify = forward_batch.forward_mode.is_target_verify()
        if verify != isinstance(graph_index, batched.VerifyGraphIndex):
            mode, graphs = forward_batch.forward_mode.name, type(graph_index).__name__
            raise RuntimeError(f"{NAME}: a {mode} batch in graphs of {graphs}")
        if not verify:
            self.index = graph_index.build(rows, seq_lens)
            return
        storage = self.token_to_kv_pool.storage
        rollback_records = storage.rollback_records(rows)
        storage.begin_verify_rows(rows, rollback_records[:, 0])
        self.index = graph_index.build(rows, seq_lens, rollback_records)

    def _graph_index(self) -> batched.DecodeGraphIndex | batched.VerifyGraphIndex:
        if self.graph_index is None:
            raise RuntimeError(f"{NAME}: a CUDA-graph metadata hook before init_cuda_graph_state")
        return self.graph_index

    def attend(self, attention: Attention, layer: int, x: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        """Attention output ``[tokens, hidden]`` of the batch's new tokens ``x [tokens, hidden]``.

        An idle DP rank's forward of no rows comes without ``init_forward_metadata``: it reads and writes nothing.
        """
        if x.shape[0] == 0:
            return torch.empty_like(x)
        if self.index is None:
            raise RuntimeError(f"{NAME}: attend before init_forward_metadata")
        storage = self.token_to_kv_pool.storage
        if self.covered is None:
            return attention.project_out(batched.attend(attention, layer, x, self.index, storage))
        out = torch.zeros_like(x)
        out[self.covered] = attention.project_out(
            batched.attend(attention, layer, x[self.covered], self.index, storage)
        )
        return out


def batch_plan(checkpoints: Checkpoints, spans: list[RequestSpan]) -> batched.BatchPlan:
    """The forward's requests and the checkpoints it fills, as plain values."""
    snapshots = [
        batched.Snapshot(i, checkpoint.position, checkpoint.record)
        for i, span in enumerate(spans)
        for checkpoint in checkpoints.between(span.row, span.start, span.start + span.length)
    ]
    return batched.BatchPlan([s.row for s in spans], [s.start for s in spans], [s.length for s in spans], snapshots)


def rollback_snapshots(storage: V4PoolStorage, spans: list[RequestSpan]) -> list[batched.Snapshot]:
    """A verify forward's rollback records: each request's state before it (copied now) and after each of its
    tokens but the last (filled by the forward)."""
    snapshots = []
    for i, span in enumerate(spans):
        storage.begin_verify(span.row)
        for offset in range(1, span.length):
            snapshots.append(batched.Snapshot(i, span.start + offset, storage.rollback_record(span.row, offset)))
    return snapshots


def covered_rows(spans: list[RequestSpan], tokens: int) -> torch.Tensor | None:
    """The batch rows the spans run, in order; None when they are all ``tokens`` rows."""
    if sum(span.length for span in spans) == tokens:
        return None
    return torch.cat([torch.arange(span.offset, span.offset + span.length) for span in spans])
