"""How many rows of each kind the host tier holds, from SGLang's HiCache flags.

The host tier mirrors the device rows a cached prefix keeps: window slots (checkpoint windows), checkpoint
records and compressed entry rows (each with its indexer keys). ``--hicache-ratio`` is host rows per device row of
each kind; ``--hicache-size`` (GB, 10^9 bytes as SGLang's host pools count) sets the ratio that makes the host
rows that many bytes. With neither flag SGLang's auto-sizing picks the ratio that fits this host's memory, from
:func:`mirrored_device_bytes` (the hook :func:`estimate_hicache_bytes`, which SGLang's own estimate cannot give
for the V4 pool).
"""

from __future__ import annotations

from typing import Any

from ..config import ConfigError
from ..memory_pool.storage import V4PoolStorage

GB = 10**9


def mirrored_bytes_per_row(storage: V4PoolStorage) -> dict[str, int]:
    """Bytes of one row of each kind the host tier mirrors, by the audit's names for the kinds."""
    layout = storage.layout
    per_row = {"window_slots": layout.window_slot_bytes, "checkpoint_records": layout.record_bytes}
    for ratio in storage.entry_rows:
        buffers = [b for b in layout.compressed_buffers() if b.ratio == ratio]
        per_row[f"ratio_{ratio}_entries"] = sum(layout.row_bytes(b) for b in buffers)
    return per_row


def device_rows(storage: V4PoolStorage) -> dict[str, int]:
    """Rows of each mirrored kind the device pool holds."""
    rows = {"window_slots": storage.window_slots.capacity, "checkpoint_records": storage.records.capacity}
    rows.update({f"ratio_{r}_entries": shared.capacity for r, shared in storage.entry_rows.items()})
    return rows


def mirrored_device_bytes(storage: V4PoolStorage) -> int:
    per_row = mirrored_bytes_per_row(storage)
    return sum(rows * per_row[kind] for kind, rows in device_rows(storage).items())


def host_rows(storage: V4PoolStorage, *, ratio: float, size_gb: int) -> dict[str, int]:
    """Host rows of each kind: ``ratio`` times the device's, or as many as ``size_gb`` holds when it is set."""
    scale = size_gb * GB / mirrored_device_bytes(storage) if size_gb > 0 else ratio
    return {kind: int(rows * scale) for kind, rows in device_rows(storage).items()}


def host_bytes(storage: V4PoolStorage, rows: dict[str, int]) -> int:
    per_row = mirrored_bytes_per_row(storage)
    return sum(count * per_row[kind] for kind, count in rows.items())


def check_fits_host_memory(requested_bytes: int, available_bytes: int) -> None:
    """Refuse a host tier larger than the host memory free now (SGLang's host pools refuse the same way)."""
    if requested_bytes > available_bytes:
        raise ConfigError(
            f"--enable-hierarchical-cache: the host tier asks {requested_bytes / GB:.2f} GB of host memory and "
            f"{available_bytes / GB:.2f} GB is free; lower --hicache-ratio or --hicache-size"
        )


def estimate_hicache_bytes(original, params: Any, draft_plan: Any) -> int:
    """SGLang's HiCache auto-sizing asks the device bytes its host mirrors scale with: for the V4 pool, the rows
    the host tier mirrors."""
    from ..kv_cache import V4KVPool

    pool = params.token_to_kv_pool_allocator.get_kvcache()
    if isinstance(pool, V4KVPool):
        return mirrored_device_bytes(pool.storage)
    return original(params, draft_plan)
