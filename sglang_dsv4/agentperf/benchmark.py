"""The benchmark: a CPG search per configuration, their trials interleaved, bounded in time and requests.

Each server first gets one untimed request. Configurations then take turns, one trial each per round, so a
drift in the host's speed touches all of them alike; a configuration with ``server_args`` has its server
switched to them, and its prefix cache emptied, before each of its trials (several configurations may share
one URL: one server, modes switched at run time). Trial ``r`` at concurrency ``c`` replays the same seeded
workload for every configuration. The run stops starting trials when the next one's window would pass
``max_seconds`` or ``max_requests`` is spent; a trial cut short decides nothing, and the searches it
interrupts report their lower bound (``CpgSearch.lower_bound``), as incomplete.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from .progress import Progress
from .replay import RequestBudget, TrialPlan, TurnRecord, run_trial
from .search import CpgSearch
from .server import ChatServer, GenerateServer, Server, ServerError, first_model
from .slo import AgentMetrics, Slo, agent_metrics, meets
from .trajectory import Trajectory


@dataclass(frozen=True)
class Configuration:
    """One thing to measure: a server, and the modes to switch it to before each of its trials (if any)."""

    name: str
    url: str
    server_args: dict[str, Any] | None = None


@dataclass(frozen=True)
class Settings:
    """Everything a run is judged and bounded by."""

    slo: Slo
    warmup_s: float
    measure_s: float
    request_timeout_s: float
    trials: int
    max_concurrency: int
    gpus: int
    max_seconds: float
    max_requests: int
    served_history: bool
    seed: int


@dataclass
class TrialResult:
    """One trial of one configuration: its verdict, per-agent metrics and every turn."""

    concurrency: int
    repeat: int
    passed: bool
    started_at: float
    modes: dict[str, Any] | None
    agents: list[AgentMetrics]
    records: list[TurnRecord]


@dataclass
class ConfigurationResult:
    """A configuration's CPG: the largest concurrency meeting the SLO, and that per GPU."""

    configuration: Configuration
    cpg_concurrency: int = 0
    cpg: float = 0.0
    complete: bool = False
    ratio_to_first: float | None = None
    trials: list[TrialResult] = field(default_factory=list)


@dataclass
class BenchmarkResult:
    settings: Settings
    trace: str
    configurations: list[ConfigurationResult]
    stopped: str | None = None


async def measure(
    configurations: list[Configuration],
    trajectories: list[Trajectory],
    settings: Settings,
    trace: str,
    api: str = "chat",
    model: str | None = None,
    tokenizer: str | None = None,
) -> BenchmarkResult:
    """``run_benchmark`` over HTTP: OpenAI chat (``api="chat"``) or SGLang ``/generate`` with ``tokenizer``."""
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        if api == "generate":
            from transformers import AutoTokenizer

            loaded = AutoTokenizer.from_pretrained(tokenizer)
            servers: list[Server] = [GenerateServer(c.url, session, loaded) for c in configurations]
        else:
            servers = [ChatServer(c.url, session, model or await first_model(c.url, session)) for c in configurations]
        return await run_benchmark(
            configurations, servers, trajectories, settings, trace, Progress(settings.max_seconds)
        )


async def run_benchmark(
    configurations: list[Configuration],
    servers: list[Server],
    trajectories: list[Trajectory],
    settings: Settings,
    trace: str,
    progress: Progress,
) -> BenchmarkResult:
    """Search every configuration's CPG, interleaved (``servers[i]`` serves ``configurations[i]``)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + settings.max_seconds
    budget = RequestBudget(settings.max_requests)
    result = BenchmarkResult(settings, trace, [ConfigurationResult(c) for c in configurations])
    for server in servers:
        await _prime(server, settings.request_timeout_s, budget)
    searches = [CpgSearch(settings.max_concurrency, settings.trials) for _ in configurations]
    steps = [search.steps() for search in searches]
    pending = {index: next(step) for index, step in enumerate(steps)}
    while pending and result.stopped is None:
        for index in list(pending):
            if loop.time() + settings.warmup_s + settings.measure_s > deadline:
                result.stopped = f"the run's {settings.max_seconds:g}s limit leaves no room for another trial"
                break
            outcome = result.configurations[index]
            trial = await _trial(
                outcome, servers[index], pending[index], trajectories, settings, budget, deadline, progress
            )
            if isinstance(trial, str):
                result.stopped = trial
                break
            outcome.trials.append(trial)
            try:
                pending[index] = steps[index].send(trial.passed)
            except StopIteration as done:
                del pending[index]
                outcome.cpg_concurrency, outcome.complete = done.value, True
    for index in pending:
        result.configurations[index].cpg_concurrency = searches[index].lower_bound()
    _summarize(result.configurations, settings.gpus)
    return result


async def _prime(server: Server, timeout_s: float, budget: RequestBudget) -> None:
    """One short untimed request, so a server's one-time costs (its first chat request compiles the template,
    allocates, warms caches: seconds on a CPU host) do not land in the first trial. Failures are left to the
    trials to report."""
    if not budget.take():
        return
    try:
        async with asyncio.timeout(timeout_s):
            async for _ in server.stream([{"role": "user", "content": "Hello."}], 2, ()):
                pass
    except (TimeoutError, ServerError):
        pass


async def _trial(
    outcome: ConfigurationResult,
    server: Server,
    concurrency: int,
    trajectories: list[Trajectory],
    settings: Settings,
    budget: RequestBudget,
    deadline: float,
    progress: Progress,
) -> TrialResult | str:
    """One trial, or why it was cut short."""
    configuration = outcome.configuration
    repeat = sum(1 for trial in outcome.trials if trial.concurrency == concurrency)
    modes = await server.apply(configuration.server_args) if configuration.server_args else None
    plan = TrialPlan(
        concurrency=concurrency,
        warmup_s=settings.warmup_s,
        measure_s=settings.measure_s,
        request_timeout_s=settings.request_timeout_s,
        served_history=settings.served_history,
        seed=random.Random(f"{settings.seed}/{concurrency}/{repeat}").getrandbits(32),
    )
    label = f"{configuration.name}  concurrency {concurrency}  trial {repeat + 1}"
    started_at = time.time()
    async with progress.trial(label, settings.warmup_s + settings.measure_s):
        try:
            async with asyncio.timeout_at(deadline):
                records = await run_trial(server, trajectories, plan, budget)
        except TimeoutError:
            return f"the run's {settings.max_seconds:g}s limit was reached during a trial ({label})"
    if records.cut_short:
        return f"{records.cut_short} during a trial ({label})"
    agents = agent_metrics(records.records, concurrency, settings.slo.ttft_quantile)
    passed = meets(settings.slo, agents)
    progress.finished(
        f"{label}: {'meets' if passed else 'misses'} {settings.slo.name}  ({_worst(agents, settings.slo)})"
    )
    return TrialResult(concurrency, repeat, passed, started_at, modes, agents, records.records)


def _worst(agents: list[AgentMetrics], slo: Slo) -> str:
    """The slowest agent's speed, the largest TTFT quantile, and how many agents miss the SLO (with one reason)."""
    speeds = [a.output_speed for a in agents if a.output_speed is not None]
    ttfts = [a.ttft_quantile_s for a in agents if a.ttft_quantile_s is not None]
    parts = [f"slowest agent {min(speeds):.1f} tok/s"] if speeds else []
    parts += [f"worst TTFT p{slo.ttft_quantile * 100:g} {max(ttfts):.2f}s"] if ttfts else []
    missing = [agent.failures(slo) for agent in agents if agent.failures(slo)]
    summary = ", ".join(parts) or "nothing measured"
    return summary + (f"; {len(missing)}/{len(agents)} agents miss it, e.g. {missing[0][0]}" if missing else "")


def _summarize(outcomes: list[ConfigurationResult], gpus: int) -> None:
    for outcome in outcomes:
        outcome.cpg = outcome.cpg_concurrency / gpus
    first = outcomes[0].cpg
    for outcome in outcomes:
        outcome.ratio_to_first = outcome.cpg / first if first > 0 else None
