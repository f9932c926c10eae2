"""Soak: the tiny V4 server under agentic load for a long stretch, then idle again.

Replays the recorded agent sessions (``dsv4 agentperf``'s CPU scale, chat API, the
server's own replies kept in the history) with ``--concurrency`` agents (the largest
that met the SLO in the AgentPerf run, see ``benchmarks/RESULTS.md``) for ``--minutes``,
then reports: errors (must be none), latency drift between the first and the last five
minutes (TTFT p50/p90 and output speed), and the pools once the load stopped and after
``/flush_cache`` (free plus evictable must cover every pool, and flushed every pool must
be back at the idle baseline taken before the load). The server it starts is the AgentPerf
run's: one torch thread, the same 16,384-token pool.

    python benchmarks/soak.py [--minutes 30] [--concurrency 2] [--url URL] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp
import requests

from sglang_dsv4.agentperf.replay import RequestBudget, TrialPlan, TurnRecord, run_trial
from sglang_dsv4.agentperf.server import ChatServer, first_model
from sglang_dsv4.agentperf.traces import load_sessions
from sglang_dsv4.agentperf.trajectory import SCALES, ToolLatency
from sglang_dsv4.launch import ONE_TORCH_THREAD, running_server
from sglang_dsv4.tiny import build_checkpoint

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "agentic_trajectories.jsonl.gz"
WARMUP_S = 30.0
WINDOW_S = 300.0  # the first and last five minutes compared for drift
SERVER_ARGS = ("--dtype", "float32", "--max-total-tokens", "16384")


def pools(url: str) -> dict:
    return requests.get(f"{url}/server_info", timeout=30).json()["internal_states"][0]["dsv4_pools"]


def free_counts(usage: dict) -> dict[str, int]:
    return {name: kind["free"] for name, kind in usage.items() if isinstance(kind, dict) and "free" in kind}


async def load(url: str, concurrency: int, seconds: float) -> list[TurnRecord]:
    trajectories = load_sessions(DATA, SCALES["cpu"], ToolLatency(), seed=0)
    plan = TrialPlan(concurrency, WARMUP_S, seconds, request_timeout_s=120.0, served_history=True, seed=0)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        server = ChatServer(url, session, await first_model(url, session))
        return (await run_trial(server, trajectories, plan, RequestBudget(10**9))).records


def window_figures(records: list[TurnRecord]) -> dict[str, float]:
    ttfts = sorted(r.ttft_s for r in records)
    speeds = [(r.output_tokens - 1) / r.decode_s for r in records if r.output_tokens > 1 and r.decode_s > 0]
    return {
        "turns": len(records),
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p90_s": ttfts[min(len(ttfts) - 1, round(0.9 * (len(ttfts) - 1)))],
        "speed_p50_tok_s": statistics.median(speeds),
    }


def soak(url: str, concurrency: int, minutes: float) -> str:
    requests.post(f"{url}/flush_cache", timeout=30)
    baseline = free_counts(pools(url))
    started = time.time()
    records = asyncio.run(load(url, concurrency, minutes * 60))
    measured = [r for r in records if r.measured]
    errors = [r for r in records if r.error]
    done = [r for r in measured if r.error is None]
    end = WARMUP_S + minutes * 60
    first = window_figures([r for r in done if r.sent_at < WARMUP_S + WINDOW_S])
    last = window_figures([r for r in done if r.sent_at >= end - WINDOW_S])
    after_load = pools(url)
    token_slots = after_load["token_slots"]
    requests.post(f"{url}/flush_cache", timeout=30)
    flushed = free_counts(pools(url))
    lines = [
        f"Soak: {concurrency} agents, {minutes:g} minutes measured after a {WARMUP_S:g} s warm-up"
        f" ({time.time() - started:.0f} s in all), recorded sessions at the CPU scale, chat API.",
        "",
        f"- turns: {len(records)} sent, {len(measured)} measured; errors: {len(errors)}"
        + (f" (first: {errors[0].error})" if errors else ""),
        "- drift, first vs last five minutes:",
        "",
        "| window | turns | TTFT p50 (s) | TTFT p90 (s) | output speed p50 (tok/s) |",
        "|---|---|---|---|---|",
        *(
            f"| {name} | {f['turns']} | {f['ttft_p50_s']:.3f} | {f['ttft_p90_s']:.3f} | {f['speed_p50_tok_s']:.1f} |"
            for name, f in (("first 5 min", first), ("last 5 min", last))
        ),
        f"| last / first | | {last['ttft_p50_s'] / first['ttft_p50_s']:.3f} |"
        f" {last['ttft_p90_s'] / first['ttft_p90_s']:.3f} | {last['speed_p50_tok_s'] / first['speed_p50_tok_s']:.3f} |",
        "",
        f"- pools once the load stopped: token slots free {token_slots['free']:,} + evictable"
        f" {token_slots['evictable']:,} of {token_slots['total']:,}"
        f" ({'all' if token_slots['free'] + token_slots['evictable'] == token_slots['total'] else 'NOT all'})",
        f"- after /flush_cache, every pool back at the idle baseline: {flushed == baseline}"
        + ("" if flushed == baseline else f" (baseline {baseline}, now {flushed})"),
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--url", help="a running sglang-dsv4 server (default: start the tiny one)")
    parser.add_argument("--out", type=Path, help="also write the report here")
    args = parser.parse_args()
    if args.url:
        report = soak(args.url, args.concurrency, args.minutes)
    else:
        with tempfile.TemporaryDirectory() as scratch:
            model = build_checkpoint(Path(scratch) / "tiny")
            log_path = Path(scratch) / "server.log"
            with running_server(model, *SERVER_ARGS, log_path=log_path, env=ONE_TORCH_THREAD) as url:
                report = soak(url, args.concurrency, args.minutes)
    print(report)
    if args.out:
        args.out.write_text(report + "\n")


if __name__ == "__main__":
    main()
