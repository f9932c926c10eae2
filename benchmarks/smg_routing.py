"""Instance-level routing with the gateway ``smg`` (issue 24): the recorded agent sessions replayed through it.

Six configurations, one server start each, back to back, on the shipped tiny V4 (CPU, float32, one torch thread):

- ``dsv4_cache_aware, direct``: one server at attention-DP 2 (``--tp 2 --attn-dp-size 2 --ep-size 2``) reached
  directly, its DP controller routing with ours;
- ``round_robin`` and ``total_tokens, direct``: the same server started with SGLang's
  ``--load-balance-method round_robin`` or ``total_tokens``;
- ``smg --dp-aware``: the same DP server (started afresh) behind ``smg launch --dp-aware --policy cache_aware``,
  which registers one worker per DP rank it finds in ``/server_info`` and pins each request with
  ``data_parallel_rank`` (SGLang's alias of ``routed_dp_rank``);
- ``smg cache_aware``: two single-process servers behind ``smg launch --policy cache_aware``;
- ``smg round_robin``: two such servers behind ``--policy round_robin``.

The first ``--turns`` turns of ``--sessions`` recorded sessions (``prefix_reuse.py``'s CPU scale) are replayed
all at once, id-level: each turn sends ``/generate`` the last turn's ids, the model's reply ids and the turn's
new messages' ids. Per configuration: prompt tokens, tokens resumed from the cache (``meta_info.cached_tokens``),
tokens prefilled, resumed / prompt, resumed / reusable (a turn's reusable prefix is its session's previous prompt
and reply but the reply's last token), the requests each worker or rank served, the sessions whose turns all
landed on one worker or rank, and the outputs equal to the first configuration's (routing must not change a
greedy token). Where a turn ran is the worker ``smg`` names in its ``x-smg-routed-worker-id`` reply header and
the DP rank in ``meta_info.dp_rank``; a DP server's requests per rank are its ranks' ``dsv4_routing.routed`` in
``/server_info``. ``--configs`` runs some of the six, in the order given.

``smg`` is not a dependency of this package: install it apart (``python -m venv /tmp/smg && /tmp/smg/bin/pip
install smg``) and pass its command with ``--smg``.

    python benchmarks/smg_routing.py --smg /tmp/smg/bin/smg [--sessions 10] [--turns 8] [--configs ours ...]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import shlex
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import requests
from prefix_reuse import DATA, SCALE, first_turns, render
from transformers import AutoTokenizer

from sglang_dsv4.agentperf.traces import load_sessions
from sglang_dsv4.agentperf.trajectory import ToolLatency, Trajectory
from sglang_dsv4.launch import ONE_TORCH_THREAD, free_port, running_server, stop_process_group
from sglang_dsv4.tiny import shipped_checkpoint

DP_ARGS = ("--tp", "2", "--attn-dp-size", "2", "--ep-size", "2")
GATEWAY_STARTUP_S = 120
SERVER_STARTUP_S = 900  # a start takes minutes on a loaded 2-core host
# No health probes (SGLang's /health runs a generation, which would count as routed requests and fill caches),
# no retries (a retried turn would be prefilled twice), no circuit breaker (a slow CPU worker is not a dead one).
GATEWAY_ARGS = ("--disable-health-check", "--disable-retries", "--disable-circuit-breaker",
                "--disable-tokenizer-autoload", "--request-timeout-secs", "3600", "--log-level", "warn")  # fmt: skip
ROUTED_WORKER_HEADER = "x-smg-routed-worker-id"


@dataclass
class TurnResult:
    prompt_tokens: int
    cached_tokens: int
    reusable_tokens: int  # the previous turn's prompt and reply but its last token; 0 on a session's first turn
    worker: str  # where it ran: :func:`routed_to`
    output_ids: list[int]


@dataclass
class Replay:
    name: str
    turns: dict[str, list[TurnResult]] = field(default_factory=dict)  # per session
    workers: Counter = field(default_factory=Counter)  # requests per worker or DP rank
    seconds: float = 0.0

    def total(self, attribute: str) -> int:
        return sum(getattr(turn, attribute) for turns in self.turns.values() for turn in turns)

    @property
    def requests(self) -> int:
        return sum(map(len, self.turns.values()))

    @property
    def sticky_sessions(self) -> int | None:
        """Sessions whose turns all ran on one worker or rank (None if a turn's is unknown)."""
        if any(turn.worker == "" for turns in self.turns.values() for turn in turns):
            return None
        return sum(len({turn.worker for turn in turns}) == 1 for turns in self.turns.values())


def replay_session(url: str, tokenizer, trajectory: Trajectory) -> list[TurnResult]:
    """The session's turns in order, each sent once its previous turn answered."""
    history: list[int] = []
    results: list[TurnResult] = []
    for turn in trajectory.turns:
        reusable = len(history) - 1 if results else 0
        history = history + render(tokenizer, turn.new_messages)
        payload = {
            "input_ids": history,
            "sampling_params": {"max_new_tokens": turn.output_tokens, "temperature": 0, "ignore_eos": True},
        }
        reply = requests.post(f"{url}/generate", json=payload, timeout=3600)
        reply.raise_for_status()
        body = reply.json()
        worker = routed_to(reply.headers.get(ROUTED_WORKER_HEADER, ""), body["meta_info"]["dp_rank"])
        results.append(TurnResult(len(history), body["meta_info"]["cached_tokens"], reusable, worker,
                                  body["output_ids"]))  # fmt: skip
        history = history + body["output_ids"]
    return results


def routed_to(gateway_worker: str, dp_rank: int | None) -> str:
    """Where a turn ran: the worker smg named, and the DP rank that served it (``meta_info.dp_rank``)."""
    return " ".join(part for part in (gateway_worker, None if dp_rank is None else f"rank {dp_rank}") if part)


def replay(name: str, url: str, tokenizer, sessions: list[Trajectory]) -> Replay:
    """Every session at once through ``url``."""
    result, start = Replay(name), time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(sessions)) as pool:
        for trajectory, turns in zip(sessions, pool.map(lambda t: replay_session(url, tokenizer, t), sessions)):
            result.turns[trajectory.name] = turns
    result.seconds = time.perf_counter() - start
    result.workers = Counter(turn.worker for turns in result.turns.values() for turn in turns)
    print(f"{name}: {row(result, result)}", flush=True)
    return result


def dp_rank_requests(url: str) -> Counter | None:
    """Requests our router counted for each DP rank (``dsv4_routing.routed`` in ``/server_info``); None when the
    server routes by one of SGLang's methods, which count nothing."""
    states = requests.get(f"{url}/server_info", timeout=60).json()["internal_states"]
    if any("dsv4_routing" not in state for state in states):
        return None
    return Counter({f"rank {state['attn_dp_rank']}": state["dsv4_routing"]["routed"] for state in states})


@contextlib.contextmanager
def running_gateway(smg: list[str], worker_urls: list[str], *args: str, log_path: Path) -> Iterator[str]:
    """``smg launch`` in front of ``worker_urls``; yields its URL once every worker is registered."""
    port = free_port()
    command = [*smg, "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *worker_urls,
               *GATEWAY_ARGS, *args]  # fmt: skip
    print(shlex.join(command), flush=True)
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            print(f"  workers: {_wait_for_workers(url, process, log_path, len(worker_urls))}", flush=True)
            yield url
        finally:
            stop_process_group(process)


def _wait_for_workers(url: str, process: subprocess.Popen, log_path: Path, expected: int) -> list[str]:
    deadline = time.monotonic() + GATEWAY_STARTUP_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"smg exited with {process.returncode}:\n{log_path.read_text()[-4000:]}")
        with contextlib.suppress(requests.RequestException):
            workers = [w["url"] for w in requests.get(f"{url}/workers", timeout=5).json()["workers"]]
            if len(workers) >= expected:
                return workers
        time.sleep(1)
    raise RuntimeError(
        f"smg has not registered its workers after {GATEWAY_STARTUP_S}s:\n{log_path.read_text()[-4000:]}"
    )


@dataclass
class Bench:
    """What every configuration shares: the servers' start, the gateway's command, the sessions."""

    model: Path
    server_args: tuple[str, ...]
    smg: list[str]
    tokenizer: object
    sessions: list[Trajectory]
    work: Path

    def server(self, *args: str, log_name: str) -> contextlib.AbstractContextManager[str]:
        return running_server(self.model, *self.server_args, *args, log_path=self.work / log_name,
                              env=ONE_TORCH_THREAD, startup_timeout_s=SERVER_STARTUP_S)  # fmt: skip


def dp_direct(method: str | None) -> Callable[[Bench], Replay]:
    """The DP server reached directly, its controller routing by SGLang's ``method`` (``--load-balance-method``)
    or, with None, by ours (the default under attention DP)."""

    def run(bench: Bench) -> Replay:
        args = ("--load-balance-method", method) if method else ()
        name = f"{method or 'dsv4_cache_aware (ours)'}, DP 2, direct"
        with bench.server(*DP_ARGS, *args, log_name=f"dp-{method or 'ours'}.log") as dp:
            return replay_on_ranks(name, dp, dp, bench)

    return run


def smg_dp_aware(bench: Bench) -> Replay:
    with bench.server(*DP_ARGS, log_name="dp-smg.log") as dp:
        args = ("--dp-aware", "--policy", "cache_aware")
        with running_gateway(bench.smg, [dp], *args, log_path=bench.work / "smg-dp.log") as url:
            return replay_on_ranks("smg --dp-aware cache_aware, DP 2", dp, url, bench)


def smg_two_servers(policy: str) -> Callable[[Bench], Replay]:
    def run(bench: Bench) -> Replay:
        with contextlib.ExitStack() as stack:
            workers = [stack.enter_context(bench.server(log_name=f"{policy}-{i}.log")) for i in range(2)]
            with running_gateway(
                bench.smg, workers, "--policy", policy, log_path=bench.work / f"smg-{policy}.log"
            ) as url:
                return replay(f"smg {policy}, 2 servers", url, bench.tokenizer, bench.sessions)

    return run


CONFIGURATIONS = {
    "ours": dp_direct(None),
    "dp-round-robin": dp_direct("round_robin"),
    "dp-total-tokens": dp_direct("total_tokens"),
    "smg-dp-aware": smg_dp_aware,
    "smg-cache-aware": smg_two_servers("cache_aware"),
    "smg-round-robin": smg_two_servers("round_robin"),
}


def replay_on_ranks(name: str, server: str, url: str, bench: Bench) -> Replay:
    """:func:`replay` through ``url`` in front of the DP server ``server``; the requests each rank served are
    our router's count (``dsv4_routing.routed``, pinned requests included) over the replay, or where SGLang's
    method routes, the replies' ``meta_info.dp_rank``."""
    before = dp_rank_requests(server)
    result = replay(name, url, bench.tokenizer, bench.sessions)
    after = dp_rank_requests(server)
    if before is not None and after is not None:
        result.workers = Counter({rank: after[rank] - before[rank] for rank in after})  # ranks with none kept
    print(f"  requests per rank: {dict(result.workers)}", flush=True)
    return result


def row(result: Replay, base: Replay) -> str:
    prompt, cached, reusable = (result.total(a) for a in ("prompt_tokens", "cached_tokens", "reusable_tokens"))
    same = sum(a.output_ids == b.output_ids for s in base.turns for a, b in zip(result.turns[s], base.turns[s]))
    split = " / ".join(str(n) for _, n in sorted(result.workers.items()))
    sticky = "n/a" if result.sticky_sessions is None else f"{result.sticky_sessions} / {len(result.turns)}"
    return (f"| {result.name} | {prompt:,} | {cached:,} | {prompt - cached:,} | {cached / prompt:.3f} |"
            f" {cached / max(reusable, 1):.3f} | {split} | {sticky} | {same} / {base.requests} |"
            f" {result.seconds:.0f} |")  # fmt: skip


def table(results: list[Replay]) -> str:
    lines = [
        "| configuration | prompt tokens | resumed (cached_tokens) | prefilled | resumed / prompt |"
        " resumed / reusable | requests per worker or rank | sessions on one worker | outputs equal to the first |"
        " seconds |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    return "\n".join(lines + [row(result, results[0]) for result in results])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smg", default="smg", help="the command that runs smg (installed apart)")
    parser.add_argument("--sessions", type=int, default=10)
    parser.add_argument("--turns", type=int, default=8, help="turns replayed per session (its first ones)")
    parser.add_argument("--max-total-tokens", type=int, default=65536, help="each server's (each rank's) pool")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGURATIONS), default=list(CONFIGURATIONS),
                        help="configurations to run, in this order (default: all)")  # fmt: skip
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="smg-routing-"))
    model = shipped_checkpoint()
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    sessions = [first_turns(t, args.turns) for t in load_sessions(DATA, SCALE, ToolLatency(median_s=0.0), seed=0)]
    sessions = sessions[: args.sessions]
    turns = sum(len(t.turns) for t in sessions)
    print(f"{len(sessions)} recorded sessions, their first {args.turns} turns ({turns} requests), all at once;"
          f" pools of {args.max_total_tokens:,} tokens per server or rank; logs in {work}", flush=True)  # fmt: skip
    bench = Bench(model, ("--dtype", "float32", "--max-total-tokens", str(args.max_total_tokens)),
                  shlex.split(args.smg), tokenizer, sessions, work)  # fmt: skip
    print(table([CONFIGURATIONS[name](bench) for name in args.configs]))


if __name__ == "__main__":
    main()
