"""What SGLang's plugin loader calls (entry point group ``sglang.srt.plugins``).

For checkpoints whose architecture is ``DeepseekV4ForCausalLM`` the plugin puts this
package's model, KV pool and attention backend in place of upstream's V4 path, and
takes over the decisions upstream forces for that architecture (its ``dsv4`` backend,
256-token pages, FP8 KV cache, a pool that refuses out-of-tree platforms), through
SGLang's registries and hooks only. ``SGLANG_DSV4_PLUGIN_DISABLE=1`` leaves V4 to upstream.

The SGLang functions it hooks are named here by dotted path (the data-parallel, routing, serving,
admission and speculation hooks name their own targets beside their code), all of them in
:data:`REQUIRED_HOOKS`. SGLang only logs a hook whose target moved (another SGLang version); the
launcher and the model refuse to start instead
(:func:`~sglang_dsv4.required_hooks.require_hooks_applied`), naming the hooks that did not apply.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from .config import check_tensor_parallel
from .data_parallel import DATA_PARALLEL_HOOKS, check_attention_data_parallel, register_data_parallel_hooks
from .disaggregation import (
    attach_cache_manager,
    check_disaggregation,
    disaggregation_hooks,
    register_disaggregation_hooks,
    request_rows,
    transfer_report,
    use_legacy_tcp_framing,
)
from .emulation import (
    FREE_LIST_OPERATIONS,
    HOST_TIER_LOAD,
    HOST_TIER_WRITE_BACK,
    RESULT_COPY,
    check_emulation,
    emulating,
)
from .platform import bind_rank_threads, host_sharing
from .prefix_cache.admission import ADMISSION_HOOKS
from .required_hooks import require, require_hooks_applied
from .routing.controller import ROUTING_HOOKS, register_routing_hooks
from .served_config import ARCHITECTURE, attach_checkpoint_config, is_v4_checkpoint, served_config
from .serving import SERVING_HOOKS, register_serving_hooks
from .settings import settings
from .speculation import SPECULATION_HOOKS, check_speculation, register_speculation_hooks, verify_tokens

logger = logging.getLogger(__name__)

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
    *disaggregation_hooks(),  # the Mooncake ones only with the pd extra installed
)


def register() -> None:
    """Entry point: register the model, the attention backend, the overrides and the hooks."""
    if settings().disable:
        logger.info("sglang-dsv4 disabled (SGLANG_DSV4_PLUGIN_DISABLE); DeepSeek-V4 uses upstream's path")
        return
    require(REQUIRED_HOOKS + ((RESULT_COPY, *FREE_LIST_OPERATIONS) if emulating() else ()))
    _register_model()
    _register_attention_backend()
    _register_server_arg_overrides()
    HookRegistry.register(CONFIG_LOADING, attach_checkpoint_config, HookType.AFTER)
    HookRegistry.register(CPU_PADDING, _keep_v4_unpadded, HookType.AROUND)
    HookRegistry.register(THREAD_BINDING, bind_rank_threads, HookType.AROUND)
    HookRegistry.register(UPSTREAM_V4_DEFAULTS, _skip_upstream_v4_defaults, HookType.AROUND)
    HookRegistry.register(KV_POOL_BUILDER, _build_v4_kv_pool, HookType.AROUND)
    HookRegistry.register(POOL_SIZING, _size_v4_pools, HookType.AROUND)
    HookRegistry.register(CHAT_ENCODING, _prefer_checkpoint_chat_template, HookType.AROUND)
    HookRegistry.register(INTERNAL_STATE, _report_pool_usage, HookType.AFTER)
    _register_quantization_hooks()
    register_data_parallel_hooks()
    register_routing_hooks()
    register_serving_hooks()
    register_speculation_hooks()
    register_disaggregation_hooks()
    _register_prefix_cache()
    if emulating():
        _register_emulation()


def _register_emulation() -> None:
    """``SGLANG_DSV4_PLUGIN_EMULATE``: the emulated model in place of ours, the host waiting for the emulated
    device at the result copy, the allocator's free-list operations timed as a GPU's, the host tier's copies as
    ours on an H200 (:mod:`sglang_dsv4.emulation`)."""
    from sglang.srt.models.registry import ModelRegistry

    from .emulation.device import on_the_device, wait_at_result_copy
    from .emulation.host_tier import timed_load, timed_write_back
    from .emulation.model import EmulatedDeepseekV4ForCausalLM

    ModelRegistry.models[ARCHITECTURE] = EmulatedDeepseekV4ForCausalLM
    HookRegistry.register(RESULT_COPY, wait_at_result_copy, HookType.AROUND)
    for operation in FREE_LIST_OPERATIONS:
        HookRegistry.register(operation, on_the_device, HookType.AROUND)
    HookRegistry.register(HOST_TIER_LOAD, timed_load, HookType.AROUND)
    HookRegistry.register(HOST_TIER_WRITE_BACK, timed_write_back, HookType.AROUND)


def _register_model() -> None:
    from sglang.srt.models.registry import ModelRegistry

    from .model.sglang_draft import DRAFT_ARCHITECTURE, DeepseekV4ForCausalLMNextN
    from .model.sglang_model import DeepseekV4ForCausalLM
    from .model.fused_moe import register_cpu_forward
    from .platform import DISPATCH_KEY

    ModelRegistry.models[ARCHITECTURE] = DeepseekV4ForCausalLM
    ModelRegistry.models[DRAFT_ARCHITECTURE] = DeepseekV4ForCausalLMNextN
    register_cpu_forward(DISPATCH_KEY)


def _register_quantization_hooks() -> None:
    from .quantization import cpu_activation_dtypes, cpu_quant_method

    HookRegistry.register(FP8_METHOD_CHOICE, cpu_quant_method, HookType.AROUND)
    HookRegistry.register(FP8_ACTIVATION_DTYPES, cpu_activation_dtypes, HookType.AROUND)


def _register_attention_backend() -> None:
    from sglang.srt.layers.attention.attention_registry import register_attention_backend
    from sglang.srt.server_args import add_attention_backend_choices

    for name, backend in _attention_backends().items():
        register_attention_backend(name)(backend)
    add_attention_backend_choices(list(_attention_backends()))


def _attention_backends() -> dict[str, type]:
    """Ours, the default first: the batched backend, and the per-request torch reference (the oracle); under
    emulation only the emulated one."""
    from .attention_backend import batched_backend, torch_reference

    if emulating():
        from .emulation import backend

        return {backend.NAME: backend.EmulatedBackend}
    return {
        batched_backend.NAME: batched_backend.BatchedBackend,
        torch_reference.NAME: torch_reference.TorchReferenceBackend,
    }


def _register_server_arg_overrides() -> None:
    # Upstream's provider for the architecture must be registered first: the last one wins.
    import sglang.srt.arg_groups.model_overrides.deepseek_v4  # noqa: F401
    from sglang.srt.arg_groups.model_override_base import register_model_override

    register_model_override(ARCHITECTURE)(_server_arg_overrides)


def _server_arg_overrides(server_args: Any, hf_config: Any) -> dict:
    """Our attention backend (the batched one unless ``--attention-backend`` names another of
    ours), token-granular pages, one token pool (the prefix cache is ours too:
    :func:`_register_prefix_cache`).

    Called in the launcher before any scheduler starts (after SGLang rewrote ``--dp-size D
    --enable-dp-attention`` to ``--attn-dp-size D``): a config this plugin cannot serve, or a
    ``--tp`` / ``--attn-dp-size`` that does not divide it, stops the launcher here with the
    :class:`ConfigError` naming the key.
    """
    from sglang.srt.arg_groups.overrides import resolving_view

    from .radix_cache import check_cache_tiers

    require_hooks_applied()
    view = resolving_view(server_args)
    check_tensor_parallel(served_config(hf_config), view.tp_size, view.attn_dp_size)
    check_attention_data_parallel(view)
    check_speculation(view, hf_config)
    check_cache_tiers(view)
    check_disaggregation(view)
    use_legacy_tcp_framing(view)
    if emulating():
        check_emulation(view)
    backends = list(_attention_backends())
    requested = server_args.attention_backend  # the command line's (providers read the raw arguments)
    backend = requested if requested in backends else backends[0]
    return {"attention_backend": backend, "page_size": 1, "disable_hybrid_swa_memory": True}


def _register_prefix_cache() -> None:
    """The dsv4 radix cache: the default for V4 checkpoints, and ``--radix-cache-backend dsv4``."""
    from sglang.srt.mem_cache.registry import register_radix_cache_backend, registered_radix_cache_backends

    from .prefix_cache.admission import register_admission_hooks
    from .prefix_cache.host_tier_size import estimate_hicache_bytes
    from .radix_cache import build_v4_radix_cache

    if "dsv4" not in registered_radix_cache_backends():  # a second register() in one process (tests) keeps it
        register_radix_cache_backend("dsv4", build_v4_radix_cache)
    HookRegistry.register(RADIX_CACHE_FACTORY, _default_to_v4_radix_cache, HookType.AROUND)
    HookRegistry.register(HICACHE_AUTO_SIZING, estimate_hicache_bytes, HookType.AROUND)
    HookRegistry.register(STATE_UPDATES, _add_prefix_cache_updates, HookType.AROUND)
    register_admission_hooks()


def _default_to_v4_radix_cache(original, ctx):
    from .kv_cache import V4KVPool
    from .radix_cache import build_v4_radix_cache

    if isinstance(ctx.params.token_to_kv_pool_allocator.get_kvcache(), V4KVPool):
        return build_v4_radix_cache(ctx)
    return original(ctx)


def _add_prefix_cache_updates(original, controller) -> dict:
    """``/set_internal_state`` accepts ``dsv4_prefix_hits``, ``dsv4_window_policy`` and
    ``dsv4_checkpoint_retention``."""
    from .radix_cache import runtime_mode_updates

    return {**original(controller), **runtime_mode_updates(controller.scheduler.tree_cache)}


def _prefer_checkpoint_chat_template(original, *, hf_config: Any, tokenizer: Any, tool_call_parser=None):
    """A V4 checkpoint that ships a chat template is rendered with it.

    Upstream picks its DeepSeek-V4 encoder for any V4 architecture, and for ``--tool-call-parser deepseekv4``;
    it needs V4's own special tokens, which a checkpoint with its own template (the tiny one) need not have.
    With the checkpoint's template the replies go through SGLang's usual parsers (``--tool-call-parser
    deepseekv4``, ``--reasoning-parser deepseek-v4``), which read the DSML the template writes
    (``tests/test_chat_template_parsers.py`` checks they agree).
    """
    spec = original(hf_config=hf_config, tokenizer=tokenizer, tool_call_parser=tool_call_parser)
    if spec == "dsv4" and tool_call_parser in (None, "deepseekv4") and getattr(tokenizer, "chat_template", None):
        return None
    return spec


def _keep_v4_unpadded(original, model_config: Any, load_config: Any, tp_size: int):
    """SGLang pads unaligned dimensions on a CPU device; a V4 config is left as the checkpoint has it (the
    launcher refused a ``--tp`` that does not divide it: :func:`_server_arg_overrides`)."""
    if is_v4_checkpoint(model_config.hf_config):
        return model_config
    return original(model_config, load_config, tp_size)


def _skip_upstream_v4_defaults(original, server_args: Any, model_arch: str) -> None:
    """Upstream's V4 defaults configure its own kernels (FP8 KV cache, dsv4 backends): not ours."""
    logger.info("sglang-dsv4 serves %s; upstream's DeepSeek-V4 defaults are not applied", model_arch)


def _size_v4_pools(original, configurator):
    """Split the memory budget with the V4 pool layout (bytes per token, bytes per request)."""
    from sglang.srt.configs.model_config import is_deepseek_v4
    from sglang.srt.runtime_context import get_schedule

    if not is_deepseek_v4(configurator.model_config.hf_config):
        return original(configurator)
    from .memory_pool.layout import PoolLayout
    from .memory_pool.sizing import V4PoolConfigurator

    config = served_config(configurator.model_config.hf_config)
    layout = PoolLayout(config, configurator.kv_cache_dtype, verify_tokens())
    context = configurator.model_config.context_len
    if emulating():
        from .emulation.pools import EmulatedPoolConfigurator

        rows, fraction = get_schedule().max_running_requests, get_schedule().mem_fraction_static
        return EmulatedPoolConfigurator(layout, rows, context, settings().emulate_gpus, fraction)
    return V4PoolConfigurator(layout, get_schedule().max_running_requests, context, host_sharing())


def _build_v4_kv_pool(original, configurator, *, sizes, is_dsa_model, is_dsv4_model, req_to_token_pool):
    if not is_dsv4_model:
        return original(
            configurator,
            sizes=sizes,
            is_dsa_model=is_dsa_model,
            is_dsv4_model=is_dsv4_model,
            req_to_token_pool=req_to_token_pool,
        )
    from .kv_cache import V4KVPool
    from .memory_pool.ledger import KVLedger

    if configurator.is_draft_worker:
        # The EAGLE draft's view of the target's pool (its MTP layer's rows are there): SGLang hands the draft
        # worker the target's request pool, whose auxiliary cache is the target's cache manager.
        return V4KVPool(
            size=sizes.max_total_num_tokens,
            page_size=configurator.pool_page_size,
            config=served_config(configurator.model_config.hf_config),
            kv_dtype=configurator.kv_cache_dtype,
            max_requests=req_to_token_pool.size,
            max_context=req_to_token_pool.max_context_len,
            device=configurator.device,
            shared=req_to_token_pool._aux_cache,
        )
    pool = V4KVPool(
        size=sizes.max_total_num_tokens,
        page_size=configurator.pool_page_size,
        config=served_config(configurator.model_config.hf_config),
        kv_dtype=configurator.kv_cache_dtype,
        max_requests=request_rows(req_to_token_pool),
        max_context=req_to_token_pool.max_context_len,
        device=configurator.device,
        verify_tokens=verify_tokens(),
        storage_class=_pool_storage(),
    )
    # SGLang has each request's V4 rows reserved before a forward and returned when it frees the
    # request, through the request pool's auxiliary cache: the cache manager.
    attach_cache_manager(req_to_token_pool, pool.manager)
    logger.info(
        "sglang-dsv4 KV pool: %d token slots, %d request rows, %.3f GiB allocated; KV ledger:\n%s",
        sizes.max_total_num_tokens,
        req_to_token_pool.size,
        pool.storage.allocated_bytes / 2**30,
        KVLedger(pool.storage.config, configurator.kv_cache_dtype, pool.storage.verify_tokens).table(
            [req_to_token_pool.max_context_len]
        ),
    )
    return pool


def _pool_storage() -> type:
    from .memory_pool.storage import V4PoolStorage

    if emulating():
        from .emulation.pools import WidthlessPoolStorage

        return WidthlessPoolStorage
    return V4PoolStorage


def _report_pool_usage(result, controller, recv_req) -> None:
    """Add the V4 pools' totals, free and evictable counts, the rank's resident weight bytes, and what the DP
    controller's router sent it, to ``/server_info``."""
    from .kv_cache import V4KVPool
    from .routing.report import rank_report

    scheduler = controller.scheduler
    allocator = scheduler.token_to_kv_pool_allocator
    pool = allocator.get_kvcache()
    if not isinstance(pool, V4KVPool):
        return
    from sglang.srt.runtime_context import get_parallel

    result.internal_state["attn_dp_rank"] = get_parallel().attn_dp_rank
    if scheduler.disaggregation_mode.value != "null":
        result.internal_state["dsv4_transfer"] = transfer_report()
    routing = rank_report(get_parallel().attn_dp_rank)
    if routing is not None:
        result.internal_state["dsv4_routing"] = routing
    result.internal_state["dsv4_pools"] = {
        "token_slots": {
            "total": scheduler.max_total_num_tokens,
            "free": allocator.available_size(),
            "evictable": scheduler.tree_cache.evictable_size(),
        },
        "request_rows": {
            "total": pool.storage.tables.request_rows - 1,
            "free": scheduler.req_to_token_pool.available_size(),
        },
        **pool.storage.usage(),
        "allocated_bytes": pool.storage.allocated_bytes,
    }
    host = getattr(scheduler.tree_cache, "host", None)
    if host is not None:
        host_rows = {**host.pools.usage(), "allocated_bytes": host.pools.allocated_bytes}
        result.internal_state["dsv4_pools"]["host_tier"] = host_rows
    if emulating():
        from .emulation import emulation_report

        result.internal_state["dsv4_emulation"] = emulation_report(scheduler)
    resident = _over_request_group(_resident_bytes(scheduler.tp_worker.model_runner.model))
    result.internal_state["dsv4_weights"] = {"resident_bytes_per_rank": resident}
    if hasattr(scheduler.tree_cache, "modes"):
        tree = scheduler.tree_cache
        digests = _over_request_group(tree.digest())
        report = {**tree.modes(), **tree.checkpoint_report(), "rows_miscounted": tree.audit()}
        report["tp_digest_mismatches"] = sum(digest != digests[0] for digest in digests)
        result.internal_state["dsv4_prefix_cache"] = report


def _over_request_group(value: Any) -> list[Any]:
    """``value`` from every rank that holds this rank's requests, in rank order: the TP group, or under
    attention DP this DP rank's attention-TP group (every rank of it runs this request's hooks)."""
    from sglang.srt.layers.dp_attention import get_dp_tp_group

    group = get_dp_tp_group()
    if group is None or group.world_size == 1:
        return [value]
    values = [None] * group.world_size
    torch.distributed.all_gather_object(values, value, group=group.cpu_group)
    return values


def _resident_bytes(model: Any) -> int:
    """Bytes of the model's parameters and buffers on this rank (what the weight ledger predicts)."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)
