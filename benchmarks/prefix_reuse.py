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

    python benchmarks/prefix_reuse.py [--sessions 6] [--concurrency 3] [--out benchmarks/prefix_reuse.md]
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


def replay_session(url: str, tokenizer, trajectory: Trajectory, result: ModeResult) -> None:
    history: list[int] = []
    for turn in trajectory.turns:
        history = history + render(tokenizer, turn.new_messages)
        payload = {
            "input_ids": history,
            "sampling_params": {"max_new_tokens": turn.output_tokens, "temperature": 0, "ignore_eos": True},
            "stream": True,
        }
        start, first, meta, output = time.perf_counter(), None, {}, []
        with requests.post(f"{url}/generate", json=payload, stream=True, timeout=600) as response:
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
        history = history + output


def set_modes(url: str, prefix_hits: str, window_policy: str) -> None:
    args = {"dsv4_prefix_hits": mode_code("dsv4_prefix_hits", prefix_hits)}
    args["dsv4_window_policy"] = mode_code("dsv4_window_policy", window_policy)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=3)
    parser.add_argument("--turns", type=int, default=10, help="turns replayed per session (its first ones)")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("prefix_reuse.md"))
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="prefix-reuse-"))
    model = build_checkpoint(work / "tiny")
    tokenizer = AutoTokenizer.from_pretrained(str(model))
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
                    set_modes(url, *mode)
                    results[mode] = replay(url, tokenizer, trajectories, args.concurrency, slot_bytes)
                turns = sum(len(t.turns) for t in trajectories)
                section = f"### {trace_name}, {budget_name} ({turns} turns)\n\n{table(results)}"
                print(section + "\n", flush=True)
                report.append(section)
    args.out.write_text("\n\n".join(report) + "\n")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
