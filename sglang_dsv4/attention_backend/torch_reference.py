"""The torch reference attention backend: every layer kind, prefill, extend and decode.

For each request of a batch it loads the layer's state at the request's position from
the V4 pool, runs the network's :class:`~sglang_dsv4.model.attention.Attention` on the
request's new tokens, and stores the advanced state back. Correct everywhere, fast
nowhere: the Triton kernels come behind the same :meth:`attend`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sglang.srt.model_executor.forward_batch_info import ForwardBatch

from ..model.attention import Attention
from .pool_bound import V4PoolBackend

NAME = "dsv4_torch"


@dataclass(frozen=True)
class RequestSpan:
    """One request's new tokens in a batch: its request row ``row`` (SGLang's ``req_pool_idx``) runs
    positions ``start ..``, forward rows ``offset .. offset + length``."""

    row: int
    start: int
    length: int
    offset: int


class TorchReferenceBackend(V4PoolBackend):
    name = NAME

    def __init__(self, model_runner):
        super().__init__(model_runner)
        self.spans: list[RequestSpan] = []
        self.pieces: list[list[tuple[int, list[int]]]] = []

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        self.token_to_kv_pool.storage.tables.begin_forward()
        self.plan_forward(request_spans(forward_batch), verify=forward_batch.forward_mode.is_target_verify())

    def plan_forward(self, spans: list[RequestSpan], verify: bool = False) -> None:
        """The forward's requests and the records it fills: the checkpoints the pool has pending for them,
        and in a speculative ``verify`` forward each request's rollback records."""
        self.spans = spans
        self.pieces = [self._pieces(span, verify) for span in spans]

    def attend(self, attention: Attention, layer: int, x: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        """Attention output ``[tokens, hidden]`` of the batch's new tokens ``x [tokens, hidden]``.

        A request's tokens run in pieces that end where a record is filled (its checkpoints, and in a
        verify forward its rollback records), copied as the layer passes them (the network is exact under
        chunking). Rows no span covers (the drafts after the accepted ones in a draft-extend forward) are
        zeros. An idle DP rank's forward of no rows comes without ``init_forward_metadata`` (the plan
        is the previous forward's): it reads and writes nothing.
        """
        out = torch.zeros_like(x)
        if x.shape[0] == 0:
            return out
        storage = self.token_to_kv_pool.storage
        for span, pieces in zip(self.spans, self.pieces, strict=True):
            state = storage.load(layer, span.row, span.start, x.dtype)
            start = span.start
            for piece_end, records in pieces:
                rows = slice(span.offset + start - span.start, span.offset + piece_end - span.start)
                out[rows] = attention(x[rows], start, state)
                storage.store(layer, span.row, start, piece_end, state)
                for record in records:
                    storage.snapshot(layer, span.row, record)
                start = piece_end
        return out

    def _pieces(self, span: RequestSpan, verify: bool) -> list[tuple[int, list[int]]]:
        """Where the span's pieces end, each with the records filled there."""
        end = span.start + span.length
        storage = self.token_to_kv_pool.storage
        filled: dict[int, list[int]] = {}
        for checkpoint in self.token_to_kv_pool.checkpoints.between(span.row, span.start, end):
            filled.setdefault(checkpoint.position, []).append(checkpoint.record)
        if verify:
            storage.begin_verify(span.row)
            for offset in range(1, span.length):
                filled.setdefault(span.start + offset, []).append(storage.rollback_record(span.row, offset))
        filled.setdefault(end, [])
        return sorted(filled.items())


def request_spans(forward_batch: ForwardBatch) -> list[RequestSpan]:
    """Where each request's new tokens sit in the batch and at which position they start.

    A speculative verify forward runs the same number of tokens for every request (its own and the drafts);
    a draft-extend forward after it has as many rows per request, of which the MTP layer reads only the
    accepted ones (``spec_info.num_accept_tokens``): the rest are rejected drafts.
    """
    rows = forward_batch.req_pool_indices.tolist()
    mode = forward_batch.forward_mode
    if mode.is_target_verify() or mode.is_draft_extend_v2():
        per_request = forward_batch.positions.shape[0] // max(1, len(rows))
        offsets = list(range(0, per_request * len(rows), per_request))
        starts = forward_batch.positions[offsets].tolist() if rows else []
        lengths = [per_request] * len(rows)
        if mode.is_draft_extend_v2():
            lengths = forward_batch.spec_info.num_accept_tokens.tolist()
        return [RequestSpan(*span) for span in zip(rows, starts, lengths, offsets, strict=True)]
    if mode.is_decode_or_idle():
        seq_lens = forward_batch.seq_lens_cpu if forward_batch.seq_lens_cpu is not None else forward_batch.seq_lens
        starts = [n - 1 for n in seq_lens.tolist()]
        lengths = [1] * len(rows)
    else:
        starts = list(forward_batch.extend_prefix_lens_cpu)
        lengths = list(forward_batch.extend_seq_lens_cpu)
    spans, offset = [], 0
    for row, start, length in zip(rows, starts, lengths, strict=True):
        spans.append(RequestSpan(row, int(start), int(length), offset))
        offset += int(length)
    return spans
