"""The host tier's rows: the device pool's cached kinds of row copied to CPU memory and back, as stored."""

from __future__ import annotations

import pytest
import torch

from sglang_dsv4.kv_cache import V4KVPool
from sglang_dsv4.memory_pool.host_pools import HostPools, device_kinds, host_rows_for_bytes


def device_pool(config, kv_dtype: torch.dtype) -> V4KVPool:
    return V4KVPool(1024, 1, config, kv_dtype, max_requests=4, max_context=1024, device="cpu")


def fill_with_random_bytes(buffers: list[torch.Tensor], generator: torch.Generator) -> None:
    for buffer in buffers:
        raw = buffer.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn])
def test_every_kind_of_row_comes_back_from_the_host_bit_for_bit(tiny_model, kv_dtype):
    """Random bytes in the device rows of every kind (FP8-packed rows under FP8) are saved to the host, the
    device rows are overwritten, and restored into other device rows: equal to what was saved, byte for byte."""
    storage = device_pool(tiny_model.config, kv_dtype).storage
    host = HostPools(storage, {name: 20 for name in device_kinds(storage)})
    generator = torch.Generator().manual_seed(0)
    for name, (rows, buffers) in device_kinds(storage).items():
        fill_with_random_bytes(buffers, generator)
        kind = host.kinds()[name]
        source, target = rows.alloc(4), rows.alloc(4)
        saved = [b[source].clone() for b in buffers]
        held = kind.save(source)
        fill_with_random_bytes(buffers, generator)
        kind.restore(held, target)
        for before, buffer in zip(saved, buffers, strict=True):
            assert torch.equal(before.view(torch.uint8), buffer[target].view(torch.uint8)), name


def test_a_short_host_reports_the_shortage_and_takes_nothing(tiny_model):
    storage = device_pool(tiny_model.config, torch.float32).storage
    host = HostPools(storage, {name: 3 for name in device_kinds(storage)})
    window = host.window
    assert window.save(storage.window_slots.alloc(4)) is None
    assert window.rows.free == 3
    assert window.save(storage.window_slots.alloc(3)) is not None and window.rows.free == 0


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn])
def test_a_host_sized_by_bytes_fits_them_in_the_device_pools_proportions(tiny_model, kv_dtype):
    storage = device_pool(tiny_model.config, kv_dtype).storage
    device_bytes = sum(b.numel() * b.element_size() for _, buffers in device_kinds(storage).values() for b in buffers)
    capacity = 3 * device_bytes
    rows = host_rows_for_bytes(storage, capacity)
    assert 0.98 * capacity <= HostPools(storage, rows).allocated_bytes <= capacity
    window_share = rows["window_slots"] / storage.window_slots.capacity
    for name, (device_rows, _) in device_kinds(storage).items():
        assert rows[name] == pytest.approx(device_rows.capacity * window_share, abs=1), name
