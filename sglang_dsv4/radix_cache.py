"""The V4 prefix cache as SGLang's radix cache: what SGLang calls (the radix-cache factory, the
``/set_internal_state`` handlers, and the launcher's check of cache tiers and their flags).

An SGLang adapter beside :mod:`.kv_cache`, above :mod:`.prefix_cache`: the factory is handed SGLang's pool and
builds the tree over the V4 pool's cache manager.
"""

from __future__ import annotations

from typing import Any

from .config import ConfigError
from .kv_cache import V4KVPool
from .memory_pool.host_pools import allocation_bytes, host_rows_for_bytes
from .memory_pool.storage import V4PoolStorage
from .prefix_cache import MODE_CODES
from .prefix_cache.host_tier import WRITE_POLICIES, HostTier
from .prefix_cache.host_tier_size import check_fits_host_memory, host_tier_bytes
from .prefix_cache.tree import V4RadixCache
from .settings import settings

# SGLang's HiCache transfer settings, at their defaults: the V4 host tier copies rows in the device pool's own
# formats, so neither an I/O backend nor a host layout applies to it.
UNUSED_HICACHE_DEFAULTS = {"hicache_io_backend": "kernel", "hicache_mem_layout": "page_first"}


def check_cache_tiers(view: Any) -> None:
    """Refuse, at launch, what the V4 prefix cache has no tier for: LMCache (it copies a KV layout V4's pool does
    not have), and under ``--enable-hierarchical-cache`` a storage tier, a host buffer without a cache, other I/O
    settings than the defaults it does not use, and speculation."""
    if view.enable_lmcache:
        raise ConfigError("--enable-lmcache: DeepSeek-V4's pool rows and checkpoints have no LMCache layout; leave it "
                          "off")
    if not view.enable_hierarchical_cache:
        return
    for refused, reason in _host_tier_refusals(view):
        if refused:
            raise ConfigError(f"--enable-hierarchical-cache: {reason}")


def _host_tier_refusals(view: Any) -> list[tuple[bool, str]]:
    refusals = [
        (
            view.hicache_storage_backend is not None,
            f"--hicache-storage-backend {view.hicache_storage_backend}: DeepSeek-V4's host tier has no storage "
            "tier below it; leave the flag off",
        ),
        (
            view.hicache_host_memory_mode != "cache",
            f"--hicache-host-memory-mode {view.hicache_host_memory_mode}: DeepSeek-V4's host tier keeps what the "
            "device evicts (mode cache); a staging buffer has nothing to hit without a storage tier",
        ),
        (
            bool(view.speculative_algorithm),
            "DeepSeek-V4's host tier is not built for speculative decoding yet; leave one of the two off",
        ),
    ]
    for name, default in UNUSED_HICACHE_DEFAULTS.items():
        value = getattr(view, name)
        flag = "--" + name.replace("_", "-")
        refusals.append(
            (
                value != default,
                f"{flag} {value}: DeepSeek-V4's host tier copies rows in the device pool's own formats and uses no "
                f"{flag}; leave it at its default ({default})",
            )
        )
    return refusals


def build_v4_radix_cache(ctx: Any) -> V4RadixCache:
    """The factory SGLang calls with its ``TreeCacheBuildContext``."""
    pool = ctx.params.token_to_kv_pool_allocator.get_kvcache()
    if not isinstance(pool, V4KVPool):
        raise ValueError(f"the dsv4 radix cache serves DeepSeek-V4's pool only, not {type(pool).__name__}")
    ctx.params.disable = ctx.disable_radix_cache
    # Under EAGLE SGLang keys its radix tree by token pairs, since its draft's KV at a position depends on the next
    # token. Ours keys by tokens: the MTP layer's rows ride in the V4 pool's window and records, and a resumed
    # request's last one, made with another next token, can only make drafts worse, never the output.
    ctx.params.is_eagle = False
    chosen = settings()
    return V4RadixCache(
        ctx.params,
        pool.manager,
        prefix_hits=chosen.prefix_hits,
        window_policy=chosen.window_policy,
        checkpoint_interval=chosen.checkpoint_interval,
        host_tier=build_host_tier(ctx.server_args, pool.storage) if ctx.enable_hierarchical_cache else None,
        unmatched_prompt_tail=tokens_left_to_prefill(ctx.server_args),
    )


def tokens_left_to_prefill(server_args: Any) -> int:
    """Tokens at a prompt's end that a decode instance's radix cache never matches: one (SGLang's decode side does
    not cap its match, and the prefill instance must compute the prompt's last token to sample the first output
    token); none elsewhere (SGLang caps the match itself)."""
    return int(server_args.disaggregation_mode == "decode" and server_args.disaggregation_decode_enable_radix_cache)


def build_host_tier(server_args: Any, storage: V4PoolStorage) -> HostTier:
    """The host tier ``--enable-hierarchical-cache`` asks for: ``--hicache-size`` GB, or the ratio (SGLang's
    auto-sizing, when it ran, has lowered it to fit this host), refused when its rows would take more of this
    host's memory than is free (none under emulation: rows of no width); written per ``--hicache-write-policy``."""
    import psutil
    from sglang.srt.runtime_context import get_memory

    size = host_tier_bytes(storage, ratio=get_memory().hicache_ratio, size_gb=server_args.hicache_size)
    rows = host_rows_for_bytes(storage, size)
    check_fits_host_memory(allocation_bytes(storage, rows), psutil.virtual_memory().available)
    return HostTier(storage, rows, WRITE_POLICIES[server_args.hicache_write_policy])


def runtime_mode_updates(tree_cache: Any) -> dict[str, Any]:
    """``/set_internal_state`` handlers for the two modes (none when the tree is not ours)."""
    from sglang.srt.managers.scheduler_components.internal_state import UpdateRejected, _UpdateHandler

    if not isinstance(tree_cache, V4RadixCache):
        return {}

    def validate(key: str, value: Any) -> None:
        names = MODE_CODES[key]
        if value not in range(len(names)):
            allowed = ", ".join(f"{code} ({name})" for code, name in enumerate(names))
            raise UpdateRejected(f"{key} is {value!r}; allowed: {allowed}")

    def apply(key: str, value: Any) -> None:
        tree_cache.set_modes(**{key.removeprefix("dsv4_"): MODE_CODES[key][int(value)]})

    return {key: _UpdateHandler(validate, apply) for key in MODE_CODES}
