"""Emulation: SGLang's real server over an emulated H200, for capacity planning.

With ``SGLANG_DSV4_PLUGIN_EMULATE=h200`` (``dsv4 emulate`` sets it) everything SGLang and this plugin run is
real (tokenizer manager, scheduler and its overlap loop, DP controller and router, prefix tree, pools,
request tables, cache manager) except the network's arithmetic: the model has no parameters
(:mod:`.model`), the pools' rows no width (:mod:`.pools`), and each forward takes the time an H200 would
(:mod:`.timing`) on an emulated device the scheduler waits for only where it reads sampled tokens
(:mod:`.device`). ``/server_info`` reports it per rank (:func:`emulation_report`).
"""

from __future__ import annotations

import os
import resource
from typing import Any

from ..config import ConfigError
from ..settings import settings

RESULT_COPY = "sglang.srt.managers.utils.GenerationBatchResult.copy_to_cpu"
FREE_LIST_OPERATIONS = (
    "sglang.srt.mem_cache.allocator.token.TokenToKVPoolAllocator.free",
    "sglang.srt.mem_cache.allocator.base.BaseTokenToKVPoolAllocator.merge_and_sort_free",
)
"""SGLang's token-slot allocator's free-list operations: ``torch.cat`` / ``torch.sort`` over a tensor of every
free slot (13.6M for V4-Flash on one H200: 109 MB). A GPU server keeps it on the GPU and the host only launches
them; under emulation it is this host's memory, and each free copied the whole list on the scheduler's thread
(:func:`.device.on_the_device` times them as a GPU's)."""


def emulating() -> bool:
    return settings().emulate != ""


def check_emulation(view: Any) -> None:
    """Refuse, at launch, what the emulator does not model."""
    refusals = [
        (view.disable_overlap_schedule, "--disable-overlap-schedule: the emulated device is waited for at the "
         "overlap loop's copy of sampled tokens; leave overlap on"),
        (view.speculative_algorithm is not None, "--speculative-algorithm: fixed logits would accept every draft; "
         "the emulator runs without speculation"),
        (view.enable_hierarchical_cache, "--enable-hierarchical-cache: the host tier's loads are not in the timing "
         "model yet"),
        (view.disaggregation_mode != "null", "--disaggregation-mode: widthless rows hold no state to transfer; the "
         "emulator models one instance"),
    ]  # fmt: skip
    for refused, reason in refusals:
        if refused:
            raise ConfigError(f"SGLANG_DSV4_PLUGIN_EMULATE={settings().emulate}: {reason}")


def emulation_report(scheduler: Any) -> dict:
    """This rank's emulation: the deployment, the timing model's kind counts, the ledger's capacity as allocated,
    the device's occupancy so far, the rank's resident memory on this host (its peak RSS) and its process id (for a
    profiler)."""
    from .device import device

    model = scheduler.tp_worker.model_runner.model
    timing = model.timing
    return {
        "device": settings().emulate,
        "gpus": timing.deployment.gpus,
        "kv_dtype": timing.deployment.kv_dtype,
        "attention": timing.attention_model,
        "attention_tp": timing.deployment.attention_tp,
        "experts": timing.deployment.experts,
        "lockstep": timing.deployment.lockstep,
        "layers": timing.layer_counts,
        "capacity": {
            "token_slots": scheduler.max_total_num_tokens,
            "request_rows": scheduler.req_to_token_pool.size,
            "context_length": scheduler.model_config.context_len,
        },
        "device_time": device().report(),
        "resident_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "pid": os.getpid(),
    }
