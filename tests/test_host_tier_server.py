"""The host tier served (issue 28): sessions the device pool cannot hold resume from host memory, token-exact.

One server of the tiny checkpoint with a device pool of 4,096 token slots and two request rows, and a host tier of
eight times the device rows (``--enable-hierarchical-cache --hicache-ratio 8``: SGLang's default write policy,
write_through, so every cached node's entries are on the host before it is evicted; write_back is served in
``test_pool_exhaustion_server.py`` and the host-tier CPG benchmark).
Six agent-like sessions of ~1,500 tokens and more take turns in rounds, two running at a time: between two turns
of a session the five others' pass through a pool that holds about two, the tree moves what it evicts to the
host, and the next turn loads its prefix back from there before its forward.
The oracle is a cold run of the same prompt on a flushed cache (outputs and teacher-forced logprobs).
"""

from __future__ import annotations

import concurrent.futures
import random

import pytest
import requests
from conftest import random_ids
from serving_checks import assert_pools_idle
from test_prefix_cache_server import assert_a_cold_prefill_agrees, flush, generate, prefix_cache_state

from sglang_dsv4.launch import running_server

HOST_TIER = ("--enable-hierarchical-cache", "--hicache-ratio", "8")
SMALL_DEVICE = ("--max-total-tokens", "4096", "--max-running-requests", "2")


@pytest.fixture(scope="module")
def server(tiny_path, log_dir):
    args = ("--dtype", "float32", "--enable-cache-report", *SMALL_DEVICE, *HOST_TIER)
    with running_server(tiny_path, *args, log_path=log_dir / "host-tier.log") as url:
        yield url


class Session:
    """An agent-like session (as :func:`test_prefix_cache_server.conversation`'s): each turn sends the history,
    and the history grows by the reply and a tool output of odd length."""

    def __init__(self, seed: int, first: int):
        self.rng = random.Random(seed)
        self.history, self.reusable = random_ids(first, 1024, seed=seed).tolist(), 0
        self.turns: list[tuple[list[int], dict, int]] = []

    def turn(self, url: str) -> None:
        result = generate(url, self.history, self.rng.randrange(3, 24), logprobs_from=self.reusable)
        self.turns.append((self.history, result, self.reusable))
        tool_output = [self.rng.randrange(1024) for _ in range(self.rng.randrange(1, 90) | 1)]
        self.reusable = len(self.history) + len(result["output_ids"]) - 1
        self.history = self.history + result["output_ids"] + tool_output


def in_rounds(url: str, sessions: list[Session], turns: int) -> None:
    """Every session's next turn, two at a time, round after round: between two turns of a session the others'
    turns have passed through the pool."""
    with concurrent.futures.ThreadPoolExecutor(2) as executor:
        for _ in range(turns):
            list(executor.map(lambda session: session.turn(url), sessions))


def host_tier_state(url: str) -> dict:
    return prefix_cache_state(url)["host_tier"]


def test_sessions_the_device_cannot_hold_resume_from_host_as_a_cold_prefill_would(server):
    flush(server)
    sessions = [Session(seed, first=1500) for seed in range(70, 76)]
    in_rounds(server, sessions, turns=3)
    turns = [turn for session in sessions for turn in session.turns]
    # Every turn resumed all that its previous turn left reusable, from the device or from the host.
    assert [cached["meta_info"]["cached_tokens"] for _, cached, _ in turns] == [reusable for _, _, reusable in turns]
    host = host_tier_state(server)
    assert host["write_policy"] == "write_through" and host["nodes_written_through"] > 0, host
    assert host["tokens_loaded_back"] > 0 and host["checkpoints_loaded_back"] > 0, host
    assert host["bytes_to_host"] > 0 and host["bytes_to_device"] > 0, host
    rows = host["host_rows"]
    assert host["host_bytes_held"] > 0 and rows["window_slots"]["free"] < rows["window_slots"]["total"], host
    miscounted = prefix_cache_state(server)["rows_miscounted"]
    assert "host_window_slots" in miscounted and set(miscounted.values()) == {0}, miscounted
    for prompt, cached, reusable in turns[1::3]:
        assert_a_cold_prefill_agrees(server, prompt, cached, reusable)
    assert requests.get(f"{server}/health", timeout=30).status_code == 200


def test_every_row_comes_back_on_both_tiers_after_a_flush(server):
    in_rounds(server, [Session(seed, first=1500) for seed in (80, 81, 82)], turns=2)
    assert_pools_idle(server)  # every section that counts rows, the host tier's among them
    host = host_tier_state(server)
    assert host["host_nodes"] == host["backed_up_nodes"] == host["host_checkpoints"] == host["host_bytes_held"] == 0
    assert all(counts["free"] == counts["total"] for counts in host["host_rows"].values()), host
