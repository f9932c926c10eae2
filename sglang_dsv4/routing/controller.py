"""``--load-balance-method dsv4_cache_aware`` in SGLang's DP controller: the default under attention DP, on one
server and on each instance of a prefill/decode pair.

SGLang's controller picks its dispatch function from a fixed enum (``LoadBalanceMethod``) and
table, and its CLI from a fixed list of choices. ``auto`` resolves to it for a V4 checkpoint under
attention DP (SGLang's resolution step ``handle_load_balance_method``, :func:`_resolve_auto`), and
three hooks add the method: the CLI accepts
its name (:func:`_accept_on_the_command_line`); ``LoadBalanceMethod.from_str`` reads it as
``total_tokens`` (:func:`_read_as_total_tokens`), so that the controller reads each rank's load figure
(queued and running tokens, from SGLang's load snapshots, refreshed at most every 20 ms), to which the
router adds the prompts sent since the figure was taken; and after the controller is built its dispatch function is
replaced by :func:`_dispatch` (:func:`_install_router`), which reads the ranks' reports
(:mod:`.rank_reports`) before each decision. A ``routed_dp_rank`` still wins (SGLang's
``maybe_external_dp_rank_routing``); every other method is SGLang's, untouched. After a scheduler is built,
its prefix cache is given the channel's rank end (:func:`_attach_rank_reporter`). Before the controller
forwards a ``/server_info`` request, the router's figures are written for the ranks to report
(:mod:`.report`).
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from ..served_config import is_v4_checkpoint
from .rank_reports import RankReporter, ReportReader, report_address
from .report import write_report
from .router import CacheAwareRouter

logger = logging.getLogger(__name__)

METHOD = "dsv4_cache_aware"
_CONTROLLER = "sglang.srt.managers.data_parallel_controller"
_METHOD_FROM_NAME = f"{_CONTROLLER}.LoadBalanceMethod.from_str"
_CONTROLLER_INIT = f"{_CONTROLLER}.DataParallelController.__init__"
_CONTROL_MESSAGE = f"{_CONTROLLER}.DataParallelController.send_control_message"
_CLI_ARGS = "sglang.srt.arg_groups.arg_utils.add_cli_args_from_dataclass"
_SCHEDULER_INIT = "sglang.srt.managers.scheduler.Scheduler.__init__"
ROUTING_HOOKS = (_METHOD_FROM_NAME, _CONTROLLER_INIT, _CONTROL_MESSAGE, _CLI_ARGS, _SCHEDULER_INIT)
_FLAG = "--load-balance-method"


def register_routing_hooks() -> None:
    _default_under_attention_dp()
    HookRegistry.register(_CLI_ARGS, _accept_on_the_command_line, HookType.AFTER)
    HookRegistry.register(_METHOD_FROM_NAME, _read_as_total_tokens, HookType.AROUND)
    HookRegistry.register(_CONTROLLER_INIT, _install_router, HookType.AFTER)
    HookRegistry.register(_CONTROL_MESSAGE, _report_before_server_info, HookType.BEFORE)
    HookRegistry.register(_SCHEDULER_INIT, _attach_rank_reporter, HookType.AFTER)


@functools.cache  # once per process: SGLang keeps every registration, and each wraps the step again
def _default_under_attention_dp() -> None:
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook

    register_resolution_hook("handle_load_balance_method")(_resolve_auto)


def _resolve_auto(server_args: Any, previous) -> None:
    """``auto`` is ``dsv4_cache_aware`` for a V4 checkpoint under attention DP, on one server and on either
    instance of a PD pair; otherwise SGLang resolves it (``round_robin``, or ``follow_bootstrap_room`` on a
    prefill server).

    On a prefill instance any method but ``follow_bootstrap_room`` makes SGLang's sender post the rank a
    request landed on to the bootstrap server (``/register_dp_rank``) and the bootstrap server tell decode
    instances to ask for it (``/query_dp_ranks``): the decode rank fetches the state from the rank chosen here.
    """
    from sglang.srt.arg_groups.model_override_base import model_config_of
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view

    cfg = resolving_view(server_args)
    ours = cfg.load_balance_method == "auto" and cfg.attn_dp_size > 1
    if ours and is_v4_checkpoint(model_config_of(server_args).hf_config):
        declare_resolution(server_args, "sglang_dsv4.routing", load_balance_method=METHOD)
    previous(server_args)


def _accept_on_the_command_line(result, parser, cls, *, fields=None) -> None:
    action = parser._option_string_actions.get(_FLAG)
    if action is not None and action.choices is not None and METHOD not in action.choices:
        action.choices = [*action.choices, METHOD]


def _read_as_total_tokens(original, cls, method: str):
    return cls.TOTAL_TOKENS if method.lower() == METHOD else original(cls, method)


def _install_router(result, controller, *args, **kwargs) -> None:
    from sglang.srt.runtime_context import get_parallel

    if get_parallel().load_balance_method.lower() != METHOD:
        return
    router = CacheAwareRouter(len(controller.workers))
    reports = ReportReader(report_address(controller.port_args.instance_id))
    controller.dsv4_router = router
    controller.dispatching = functools.partial(_dispatch, controller, router, reports)
    logger.info("DP controller routes by %s over %d ranks", METHOD, len(controller.workers))


def _attach_rank_reporter(result, scheduler, server_args, port_args) -> None:
    """Under our method, the prefix cache of each DP rank's first process on the controller's node reports
    what it holds (every attention-TP rank of a DP rank holds the same)."""
    from sglang.srt.runtime_context import get_parallel

    from ..prefix_cache.tree import V4RadixCache

    parallel = get_parallel()
    first = parallel.pp_rank == 0 and parallel.attn_tp_rank == 0 and parallel.attn_cp_rank == 0
    ours = parallel.num_dp_ranks > 1 and parallel.load_balance_method.lower() == METHOD
    if ours and first and parallel.node_rank == 0 and isinstance(scheduler.tree_cache, V4RadixCache):
        address = report_address(port_args.instance_id)
        scheduler.tree_cache.reports = RankReporter(address, parallel.dp_rank or 0)


def _report_before_server_info(controller, obj) -> None:
    from sglang.srt.managers.io_struct import GetInternalStateReq

    if isinstance(obj, GetInternalStateReq) and hasattr(controller, "dsv4_router"):
        write_report(controller.dsv4_router.report())


def _dispatch(controller, router: CacheAwareRouter, reports: ReportReader, req) -> None:
    """``req`` to its ``routed_dp_rank``, else to the rank the router chooses from what the ranks have reported
    so far and their loads; either way the router notes it sent there."""
    from sglang.srt.managers.io_struct import sock_send

    for report in reports.drain():
        router.apply(report)
    prompt = req.input_ids or []
    if controller.maybe_external_dp_rank_routing(req):
        router.sent(req.routed_dp_rank, req.rid, prompt, time.time())
        return
    active = controller._active_workers
    if not active:
        raise RuntimeError("No active DP workers are available for routing.")
    budget = controller.dp_budget
    rank = router.route(prompt, router.loads(budget.total_tokens, budget.last_timestamp), active)
    router.sent(rank, req.rid, prompt, time.time())
    sock_send(controller.workers[rank], req)
