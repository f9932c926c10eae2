"""``dsv4 emulate``'s server: SGLang's real server for V4-Flash over an emulated H200 (one shared server)."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests
import torch

from sglang_dsv4.config import ConfigError, named_config, parse_config
from sglang_dsv4.emulation import check_emulation
from sglang_dsv4.emulation.model import FIXED_TOKEN
from sglang_dsv4.emulation.pools import EmulatedPoolConfigurator, WidthlessPoolStorage
from sglang_dsv4.emulation.timing import ForwardShape, TimingModel
from sglang_dsv4.launch import running_emulated_server
from sglang_dsv4.memory_pool.host_pools import HostPools, allocation_bytes, host_rows_for_bytes
from sglang_dsv4.memory_pool.layout import PoolLayout
from sglang_dsv4.memory_pool.sizing import DEFAULT_MAX_RUNNING_REQUESTS
from sglang_dsv4.memory_pool.storage import V4PoolStorage
from sglang_dsv4.prefix_cache.host_tier_size import mirrored_device_bytes
from sglang_dsv4.tiny import TINY_CONFIG

CONTEXT = 32768
GPUS = 8


def test_widthless_storage_counts_the_rows_the_real_one_does_in_no_bytes():
    config = parse_config(TINY_CONFIG)
    shape = dict(num_tokens=2048, max_requests=8, max_context=1024, device="cpu")
    real = V4PoolStorage(config, torch.bfloat16, **shape)
    widthless = WidthlessPoolStorage(config, torch.bfloat16, **shape)
    assert widthless.usage() == real.usage()
    assert widthless.allocated_bytes == widthless.tables.device_bytes < real.allocated_bytes


def launch_view(**changes) -> SimpleNamespace:
    """The server arguments ``check_emulation`` reads, as SGLang's defaults leave them, with ``changes``."""
    defaults = dict(
        disable_overlap_schedule=False,
        speculative_algorithm=None,
        enable_hierarchical_cache=False,
        hicache_size=0,
        disaggregation_mode="null",
    )
    return SimpleNamespace(**{**defaults, **changes})


@pytest.mark.parametrize(
    "flag, value",
    [
        ("disable_overlap_schedule", True),
        ("speculative_algorithm", "EAGLE"),
        ("enable_hierarchical_cache", True),
        ("disaggregation_mode", "prefill"),
    ],
)
def test_emulation_refuses_what_it_does_not_model(monkeypatch, flag, value):
    monkeypatch.setenv("SGLANG_DSV4_PLUGIN_EMULATE", "h200")
    view = launch_view()
    check_emulation(view)
    setattr(view, flag, value)
    with pytest.raises(ConfigError, match="--" + flag.replace("_", "-")):
        check_emulation(view)


def test_emulation_takes_a_host_tier_of_the_size_given():
    view = launch_view(enable_hierarchical_cache=True)
    with pytest.raises(ConfigError, match="--hicache-size: the emulated host's memory is not this host's"):
        check_emulation(view)
    view.hicache_size = 200
    check_emulation(view)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_a_widthless_host_tier_has_the_rows_and_bytes_of_the_real_one_in_no_memory(kv_dtype):
    config = parse_config(TINY_CONFIG)
    shape = dict(num_tokens=2048, max_requests=8, max_context=1024, device="cpu")
    real = V4PoolStorage(config, kv_dtype, **shape)
    widthless = WidthlessPoolStorage(config, kv_dtype, **shape)
    capacity = 3 * mirrored_device_bytes(real)
    rows = host_rows_for_bytes(real, capacity)
    assert host_rows_for_bytes(widthless, capacity) == rows
    assert mirrored_device_bytes(widthless) == mirrored_device_bytes(real)
    host, twin = HostPools(real, rows), HostPools(widthless, rows)
    assert twin.capacity_bytes == host.capacity_bytes == host.allocated_bytes - sum(
        kind.row_bytes for kind in host.kinds().values()  # the real tier's padding rows
    )
    assert twin.allocated_bytes == 0 == allocation_bytes(widthless, rows)
    assert allocation_bytes(real, rows) == host.allocated_bytes


@pytest.fixture(scope="module")
def server(log_dir: Path):
    with running_emulated_server("flash", log_path=log_dir / "emulated_flash.log", gpus=GPUS, context_length=CONTEXT) as url:
        yield url


def emulation(url: str) -> dict:
    return requests.get(f"{url}/server_info", timeout=30).json()["internal_states"][0]


def prompt(tokens: int, seed: int) -> list[int]:
    """Token ids in the tiny tokenizer's range, distinct per seed."""
    return [(seed * 7919 + i * 31) % 900 + 20 for i in range(tokens)]


def generate(url: str, ids: list[int], new_tokens: int) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": new_tokens, "ignore_eos": True, "temperature": 0}}
    return requests.post(f"{url}/generate", json=body, timeout=120).json()


def test_openai_completions_answer_with_the_fixed_token(server):
    body = {"model": "emulated", "prompt": "def fix_bug(request):", "max_tokens": 12, "ignore_eos": True}
    reply = requests.post(f"{server}/v1/completions", json=body, timeout=120).json()
    assert reply["usage"]["completion_tokens"] == 12
    assert reply["choices"][0]["finish_reason"] == "length"
    chat = {"model": "emulated", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "ignore_eos": True}
    reply = requests.post(f"{server}/v1/chat/completions", json=chat, timeout=120).json()
    assert reply["usage"]["completion_tokens"] == 5
    output = generate(server, prompt(16, 1), 4)
    assert output["output_ids"] == [FIXED_TOKEN] * 4


def test_pools_have_the_ledgers_capacity_of_one_h200_and_no_weights(server):
    state = emulation(server)
    layout = PoolLayout(named_config("flash"), torch.bfloat16)
    expected = EmulatedPoolConfigurator(layout, DEFAULT_MAX_RUNNING_REQUESTS, CONTEXT, GPUS, 0.85)
    assert state["dsv4_pools"]["token_slots"]["total"] == expected.calculate_pool_sizes(0, 1).max_total_num_tokens
    assert state["dsv4_pools"]["token_slots"]["total"] > 10_000_000  # V4-Flash on one of 8 H200s
    assert state["dsv4_pools"]["allocated_bytes"] == 0
    assert state["dsv4_weights"]["resident_bytes_per_rank"][0] < 4096  # the fixed logits, no parameter
    assert state["dsv4_emulation"]["resident_bytes"] < 8 * 2**30


def test_a_requests_device_time_is_the_timing_models(server):
    timing = TimingModel(named_config("flash"), "flash")
    before = emulation(server)["dsv4_emulation"]["device_time"]
    length, new_tokens = 300, 6
    generate(server, prompt(length, 2), new_tokens)
    after = emulation(server)["dsv4_emulation"]["device_time"]
    expected = timing.forward(ForwardShape((length,), (length,))).total_s + sum(
        timing.forward(ForwardShape((1,), (length + i,))).total_s for i in range(1, new_tokens)
    )
    assert after["forwards"] - before["forwards"] == new_tokens
    assert after["busy_s"] - before["busy_s"] == pytest.approx(expected, abs=2e-3)


def test_the_host_overlaps_the_device_and_waits_only_for_results(server):
    """A long prefill (about a second of H200 time at 32K): the request takes at least the device's time, and the
    host waited for less than that (its own work ran while the device was busy)."""
    before = emulation(server)["dsv4_emulation"]["device_time"]
    started = time.monotonic()
    generate(server, prompt(CONTEXT - 64, 3), 8)
    wall = time.monotonic() - started
    after = emulation(server)["dsv4_emulation"]["device_time"]
    busy = after["busy_s"] - before["busy_s"]
    waited = after["host_waited_s"] - before["host_waited_s"]
    assert busy > 1.0
    assert wall >= busy
    assert 0 < waited < busy


def test_a_resumed_turn_hits_the_prefix_cache_exactly(server):
    first = prompt(777, 4)
    reply = generate(server, first, 5)
    second = first + reply["output_ids"] + prompt(40, 5)
    resumed = generate(server, second, 3)
    assert resumed["meta_info"]["cached_tokens"] == len(first) + 5 - 1
