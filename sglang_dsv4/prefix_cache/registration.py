"""What SGLang calls: the radix-cache factory and the ``/set_internal_state`` handlers."""

from __future__ import annotations

from typing import Any

from ..kv_cache import V4KVPool
from ..settings import settings
from . import MODE_CODES
from .tree import V4RadixCache


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
