"""What SGLang calls: the radix-cache factory, the ``/set_internal_state`` handlers, and the launcher's check of
cache tiers."""

from __future__ import annotations

from typing import Any

from ..config import ConfigError
from ..kv_cache import V4KVPool
from ..settings import settings
from . import MODE_CODES
from .tree import V4RadixCache

# SGLang's tiers below the device pool, each copying KV in its own layout, not the V4 pool's rows and records.
LOWER_TIERS = {"--enable-hierarchical-cache": "enable_hierarchical_cache", "--enable-lmcache": "enable_lmcache"}


def check_cache_tiers(view: Any) -> None:
    """Refuse, at launch, a cache tier below the device pool: the V4 prefix cache keeps its checkpoints
    in device memory only (SGLang's HiCache would stop the scheduler in its first loop, LMCache copies a
    KV layout V4's pool does not have)."""
    for flag, name in LOWER_TIERS.items():
        if getattr(view, name):
            raise ConfigError(
                f"{flag}: DeepSeek-V4's prefix cache keeps its checkpoints in device memory only (no host or "
                f"storage tier in this sglang-dsv4); leave {flag} off"
            )


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
    )


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
