"""A torch-native CPU platform for SGLang (entry point group ``sglang.srt.platforms``).

SGLang's in-tree CPU engine needs a CPU build of ``sgl_kernel``, which PyPI does not
ship. Declared as an out-of-tree platform, a CPU host instead gets core's torch-native
paths: no Triton, no graph capture, the torch-native attention backend by default, and
gloo for collectives. It serves any model SGLang can run with torch ops (a Llama as
well as DeepSeek-V4 through this package's model).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from sglang.srt.platforms.cpu import CpuDeviceMixin
from sglang.srt.platforms.device_mixin import PlatformEnum
from sglang.srt.platforms.interface import PlatformCapabilities, SRTPlatform

from .settings import settings

if TYPE_CHECKING:
    from .memory_pool.sizing import HostSharing

DISPATCH_KEY = "dsv4_cpu"


class TorchCpuPlatform(CpuDeviceMixin, SRTPlatform):
    """CPU through torch-native code paths only."""

    _enum = PlatformEnum.OOT
    capabilities = PlatformCapabilities(supports_triton=False, graph_capture=False)

    def get_device(self, device_id: int = 0) -> str:
        # Core formats and compares this value as a device string ("cpu").
        return "cpu"

    def get_dispatch_key_name(self) -> str:
        # SGLang's fused ops look up forwards registered for this key first (the MoE's, model/fused_moe.py).
        return DISPATCH_KEY

    def get_default_attention_backend(self) -> str:
        return "torch_native"

    def get_compile_backend(self, mode: str | None = None) -> str:
        return "eager"

    def is_pin_memory_available(self, device=None) -> bool:
        return False

    def supports_speculative_algorithm(self, algorithm: str) -> bool:
        """EAGLE (NEXTN) with DeepSeek-V4's MTP layer, whose draft and verify run on torch ops here (other
        models are refused at start: ``speculation._eagle_for_v4_only``)."""
        return algorithm in ("EAGLE", "NEXTN")

    def get_speculative_cache_locs_fn(self) -> Callable[..., torch.Tensor]:
        """SGLang's speculative KV-slot gather, in torch."""
        from .kernels.speculative import assign_extend_cache_locs

        return assign_extend_cache_locs


def on_torch_cpu_platform() -> bool:
    """Whether SGLang runs on this platform (its CPU paths are ours to choose)."""
    from sglang.srt.platforms import current_platform

    return isinstance(current_platform, TorchCpuPlatform)


def activate() -> str | None:
    """SGLang's platform discovery calls this: the platform's class path, or None to stay out.

    Active on hosts without a CUDA GPU unless ``SGLANG_DSV4_PLUGIN_CPU_PLATFORM=off``.
    """
    if settings().cpu_platform == "off" or torch.cuda.is_available():
        return None
    return f"{__name__}.{TorchCpuPlatform.__qualname__}"


def bind_rank_threads(original: Callable[..., str], *, numa_index: int, world_size: int) -> str:
    """Rank ``numa_index``'s CPU cores, its torch threads bound to them (around SGLang's ``init_threads_binding``).

    SGLang gives each CPU rank one NUMA node, or the cores ``SGLANG_CPU_OMP_THREADS_BIND``
    names, and refuses more ranks than NUMA nodes. On this platform, unless that variable
    is set, the cores this process may use are dealt out in equal contiguous shares (one
    core each, round robin, when there are more ranks than cores); the rank's threads are
    pinned to its share and their number capped by it.
    """
    if os.environ.get("SGLANG_CPU_OMP_THREADS_BIND") or not on_torch_cpu_platform():
        return original(numa_index=numa_index, world_size=world_size)
    cores = sorted(os.sched_getaffinity(0))
    share = max(1, len(cores) // world_size)
    start = (numa_index * share) % len(cores)
    mine = cores[start : start + share]
    os.sched_setaffinity(0, mine)
    torch.set_num_threads(min(torch.get_num_threads(), len(mine)))
    return ",".join(map(str, mine))


def host_sharing() -> HostSharing:
    """How the ranks of this launch on this host share the memory SGLang measures for each (none off this
    platform).

    SGLang's CPU path gives a rank the host's free memory divided by its NUMA nodes: one rank per node.
    On this platform ranks share nodes as they share cores (:func:`bind_rank_threads`), and every rank
    of a launch would otherwise size its pools from the same memory (two DP ranks on a 24 GB host each
    took 11 GB, and the kernel killed one). The ranks on one node each take an equal share of it, once
    the others' processes are set aside (as much as this one holds now, its weights loaded).
    """
    from .memory_pool.sizing import HostSharing

    if not on_torch_cpu_platform():
        return HostSharing()
    import psutil
    from sglang.srt.mem_cache.pool_host.base import ranks_per_host
    from sglang.srt.utils.common import get_cpu_ids_by_node

    nodes = max(len(get_cpu_ids_by_node()), 1)
    ranks_per_node = -(-ranks_per_host() // nodes)
    return HostSharing(ranks_per_node, psutil.Process().memory_info().rss)
