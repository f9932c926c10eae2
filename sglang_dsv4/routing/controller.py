"""``--load-balance-method dsv4_cache_aware`` in SGLang's DP controller: the default under attention DP.

SGLang's controller picks its dispatch function from a fixed enum (``LoadBalanceMethod``) and
table, and its CLI from a fixed list of choices. ``auto`` resolves to it for a V4 checkpoint under
attention DP (SGLang's resolution step ``handle_load_balance_method``, :func:`_resolve_auto`), and
three hooks add the method: the CLI accepts
its name (:func:`_accept_on_the_command_line`); ``LoadBalanceMethod.from_str`` reads it as
``total_tokens`` (:func:`_read_as_total_tokens`), so that the controller keeps SGLang's budget of
each rank's queued and running tokens (its load snapshots, refreshed at most every 20 ms, plus
the prompts it dispatched since); and after the controller is built its dispatch function is
replaced by :func:`_dispatch` (:func:`_install_router`). A ``routed_dp_rank`` still wins (SGLang's
``maybe_external_dp_rank_routing``); every other method is SGLang's, untouched. Before the controller
forwards a ``/server_info`` request, the router's figures are written for the ranks to report
(:mod:`.report`).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from ..served_config import is_v4_checkpoint
from ..settings import settings
from .report import write_report
from .router import CacheAwareRouter

logger = logging.getLogger(__name__)

METHOD = "dsv4_cache_aware"
_CONTROLLER = "sglang.srt.managers.data_parallel_controller"
_METHOD_FROM_NAME = f"{_CONTROLLER}.LoadBalanceMethod.from_str"
_CONTROLLER_INIT = f"{_CONTROLLER}.DataParallelController.__init__"
_CONTROL_MESSAGE = f"{_CONTROLLER}.DataParallelController.send_control_message"
_CLI_ARGS = "sglang.srt.arg_groups.arg_utils.add_cli_args_from_dataclass"
ROUTING_HOOKS = (_METHOD_FROM_NAME, _CONTROLLER_INIT, _CONTROL_MESSAGE, _CLI_ARGS)
_FLAG = "--load-balance-method"


def register_routing_hooks() -> None:
    _default_under_attention_dp()
    HookRegistry.register(_CLI_ARGS, _accept_on_the_command_line, HookType.AFTER)
    HookRegistry.register(_METHOD_FROM_NAME, _read_as_total_tokens, HookType.AROUND)
    HookRegistry.register(_CONTROLLER_INIT, _install_router, HookType.AFTER)
    HookRegistry.register(_CONTROL_MESSAGE, _report_before_server_info, HookType.BEFORE)


@functools.cache  # once per process: SGLang keeps every registration, and each wraps the step again
def _default_under_attention_dp() -> None:
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook

    register_resolution_hook("handle_load_balance_method")(_resolve_auto)


def _resolve_auto(server_args: Any, previous) -> None:
    """``auto`` is ``dsv4_cache_aware`` for a V4 checkpoint under attention DP outside PD disaggregation;
    otherwise SGLang resolves it (``round_robin``, or ``follow_bootstrap_room`` on a prefill server)."""
    from sglang.srt.arg_groups.model_override_base import model_config_of
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view

    cfg = resolving_view(server_args)
    ours = cfg.load_balance_method == "auto" and cfg.attn_dp_size > 1 and cfg.disaggregation_mode == "null"
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
    router = CacheAwareRouter(len(controller.workers), settings().checkpoint_interval)
    controller.dsv4_router = router
    controller.dispatching = functools.partial(_dispatch, controller, router)
    logger.info("DP controller routes by %s over %d ranks", METHOD, len(controller.workers))


def _report_before_server_info(controller, obj) -> None:
    from sglang.srt.managers.io_struct import GetInternalStateReq

    if isinstance(obj, GetInternalStateReq) and hasattr(controller, "dsv4_router"):
        write_report(controller.dsv4_router.report())


def _dispatch(controller, router: CacheAwareRouter, req) -> None:
    """``req`` to its ``routed_dp_rank``, else to the rank the router chooses; either way the checkpoints its
    prompt leaves are recorded on its rank, and the rank's budget grows by the prompt as SGLang's
    ``total_tokens`` grows it."""
    from sglang.srt.managers.io_struct import sock_send

    prompt = req.input_ids or []
    if controller.maybe_external_dp_rank_routing(req):
        router.record(req.routed_dp_rank, prompt)
        return
    active = controller._active_workers
    if not active:
        raise RuntimeError("No active DP workers are available for routing.")
    budget = controller.dp_budget
    rank = router.route(prompt, budget.total_tokens, active)
    budget.total_requests[rank] += 1
    budget.total_tokens[rank] += len(prompt)
    sock_send(controller.workers[rank], req)
