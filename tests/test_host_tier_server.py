"""The host tier served (issue 28): sessions the device pool cannot hold resume from host memory, token-exact.

One server of the tiny checkpoint with a device pool of 4,096 token slots and two request rows, and a host tier of
eight times the device rows (``--enable-hierarchical-cache --hicache-write-policy write_back --hicache-ratio 8``).
Six concurrent agent-like sessions of ~1,500 tokens and more, two running at a time, outgrow the device pool: the
tree moves what it evicts to the host, and a later turn whose prefix is there loads it back before its forward.
The oracle is a cold run of the same prompt on a flushed cache (outputs and teacher-forced logprobs).
"""

from __future__ import annotations

import concurrent.futures

import pytest
import requests
from serving_checks import assert_pools_idle
from test_prefix_cache_server import TOLERANCE, conversation, flush, generate, prefix_cache_state, prompt_logprobs

from sglang_dsv4.launch import running_server

HOST_TIER = ("--enable-hierarchical-cache", "--hicache-write-policy", "write_back", "--hicache-ratio", "8")
SMALL_DEVICE = ("--max-total-tokens", "4096", "--max-running-requests", "2")


@pytest.fixture(scope="module")
def server(tiny_path, log_dir):
    args = ("--dtype", "float32", "--enable-cache-report", *SMALL_DEVICE, *HOST_TIER)
    with running_server(tiny_path, *args, log_path=log_dir / "host-tier.log") as url:
        yield url


def host_tier_state(url: str) -> dict:
    return prefix_cache_state(url)["host_tier"]


def test_sessions_the_device_cannot_hold_resume_from_host_as_a_cold_prefill_would(server):
    flush(server)
    with concurrent.futures.ThreadPoolExecutor(2) as executor:
        sessions = list(executor.map(lambda seed: conversation(server, turns=3, seed=seed, first=1500), range(70, 76)))
    turns = [turn for session in sessions for turn in session]
    # Every turn resumed all that its previous turn left reusable, from the device or from the host.
    assert [cached["meta_info"]["cached_tokens"] for _, cached, _ in turns] == [reusable for _, _, reusable in turns]
    host = host_tier_state(server)
    assert host["tokens_loaded_back"] > 0 and host["checkpoints_loaded_back"] > 0, host
    assert host["bytes_to_host"] > 0 and host["bytes_to_device"] > 0, host
    miscounted = prefix_cache_state(server)["rows_miscounted"]
    assert "host_window_slots" in miscounted and set(miscounted.values()) == {0}, miscounted
    for prompt, cached, reusable in turns[1::3]:
        flush(server)
        cold = generate(server, prompt, len(cached["output_ids"]), logprobs_from=reusable)
        assert cold["meta_info"]["cached_tokens"] == 0
        assert cold["output_ids"] == cached["output_ids"]
        differences = [abs(a - b) for a, b in zip(prompt_logprobs(cold), prompt_logprobs(cached), strict=True)]
        assert max(differences, default=0.0) <= TOLERANCE
    assert requests.get(f"{server}/health", timeout=30).status_code == 200


def test_every_row_comes_back_on_both_tiers_after_a_flush(server):
    conversation(server, turns=2, seed=80, first=1500)
    assert_pools_idle(server)  # every section that counts rows, the host tier's among them
    host = host_tier_state(server)
    assert host["host_nodes"] == host["host_checkpoints"] == 0, host
    assert all(counts["free"] == counts["total"] for counts in host["host_rows"].values()), host
