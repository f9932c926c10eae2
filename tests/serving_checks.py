"""What the robustness tests check on a live server after bad requests: it answers, greedy
outputs are unchanged, and every pool comes back once no request is running."""

from __future__ import annotations

import time

import requests

IDLE_TIMEOUT_S = 60


def generate(url: str, ids: list[int], timeout: float = 300, **payload) -> requests.Response:
    return requests.post(f"{url}/generate", json={"input_ids": ids, **payload}, timeout=timeout)


def greedy(url: str, ids: list[int], new_tokens: int) -> list[int]:
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    reply = generate(url, ids, sampling_params=params)
    assert reply.status_code == 200, reply.text
    return reply.json()["output_ids"]


def assert_healthy(url: str) -> None:
    assert requests.get(f"{url}/health", timeout=60).status_code == 200


def wait_until_idle(url: str) -> dict:
    """SGLang's own load report once no request runs or waits and no token slot is in use.

    ``num_used_tokens`` is SGLang's count of slots neither free nor evictable by the prefix
    tree, so it reaches 0 when idle whether or not a radix cache keeps finished prefixes.
    """
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        load = requests.get(f"{url}/v1/loads", timeout=30).json()["loads"][0]
        idle = load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0
        if (idle and load["num_used_tokens"] == 0) or time.monotonic() > deadline:
            return load
        time.sleep(0.5)


def assert_pools_idle(url: str) -> None:
    """Idle: free + evictable equals the total (SGLang's report and ours); flushed: every pool row is free."""
    load = wait_until_idle(url)
    assert (load["num_running_reqs"], load["num_waiting_reqs"], load["num_used_tokens"]) == (0, 0, 0), load
    slots = pool_usage(url)["token_slots"]
    assert slots["free"] + slots["evictable"] == slots["total"], slots
    flushed = requests.post(f"{url}/flush_cache", timeout=60)
    assert flushed.status_code == 200, flushed.text
    for name, counts in _pool_counts(pool_usage(url)):
        assert counts["free"] + counts.get("evictable", 0) == counts["total"], (name, counts)


def pool_usage(url: str) -> dict:
    return requests.get(f"{url}/server_info", timeout=30).json()["internal_states"][0]["dsv4_pools"]


def _pool_counts(report: dict, prefix: str = "") -> list[tuple[str, dict]]:
    """Every section of the ``dsv4_pools`` report that counts rows (has ``total`` and ``free``), nested or not."""
    found = []
    for name, value in report.items():
        if isinstance(value, dict):
            if "total" in value and "free" in value:
                found.append((prefix + name, value))
            found += _pool_counts(value, f"{prefix}{name}.")
    return found
