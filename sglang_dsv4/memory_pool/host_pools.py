"""The host tier's rows: the kinds of row the prefix cache keeps, in CPU memory, as the device pool stores them.

The prefix cache keeps three kinds of row in the device pool (:class:`~.storage.V4PoolStorage`): window slots
(every layer's raw KV of one token), checkpoint records (every layer's compressor state at one position) and,
per compression ratio, entry rows (every layer's compressed entry, and indexer key, of one block). The host tier
holds the same kinds in CPU tensors of the device buffers' row shapes and dtypes (FP8-packed where the device
is), so a row is copied as stored, bit for bit, both ways. Each kind hands its rows out through its own
:class:`~.shared_rows.SharedRows`: :meth:`HostRowKind.save` takes only what is free and answers ``None``
when the host is short (making room is the prefix cache's, :mod:`sglang_dsv4.prefix_cache.tree`).

A row's bytes are the layout's (:func:`kind_row_bytes`: what the device stores, so sizes and bytes moved are a
GPU's whatever the buffers' width here; the emulator's rows have none), the memory taken here the buffers'.

Copies to the host (:meth:`HostRowKind.save`) are synchronous: the rows are read when a node is cached or
evicted. Copies back (:meth:`HostRowKind.restore`) go through :class:`DeviceLoads`: on CUDA, from pinned memory
on a stream of their own, so the host thread never waits and the copy overlaps what runs on other streams (the
previous batch's forward, under SGLang's overlap scheduler); on our CPU platform, where the device buffers are
CPU tensors too, a plain ``index_copy_``.
"""

from __future__ import annotations

import torch

from .layout import PoolLayout
from .shared_rows import SharedRows
from .storage import V4PoolStorage

WINDOW_SLOTS, RECORDS = "window_slots", "checkpoint_records"


def entry_kind(ratio: int) -> str:
    """The name of the kind of entry rows of ``ratio`` (as :meth:`V4PoolStorage.usage` names it)."""
    return f"ratio_{ratio}_entries"


class DeviceLoads:
    """Copies of host rows into device rows.

    On CUDA, a load is issued on a stream of its own: the host rows, in pinned memory (gathered unless they are
    consecutive), are copied to the device and scattered into their rows there, after the stream has waited for
    what the current stream was asked so far (the rows written were free by then); the current stream then waits
    for the load stream. So whatever the current stream is asked next sees the rows, while the host thread never
    blocks and the copy overlaps work on other streams. SGLang's scheduler issues loads on its schedule stream
    while the previous batch's forward runs on its forward stream, and makes the forward stream wait for the
    schedule stream before the next forward: that forward reads the rows loaded, the previous one is not held up.
    Pinned memory freed while a copy from it is in flight is not reused before the copy ends (PyTorch's
    pinned-memory cache records it).

    Host rows are written only after the loads issued have finished reading them (:meth:`finish`): a load may
    read the host buffer in place, and its rows may be freed and taken again meanwhile.

    Elsewhere (our CPU platform): a plain ``index_copy_``, done when issued.
    """

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def copy(
        self, buffers: list[tuple[torch.Tensor, torch.Tensor]], host_rows: torch.Tensor, device_rows: torch.Tensor
    ) -> None:
        """``device[device_rows] = host[host_rows]`` for each ``(host, device)`` of ``buffers``, as seen by
        whatever the current stream runs next."""
        if self.stream is None:
            for host, device in buffers:
                device.index_copy_(0, device_rows.to(device.device), host.index_select(0, host_rows))
            return
        run = consecutive(host_rows, device_rows)
        if run is not None:
            in_host, device_rows = run
        rows = device_rows.to(torch.int64).pin_memory()
        current = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            target = rows.to(self.stream.device, non_blocking=True)
            for host, device in buffers:
                staged = host[in_host] if run is not None else _gathered(host, host_rows)
                device.index_copy_(0, target, staged.to(device.device, non_blocking=True))
        current.wait_stream(self.stream)

    def finish(self) -> None:
        """The host waits until the loads issued are done (at once when none is in flight)."""
        if self.stream is not None:
            self.stream.synchronize()


def _gathered(host: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``host[rows]`` in pinned memory of its own."""
    staged = torch.empty(len(rows), *host.shape[1:], dtype=host.dtype, pin_memory=True)
    return torch.index_select(host, 0, rows, out=staged)


def consecutive(host_rows: torch.Tensor, device_rows: torch.Tensor) -> tuple[slice, torch.Tensor] | None:
    """When ``host_rows`` are consecutive rows (either way; :class:`SharedRows` hands rows out counting down while
    nothing was freed in between): the slice of the host buffer that holds them in ascending order, and
    ``device_rows`` in that order. Else ``None``."""
    step = int(host_rows[1] - host_rows[0]) if len(host_rows) > 1 else 1
    if abs(step) != 1 or not bool((host_rows.diff() == step).all()):
        return None
    if step < 0:
        host_rows, device_rows = host_rows.flip(0), device_rows.flip(0)
    start = int(host_rows[0]) if len(host_rows) else 0
    return slice(start, start + len(host_rows)), device_rows


class HostRowKind:
    """One kind of row on the host: its allocator, and each device buffer of the kind with its host twin (in
    pinned memory when the device is a GPU, so that :class:`DeviceLoads` copies it asynchronously)."""

    def __init__(self, rows: SharedRows, device_buffers: list[torch.Tensor], loads: DeviceLoads, row_bytes: int):
        self.rows = rows
        self.device_buffers = device_buffers
        self.loads = loads
        self.row_bytes = row_bytes  # one row of all its buffers, as the device stores it
        self.host_buffers = [
            torch.zeros(rows.capacity + 1, *b.shape[1:], dtype=b.dtype, pin_memory=b.is_cuda) for b in device_buffers
        ]

    def save(self, device_rows: torch.Tensor) -> torch.Tensor | None:
        """Host rows holding copies of ``device_rows`` (one reference each), or ``None`` when fewer are free."""
        host_rows = self.rows.try_alloc(len(device_rows))
        if host_rows is not None:
            self.loads.finish()
            for host, device in zip(self.host_buffers, self.device_buffers, strict=True):
                host.index_copy_(0, host_rows, device.index_select(0, device_rows.to(device.device)).cpu())
        return host_rows

    def restore(self, host_rows: torch.Tensor, device_rows: torch.Tensor) -> None:
        """Copy host rows ``host_rows`` into device rows ``device_rows`` (both held by the caller), through
        :class:`DeviceLoads`."""
        self.loads.copy(list(zip(self.host_buffers, self.device_buffers, strict=True)), host_rows, device_rows)

    @property
    def allocated_bytes(self) -> int:
        """This host's memory the kind takes."""
        return sum(b.numel() * b.element_size() for b in self.host_buffers)


class HostPools:
    """The host twins of the device pool's window slots, checkpoint records and entry rows, ``rows[kind]``
    of each kind (named as :meth:`V4PoolStorage.usage` names them; :func:`host_rows_for_bytes` sizes them)."""

    def __init__(self, storage: V4PoolStorage, rows: dict[str, int]):
        self.loads = DeviceLoads(storage.device)
        row_bytes = kind_row_bytes(storage.layout)
        kinds = {
            name: HostRowKind(SharedRows(rows[name], f"host {device_rows.name}"), buffers, self.loads, row_bytes[name])
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
    def capacity_bytes(self) -> int:
        """The bytes of every row, as the device stores them."""
        return sum(kind.rows.capacity * kind.row_bytes for kind in self.kinds().values())

    @property
    def held_bytes(self) -> int:
        """The bytes of the rows handed out, as the device stores them."""
        return sum((kind.rows.capacity - kind.rows.free) * kind.row_bytes for kind in self.kinds().values())


def host_rows_for_bytes(storage: V4PoolStorage, capacity_bytes: int) -> dict[str, int]:
    """Rows of each kind for a host tier of at most ``capacity_bytes`` (padding rows included), in the device
    pool's proportions: each kind's device row count times the same factor."""
    padding = sum(kind_row_bytes(storage.layout).values())  # one row of each kind
    share = max(0, capacity_bytes - padding) / mirrored_device_bytes(storage)
    return {name: int(rows.capacity * share) for name, (rows, _) in device_kinds(storage).items()}


def mirrored_device_bytes(storage: V4PoolStorage) -> int:
    """The device bytes of the rows the host tier mirrors."""
    row_bytes = kind_row_bytes(storage.layout)
    return sum(rows.capacity * row_bytes[name] for name, (rows, _) in device_kinds(storage).items())


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


def kind_row_bytes(layout: PoolLayout) -> dict[str, int]:
    """One row's bytes of each kind the prefix cache keeps, by name, as the device stores it: a window slot (every
    layer's raw KV of a token), a checkpoint record, an entry row (every buffer of its ratio)."""
    entries = {ratio: 0 for ratio in {b.ratio for b in layout.compressed_buffers()}}
    for buffer in layout.compressed_buffers():
        entries[buffer.ratio] += layout.row_bytes(buffer)
    return {
        WINDOW_SLOTS: layout.window_slot_bytes,
        RECORDS: layout.record_bytes,
        **{entry_kind(ratio): row_bytes for ratio, row_bytes in entries.items()},
    }


def allocation_bytes(storage: V4PoolStorage, rows: dict[str, int]) -> int:
    """This host's memory that ``rows[kind]`` host rows of each kind take (padding rows included): the device
    buffers' row widths here."""
    kinds = device_kinds(storage)
    return sum((rows[name] + 1) * sum(b[0].nbytes for b in kinds[name][1]) for name in kinds)
