"""How big the host tier is, from SGLang's HiCache flags.

The host tier mirrors the kinds of device row a cached prefix keeps (window slots, checkpoint records, entry rows
with their indexer keys: :func:`~sglang_dsv4.memory_pool.host_pools.device_kinds`), in the device pool's
proportions. ``--hicache-size`` (GB, 10^9 bytes as SGLang's host pools count) is its size; otherwise
``--hicache-ratio`` times the device bytes of those kinds. With neither flag SGLang's auto-sizing lowers its
default ratio (2.0) until the tier fits this host's memory, from
:func:`~sglang_dsv4.memory_pool.host_pools.mirrored_device_bytes` (through the hook :func:`estimate_hicache_bytes`:
SGLang's own estimate has no case for the V4 pool).
"""

from __future__ import annotations

from typing import Any

from ..config import ConfigError
from ..memory_pool.host_pools import mirrored_device_bytes
from ..memory_pool.storage import V4PoolStorage

GB = 10**9


def host_tier_bytes(storage: V4PoolStorage, *, ratio: float, size_gb: int) -> int:
    """``size_gb`` when set, else ``ratio`` times the mirrored device bytes."""
    return size_gb * GB if size_gb > 0 else int(ratio * mirrored_device_bytes(storage))


def check_fits_host_memory(requested_bytes: int, available_bytes: int) -> None:
    """Refuse a host tier that takes more than the host memory free now (SGLang's host pools refuse the same
    way)."""
    if requested_bytes > available_bytes:
        raise ConfigError(
            f"--enable-hierarchical-cache: the host tier asks {requested_bytes / GB:.2f} GB of host memory and "
            f"{available_bytes / GB:.2f} GB is free; lower --hicache-ratio or --hicache-size"
        )


def estimate_hicache_bytes(original, params: Any, draft_plan: Any) -> int:
    """SGLang's HiCache auto-sizing asks the device bytes its host mirrors scale with: for the V4 pool, the rows
    the host tier mirrors. The V4 pool is known by its storage, so this layer needs nothing from the one above."""
    storage = getattr(params.token_to_kv_pool_allocator.get_kvcache(), "storage", None)
    if isinstance(storage, V4PoolStorage):
        return mirrored_device_bytes(storage)
    return original(params, draft_plan)
