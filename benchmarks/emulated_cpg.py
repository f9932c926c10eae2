"""CPG of V4 per H200 in the emulator: ours against upstream-like prefix caching, interleaved on one server.

Starts ``dsv4 emulate``'s server (one attention-DP rank of V4-Flash on 8 H200s, DP 8 / EP 8, or with ``--config pro
--gpus 16`` of V4-Pro on two nodes; bf16 KV unless ``--kv-cache-dtype``; the ledger's pools of one GPU at
``--mem-fraction-static 0.85``) and runs AgentPerf's CPG search (``sglang_dsv4.agentperf``) on the recorded agent
sessions at their recorded lengths (``--scale gpu``), or with ``--trace synthetic`` on AgentPerf's published shape
(``sglang_dsv4.agentperf.synthetic``: ``--trajectories`` of them, seed 0), with two configurations of that one
server switched through ``/set_internal_state`` before every trial (the cache flushed):

* ``ours``: exact prefix hits, ``per_request`` windows;
* ``upstream-like``: hits only at 256-token pages (``aligned``), every written window kept (``all_committed``);
* either with ``+host-tier``: the same, on a second server with a host tier of ``--host-tier`` GB of the H200
  host's memory per rank (``--enable-hierarchical-cache --hicache-size``; its copies timed as ours on an H200),
  started beside the first when both kinds are compared and idle (``--sleep-on-idle``) while the other runs.

``--max-total-tokens`` caps the device pool below what the GPU holds (SGLang's flag): a stand-in for sessions
longer than the pool, where the host tier is meant to matter.

Upstream's round-robin DP is not part of this run: it emulates one rank. CPG = the largest concurrency whose
agents all meet the SLO tier, per GPU (this rank's GPU). Besides the search it reports the emulated device's
occupancy over the whole run (busy seconds over wall seconds, and over the rank's clock, which leaves out this
host's contention and scales its host work by ``--host-speed``) and its host waits, and per trial, over its
measured window: the occupancy over the rank's clock, the scheduler thread's CPU time per forward (this host's,
and scaled by ``--host-speed``), the time it waited for a CPU (this host's contention) and how far the wall
clock the agents read fell behind the rank's. With ``--profile`` each window is also sampled by py-spy on the
scheduler (collapsed stacks under ``--profile``'s folder, one file a trial). Results (small: the table and a
summary, not the turns) go to ``benchmarks/results/emulated_cpg/``.

    python benchmarks/emulated_cpg.py [--sessions ../shared/data/agentic_trajectories.jsonl.gz] [--measure-s 30] \
        [--warmup-s 10] [--max-concurrency 96] [--max-seconds 1500] [--host-speed 1.0] [--lockstep] \
        [--kv-cache-dtype fp8_e4m3] [--profile /tmp/profiles] [--configurations ours upstream-like] \
        [--config pro --gpus 16] [--trace synthetic --trajectories 128] \
        [--configurations ours ours+host-tier --host-tier 200] [--max-total-tokens 300000] [--trials 3] \
        [--at ours=19 upstream-like=7] [--context-length 196608] [--out PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import requests

from sglang_dsv4.agentperf.benchmark import (
    BenchmarkResult,
    Configuration,
    ConfigurationResult,
    Settings,
    _trial,
    run_benchmark,
)
from sglang_dsv4.agentperf.command import load_trajectories
from sglang_dsv4.agentperf.progress import Progress
from sglang_dsv4.agentperf.replay import RequestBudget
from sglang_dsv4.agentperf.report import markdown_table
from sglang_dsv4.agentperf.server import ChatServer, first_model
from sglang_dsv4.agentperf.slo import TIERS
from sglang_dsv4.launch import ONE_TORCH_THREAD, running_emulated_server

REPOSITORY = Path(__file__).resolve().parents[1]
SESSIONS = REPOSITORY.parent / "shared" / "data" / "agentic_trajectories.jsonl.gz"
OUT = REPOSITORY / "benchmarks" / "results" / "emulated_cpg"
CONTEXT_LENGTH = 131072
"""SGLang's --context-length for the server; turns longer than it are refused (counted in the results)."""
PY_SPY = Path(sys.executable).parent / "py-spy"
MODES = {
    "ours": {"dsv4_prefix_hits": "exact", "dsv4_window_policy": "per_request"},
    "upstream-like": {"dsv4_prefix_hits": "aligned", "dsv4_window_policy": "all_committed"},
}
HOST_TIER = "+host-tier"
CONFIGURATIONS = [*MODES, *(mode + HOST_TIER for mode in MODES)]


def on_host_tier(name: str) -> bool:
    """Whether the configuration ``name`` runs on the server with the host tier."""
    return name.endswith(HOST_TIER)


def rank_state(url: str) -> dict:
    """The emulated rank's ``/server_info`` state."""
    return requests.get(f"{url}/server_info", timeout=60).json()["internal_states"][0]


class WindowedServer(ChatServer):
    """A configuration's server that, from each trial's switch (its start), reads the emulated device at the
    start and end of the trial's measured window, and samples the scheduler with py-spy over it (``profile``)."""

    def __init__(self, url: str, session: aiohttp.ClientSession, model: str, name: str, settings: Settings,
                 profile: Path | None) -> None:  # fmt: skip
        super().__init__(url, session, model)
        self.name, self.settings, self.profile = name, settings, profile
        self.windows: list[dict[str, Any]] = []
        self.readings: list[asyncio.Task] = []

    async def apply(self, server_args: dict[str, Any]) -> dict[str, Any] | None:
        modes = await super().apply(server_args)
        self.readings.append(asyncio.create_task(self._window(len(self.readings))))
        return modes

    async def _window(self, trial: int) -> None:
        await asyncio.sleep(self.settings.warmup_s)
        start = await self._device()
        sampler = None
        if self.profile is not None:
            self.profile.mkdir(parents=True, exist_ok=True)
            sampler = subprocess.Popen(
                [str(PY_SPY), "record", "--pid", str(start["pid"]), "--rate", "50", "--nonblocking", "--idle",
                 "--threads", "--duration", f"{self.settings.measure_s:.0f}", "--format", "raw",
                 "--output", str(self.profile / f"{self.name}_{trial}.txt")],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
        await asyncio.sleep(self.settings.measure_s)
        end = await self._device()
        if sampler is not None:
            await asyncio.to_thread(sampler.wait)
        self.windows.append(window_figures(start["device_time"], end["device_time"]))
        if self.profile is not None:  # kept beside the samples as it comes, should the run break off
            (self.profile / f"{self.name}_{trial}.window.json").write_text(json.dumps(self.windows[-1]))

    async def _device(self) -> dict:
        async with self.session.get(f"{self.url}/server_info") as reply:
            return (await reply.json(content_type=None))["internal_states"][0]["dsv4_emulation"]


async def one_trial_each(
    configurations: list[Configuration], servers: list, levels: dict[str, int], trajectories: list,
    settings: Settings, trace: str,
) -> BenchmarkResult:
    """``settings.trials`` trials of each configuration at its level, interleaved, no search (their verdicts, not a
    CPG)."""
    result = BenchmarkResult(settings, trace, [ConfigurationResult(c) for c in configurations])
    deadline = asyncio.get_running_loop().time() + settings.max_seconds
    budget, progress = RequestBudget(settings.max_requests), Progress(settings.max_seconds)
    for _ in range(settings.trials):
        for outcome, server in zip(result.configurations, servers):
            level = levels[outcome.configuration.name]
            trial = await _trial(outcome, server, level, trajectories, settings, budget, deadline, progress)
            if isinstance(trial, str):
                result.stopped = trial
                return result
            outcome.trials.append(trial)
    return result


def window_figures(start: dict, end: dict) -> dict[str, float]:
    """The device and the scheduler's thread between two readings: occupancy over the rank's clock, host CPU per
    forward (this host's and scaled; the allocator's free-list work, a GPU's, apart), this host's contention and
    the wall's lag behind the rank's clock."""
    delta = {key: end[key] - start[key] for key in start if isinstance(start[key], (int, float))}
    forwards = max(delta["forwards"], 1)
    host_cpu = delta["host_cpu_s"] - delta["device_side_cpu_s"]
    return {
        "forwards": delta["forwards"],
        "wall_s": round(delta["monotonic_s"], 2),
        "rank_s": round(delta["rank_clock_s"], 2),
        "occupancy": round(delta["busy_s"] / delta["rank_clock_s"], 3),
        "device_step_ms": round(1e3 * delta["busy_s"] / forwards, 2),
        "host_cpu_ms_per_forward": round(1e3 * host_cpu / forwards, 2),
        "host_ms_per_forward_scaled": round(1e3 * end["host_speed"] * host_cpu / forwards, 2),
        "device_side_cpu_ms_per_forward": round(1e3 * delta["device_side_cpu_s"] / forwards, 2),
        "host_waited_ms_per_forward": round(1e3 * delta["host_waited_s"] / forwards, 2),
        "cpu_queued_share": round(delta["cpu_queued_s"] / delta["monotonic_s"], 3),
        "settled_share": round(delta["settled_s"] / delta["monotonic_s"], 3),
        "wall_behind_rank_share": round((delta["monotonic_s"] - delta["rank_clock_s"]) / delta["monotonic_s"], 3),
    }


async def search(
    urls: dict[bool, str], names: list[str], trajectories: list, trace: str, settings: Settings,
    profile: Path | None, levels: dict[str, int],
) -> tuple:
    """AgentPerf's interleaved search over the configurations ``names`` (each on the server of ``urls`` with or
    without the host tier), or, with ``levels``, ``settings.trials`` trials of each at its level; the result, and per
    configuration its trials' windows (in trial order)."""
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        model = await first_model(next(iter(urls.values())), session)
        url = {name: urls[on_host_tier(name)] for name in names}
        servers = [WindowedServer(url[name], session, model, name, settings, profile) for name in names]
        configurations = [Configuration(name, url[name], MODES[name.removesuffix(HOST_TIER)]) for name in names]
        if levels:
            result = await one_trial_each(configurations, servers, levels, trajectories, settings, trace)
        else:
            result = await run_benchmark(
                configurations, servers, trajectories, settings, trace, Progress(settings.max_seconds)
            )
        for server in servers:
            await asyncio.gather(*server.readings)
        return result, {server.name: server.windows for server in servers}


def run(
    urls: dict[bool, str], names: list[str], levels: dict[str, int], trajectories: list, trace: str,
    args: argparse.Namespace,
) -> dict:
    settings = Settings(
        slo=TIERS[args.slo],
        warmup_s=args.warmup_s,
        measure_s=args.measure_s,
        request_timeout_s=slowest_passing_turn_s(trajectories, TIERS[args.slo]),
        trials=args.trials,
        max_concurrency=args.max_concurrency,
        gpus=1,
        max_seconds=args.max_seconds,
        max_requests=1_000_000,
        served_history=False,
        seed=0,
    )
    before = {tier: rank_state(url) for tier, url in urls.items()}
    started = time.monotonic()
    result, windows = asyncio.run(search(urls, names, trajectories, trace, settings, args.profile, levels))
    elapsed = time.monotonic() - started
    after = {tier: rank_state(url) for tier, url in urls.items()}
    table = markdown_table(result)
    print(table, flush=True)
    return {
        "slo": args.slo,
        "trace": trace,
        "warmup_s": args.warmup_s,
        "measure_s": args.measure_s,
        "request_timeout_s": settings.request_timeout_s,
        "run_s": round(elapsed, 1),
        "stopped": result.stopped,
        "configurations": {
            outcome.configuration.name: {
                "cpg": outcome.cpg,
                "complete": outcome.complete,
                "ratio_to_first": outcome.ratio_to_first,
                "levels": {f"{t.concurrency}": t.passed for t in outcome.trials},
                "turns_measured": sum(len(t.records) for t in outcome.trials),
                "trials": [
                    {"concurrency": t.concurrency, "passed": t.passed, "window": w, "errors": errors(t.records)}
                    for t, w in zip(outcome.trials, windows[outcome.configuration.name])
                ],
            }
            for outcome in result.configurations
        },
        **{
            SERVER_NAMES[tier]: server_figures(before[tier], after[tier], elapsed) for tier in sorted(urls)
        },
        "table": table,
    }


SERVER_NAMES = {False: "server", True: "server with the host tier"}


def server_figures(before_state: dict, after_state: dict, elapsed: float) -> dict:
    """One server's emulated device between two readings of its state (busy, waited, occupancy over the run and
    over the rank's clock), its emulation's report, and its host tier's (None without one)."""
    before, after = before_state["dsv4_emulation"], after_state["dsv4_emulation"]
    busy = after["device_time"]["busy_s"] - before["device_time"]["busy_s"]
    waited = after["device_time"]["host_waited_s"] - before["device_time"]["host_waited_s"]
    rank_time = after["device_time"]["wall_s"] - before["device_time"]["wall_s"]
    return {
        "device": {
            "busy_s": round(busy, 2),
            "host_waited_s": round(waited, 2),
            "occupancy_over_run": round(busy / elapsed, 3),
            "occupancy_over_rank_clock": round(busy / rank_time, 3) if rank_time > 0 else None,
            "host_speed": after["device_time"]["host_speed"],
        },
        "emulation": {
            k: after[k] for k in ("gpus", "kv_dtype", "lockstep", "capacity", "resident_bytes", "device_time")
        },
        "host_tier": after_state["dsv4_prefix_cache"].get("host_tier"),
    }


def slowest_passing_turn_s(trajectories: list, slo) -> float:
    """How long the trace's longest turn may take within the SLO (its TTFT bound, then its output at the slowest
    speed allowed), and at least 120 s: a client timeout any shorter would fail turns that meet the SLO (the
    synthetic trace's outputs reach 16K tokens, 819 s at 20 tok/s)."""
    longest = max(turn.output_tokens for trajectory in trajectories for turn in trajectory.turns)
    return max(120.0, slo.max_ttft_s + longest / slo.min_output_speed)


def errors(records: list) -> dict[str, int]:
    """How many of a trial's turns failed with each error."""
    return dict(Counter(record.error for record in records if record.error is not None))


def at_levels(pairs: list[str]) -> dict[str, int]:
    """``--at``'s ``NAME=LEVEL`` pairs."""
    return {name: int(level) for name, _, level in (pair.partition("=") for pair in pairs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="flash", choices=["flash", "pro"], help="the shipped V4 config served")
    parser.add_argument("--gpus", type=int, default=8, help="the node's GPUs (pro: 16, two nodes)")
    parser.add_argument("--slo", default="slo20", choices=["slo20", "slo60"])
    parser.add_argument("--warmup-s", type=float, default=10.0)
    parser.add_argument("--measure-s", type=float, default=30.0)
    parser.add_argument("--max-concurrency", type=int, default=96)
    parser.add_argument("--max-seconds", type=float, default=1500.0)
    parser.add_argument("--context-length", type=int, default=CONTEXT_LENGTH)
    parser.add_argument("--trace", default="sessions", choices=["sessions", "synthetic"], help="what the agents run")
    parser.add_argument("--sessions", type=Path, default=SESSIONS, help="the recorded sessions (jsonl.gz)")
    parser.add_argument("--trajectories", type=int, default=128, help="synthetic trajectories to draw")
    parser.add_argument("--host-speed", type=float, default=1.0, help="the emulated host's time over this host's")
    parser.add_argument("--lockstep", action="store_true", help="the DP ranks' extends stall this rank (docs)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="SGLang's --kv-cache-dtype (auto: bf16)")
    parser.add_argument("--host-tier", type=int, default=0, help="GB of host memory a rank (+host-tier configurations)")
    parser.add_argument(
        "--max-total-tokens", type=int, default=0, help="SGLang's: a device pool of fewer token slots than the GPU's"
    )
    parser.add_argument("--profile", type=Path, help="a folder for py-spy's samples of each trial's window")
    parser.add_argument("--out", type=Path, help="where the results go (PATH.json, PATH.md); named after the run")
    parser.add_argument("--configurations", nargs="+", choices=CONFIGURATIONS, default=list(MODES))
    parser.add_argument("--at", nargs="+", default=[], help="NAME=LEVEL ...: trials at that level only, no search")
    parser.add_argument(
        "--trials", type=int, default=1, help="trials at each boundary level, the majority deciding (with --at: each)"
    )
    args = parser.parse_args()
    levels = at_levels(args.at)
    names = list(levels) or args.configurations
    tiers = sorted({on_host_tier(name) for name in names})
    if True in tiers and args.host_tier <= 0:
        parser.error("+host-tier configurations need --host-tier GB")
    trajectories, trace = load_trajectories(args.trace, args.sessions, "gpu", args.trajectories, seed=0)
    with tempfile.TemporaryDirectory() as scratch, contextlib.ExitStack() as servers:
        urls = {tier: servers.enter_context(emulated_server(args, Path(scratch), tier)) for tier in tiers}
        summary = run(urls, names, levels, trajectories, trace, args)
    name = "" if args.config == "flash" else f"{args.config}{args.gpus}_"
    name += "" if args.trace == "sessions" else f"{args.trace}{args.trajectories}_"
    name += f"{args.slo}_{args.measure_s:g}s_host{args.host_speed:g}" + ("_lockstep" if args.lockstep else "")
    name += "" if args.kv_cache_dtype == "auto" else f"_{args.kv_cache_dtype}"
    name += f"_hicache{args.host_tier}" if True in tiers else ""
    name += f"_slots{args.max_total_tokens}" if args.max_total_tokens else ""
    name += f"_context{args.context_length}" if args.context_length != CONTEXT_LENGTH else ""
    name += "" if args.configurations == list(MODES) else "_" + "+".join(args.configurations)
    name += "_at_" + "_".join(args.at).replace("=", "") if args.at else ""
    name += f"_trials{args.trials}" if args.trials > 1 else ""
    out = args.out or OUT / name
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(summary, indent=1) + "\n")
    Path(f"{out}.md").write_text(summary["table"])


def emulated_server(args: argparse.Namespace, scratch: Path, with_host_tier: bool):
    """``dsv4 emulate``'s server for the run, with a host tier of ``--host-tier`` GB or without."""
    tier = ("--enable-hierarchical-cache", "--hicache-size", str(args.host_tier)) if with_host_tier else ()
    slots = ("--max-total-tokens", str(args.max_total_tokens)) if args.max_total_tokens else ()
    return running_emulated_server(
        args.config, "--enable-cache-report", "--kv-cache-dtype", args.kv_cache_dtype, *tier, *slots,
        log_path=scratch / f"server{'_host_tier' if with_host_tier else ''}.log", gpus=args.gpus,
        context_length=args.context_length, env=ONE_TORCH_THREAD,
        timing={"host_speed": args.host_speed, "lockstep": args.lockstep},
    )  # fmt: skip


if __name__ == "__main__":
    main()
