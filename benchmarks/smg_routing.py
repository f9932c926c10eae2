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
``/server_info``. ``--configs`` runs some of the six, in the order given; ``--json`` writes every turn's figures
and output ids.

``--fork-turns K`` replays forks instead of independent sessions: every session's prompts begin with the history
of one more recorded session after its first ``K`` turns (their messages and recorded replies), as agents forked
from one conversation, or sharing one long system prompt and tool list, with different next messages. The first
session's first turn runs alone first; the others start once it has answered. Their first prompts then match
that prompt on the worker it ran on up to the shared history's end, mid-prompt, where the server made no
checkpoint: smg's tree (what it sent) credits the whole match, while V4 resumes only from a checkpoint (every
1,024 tokens inside a forward, and at prefill-chunk, prompt and request ends). The table gives the later
sessions' first turns' mean resumed tokens and how many of them ran where the first session's first turn did.

``smg`` is not a dependency of this package: install it apart (``python -m venv /tmp/smg && /tmp/smg/bin/pip
install smg``) and pass its command with ``--smg``.

    python benchmarks/smg_routing.py --smg /tmp/smg/bin/smg [--sessions 10] [--turns 8] [--fork-turns K]
        [--max-total-tokens N] [--configs ours ...] [--json PATH]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import shlex
import subprocess
import tempfile
import threading
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
    predicted_prefilled: float | None = None  # what our router predicted the turns would prefill, where it routed

    def total(self, attribute: str) -> int:
        return sum(getattr(turn, attribute) for turns in self.turns.values() for turn in turns)

    @property
    def requests(self) -> int:
        return sum(map(len, self.turns.values()))

    @property
    def later_first_turns(self) -> list[TurnResult]:
        """The first turns of every session but the first (those that arrive after it under ``--fork-turns``)."""
        return [turns[0] for turns in list(self.turns.values())[1:]]

    @property
    def first_turns_with_leader(self) -> int:
        """Later sessions whose first turn ran where the first session's first turn did."""
        leader = next(iter(self.turns.values()))[0].worker
        return sum(turn.worker == leader for turn in self.later_first_turns)

    @property
    def sticky_sessions(self) -> int | None:
        """Sessions whose turns all ran on one worker or rank (None if a turn's is unknown)."""
        if any(turn.worker == "" for turns in self.turns.values() for turn in turns):
            return None
        return sum(len({turn.worker for turn in turns}) == 1 for turns in self.turns.values())


def replay_session(url: str, tokenizer, trajectory: Trajectory, shared_prefix: list[int], start: threading.Event,
                   first_answered: threading.Event | None = None) -> list[TurnResult]:
    """The session's turns in order, each sent once its previous turn answered, the first once ``start`` is set
    (``first_answered`` is set when it has answered); every prompt begins with ``shared_prefix``."""
    history = list(shared_prefix)
    results: list[TurnResult] = []
    start.wait()
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
        if first_answered is not None:
            first_answered.set()
    return results


def routed_to(gateway_worker: str, dp_rank: int | None) -> str:
    """Where a turn ran: the worker smg named, and the DP rank that served it (``meta_info.dp_rank``)."""
    return " ".join(part for part in (gateway_worker, None if dp_rank is None else f"rank {dp_rank}") if part)


def replay(name: str, url: str, bench: Bench) -> Replay:
    """Every session at once through ``url``; with a ``shared_prefix``, the first session's first turn runs alone
    first (so that one worker holds the prefix when the other sessions arrive)."""
    result, start = Replay(name), time.perf_counter()
    tokenizer, sessions, shared_prefix = bench.tokenizer, bench.sessions, bench.shared_prefix
    leader_answered, now = threading.Event(), threading.Event()
    now.set()
    others_start = leader_answered if shared_prefix else now

    def run(index: int) -> list[TurnResult]:
        if index == 0:
            return replay_session(url, tokenizer, sessions[0], shared_prefix, now, leader_answered)
        return replay_session(url, tokenizer, sessions[index], shared_prefix, others_start)

    with concurrent.futures.ThreadPoolExecutor(len(sessions)) as pool:
        for trajectory, turns in zip(sessions, pool.map(run, range(len(sessions)))):
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


def predicted_uncached_tokens(url: str) -> float | None:
    """The prompt tokens our router has predicted uncached over every request it saw, summed over the ranks
    (``dsv4_routing``'s mean times its count); None under SGLang's methods."""
    states = requests.get(f"{url}/server_info", timeout=60).json()["internal_states"]
    if any("dsv4_routing" not in state for state in states):
        return None
    return sum(s["dsv4_routing"]["mean_uncached_prompt_tokens"] * s["dsv4_routing"]["routed"] for s in states)


@contextlib.contextmanager
def running_gateway(smg: list[str], worker_urls: list[str], *args: str, log_path: Path) -> Iterator[str]:
    """``smg launch`` in front of ``worker_urls``; yields its URL once every worker is registered."""
    port = free_port()
    # Its metrics on a free port, not its fixed default 29000 (another gateway on the host may hold that).
    command = [*smg, "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *worker_urls,
               "--prometheus-port", str(free_port()), *GATEWAY_ARGS, *args]  # fmt: skip
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
    shared_prefix: list[int]  # every prompt's first tokens (``--fork-turns``)
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
                return replay(f"smg {policy}, 2 servers", url, bench)

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
    method routes, the replies' ``meta_info.dp_rank``. Under our router, also what it predicted the replay would
    prefill."""
    before, predicted_before = dp_rank_requests(server), predicted_uncached_tokens(server)
    result = replay(name, url, bench)
    after, predicted_after = dp_rank_requests(server), predicted_uncached_tokens(server)
    if predicted_before is not None and predicted_after is not None:
        result.predicted_prefilled = predicted_after - predicted_before
    if before is not None and after is not None:
        result.workers = Counter({rank: after[rank] - before[rank] for rank in after})  # ranks with none kept
    print(f"  requests per rank: {dict(result.workers)}", flush=True)
    return result


def row(result: Replay, base: Replay) -> str:
    prompt, cached, reusable = (result.total(a) for a in ("prompt_tokens", "cached_tokens", "reusable_tokens"))
    same = sum(a.output_ids == b.output_ids for s in base.turns for a, b in zip(result.turns[s], base.turns[s]))
    split = " / ".join(str(n) for _, n in sorted(result.workers.items()))
    sticky = "n/a" if result.sticky_sessions is None else f"{result.sticky_sessions} / {len(result.turns)}"
    later_first = sum(turn.cached_tokens for turn in result.later_first_turns) / max(len(result.later_first_turns), 1)
    predicted = "n/a" if result.predicted_prefilled is None else f"{result.predicted_prefilled:,.0f}"
    return (f"| {result.name} | {prompt:,} | {cached:,} | {prompt - cached:,} | {predicted} | {cached / prompt:.3f} |"
            f" {cached / max(reusable, 1):.3f} | {split} | {sticky} | {later_first:,.0f} |"
            f" {result.first_turns_with_leader} / {len(result.later_first_turns)} | {same} / {base.requests} |"
            f" {result.seconds:.0f} |")  # fmt: skip


def table(results: list[Replay]) -> str:
    lines = [
        "| configuration | prompt tokens | resumed (cached_tokens) | prefilled | prefilled as our router predicted |"
        " resumed / prompt |"
        " resumed / reusable | requests per worker or rank | sessions on one worker |"
        " later sessions' first turns: mean resumed | later first turns where the first session's ran |"
        " outputs equal to the first | seconds |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    return "\n".join(lines + [row(result, results[0]) for result in results])


def fork_prefix(tokenizer, trajectory: Trajectory, turns: int) -> list[int]:
    """A recorded session's history after its first ``turns`` turns: their new messages and recorded replies."""
    messages = []
    for turn in trajectory.turns[:turns]:
        messages += [*turn.new_messages, *([turn.recorded_reply] if turn.recorded_reply is not None else [])]
    return render(tokenizer, tuple(messages))


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def as_json(result: Replay) -> dict:
    """One configuration's figures, per turn, for the record."""
    return {
        "name": result.name,
        "seconds": result.seconds,
        "predicted_prefilled": result.predicted_prefilled,
        "requests_per_worker": dict(result.workers),
        "sessions": {
            name: [{k: v for k, v in vars(turn).items() if k != "output_ids"} for turn in turns]
            for name, turns in result.turns.items()
        },
        "output_ids": {name: [turn.output_ids for turn in turns] for name, turns in result.turns.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smg", default="smg", help="the command that runs smg (installed apart)")
    parser.add_argument("--sessions", type=int, default=10)
    parser.add_argument("--turns", type=int, default=8, help="turns replayed per session (its first ones)")
    parser.add_argument("--fork-turns", type=int, default=0,
                        help="every session forks from the recorded session after the replayed ones after this many"
                             " of its turns: its prompts begin with that history; the first session's first turn"
                             " runs alone first (default 0: no shared prefix)")  # fmt: skip
    parser.add_argument("--max-total-tokens", type=int, default=65536, help="each server's (each rank's) pool")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGURATIONS), default=list(CONFIGURATIONS),
                        help="configurations to run, in this order (default: all)")  # fmt: skip
    parser.add_argument("--json", type=Path, help="write every configuration's per-turn figures here")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="smg-routing-"))
    model = shipped_checkpoint()
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    recorded = load_sessions(DATA, SCALE, ToolLatency(median_s=0.0), seed=0)
    sessions = [first_turns(t, args.turns) for t in recorded[: args.sessions]]
    shared_prefix = fork_prefix(tokenizer, recorded[args.sessions], args.fork_turns) if args.fork_turns else []
    turns = sum(len(t.turns) for t in sessions)
    if shared_prefix:
        first_prompts = [shared_prefix + render(tokenizer, t.turns[0].new_messages) for t in sessions]
        shared = [_common_prefix(first_prompts[0], prompt) for prompt in first_prompts[1:]]
        print(f"The later sessions' first prompts share {sum(shared) / len(shared):,.0f} tokens on average with the"
              f" first session's (the match smg's tree credits on the worker that ran it)", flush=True)  # fmt: skip
    print(f"{len(sessions)} recorded sessions, their first {args.turns} turns ({turns} requests), all at once;"
          f" a shared prefix of {len(shared_prefix):,} tokens;"
          f" pools of {args.max_total_tokens:,} tokens per server or rank; logs in {work}", flush=True)  # fmt: skip
    bench = Bench(model, ("--dtype", "float32", "--max-total-tokens", str(args.max_total_tokens)),
                  shlex.split(args.smg), tokenizer, sessions, shared_prefix, work)  # fmt: skip
    results = [CONFIGURATIONS[name](bench) for name in args.configs]
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "shared_prefix_tokens": len(shared_prefix),
                                         "results": [as_json(r) for r in results]}))  # fmt: skip


if __name__ == "__main__":
    main()
