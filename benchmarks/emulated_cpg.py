"""CPG of V4-Flash per H200 in the emulator: ours against upstream-like prefix caching, interleaved on one server.

Starts ``dsv4 emulate``'s server (one attention-DP rank of 8 H200s, DP 8 / EP 8, bf16 KV, the ledger's pools of
one GPU at ``--mem-fraction-static 0.85``) and runs AgentPerf's CPG search (``sglang_dsv4.agentperf``) on the
recorded agent sessions at their recorded lengths (``--scale gpu``), with two configurations of that one server
switched through ``/set_internal_state`` before every trial (the cache flushed):

* ``ours``: exact prefix hits, ``per_request`` windows;
* ``upstream-like``: hits only at 256-token pages (``aligned``), every written window kept (``all_committed``).

Upstream's round-robin DP is not part of this run: it emulates one rank. CPG = the largest concurrency whose
agents all meet the SLO tier, per GPU (this rank's GPU). Besides the search it reports the emulated device's
occupancy over the whole run (busy seconds over wall seconds, and over the rank's clock, which leaves out this
host's contention and scales its host work by ``--host-speed``) and its host waits. Results (small: the table and a
summary, not the turns) go to ``benchmarks/results/emulated_cpg/``.

    python benchmarks/emulated_cpg.py [--sessions ../shared/data/agentic_trajectories.jsonl.gz] [--measure-s 30] \
        [--warmup-s 10] [--max-concurrency 96] [--max-seconds 1500] [--host-speed 1.0] [--lockstep]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import requests

from sglang_dsv4.agentperf.benchmark import Configuration, Settings, measure
from sglang_dsv4.agentperf.report import markdown_table
from sglang_dsv4.agentperf.slo import TIERS
from sglang_dsv4.agentperf.traces import load_sessions
from sglang_dsv4.agentperf.trajectory import SCALES, ToolLatency
from sglang_dsv4.launch import ONE_TORCH_THREAD, running_emulated_server

REPOSITORY = Path(__file__).resolve().parents[1]
SESSIONS = REPOSITORY.parent / "shared" / "data" / "agentic_trajectories.jsonl.gz"
OUT = REPOSITORY / "benchmarks" / "results" / "emulated_cpg"
MODES = {
    "ours": {"dsv4_prefix_hits": "exact", "dsv4_window_policy": "per_request"},
    "upstream-like": {"dsv4_prefix_hits": "aligned", "dsv4_window_policy": "all_committed"},
}


def device_time(url: str) -> dict:
    return requests.get(f"{url}/server_info", timeout=60).json()["internal_states"][0]["dsv4_emulation"]


def run(url: str, trajectories: list, args: argparse.Namespace) -> dict:
    settings = Settings(
        slo=TIERS[args.slo],
        warmup_s=args.warmup_s,
        measure_s=args.measure_s,
        request_timeout_s=120.0,
        trials=1,
        max_concurrency=args.max_concurrency,
        gpus=1,
        max_seconds=args.max_seconds,
        max_requests=1_000_000,
        served_history=False,
        seed=0,
    )
    configurations = [Configuration(name, url, modes) for name, modes in MODES.items()]
    before = device_time(url)
    started = time.monotonic()
    result = asyncio.run(measure(configurations, trajectories, settings, f"recorded sessions ({len(trajectories)}), gpu scale"))
    elapsed = time.monotonic() - started
    after = device_time(url)
    table = markdown_table(result)
    print(table, flush=True)
    busy = after["device_time"]["busy_s"] - before["device_time"]["busy_s"]
    waited = after["device_time"]["host_waited_s"] - before["device_time"]["host_waited_s"]
    rank_time = after["device_time"]["wall_s"] - before["device_time"]["wall_s"]
    return {
        "slo": args.slo,
        "warmup_s": args.warmup_s,
        "measure_s": args.measure_s,
        "run_s": round(elapsed, 1),
        "stopped": result.stopped,
        "configurations": {
            outcome.configuration.name: {
                "cpg": outcome.cpg,
                "complete": outcome.complete,
                "ratio_to_first": outcome.ratio_to_first,
                "levels": {f"{t.concurrency}": t.passed for t in outcome.trials},
                "turns_measured": sum(len(t.records) for t in outcome.trials),
            }
            for outcome in result.configurations
        },
        "device": {
            "busy_s": round(busy, 2),
            "host_waited_s": round(waited, 2),
            "occupancy_over_run": round(busy / elapsed, 3),
            "occupancy_over_rank_clock": round(busy / rank_time, 3),
            "host_speed": after["device_time"]["host_speed"],
        },
        "emulation": {k: after[k] for k in ("gpus", "kv_dtype", "lockstep", "capacity", "resident_bytes")},
        "table": table,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slo", default="slo20", choices=["slo20", "slo60"])
    parser.add_argument("--warmup-s", type=float, default=10.0)
    parser.add_argument("--measure-s", type=float, default=30.0)
    parser.add_argument("--max-concurrency", type=int, default=96)
    parser.add_argument("--max-seconds", type=float, default=1500.0)
    parser.add_argument("--context-length", type=int, default=131072)
    parser.add_argument("--sessions", type=Path, default=SESSIONS, help="the recorded sessions (jsonl.gz)")
    parser.add_argument("--host-speed", type=float, default=1.0, help="the emulated host's time over this host's")
    parser.add_argument("--lockstep", action="store_true", help="the DP ranks' extends stall this rank (docs)")
    args = parser.parse_args()
    trajectories = load_sessions(args.sessions, SCALES["gpu"], ToolLatency(), seed=0)
    with tempfile.TemporaryDirectory() as scratch:
        log = Path(scratch) / "server.log"
        with running_emulated_server(
            "flash", "--enable-cache-report", log_path=log, gpus=8, context_length=args.context_length,
            env=ONE_TORCH_THREAD, timing={"host_speed": args.host_speed, "lockstep": args.lockstep},
        ) as url:  # fmt: skip
            summary = run(url, trajectories, args)
    OUT.mkdir(parents=True, exist_ok=True)
    name = f"{args.slo}_{args.measure_s:g}s" + ("_lockstep" if args.lockstep else "")
    (OUT / f"{name}.json").write_text(json.dumps(summary, indent=1) + "\n")
    (OUT / f"{name}.md").write_text(summary["table"])


if __name__ == "__main__":
    main()
