"""Emulation: SGLang's real server over an emulated H200, for capacity planning.

With ``SGLANG_DSV4_PLUGIN_EMULATE=h200`` (``dsv4 emulate`` sets it) everything SGLang and this plugin run is
real (tokenizer manager, scheduler and its overlap loop, DP controller and router, prefix tree, pools,
request tables, cache manager, host tier) except the network's arithmetic: the model has no parameters
(:mod:`.model`), the pools' rows no width (:mod:`.pools`), and each forward takes the time an H200 would
(:mod:`.timing`) on an emulated device the scheduler waits for only where it reads sampled tokens
(:mod:`.device`); the host tier's copies take the time our copies take on an H200 (:mod:`.host_tier`).
``/server_info`` reports it per rank (:func:`emulation_report`).
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

HOST_TIER_LOAD = "sglang_dsv4.memory_pool.host_pools.HostRowKind.restore"
HOST_TIER_WRITE_BACK = "sglang_dsv4.memory_pool.host_pools.HostRowKind.save"
"""The host tier's two copies between the tiers, timed as on an H200 (:mod:`.host_tier`)."""


def emulating() -> bool:
    return settings().emulate != ""


def check_emulation(view: Any) -> None:
    """Refuse, at launch, what the emulator does not model."""
    refusals = [
        (view.disable_overlap_schedule, "--disable-overlap-schedule: the emulated device is waited for at the "
         "overlap loop's copy of sampled tokens; leave overlap on"),
        (view.speculative_algorithm is not None, "--speculative-algorithm: fixed logits would accept every draft; "
         "the emulator runs without speculation"),
        (view.enable_hierarchical_cache and view.hicache_size <= 0, "--enable-hierarchical-cache without "
         "--hicache-size: the emulated host's memory is not this host's; give the host tier's GB per rank"),
        (view.disaggregation_mode != "null", "--disaggregation-mode: widthless rows hold no state to transfer; the "
         "emulator models one instance"),
    ]  # fmt: skip
    for refused, reason in refusals:
        if refused:
            raise ConfigError(f"SGLANG_DSV4_PLUGIN_EMULATE={settings().emulate}: {reason}")


def host_tier_capacity(tree: Any) -> dict[str, int]:
    """The host tier's bytes as an H200 host holds them (none without a host tier)."""
    host = getattr(tree, "host", None)
    return {} if host is None else {"host_tier_bytes": host.pools.capacity_bytes}


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
            **host_tier_capacity(scheduler.tree_cache),
        },
        "device_time": device().report(),
        "resident_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "pid": os.getpid(),
    }
