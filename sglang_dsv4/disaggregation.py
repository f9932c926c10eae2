"""Prefill/decode disaggregation (SGLang's ``--disaggregation-mode prefill|decode``) for the V4 pools.

A prefill instance runs a request's prompt and sends its state to a decode instance, which continues from it:
SGLang's bootstrap server pairs the two, its Mooncake manager moves the bytes. The V4 pool takes part through
SGLang's seams only:

* the pool describes no page-indexed buffers (``get_contiguous_buf_infos`` is empty) and four groups of per-request
  state, appended by :func:`_add_request_state` to SGLang's ``setup_state_kv_args`` as ``DSV4_REQUEST_STATE``
  components with their layers' ids (:mod:`sglang_dsv4.memory_pool.transfer`: window rows, ratio-4 entries and
  indexer keys, ratio-128 entries, the compressors' state records);
* SGLang asks the pool for a request's indices once per component, with the same arguments each time; the pool
  answers with a :class:`~sglang_dsv4.kv_cache.RequestStateRows` naming the request, and the sender's ``send``
  and the receiver's ``send_metadata`` resolve each into the rows of the group at that component's position
  (:func:`_resolve_rows`), so the pairing does not depend on the order SGLang asks in. Both resolve them past the
  prefix the decode instance holds (SGLang's ``decode_prefix_len``: the receiver is handed it, the sender pops it at
  bootstrap, :func:`_remember_decode_prefix`), so only what it lacks moves;
* with ``--disaggregation-decode-enable-radix-cache`` the decode instance keeps its own V4 tree: SGLang matches
  each prompt against it, the row resumes from the checkpoint there (:meth:`V4RadixCache.maybe_hand_to_session`,
  as on one server) and the prompt's last token is always left to the prefill instance, which samples the first
  output token (:func:`sglang_dsv4.radix_cache.tokens_left_to_prefill`);
* on the decode side SGLang's ``DecodeReqToTokenPool`` has no auxiliary cache: its ``free``, ``clear`` and
  ``alloc_aux_to_lengths`` reach the V4 cache manager (:func:`attach_cache_manager`), and a request row is bound
  at the prompt's end before its rows are published to the prefill side;
* the bytes moved are counted from the lengths handed to the transfer engine's ``batch_transfer_sync`` for each
  request's state and reported in ``/server_info`` as ``dsv4_transfer`` (:func:`transfer_report`).

Under attention DP on either instance each rank is a sender or receiver of its own: the DP controllers route by
``dsv4_cache_aware`` (:mod:`sglang_dsv4.routing`), the prefill rank chosen is posted to the bootstrap server, and
the decode rank asks for it there (SGLang's ``/register_dp_rank`` and ``/query_dp_ranks``).

On the CPU platform SGLang's sender would pin host memory and record a CUDA event for its indices: the platform
supplies the plain path (:func:`_no_device_indices_on_cpu`). SGLang's early send of a cached prefix's pages moves
nothing for V4 (it has no pages to move) and is skipped. What is not built is refused at launch
(:func:`check_disaggregation`). Mooncake's TCP transport runs with its legacy framing (:func:`use_legacy_tcp_framing`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from .config import ConfigError
from .kv_cache import RequestStateRows, V4KVPool
from .platform import on_torch_cpu_platform

_UTILS = "sglang.srt.disaggregation.utils"
_DECODE_POOL = "sglang.srt.disaggregation.decode.DecodeReqToTokenPool"
_MOONCAKE = "sglang.srt.disaggregation.mooncake.conn"
STATE_ARGS = f"{_UTILS}.setup_state_kv_args"
SENDER_INIT = f"{_MOONCAKE}.MooncakeKVSender.__init__"
SENDER_SEND = f"{_MOONCAKE}.MooncakeKVSender.send"
SENDER_DECODE_PREFIX = "sglang.srt.disaggregation.common.conn.CommonKVSender.pop_decode_prefix_len"
RECEIVER_METADATA = "sglang.srt.disaggregation.common.conn.CommonKVReceiver.send_metadata"
STATE_SEND = f"{_MOONCAKE}.MooncakeKVManager.maybe_send_extra"
ENGINE_TRANSFER = f"{_MOONCAKE}.MooncakeKVManager._transfer_data"
SENDER_ABORT = "sglang.srt.disaggregation.common.conn.CommonKVSender.abort"
CACHED_PREFIX_SEND = (
    "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin.maybe_send_cached_prefix_chunk"
)
DECODE_POOL_METHODS = {
    f"{_DECODE_POOL}.free": "_free_row",
    f"{_DECODE_POOL}.clear": "_clear_rows",
    f"{_DECODE_POOL}.alloc_aux_to_lengths": "_reserve_rows",
    f"{_DECODE_POOL}.schedulable_token_capacity": "_token_capacity",
}
MOONCAKE_HOOKS = {
    SENDER_INIT: ("_no_device_indices_on_cpu", "AFTER"),
    SENDER_SEND: ("_send_with_rows", "AROUND"),
    SENDER_DECODE_PREFIX: ("_remember_decode_prefix", "AFTER"),
    RECEIVER_METADATA: ("_publish_with_rows", "AROUND"),
    STATE_SEND: ("_counting_request_state", "AROUND"),
    ENGINE_TRANSFER: ("_counted_transfer", "AROUND"),
    SENDER_ABORT: ("_tell_the_decode_side_of_an_abort", "AFTER"),
}
HOOKS = {
    STATE_ARGS: ("_add_request_state", "AFTER"),
    CACHED_PREFIX_SEND: ("_skip_cached_prefix_send", "AROUND"),
    **{target: (name, "AROUND") for target, name in DECODE_POOL_METHODS.items()},
}
TRANSFER_BACKENDS = ("mooncake", "mooncake_tcp")
LEGACY_TCP_FRAMING = "MC_TCP_PROTO"

logger = logging.getLogger(__name__)


def mooncake_installed() -> bool:
    """Whether the ``pd`` extra (Mooncake's transfer engine) is installed: the hooks on SGLang's Mooncake
    classes apply only then (its module imports without it, its engine does not start)."""
    import importlib.util

    return importlib.util.find_spec("mooncake") is not None


def disaggregation_hooks() -> dict[str, tuple[str, str]]:
    """Target -> (hook, type): every hook, the Mooncake ones only with the ``pd`` extra installed."""
    return {**HOOKS, **(MOONCAKE_HOOKS if mooncake_installed() else {})}


def register_disaggregation_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, (name, kind) in disaggregation_hooks().items():
        HookRegistry.register(target, globals()[name], HookType[kind])


def check_disaggregation(view: Any) -> None:
    """Refuse, at launch, the disaggregated layouts not built for V4 (naming the flag and why)."""
    if view.disaggregation_mode == "null":
        return
    mode = f"--disaggregation-mode {view.disaggregation_mode}"
    backend = view.disaggregation_transfer_backend
    refusals = [
        (
            backend not in TRANSFER_BACKENDS,
            f"--disaggregation-transfer-backend {backend}: DeepSeek-V4's request state moves through Mooncake "
            "(mooncake, or mooncake_tcp on a host without RDMA); fake moves no bytes, and nixl, mori and ascend "
            "are not built for the V4 pools",
        ),
        (
            not mooncake_installed(),
            "Mooncake's transfer engine is not installed: pip install 'sglang-dsv4[pd]' (and the system libraries "
            "libibverbs1 and libnuma1)",
        ),
        (
            view.disaggregation_decode_enable_radix_cache and view.enable_hierarchical_cache,
            "--disaggregation-decode-enable-radix-cache with --enable-hierarchical-cache: the decode instance's "
            "tree is not built to load checkpoints back from a host tier; leave one of the two off",
        ),
        (
            view.disaggregation_enable_kv_checksum,
            "--disaggregation-enable-kv-checksum: SGLang's checksum reads page-indexed KV buffers, and V4's state "
            "moves as request rows",
        ),
        (
            bool(view.speculative_algorithm),
            f"--speculative-algorithm {view.speculative_algorithm}: the MTP layer's state is not sent across the "
            "pair; speculate on a single server",
        ),
    ]
    for refused, reason in refusals:
        if refused:
            raise ConfigError(f"{mode}: {reason}")


def use_legacy_tcp_framing(view: Any) -> None:
    """Under Mooncake's TCP transport (``mooncake_tcp``), its legacy framing (``MC_TCP_PROTO=1``) unless the
    environment chooses one; set in the launcher, so every scheduler's engine inherits it.

    With the acknowledged framing of the pinned wheel (0.3.13.post1, the default there), transfers between two
    attention-DP instances on this host stalled until Mooncake's 30 s status timeout in each of five runs (the
    receiving engine left the connections unaccepted or their bytes unread; the sender then failed the request and
    smg retried it on other ranks), and in none of the runs with the legacy framing (cause inside the engine not
    found: docs/serving.md). The legacy framing reports a write complete once it has left the sender's
    socket rather than once it has landed; on one host's loopback the pairs' outputs equal the single server's in
    every PD test. RDMA (``mooncake``) does not read the variable."""
    tcp = view.disaggregation_transfer_backend == "mooncake_tcp" or os.environ.get("MC_FORCE_TCP") == "1"
    if view.disaggregation_mode != "null" and tcp and LEGACY_TCP_FRAMING not in os.environ:
        os.environ[LEGACY_TCP_FRAMING] = "1"
        logger.info("Mooncake's TCP transport with its legacy framing (%s=1; docs/serving.md)", LEGACY_TCP_FRAMING)


# --- the transfer layout ------------------------------------------------------------------------


def _add_request_state(result, kv_args, token_to_kv_pool, *args, **kwargs) -> None:
    """After SGLang described its pools' state: the V4 pool's transfer groups, one component each, and the
    group at each component's position."""
    if not isinstance(token_to_kv_pool, V4KVPool):
        return
    from sglang.srt.disaggregation.base.conn import StateType
    from sglang.srt.disaggregation.utils import append_state_component

    kv_args.dsv4_groups = {}
    for group in token_to_kv_pool.transfer.groups:
        kv_args.dsv4_groups[len(kv_args.state_types)] = group.name
        append_state_component(
            kv_args, StateType.DSV4_REQUEST_STATE, *group.buffer_infos(), layer_ids=list(group.layer_ids)
        )


def _resolve_rows(kv_manager: Any, state_indices: list | None, decode_prefix: int) -> list | None:
    """``state_indices`` with each :class:`RequestStateRows` replaced by that request's rows in the group at
    its position, past the ``decode_prefix`` tokens whose state the decode instance holds."""
    if not state_indices:
        return state_indices
    groups = getattr(kv_manager.kv_args, "dsv4_groups", {})
    resolved = list(state_indices)
    for position, indices in enumerate(state_indices):
        if isinstance(indices, RequestStateRows):
            resolved[position] = indices.rows(groups[position], decode_prefix)
    return resolved


def _remember_decode_prefix(result: int, sender, *args, **kwargs) -> None:
    """The prefill side pops the prefix the decode instance holds once, at bootstrap: its sends resolve past it."""
    sender.dsv4_decode_prefix = result


def _send_with_rows(original, sender, kv_indices, state_indices=None, *args, **kwargs):
    rows = _resolve_rows(sender.kv_mgr, state_indices, getattr(sender, "dsv4_decode_prefix", 0))
    return original(sender, kv_indices, rows, *args, **kwargs)


def _publish_with_rows(
    original, receiver, kv_indices, aux_index=None, state_indices=None, decode_prefix_len=None, **kwargs
):
    rows = _resolve_rows(receiver.kv_mgr, state_indices, decode_prefix_len or 0)
    return original(receiver, kv_indices, aux_index, rows, decode_prefix_len=decode_prefix_len, **kwargs)



def _no_device_indices_on_cpu(result, sender, *args, **kwargs) -> None:
    """On the CPU platform the sender's indices are host arrays already: no pinned copy, no CUDA event."""
    if on_torch_cpu_platform():
        sender.supports_host_tensor_indices = False


def _skip_cached_prefix_send(original, scheduler, req, *args, **kwargs) -> None:
    if isinstance(scheduler.token_to_kv_pool_allocator.get_kvcache(), V4KVPool):
        return  # V4 has no pages to send early: its state moves with the prompt's last chunk
    return original(scheduler, req, *args, **kwargs)


# --- bytes moved ---------------------------------------------------------------------------------

_counting = threading.local()
_moved = {"bytes": 0, "blocks": 0, "requests": 0, "seconds": 0.0, "decode_prefix_tokens": 0}
_moved_lock = threading.Lock()


def _counting_request_state(original, manager, req, *args, **kwargs) -> int:
    """One request's state sent: the bytes of every transfer it submits are counted, the time it takes, and the
    prompt tokens whose state the decode instance held already."""
    _counting.active, start = True, time.perf_counter()
    try:
        result = original(manager, req, *args, **kwargs)
    finally:
        _counting.active = False
    with _moved_lock:
        _moved["requests"] += 1
        _moved["seconds"] += time.perf_counter() - start
        _moved["decode_prefix_tokens"] += req.decode_prefix_len or 0
    return result


def _counted_transfer(original, manager, session_id, transfer_blocks) -> int:
    result = original(manager, session_id, transfer_blocks)
    if getattr(_counting, "active", False) and result == 0:
        with _moved_lock:
            _moved["bytes"] += sum(length for _, _, length in transfer_blocks)
            _moved["blocks"] += len(transfer_blocks)
    return result


def transfer_report() -> dict[str, float]:
    """What this instance sent: requests' states, their bytes and contiguous blocks as submitted to the transfer
    engine (SGLang merges rows adjacent on both sides into one block), the seconds the sends took (the transfer
    worker's, beside the scheduler), and the prompt tokens whose state the decode instances held already (their
    ``decode_prefix_len``)."""
    with _moved_lock:
        return {
            "states_sent": _moved["requests"],
            "bytes_sent": _moved["bytes"],
            "blocks_sent": _moved["blocks"],
            "send_seconds": _moved["seconds"],
            "decode_prefix_tokens": _moved["decode_prefix_tokens"],
        }


# --- faults ------------------------------------------------------------------------------------


def _tell_the_decode_side_of_an_abort(result, sender, *args, **kwargs) -> None:
    """A request aborted on the prefill instance (``/abort_request``, a client gone) fails on the decode instance
    too, as a failed transfer does (SGLang's sender marks it failed on the prefill side only, and the decode
    instance would wait ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` for it): the room's decode endpoints, once they
    have sent their metadata, get its failure. Before that the decode instance's own timeout ends it."""
    manager, room = sender.kv_mgr, sender.bootstrap_room
    if room in manager.request_status:
        manager.conclude_failure(bootstrap_room=room, failure_reason="Aborted on the prefill instance")


# --- the decode side's request rows ------------------------------------------------------------


def attach_cache_manager(req_to_token_pool: Any, manager: Any) -> None:
    """The request pool frees, clears and reserves through the V4 cache manager (SGLang's own pool has
    ``attach_aux_cache``; its decode-side pool keeps the attribute but not the calls, which the hooks below add)."""
    if hasattr(req_to_token_pool, "attach_aux_cache"):
        req_to_token_pool.attach_aux_cache(manager)
    else:
        req_to_token_pool._aux_cache = manager


def request_rows(req_to_token_pool: Any) -> int:
    """Request rows the V4 pool needs for SGLang's request pool (the decode side's holds its preallocated
    requests' rows beside the running ones)."""
    return getattr(req_to_token_pool, "_alloc_size", req_to_token_pool.size + 1) - 1


def _free_row(original, pool, req) -> None:
    row = req.kv.req_pool_idx
    original(pool, req)
    if pool._aux_cache is not None:
        pool._aux_cache.free(row)


def _clear_rows(original, pool) -> None:
    original(pool)
    if pool._aux_cache is not None:
        pool._aux_cache.clear()


def _reserve_rows(original, pool, *, req_pool_indices_cpu, target_seq_lens_cpu) -> None:
    if pool._aux_cache is None:
        return original(pool, req_pool_indices_cpu=req_pool_indices_cpu, target_seq_lens_cpu=target_seq_lens_cpu)
    pool._aux_cache.alloc_to_lengths(req_pool_indices_cpu=req_pool_indices_cpu, target_seq_lens_cpu=target_seq_lens_cpu)


def _token_capacity(original, pool, physical_capacity: int) -> int:
    if pool._aux_cache is None:
        return original(pool, physical_capacity)
    return pool._aux_cache.dense_capacity
