"""``dsv4 emulate``'s server with the host tier: V4-Flash's host rows sized in H200 bytes, its copies timed as ours
on an H200 (one shared server).

The device pool is cut to 64K token slots and 8 request rows (``--max-total-tokens``, ``--max-running-requests``)
so that four 20K-token sessions evict the first to a host tier of 4 GB (``--hicache-size``, SGLang's default write
policy; in the device pool's proportions about six times its rows); the first session's next turn loads its prefix
back. The oracle for the copies' time: the host tier's own count of the bytes it moved, at the per-byte
figures of our copies measured on the H200 (:mod:`sglang_dsv4.emulation.host_tier`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import requests
from test_emulation_server import generate, prompt

from sglang_dsv4.emulation.host_tier import LOAD_ISSUE_S, LOAD_S, SESSION_BYTES, WRITE_BACK_S
from sglang_dsv4.launch import running_emulated_server
from sglang_dsv4.prefix_cache.host_tier_size import GB

HOST_TIER_GB = 4
SESSION = 20_000


@pytest.fixture(scope="module")
def server(log_dir: Path):
    device = ("--max-total-tokens", "65536", "--max-running-requests", "8")
    args = (*device, "--enable-hierarchical-cache", "--hicache-size", str(HOST_TIER_GB))
    log_path = log_dir / "emulated_host_tier.log"
    with running_emulated_server("flash", *args, log_path=log_path, context_length=32768) as url:
        yield url


def state(url: str) -> dict:
    return requests.get(f"{url}/server_info", timeout=30).json()["internal_states"][0]


def test_the_host_tier_holds_the_gb_given_in_h200_bytes_and_none_here(server):
    reported = state(server)
    assert 0.99 * HOST_TIER_GB * GB <= reported["dsv4_emulation"]["capacity"]["host_tier_bytes"] <= HOST_TIER_GB * GB
    assert reported["dsv4_pools"]["host_tier"]["allocated_bytes"] == 0


def test_an_evicted_session_resumes_from_the_host_and_each_copy_takes_its_measured_time(server):
    before = state(server)
    first = prompt(SESSION, 11)
    reply = generate(server, first, 4)
    for seed in (12, 13, 14):  # 60K more tokens through a pool of 64K: the first session goes to the host
        generate(server, prompt(SESSION, seed), 4)
    resumed = generate(server, first + reply["output_ids"] + prompt(40, 15), 3)
    assert resumed["meta_info"]["cached_tokens"] == SESSION + 4 - 1
    after = state(server)
    host, host_before = after["dsv4_prefix_cache"]["host_tier"], before["dsv4_prefix_cache"]["host_tier"]
    assert host["tokens_loaded_back"] > host_before["tokens_loaded_back"]  # what eviction took, the rest stayed
    to_device = (host["bytes_to_device"] - host_before["bytes_to_device"]) / SESSION_BYTES["bf16"]
    to_host = (host["bytes_to_host"] - host_before["bytes_to_host"]) / SESSION_BYTES["bf16"]
    assert to_device > 0.05 and to_host > 0.05  # a 20K session is ~0.7 of the measured one's bytes
    device, device_before = after["dsv4_emulation"]["device_time"], before["dsv4_emulation"]["device_time"]
    loaded = device["loaded_s"] - device_before["loaded_s"]
    held = device["held_host_s"] - device_before["held_host_s"]
    assert loaded == pytest.approx(to_device * (LOAD_S["bf16"] - LOAD_ISSUE_S["bf16"]), abs=1e-5)
    assert held == pytest.approx(to_device * LOAD_ISSUE_S["bf16"] + to_host * WRITE_BACK_S["bf16"], abs=1e-5)
