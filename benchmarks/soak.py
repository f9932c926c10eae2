"""Soak: the tiny V4 server under agentic load for a long stretch, then idle again.

Replays the recorded agent sessions (``dsv4 agentperf``'s CPU scale, chat API) with ``--concurrency`` agents
(the largest that met the SLO in the AgentPerf run, see ``benchmarks/RESULTS.md``) for ``--minutes``, then
reports: errors (must be none); a timeline of five-minute windows (prompt length, share cached, TTFT p50/p90
and output speed of the turns sent in it; the pools, checkpoints and reference-count audit at its end); the
drift between the first and the last window; the pools once the load stopped and after ``/flush_cache`` (free
plus evictable must cover every pool, and flushed every pool must be back at the idle baseline taken before
the load). The server it starts is the AgentPerf run's: one torch thread, the same 16,384-token pool.
``--history`` is ``dsv4 agentperf``'s: ``recorded`` (the default) is the load the CPG was measured with;
``served`` keeps the server's own replies in each history, as a real agent does (on the tiny model: longer
prompts, less of each cached).

    python benchmarks/soak.py [--minutes 30] [--concurrency 2] [--history recorded|served] [--url URL] [--out FILE]
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
from sglang_dsv4.agentperf.report import cached_share
from sglang_dsv4.agentperf.server import ChatServer, first_model
from sglang_dsv4.agentperf.slo import nearest_rank
from sglang_dsv4.agentperf.traces import load_sessions
from sglang_dsv4.agentperf.trajectory import SCALES, ToolLatency
from sglang_dsv4.launch import ONE_TORCH_THREAD, running_server
from sglang_dsv4.tiny import build_checkpoint

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "agentic_trajectories.jsonl.gz"
WARMUP_S = 30.0
WINDOW_S = 300.0  # the timeline's windows; drift compares the first and the last
SERVER_ARGS = ("--dtype", "float32", "--max-total-tokens", "16384", "--enable-cache-report")


def server_state(url: str) -> dict:
    """The dsv4 part of ``/server_info``: ``dsv4_pools`` and ``dsv4_prefix_cache``."""
    state = requests.get(f"{url}/server_info", timeout=60).json()["internal_states"][0]
    return {key: state[key] for key in ("dsv4_pools", "dsv4_prefix_cache")}


def free_counts(usage: dict) -> dict[str, int]:
    return {name: kind["free"] for name, kind in usage.items() if isinstance(kind, dict) and "free" in kind}


async def load(
    url: str, concurrency: int, seconds: float, served_history: bool
) -> tuple[list[TurnRecord], list[tuple[float, dict]]]:
    """Every turn of the load, and the server's state sampled at the end of every window (trial clock)."""
    trajectories = load_sessions(DATA, SCALES["cpu"], ToolLatency(), seed=0)
    plan = TrialPlan(concurrency, WARMUP_S, seconds, request_timeout_s=120.0, served_history=served_history, seed=0)
    samples: list[tuple[float, dict]] = []

    async def sample() -> None:
        started = asyncio.get_running_loop().time()
        for end in window_ends(seconds):
            await asyncio.sleep(max(0.0, started + end - asyncio.get_running_loop().time()))
            samples.append((end, await asyncio.to_thread(server_state, url)))

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        server = ChatServer(url, session, await first_model(url, session))
        sampler = asyncio.create_task(sample())
        trial = await run_trial(server, trajectories, plan, RequestBudget(10**9))
        await sampler  # its last sample is at the window's end, which the trial outlasts
    return trial.records, samples


def window_ends(seconds: float) -> list[float]:
    count = max(1, round(seconds / WINDOW_S))
    return [WARMUP_S + seconds * (k + 1) / count for k in range(count)]


def window_figures(records: list[TurnRecord]) -> dict[str, float]:
    ttfts = [r.ttft_s for r in records]
    speeds = [(r.output_tokens - 1) / r.decode_s for r in records if r.output_tokens > 1 and r.decode_s > 0]
    prompt_tokens = sum(r.prompt_tokens or 0 for r in records)
    return {
        "turns": len(records),
        "prompt_tokens": prompt_tokens / len(records),
        "cached": cached_share(records) or 0.0,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p90_s": nearest_rank(ttfts, 0.9),
        "speed_p50_tok_s": statistics.median(speeds),
    }


def timeline_row(label: str, figures: dict[str, float], state: dict) -> str:
    pools, cache = state["dsv4_pools"], state["dsv4_prefix_cache"]
    tokens, window = pools["token_slots"], pools["window_slots"]
    return (
        f"| {label} | {figures['turns']} | {figures['prompt_tokens']:.0f} | {figures['cached']:.0%}"
        f" | {figures['ttft_p50_s']:.3f} | {figures['ttft_p90_s']:.3f}"
        f" | {figures['speed_p50_tok_s']:.1f} | {tokens['free'] + tokens['evictable']:,} of {tokens['total']:,}"
        f" | {window['free']:,} of {window['total']:,} | {cache['checkpoints']:,}"
        f" | {sum(cache['rows_miscounted'].values())} |"
    )


def soak(url: str, concurrency: int, minutes: float, history: str) -> str:
    requests.post(f"{url}/flush_cache", timeout=30)
    baseline = free_counts(server_state(url)["dsv4_pools"])
    started = time.time()
    records, samples = asyncio.run(load(url, concurrency, minutes * 60, served_history=history == "served"))
    measured = [r for r in records if r.measured]
    errors = [r for r in records if r.error]
    done = [r for r in measured if r.error is None]
    windows, begin = [], WARMUP_S
    for end, state in samples:
        windows.append((begin, end, window_figures([r for r in done if begin <= r.sent_at < end]), state))
        begin = end
    first, last = windows[0][2], windows[-1][2]
    after_load = server_state(url)
    token_slots = after_load["dsv4_pools"]["token_slots"]
    requests.post(f"{url}/flush_cache", timeout=30)
    flushed = free_counts(server_state(url)["dsv4_pools"])
    lines = [
        f"Soak: {concurrency} agents, {minutes:g} minutes measured after a {WARMUP_S:g} s warm-up"
        f" ({time.time() - started:.0f} s in all), recorded sessions at the CPU scale, chat API,"
        f" {history} replies in the histories.",
        "",
        f"- turns: {len(records)} sent, {len(measured)} measured; errors: {len(errors)}"
        + (f" (first: {errors[0].error})" if errors else ""),
        "- timeline (turns sent in each window; the server's state at the window's end):",
        "",
        "| minutes | turns | prompt tokens (mean) | cached | TTFT p50 (s) | TTFT p90 (s) | output speed p50 (tok/s)"
        " | token slots free + evictable | window slots free | checkpoints | rows miscounted |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *(
            timeline_row(f"{(b - WARMUP_S) / 60:.0f}-{(e - WARMUP_S) / 60:.0f}", figures, state)
            for b, e, figures, state in windows
        ),
        "",
        f"- drift, last window / first: TTFT p50 {last['ttft_p50_s'] / first['ttft_p50_s']:.3f},"
        f" TTFT p90 {last['ttft_p90_s'] / first['ttft_p90_s']:.3f},"
        f" output speed p50 {last['speed_p50_tok_s'] / first['speed_p50_tok_s']:.3f}",
        f"- pools once the load stopped: token slots free {token_slots['free']:,} + evictable"
        f" {token_slots['evictable']:,} of {token_slots['total']:,}"
        f" ({'all' if token_slots['free'] + token_slots['evictable'] == token_slots['total'] else 'NOT all'});"
        f" rows whose reference count differs from their holders: {after_load['dsv4_prefix_cache']['rows_miscounted']}",
        f"- after /flush_cache, every pool back at the idle baseline: {flushed == baseline}"
        + ("" if flushed == baseline else f" (baseline {baseline}, now {flushed})"),
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--history", choices=("recorded", "served"), default="recorded")
    parser.add_argument("--url", help="a running sglang-dsv4 server (default: start the tiny one)")
    parser.add_argument("--out", type=Path, help="also write the report here")
    args = parser.parse_args()
    if args.url:
        report = soak(args.url, args.concurrency, args.minutes, args.history)
    else:
        with tempfile.TemporaryDirectory() as scratch:
            model = build_checkpoint(Path(scratch) / "tiny")
            log_path = Path(scratch) / "server.log"
            with running_server(model, *SERVER_ARGS, log_path=log_path, env=ONE_TORCH_THREAD) as url:
                report = soak(url, args.concurrency, args.minutes, args.history)
    print(report)
    if args.out:
        args.out.write_text(report + "\n")


if __name__ == "__main__":
    main()
