"""A forward that raises fails the requests of its batch only; the server keeps serving.

Upstream SGLang lets any exception out of the scheduler's event loop, and
``run_scheduler_process`` then takes the whole server down. Here an exception in
:meth:`Scheduler.run_batch` (the forward and, usually, the sampling) or in
:meth:`Scheduler.launch_batch_sample_if_needed` (the sampling the overlap scheduler
delays, for grammar-constrained batches) finishes every request of that batch with an
HTTP 500 carrying the exception, and releases each the way SGLang releases an aborted
request: the tree's lock, its own slots (a prefix the tree protects stays in the tree),
its request row and the per-request pages attached to the row. Nothing the failed batch
computed is inserted into the prefix tree. The batch's result becomes a
:class:`FailedBatch` that :meth:`Scheduler.process_batch_result` skips.

Both event loops are covered. Without overlap a batch's result is processed right after
its forward. With overlap the scheduler launches batch k before it processes batch k-1's
result: the requests of the failed batch k are finished and released at once, so when
batch k-1's result is processed SGLang skips them as already finished (the same path
that skips a request finished one step early), and they are filtered out of the running
batch before batch k+1 is built. A chunked prefill in flight is dropped with its request.

Not contained, so that the server exits as upstream's does: device errors
(``torch.AcceleratorError``: the device's state is lost for every request), and any
exception on a scheduler with several tensor- or pipeline-parallel ranks, attention-DP ranks
included (they are ranks of the TP group; a rank that fails alone would leave the others
waiting in a collective).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from http import HTTPStatus

import torch
from sglang.srt.plugins.hook_registry import HookRegistry, HookType

logger = logging.getLogger(__name__)

_RUN_BATCH = "sglang.srt.managers.scheduler.Scheduler.run_batch"
_DELAYED_SAMPLE = "sglang.srt.managers.scheduler.Scheduler.launch_batch_sample_if_needed"
_PROCESS_RESULT = "sglang.srt.managers.scheduler.Scheduler.process_batch_result"
CONTAINMENT_HOOKS = (_RUN_BATCH, _DELAYED_SAMPLE, _PROCESS_RESULT)


@dataclass(frozen=True)
class FailedBatch:
    """The result of a batch whose forward or sampling raised: its requests are already failed and released."""

    reason: str


def register_containment_hooks() -> None:
    HookRegistry.register(_RUN_BATCH, _run_batch_contained, HookType.AROUND)
    HookRegistry.register(_DELAYED_SAMPLE, _sample_contained, HookType.AROUND)
    HookRegistry.register(_PROCESS_RESULT, _skip_failed_batch, HookType.AROUND)


def _run_batch_contained(run_batch, scheduler, batch, *args, **kwargs):
    try:
        return run_batch(scheduler, batch, *args, **kwargs)
    except Exception as error:
        if not _containable(error):
            raise
        return fail_batch(scheduler, batch, error)


def _sample_contained(launch_sample, scheduler, batch_result, batch):
    if isinstance(batch_result, FailedBatch):
        return None
    try:
        return launch_sample(scheduler, batch_result, batch)
    except Exception as error:
        if not _containable(error):
            raise
        failed = fail_batch(scheduler, batch, error)
        # The overlap loop queued this result before sampling it: process the failure instead.
        queue = scheduler.result_queue
        for index, (queued_batch, queued_result) in enumerate(queue):
            if queued_result is batch_result:
                queue[index] = (queued_batch, failed)
        return None


def _skip_failed_batch(process_batch_result, scheduler, batch, result):
    if isinstance(result, FailedBatch):
        return None
    return process_batch_result(scheduler, batch, result)


def _containable(error: Exception) -> bool:
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    single_rank = parallel.tp_size == 1 and parallel.pp_size == 1
    return single_rank and not isinstance(error, torch.AcceleratorError)


def fail_batch(scheduler, batch, error: Exception) -> FailedBatch:
    """Finish every unfinished request of ``batch`` with an HTTP 500 naming ``error``, and free what it holds."""
    reason = (
        f"the batch this request ran in failed ({type(error).__name__}: {error}); "
        "its requests were dropped and the server keeps serving"
    )
    unfinished = [req for req in batch.reqs if not req.finished()]
    logger.exception(
        "sglang-dsv4: a %s batch of %d request(s) raised; failing %s with HTTP 500",
        batch.forward_mode.name,
        len(batch.reqs),
        [req.rid for req in unfinished],
    )
    for req in unfinished:
        _fail_request(scheduler, req, reason)
    return FailedBatch(reason)


def _fail_request(scheduler, req, reason: str) -> None:
    """SGLang's own abort steps for a request that holds KV, with a 500 for its client."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT
    from sglang.srt.managers.scheduler import _make_abort_req
    from sglang.srt.mem_cache.common import release_kv_cache

    req.finished_reason = FINISH_ABORT(reason, HTTPStatus.INTERNAL_SERVER_ERROR, "InternalServerError")
    req.to_finish = None
    req.skip_radix_cache_insert = True  # what the failed forward wrote is not a cacheable prefix
    if scheduler.chunked_req is req:
        scheduler.chunked_req = None
    if scheduler._pending_chunked_abort_req is req:
        scheduler._pending_chunked_abort_req = None
    scheduler._release_aborted_request(req)
    if req.kv.holds_kv:
        release_kv_cache(req, scheduler.tree_cache, checkpoint=False)
    scheduler.send_abort_output(_make_abort_req(req, finished_reason=req.finished_reason.to_json()), req)
    # Its final output is sent: a later stream step (the overlap lag) must not send another.
    req.finished_output = True
