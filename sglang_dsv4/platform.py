"""A torch-native CPU platform for SGLang (entry point group ``sglang.srt.platforms``).

SGLang's in-tree CPU engine needs a CPU build of ``sgl_kernel``, which PyPI does not
ship. Declared as an out-of-tree platform, a CPU host instead gets core's torch-native
paths: no Triton, no graph capture, the torch-native attention backend by default, and
gloo for collectives. It serves any model SGLang can run with torch ops (a Llama as
well as DeepSeek-V4 through this package's model).
"""

from __future__ import annotations

import torch
from sglang.srt.platforms.cpu import CpuDeviceMixin
from sglang.srt.platforms.device_mixin import PlatformEnum
from sglang.srt.platforms.interface import PlatformCapabilities, SRTPlatform

from .settings import settings

DISPATCH_KEY = "dsv4_cpu"


class TorchCpuPlatform(CpuDeviceMixin, SRTPlatform):
    """CPU through torch-native code paths only."""

    _enum = PlatformEnum.OOT
    capabilities = PlatformCapabilities(supports_triton=False, graph_capture=False)

    def get_device(self, device_id: int = 0) -> str:
        # Core formats and compares this value as a device string ("cpu").
        return "cpu"

    def get_dispatch_key_name(self) -> str:
        # SGLang's fused ops look up forwards registered for this key first (the MoE's, moe/fused_moe.py).
        return DISPATCH_KEY

    def get_default_attention_backend(self) -> str:
        return "torch_native"

    def get_compile_backend(self, mode: str | None = None) -> str:
        return "eager"

    def is_pin_memory_available(self, device=None) -> bool:
        return False


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
