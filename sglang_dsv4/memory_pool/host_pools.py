"""The host tier's rows: the kinds of row the prefix cache keeps, in CPU memory, as the device pool stores them.

The prefix cache keeps three kinds of row in the device pool (:class:`~.storage.V4PoolStorage`): window slots
(every layer's raw KV of one token), checkpoint records (every layer's compressor state at one position) and,
per compression ratio, entry rows (every layer's compressed entry, and indexer key, of one block). The host tier
holds the same kinds in CPU tensors of the device buffers' row shapes and dtypes (FP8-packed where the device
is), so a row is copied as stored, bit for bit, both ways. Each kind hands its rows out through its own
:class:`~.shared_rows.SharedRows`: :meth:`HostRowKind.save` takes only what is free and answers ``None``
when the host is short (making room is the prefix cache's, :mod:`sglang_dsv4.prefix_cache.tree`).

On our CPU platform the device buffers are CPU tensors too; the copies are ``index_select`` / ``index_copy_``
whatever the device, synchronous.
"""

from __future__ import annotations

import torch

from .shared_rows import SharedRows
from .storage import V4PoolStorage

WINDOW_SLOTS, RECORDS = "window_slots", "checkpoint_records"


def entry_kind(ratio: int) -> str:
    """The name of the kind of entry rows of ``ratio`` (as :meth:`V4PoolStorage.usage` names it)."""
    return f"ratio_{ratio}_entries"


class HostRowKind:
    """One kind of row on the host: its allocator, and each device buffer of the kind with its host twin."""

    def __init__(self, rows: SharedRows, device_buffers: list[torch.Tensor]):
        self.rows = rows
        self.device_buffers = device_buffers
        self.host_buffers = [torch.zeros(rows.capacity + 1, *b.shape[1:], dtype=b.dtype) for b in device_buffers]

    def save(self, device_rows: torch.Tensor) -> torch.Tensor | None:
        """Host rows holding copies of ``device_rows`` (one reference each), or ``None`` when fewer are free."""
        host_rows = self.rows.try_alloc(len(device_rows))
        if host_rows is not None:
            for host, device in zip(self.host_buffers, self.device_buffers, strict=True):
                host.index_copy_(0, host_rows, device.index_select(0, device_rows.to(device.device)).cpu())
        return host_rows

    def restore(self, host_rows: torch.Tensor, device_rows: torch.Tensor) -> None:
        """Copy host rows ``host_rows`` into device rows ``device_rows`` (both held by the caller)."""
        for host, device in zip(self.host_buffers, self.device_buffers, strict=True):
            rows = host.index_select(0, host_rows).to(device.device)
            device.index_copy_(0, device_rows.to(device.device), rows)

    @property
    def row_bytes(self) -> int:
        """The bytes of one row (all its buffers')."""
        return _row_bytes(self.host_buffers)

    @property
    def allocated_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.host_buffers)


class HostPools:
    """The host twins of the device pool's window slots, checkpoint records and entry rows, ``rows[kind]``
    of each kind (named as :meth:`V4PoolStorage.usage` names them; :func:`host_rows_for_bytes` sizes them)."""

    def __init__(self, storage: V4PoolStorage, rows: dict[str, int]):
        kinds = {
            name: HostRowKind(SharedRows(rows[name], f"host {device_rows.name}"), buffers)
            for name, (device_rows, buffers) in device_kinds(storage).items()
        }
        self.window, self.records = kinds[WINDOW_SLOTS], kinds[RECORDS]
        self.entries = {ratio: kinds[entry_kind(ratio)] for ratio in storage.entry_rows}

    def kinds(self) -> dict[str, HostRowKind]:
        """Every kind of row, by name."""
        return {WINDOW_SLOTS: self.window, RECORDS: self.records, **{entry_kind(r): k for r, k in self.entries.items()}}

    def usage(self) -> dict[str, dict[str, int]]:
        """Per kind of row: how many there are and how many are free."""
        return {name: kind.rows.usage() for name, kind in self.kinds().items()}

    @property
    def allocated_bytes(self) -> int:
        return sum(kind.allocated_bytes for kind in self.kinds().values())

    @property
    def held_bytes(self) -> int:
        """The bytes of the rows handed out."""
        return sum((kind.rows.capacity - kind.rows.free) * kind.row_bytes for kind in self.kinds().values())


def host_rows_for_bytes(storage: V4PoolStorage, capacity_bytes: int) -> dict[str, int]:
    """Rows of each kind for a host tier of at most ``capacity_bytes`` (padding rows included), in the device
    pool's proportions: each kind's device row count times the same factor."""
    kinds = {name: (rows, _row_bytes(buffers)) for name, (rows, buffers) in device_kinds(storage).items()}
    padding = sum(row_bytes for _, row_bytes in kinds.values())
    device_bytes = sum(rows.capacity * row_bytes for rows, row_bytes in kinds.values())
    share = max(0, capacity_bytes - padding) / device_bytes
    return {name: int(rows.capacity * share) for name, (rows, _) in kinds.items()}


def device_kinds(storage: V4PoolStorage) -> dict[str, tuple[SharedRows, list[torch.Tensor]]]:
    """Every kind of device row the prefix cache keeps, by name: its allocator and its buffers."""
    return {
        WINDOW_SLOTS: (storage.window_slots, list(storage.window)),
        RECORDS: (storage.records, list(storage.checkpoint_state.values())),
        **{
            entry_kind(ratio): (rows, [b for key, b in storage.compressed.items() if storage.ratio[key] == ratio])
            for ratio, rows in storage.entry_rows.items()
        },
    }


def _row_bytes(buffers: list[torch.Tensor]) -> int:
    return sum(b[0].numel() * b.element_size() for b in buffers)
