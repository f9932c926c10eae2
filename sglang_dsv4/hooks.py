"""The SGLang functions this plugin hooks, by dotted path, and the check that every hook applied.

SGLang's ``HookRegistry`` only logs a hook whose target moved (another SGLang version); the
model refuses to start instead (:func:`require_hooks_applied`), naming the hooks that did not
apply. :mod:`sglang_dsv4.plugin` registers the hooks on these targets; the data-parallel, routing,
serving, admission and speculation hooks name their own targets beside their code.
"""

from __future__ import annotations

from sglang.srt.plugins.hook_registry import HookRegistry

from .data_parallel import DATA_PARALLEL_HOOKS
from .prefix_cache.admission import ADMISSION_HOOKS
from .routing.controller import ROUTING_HOOKS
from .serving import SERVING_HOOKS
from .speculation import SPECULATION_HOOKS

UPSTREAM_V4_DEFAULTS = "sglang.srt.arg_groups.deepseek_v4_hook.apply_deepseek_v4_defaults"
KV_POOL_BUILDER = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_token_to_kv_pool"
POOL_SIZING = "sglang.srt.model_executor.pool_configurator.create_memory_pool_configurator"
CHAT_ENCODING = "sglang.srt.entrypoints.openai.chat_encoding.resolve_chat_encoding_spec"
INTERNAL_STATE = (
    "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController.get_internal_state"
)
RADIX_CACHE_FACTORY = "sglang.srt.mem_cache.registry.default_radix_cache_factory"
# SGLang's HiCache auto-sizing: the device bytes the host tier mirrors (prefix_cache/host_tier_size.py).
HICACHE_AUTO_SIZING = "sglang.srt.mem_cache.hicache_auto_size._estimate_hicache_bytes"
CONFIG_LOADING = "sglang.srt.utils.hf_transformers.config.get_config"
CPU_PADDING = "sglang.srt.configs.update_config.adjust_config_with_unaligned_cpu_tp"
THREAD_BINDING = "sglang.srt.utils.numa_utils.init_threads_binding"
STATE_UPDATES = (
    "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController._update_handlers"
)
# On the CPU platform, FP8 checkpoints' methods dequantize per use (quantization.py).
FP8_METHOD_CHOICE = "sglang.srt.layers.quantization.fp8.Fp8Config.get_quant_method"
FP8_ACTIVATION_DTYPES = "sglang.srt.layers.quantization.fp8.Fp8Config.get_supported_act_dtypes"
REQUIRED_HOOKS = (
    CONFIG_LOADING,
    CPU_PADDING,
    THREAD_BINDING,
    UPSTREAM_V4_DEFAULTS,
    KV_POOL_BUILDER,
    POOL_SIZING,
    CHAT_ENCODING,
    INTERNAL_STATE,
    *SERVING_HOOKS,
    RADIX_CACHE_FACTORY,
    HICACHE_AUTO_SIZING,
    STATE_UPDATES,
    *ADMISSION_HOOKS,
    FP8_METHOD_CHOICE,
    FP8_ACTIVATION_DTYPES,
    *DATA_PARALLEL_HOOKS,
    *ROUTING_HOOKS,
    *SPECULATION_HOOKS,
)


def require_hooks_applied() -> None:
    """Refuse to start when a hook this plugin needs did not apply (SGLang only logs that)."""
    missing = [target for target in REQUIRED_HOOKS if target not in HookRegistry._patched]
    if missing:
        raise RuntimeError(
            f"sglang-dsv4: hooks not applied: {missing}. This SGLang version is not the one the plugin "
            "supports (sglang==0.5.23); set SGLANG_DSV4_PLUGIN_DISABLE=1 to use upstream's V4 path."
        )
