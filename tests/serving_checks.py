"""What the robustness tests check on a live server after bad requests: it answers, greedy
outputs are unchanged, and every pool comes back once no request is running."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
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


@contextlib.contextmanager
def reported_if_down(log_path: Path, sent: object) -> Iterator[None]:
    """Fail with what was sent and the server log's tail when the server stops answering connections
    (a crash found by fuzzing in CI would otherwise leave only "connection refused")."""
    try:
        yield
    except requests.ConnectionError:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:])
        pytest.fail(f"the server stopped answering after:\n{sent!r}\nits log ends:\n{tail}", pytrace=False)


LOG_TAIL_LINES = 60


def _sglang_load(url: str) -> dict:
    """SGLang's own load report, summed over the DP ranks of an attention-DP server: running and waiting requests
    and token slots in use.

    ``num_used_tokens`` is SGLang's count of slots neither free nor evictable by the prefix
    tree, so it reaches 0 when idle whether or not a radix cache keeps finished prefixes.
    """
    loads = requests.get(f"{url}/v1/loads", timeout=30).json()["loads"]
    counts = ("num_running_reqs", "num_waiting_reqs", "num_used_tokens")
    return {count: sum(rank[count] for rank in loads) for count in counts}


def assert_pools_idle(url: str) -> None:
    """Idle: free + evictable equals the total (SGLang's report and ours); flushed: every pool row is free,
    on every DP rank.

    Each is polled until it holds or ``IDLE_TIMEOUT_S`` passes. SGLang's load report does not count a request
    whose grammar is still compiling, so a fuzzed request whose client left at once can reach the running
    batch after the first idle report and hold its rows until its abort lands; a leaked row stays leaked past
    the deadline.
    """
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    for rows_held in (_rows_held_while_idle, _rows_held_after_flush):
        while (held := rows_held(url)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not held, held


def _rows_held_while_idle(url: str) -> list:
    """What stops the server counting as idle: SGLang's nonzero loads, or a rank whose token slots are neither
    free nor evictable."""
    load = _sglang_load(url)
    if any(load.values()):
        return [load]
    return [
        (rank, slots)
        for rank, usage in enumerate(pool_usages(url))
        if (slots := usage["token_slots"])["free"] + slots["evictable"] != slots["total"]
    ]


def _rows_held_after_flush(url: str) -> list:
    """A refused flush, or every pool section of every rank whose rows are not all free once flushed."""
    flushed = requests.post(f"{url}/flush_cache", timeout=60)
    if flushed.status_code != 200:
        return [flushed.text]
    return [
        (rank, name, counts)
        for rank, usage in enumerate(pool_usages(url))
        for name, counts in _pool_counts(usage)
        if counts["free"] + counts.get("evictable", 0) != counts["total"]
    ]


def pool_usages(url: str) -> list[dict]:
    """The V4 pools' report of each DP rank (one entry without attention DP)."""
    states = requests.get(f"{url}/server_info", timeout=30).json()["internal_states"]
    return [state["dsv4_pools"] for state in states]


def _pool_counts(report: dict, prefix: str = "") -> list[tuple[str, dict]]:
    """Every section of the ``dsv4_pools`` report that counts rows (has ``total`` and ``free``), nested or not."""
    found = []
    for name, value in report.items():
        if isinstance(value, dict):
            if "total" in value and "free" in value:
                found.append((prefix + name, value))
            found += _pool_counts(value, f"{prefix}{name}.")
    return found
