"""Prefix reuse on agentic traffic: the four prefix-cache modes, alternated on one server.

Replays multi-turn agent sessions through ``/generate`` with token ids (the history
grows with the model's own output ids and the next messages' ids, as an agent harness
that keeps token ids does), several sessions at a time, against one tiny-V4 server
whose modes are switched between replays (``/set_internal_state``), once with room for
everything and once with a KV budget small enough that eviction runs. Per mode: reused
tokens / prompt tokens, tokens prefilled, TTFT p50/p90, window bytes retained per
finished conversation (window slots still held once every session ended, over the
sessions), and each figure's ratio to ``aligned + all_committed`` (upstream's behaviour).

Traces, scaled for a CPU (said in the output): the recorded sessions of
``../shared/data/agentic_trajectories.jsonl.gz`` and the synthetic AgentPerf shape, both
through ``sglang_dsv4.agentperf``'s loaders.

    python benchmarks/prefix_reuse.py [--sessions 6] [--concurrency 3] [--out benchmarks/results/prefix_reuse.md]

``--full-length`` measures the checkpoint retention rule (issue 29) instead, on the recorded sessions
with the most turns, every message whole (:func:`full_length`): window bytes kept under per_request
against all_committed with room for everything, and prefill under the rule against plain LRU
(``dsv4_checkpoint_retention``) with too few request rows for the sessions' checkpoints.

    python benchmarks/prefix_reuse.py --full-length --sessions 3 [--turns 24] [--pressure-turns 10]
    python benchmarks/prefix_reuse.py --full-length --sessions 3 --pressure-only --pressure-rows 1 --pressure-turns 6
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests
import torch
from transformers import AutoTokenizer

from sglang_dsv4.agentperf.synthetic import synthesize
from sglang_dsv4.agentperf.traces import load_sessions
from sglang_dsv4.agentperf.trajectory import ToolLatency, TraceScale, Trajectory
from sglang_dsv4.config import load_config
from sglang_dsv4.launch import running_server
from sglang_dsv4.memory_pool.layout import PoolLayout
from sglang_dsv4.prefix_cache import mode_code
from sglang_dsv4.tiny import build_checkpoint

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "agentic_trajectories.jsonl.gz"
MODES = [
    ("exact", "per_request"),
    ("exact", "all_committed"),
    ("aligned", "per_request"),
    ("aligned", "all_committed"),
]
BASELINE = ("aligned", "all_committed")
SCALE = TraceScale(input_fraction=0.2, output_fraction=0.1, max_output_tokens=24, max_context_tokens=3000)
BUDGETS = {"room for everything": 65536, "eviction (4,096 tokens)": 4096}


@dataclass
class ModeResult:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttfts: list[float] = field(default_factory=list)
    outputs: dict[str, list[list[int]]] = field(default_factory=dict)  # per session, per turn
    cached_per_turn: dict[str, list[int]] = field(default_factory=dict)  # per session, per turn
    window_bytes_per_session: float = 0.0

    @property
    def prefilled(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def reuse(self) -> float:
        return self.cached_tokens / self.prompt_tokens


def first_turns(trajectory: Trajectory, turns: int) -> Trajectory:
    return Trajectory(trajectory.name, trajectory.turns[:turns])


def render(tokenizer, messages: tuple[dict, ...]) -> list[int]:
    text = "".join(f"<{m['role']}>{m.get('content') or ''}\n" for m in messages)
    return tokenizer.encode(text, add_special_tokens=False)


def replay_session(
    url: str, tokenizer, trajectory: Trajectory, result: ModeResult, keep_recorded_replies: bool = False
) -> None:
    """The session's turns in order; each turn's history is the last one's, the reply's ids (and, with
    ``keep_recorded_replies``, the recorded reply's text after them) and the turn's new messages."""
    history: list[int] = []
    for turn in trajectory.turns:
        history = history + render(tokenizer, turn.new_messages)
        payload = {
            "input_ids": history,
            "sampling_params": {"max_new_tokens": turn.output_tokens, "temperature": 0, "ignore_eos": True},
            "stream": True,
        }
        start, first, meta, output = time.perf_counter(), None, {}, []
        # A request may wait behind every other session's turn (one request row, a loaded host): no read timeout.
        with requests.post(f"{url}/generate", json=payload, stream=True, timeout=(30, None)) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                    continue
                first = first or time.perf_counter()
                event = json.loads(line[5:])
                meta, output = event["meta_info"], event["output_ids"]
        result.prompt_tokens += len(history)
        result.cached_tokens += meta["cached_tokens"]
        result.ttfts.append(first - start)
        result.outputs.setdefault(trajectory.name, []).append(output)
        result.cached_per_turn.setdefault(trajectory.name, []).append(meta["cached_tokens"])
        history = history + output
        if keep_recorded_replies and turn.recorded_reply is not None:
            history = history + render(tokenizer, (turn.recorded_reply,))


def set_modes(url: str, **modes: str) -> None:
    """Set prefix-cache modes by name (``prefix_hits``, ``window_policy``, ``checkpoint_retention``)."""
    args = {f"dsv4_{key}": mode_code(f"dsv4_{key}", value) for key, value in modes.items()}
    assert all(requests.post(f"{url}/set_internal_state", json={"server_args": args}, timeout=30).json())


def window_slots_held(url: str) -> int:
    pools = requests.get(f"{url}/server_info", timeout=30).json()["internal_states"][0]["dsv4_pools"]
    return pools["window_slots"]["total"] - pools["window_slots"]["free"]


def replay(url: str, tokenizer, trajectories: list[Trajectory], concurrency: int, slot_bytes: int) -> ModeResult:
    result = ModeResult()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda t: replay_session(url, tokenizer, t, result), trajectories))
    result.window_bytes_per_session = window_slots_held(url) * slot_bytes / len(trajectories)
    return result


def quantile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def table(results: dict[tuple[str, str], ModeResult]) -> str:
    base = results[BASELINE]
    lines = [
        "| mode | reused / prompt | tokens prefilled | TTFT p50 (ms) | TTFT p90 (ms) | window KiB kept / session |"
        " prefilled vs base | TTFT p50 vs base | window vs base |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, r in results.items():
        p50, p90 = quantile(r.ttfts, 0.5), quantile(r.ttfts, 0.9)
        window_ratio = r.window_bytes_per_session / max(base.window_bytes_per_session, 1)
        lines.append(
            f"| {' + '.join(mode)} | {r.reuse:.3f} | {r.prefilled:,} | {p50 * 1e3:.0f} | {p90 * 1e3:.0f} |"
            f" {r.window_bytes_per_session / 1024:,.0f} | {r.prefilled / base.prefilled:.3f} |"
            f" {p50 / quantile(base.ttfts, 0.5):.3f} | {window_ratio:.3f} |"
        )
    return "\n".join(lines)


# --- full length: the recorded sessions' histories as recorded, the retention rule measured ---------------------

FULL_SCALE = TraceScale(input_fraction=1.0, output_fraction=1.0, max_output_tokens=4, max_context_tokens=10**9)


def full_length_sessions(tokenizer, count: int, max_history: int, turns: int | None) -> list[Trajectory]:
    """The ``count`` recorded sessions with the most turns whose prompts stay under ``max_history`` tokens
    (each cut before the first turn that would pass it; then to its first ``turns``, if given). The
    history a turn sends is the recorded one: every message whole, and each recorded reply's text after
    the ids the server decoded for it (``FULL_SCALE.max_output_tokens`` at most), so the prompts grow as recorded."""
    cut = []
    for trajectory in load_sessions(DATA, FULL_SCALE, ToolLatency(median_s=0.0), seed=0):
        history, kept = 0, []
        for turn in trajectory.turns:
            history += len(render(tokenizer, turn.new_messages))
            if history > max_history:
                break
            kept.append(turn)
            history += turn.output_tokens + len(render(tokenizer, (turn.recorded_reply,)))
        cut.append(Trajectory(trajectory.name, tuple(kept)))
    longest = sorted(cut, key=lambda t: len(t.turns), reverse=True)[:count]
    return [first_turns(t, turns or len(t.turns)) for t in longest]


def prefix_cache_state(url: str) -> dict:
    state = requests.get(f"{url}/server_info", timeout=30).json()["internal_states"][0]
    return {"pools": state["dsv4_pools"], **state["dsv4_prefix_cache"]}


@dataclass
class FullLengthRun:
    name: str
    result: ModeResult
    state: dict  # /server_info's pools and prefix cache once every session ended
    seconds: float

    @property
    def window_bytes(self) -> int:
        slots = self.state["pools"]["window_slots"]
        return (slots["total"] - slots["free"]) * self.state["slot_bytes"]


def full_length_run(url: str, tokenizer, sessions: list[Trajectory], concurrency: int, slot_bytes: int,
                    name: str, **modes: str) -> FullLengthRun:  # fmt: skip
    requests.post(f"{url}/flush_cache", timeout=30)
    set_modes(url, **modes)
    result, start = ModeResult(), time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda t: replay_session(url, tokenizer, t, result, keep_recorded_replies=True), sessions))
    state = {**prefix_cache_state(url), "slot_bytes": slot_bytes}
    run = FullLengthRun(name, result, state, time.perf_counter() - start)
    print(f"{name}: {json.dumps(run_row(run))}", flush=True)
    return run


def run_row(run: FullLengthRun) -> dict:
    state, r = run.state, run.result
    return {
        "prompt": r.prompt_tokens, "reused": r.cached_tokens, "prefilled": r.prefilled,
        "window_bytes": run.window_bytes, "checkpoints": state["checkpoints"],
        "by_state": state["checkpoints_by_state"], "evictions": state["checkpoint_evictions"],
        "skipped": state["checkpoints_skipped"], "seconds": round(run.seconds),
        "turns_from_zero": sum(cached == 0 for turns in r.cached_per_turn.values() for cached in turns),
        "cached_per_turn": r.cached_per_turn,
    }  # fmt: skip


def full_length_table(runs: list[FullLengthRun], base: FullLengthRun) -> str:
    lines = [
        "| run | reused / prompt | tokens prefilled | prefilled vs base | window MB kept | window vs base |"
        " checkpoints kept (live / superseded) | evicted: superseded / shallower / deepest / with tokens |"
        " released at resume | skipped | outputs equal to base's |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        r, state = run.result, run.state
        by_state, ev = state["checkpoints_by_state"], state["checkpoint_evictions"]
        same = sum(a == b for s in base.result.outputs for a, b in zip(r.outputs[s], base.result.outputs[s]))
        lines.append(
            f"| {run.name} | {r.cached_tokens:,} / {r.prompt_tokens:,} | {r.prefilled:,} |"
            f" {r.prefilled / base.result.prefilled:.3f} | {run.window_bytes / 1e6:.1f} |"
            f" {run.window_bytes / base.window_bytes:.3f} | {state['checkpoints']:,}"
            f" ({by_state['live']['count']} / {by_state['superseded']['count']}) |"
            f" {ev['superseded']} / {ev['shallower']} / {ev['deepest']} / {ev['with_tokens']} |"
            f" {ev['superseded_at_resume']} | {sum(state['checkpoints_skipped'].values())} |"
            f" {same} / {len(r.ttfts)} |"
        )
    return "\n".join(lines)


def full_length_room(args: argparse.Namespace, work: Path, model: Path, tokenizer, slot_bytes: int,
                     sessions: list[Trajectory], report: list[str]) -> list[FullLengthRun]:  # fmt: skip
    """(a) With room for everything: window bytes kept under per_request against all_committed's (its runs;
    its table appended to ``report``)."""
    room = ("--max-total-tokens", str(args.full_tokens), "--max-running-requests", str(args.room_rows))
    with running_server(model, "--dtype", "float32", *room, log_path=work / "server-room.log") as url:
        per_request, committed = [
            full_length_run(url, tokenizer, sessions, args.concurrency, slot_bytes, f"exact + {policy}",
                            prefix_hits="exact", window_policy=policy, checkpoint_retention="worth")
            for policy in ("per_request", "all_committed")
        ]  # fmt: skip
    room_table = full_length_table([committed, per_request], committed)
    report.append(f"### no pressure ({args.room_rows} request rows, {args.full_tokens:,} token slots)\n\n{room_table}")
    print(report[-1], flush=True)
    return [per_request, committed]


def full_length(args: argparse.Namespace, work: Path, model: Path, tokenizer, slot_bytes: int) -> list[str]:
    """(a) No pressure: window bytes kept under per_request against all_committed's. (b) The pool below
    the sessions' working set (``--pressure-rows`` request rows, so their window slots and records):
    prefill under the retention rule against plain LRU. ``--pressure-only``: (b) alone."""
    sessions = full_length_sessions(tokenizer, args.sessions, args.max_history, args.turns)
    pressure_sessions = [first_turns(t, args.pressure_turns or len(t.turns)) for t in sessions]
    turns = sum(len(t.turns) for t in sessions)
    report = [
        f"Full length: the {len(sessions)} recorded sessions with the most turns under {args.max_history:,}-token"
        f" histories ({turns} turns, {turns - len(sessions)} resumed; {', '.join(t.name for t in sessions)}),"
        f" {args.concurrency} at a time; every message whole, each turn decodes min(recorded, 4) tokens and the"
        " history then carries the recorded reply; tiny V4 on this CPU, float32; cache flushed between runs."
    ]
    print(report[0], flush=True)
    runs = [] if args.pressure_only else full_length_room(args, work, model, tokenizer, slot_bytes, sessions, report)
    pressure = ("--max-total-tokens", str(args.full_tokens), "--max-running-requests", str(args.pressure_rows))
    with running_server(model, "--dtype", "float32", *pressure, log_path=work / "server-pressure.log") as url:
        pressure_runs = [
            full_length_run(url, tokenizer, pressure_sessions, args.concurrency, slot_bytes,
                            f"exact + per_request, {name}", prefix_hits="exact", window_policy="per_request",
                            checkpoint_retention=retention)
            for name, retention in (("plain LRU", "lru"), ("by worth", "worth"))
        ]  # fmt: skip
    lru, worth = pressure_runs
    pressure_table = full_length_table([lru, worth], lru)
    pressure_turns = sum(len(t.turns) for t in pressure_sessions)
    heading = f"### pool below the working set ({args.pressure_rows} request rows, {pressure_turns} turns)"
    report.append(f"{heading}\n\n{pressure_table}")
    print(report[-1], flush=True)
    runs += pressure_runs
    (work / "full_length.json").write_text(json.dumps({run.name: run_row(run) for run in runs}, indent=1))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=3)
    parser.add_argument("--turns", type=int, default=None, help="turns replayed per session (its first ones)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "prefix_reuse.md")
    parser.add_argument("--full-length", action="store_true", help="the retention measurements (see full_length)")
    parser.add_argument("--max-history", type=int, default=60_000, help="full length: tokens a history stays under")
    parser.add_argument("--full-tokens", type=int, default=200_000, help="full length: the token pool")
    parser.add_argument("--room-rows", type=int, default=512, help="full length: request rows with no pressure")
    parser.add_argument("--pressure-rows", type=int, default=2, help="full length: request rows under pressure")
    parser.add_argument("--pressure-turns", type=int, default=None, help="full length: turns a session under pressure")
    parser.add_argument("--pressure-only", action="store_true", help="full length: only the runs under pressure")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="prefix-reuse-"))
    model = build_checkpoint(work / "tiny")
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    if args.full_length:
        slot_bytes = PoolLayout(load_config(model), torch.float32).window_slot_bytes
        args.out.write_text("\n\n".join(full_length(args, work, model, tokenizer, slot_bytes)) + "\n")
        print(f"written to {args.out}")
        return
    args.turns = args.turns or 10
    slot_bytes = PoolLayout(load_config(model), torch.float32).window_slot_bytes
    latency = ToolLatency(median_s=0.0)
    traces = {
        "recorded sessions": load_sessions(DATA, SCALE, latency, seed=0)[: args.sessions],
        "synthetic AgentPerf shape": synthesize(args.sessions, SCALE, latency, seed=0),
    }
    traces = {name: [first_turns(t, args.turns) for t in trajectories] for name, trajectories in traces.items()}
    report = [
        f"Scaling: every message keeps {SCALE.input_fraction:.0%} of its text, outputs {SCALE.output_fraction:.0%}"
        f" of the recorded length (2..{SCALE.max_output_tokens} tokens), sessions end before"
        f" {SCALE.max_context_tokens:,} tokens; {args.sessions} sessions per trace (their first {args.turns} turns),"
        f" {args.concurrency} at a time;"
        " tiny V4 on this CPU, float32; modes alternated on one server per budget (cache flushed between modes)."
    ]
    for budget_name, tokens in BUDGETS.items():
        server_args = ("--dtype", "float32", "--max-total-tokens", str(tokens))
        with running_server(model, *server_args, log_path=work / f"server-{tokens}.log") as url:
            for trace_name, trajectories in traces.items():
                results = {}
                for mode in MODES:
                    requests.post(f"{url}/flush_cache", timeout=30)
                    set_modes(url, prefix_hits=mode[0], window_policy=mode[1])
                    results[mode] = replay(url, tokenizer, trajectories, args.concurrency, slot_bytes)
                turns = sum(len(t.turns) for t in trajectories)
                section = f"### {trace_name}, {budget_name} ({turns} turns)\n\n{table(results)}"
                print(section + "\n", flush=True)
                report.append(section)
    args.out.write_text("\n\n".join(report) + "\n")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
