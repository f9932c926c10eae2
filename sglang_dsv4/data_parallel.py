"""Attention data parallelism (SGLang's ``--attn-dp-size D``): what the launcher accepts, and what
SGLang's DP path needs on the CPU platform.

Each of D DP ranks has its own scheduler, requests, pools and prefix tree; the model runs
attention on the rank's attention-TP group and the MoE over every rank's rows through SGLang's
DP-attention gather (:mod:`sglang_dsv4.model.sglang_model`). SGLang's DP path decides "CPU" by its
own CPU engine's variable, not by the platform, so on this package's CPU platform it would pin
host memory (no CUDA driver) and copy rows with a Triton kernel: :func:`_use_cpu_paths` points
those two choices at SGLang's own CPU code before the first DP batch is prepared, which also makes
SGLang pad idle rows with the backends' ``get_cpu_graph_seq_len_fill_value``; and SGLang registers
its custom ops for an out-of-tree platform's ``PrivateUse1`` key only, so its collectives' ops
(the DP gather's all-gather and all-reduce, a decode instance's TP LM-head all-to-all) get their own
functions registered for CPU tensors.
SGLang's DP controller polls its socket in a loop that never waits, whatever ``--sleep-on-idle``
says (a core each, taken from the ranks on a CPU host): under that flag it waits for the next
request on SGLang's own ``IdleSleeper`` between drains (:func:`_event_loop_sleeping_when_idle`).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from .config import ConfigError
from .platform import on_torch_cpu_platform

_MLP_SYNC = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.prepare_mlp_sync_batch"
_CONTROLLER_LOOP = "sglang.srt.managers.data_parallel_controller.DataParallelController.event_loop"
DATA_PARALLEL_HOOKS = (_MLP_SYNC, _CONTROLLER_LOOP)
# SGLang's collectives registered as custom ops (parallel_state.py), which the DP gather and scatter call, and
# the all-to-all of the TP LM head that SGLang turns on by default on a decode instance under pure attention DP.
_COLLECTIVE_OPS = (
    "inplace_all_reduce",
    "outplace_all_reduce",
    "reg_all_gather_into_tensor",
    "reg_reduce_scatter_tensor",
    "reg_all_to_all_single",
)


def register_data_parallel_hooks() -> None:
    HookRegistry.register(_MLP_SYNC, _prepare_on_cpu_paths, HookType.AROUND)
    HookRegistry.register(_CONTROLLER_LOOP, _event_loop_sleeping_when_idle, HookType.AROUND)


def check_attention_data_parallel(view: Any) -> None:
    """Refuse, at launch, the attention-DP layouts this plugin's model does not serve (naming the flag).

    Served: D DP ranks, D dividing ``--tp`` (checked with the config's dimensions by
    :func:`~sglang_dsv4.config.check_tensor_parallel`), the MoE over the gathered rows of every rank.
    Not served: attention context parallelism, MoE data parallelism and all-to-all MoE backends
    (the model gathers rows through SGLang's DP-attention gather, not a dispatcher).
    """
    if view.attn_dp_size == 1:
        return
    refused = {
        "--attn-cp-size": view.attn_cp_size != 1,
        "--moe-dp-size": view.moe_dp_size != 1,
        "--moe-a2a-backend": view.moe_a2a_backend != "none",
    }
    for flag, is_set in refused.items():
        if is_set:
            raise ConfigError(
                f"{flag} with --attn-dp-size {view.attn_dp_size}: DeepSeek-V4 under attention data parallelism is "
                f"served with the MoE over every DP rank's gathered rows only; leave {flag} at its default"
            )


def _prepare_on_cpu_paths(original, forward_batch, model_runner) -> None:
    if on_torch_cpu_platform():
        _use_cpu_paths()
    return original(forward_batch, model_runner)


@functools.cache
def _use_cpu_paths() -> None:
    """SGLang's CPU choices in the two DP modules that read its CPU-engine variable at import, and its
    collectives' custom ops for CPU tensors."""
    from sglang.srt.distributed import parallel_state
    from sglang.srt.layers import dp_attention
    from sglang.srt.model_executor import forward_batch_info
    from sglang.srt.utils.common import sglang_lib

    forward_batch_info._is_cpu = True  # no pinned host tensor; padded rows from get_cpu_graph_seq_len_fill_value
    dp_attention.memcpy_func = dp_attention.memcpy_cpu  # rows copied by torch, not the Triton kernel
    for name in _COLLECTIVE_OPS:
        collective = inspect.unwrap(getattr(parallel_state, name))  # the op's own function: the group's collective
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"{sglang_lib.ns}::{name}", "CPU"):
            sglang_lib.impl(name, collective, "CPU")



def _event_loop_sleeping_when_idle(original, controller) -> None:
    """SGLang's controller loop (every waiting request to its dispatcher, the watchdog fed), waiting up to a
    second for the tokenizer's socket whenever it is drained, under ``--sleep-on-idle``."""
    import zmq
    from sglang.srt.managers.io_struct import sock_recv
    from sglang.srt.managers.scheduler_components.idle_sleeper import IdleSleeper
    from sglang.srt.runtime_context import get_device

    if not get_device().sleep_on_idle:
        return original(controller)
    sleeper = IdleSleeper([controller.recv_from_tokenizer])
    while True:
        while True:
            controller.soft_watchdog.feed()
            try:
                request = sock_recv(controller.recv_from_tokenizer, flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                break
            controller._request_dispatcher(request)
        sleeper.maybe_sleep()
