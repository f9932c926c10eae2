"""Per-agent service objectives, the named tiers, and the arithmetic that judges a trial.

An agent meets an ``Slo`` in a trial when, over the turns it sent inside the measurement window, none
failed, the ``ttft_quantile`` of its times to first token is at most ``max_ttft_s`` and its output speed
is at least ``min_output_speed``. Output speed is tokens after the first over the time from first to last
token, summed over the agent's turns (a token-weighted mean: long replies weigh more, as they do for the
user). A trial meets the SLO when every agent does: AgentPerf counts agents that keep their objective, and
an agent starved for the whole window must not hide behind the others. An agent that sent no turn in the
window fails: with a window longer than the longest tool wait, it was waiting on one reply throughout.

Quantiles are nearest-rank: the smallest value with at least that fraction of values at or below it (the
p90 of 10 values is the 9th smallest), so every reported quantile is a measured value.

Tiers:

* ``slo20``, ``slo60`` (GPU, AgentPerf's speeds): 20 and 60 tokens/s per agent. AgentPerf does not publish
  its TTFT limits; ours are a p90 of 10 s at ``slo20`` (a first turn prefills up to ~131K tokens, and a
  coding agent waits on its tools for seconds anyway) and 5 s at ``slo60`` (the interactive tier).
* ``cpu-slo20``, ``cpu-slo60`` (the tiny V4 served on a CPU host, with ``--scale cpu`` traces): the GPU
  tiers times 0.4, i.e. 8 and 24 tokens/s with TTFT p90 limits of 4 s and 2 s. One agent alone decodes the
  tiny model at ~80 tokens/s on an unloaded 2-core host (``benchmarks/NOTES.md``, served decode at batch 1),
  against roughly 200 tokens/s for one V4 stream on a current GPU (our assumption), so each tier keeps its
  share of what an agent gets alone. A whole scaled history (at most 1,024 tokens) prefills in ~0.3 s
  unloaded, so the TTFT limits, like the GPU ones, bound the queueing behind other agents.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .replay import TurnRecord


@dataclass(frozen=True)
class Slo:
    """Per agent: TTFT ``ttft_quantile`` at most ``max_ttft_s``, output speed at least ``min_output_speed`` tok/s."""

    name: str
    min_output_speed: float
    max_ttft_s: float
    ttft_quantile: float = 0.9


TIERS: dict[str, Slo] = {
    tier.name: tier
    for tier in (
        Slo("slo20", min_output_speed=20.0, max_ttft_s=10.0),
        Slo("slo60", min_output_speed=60.0, max_ttft_s=5.0),
        Slo("cpu-slo20", min_output_speed=8.0, max_ttft_s=4.0),
        Slo("cpu-slo60", min_output_speed=24.0, max_ttft_s=2.0),
    )
}


@dataclass(frozen=True)
class AgentMetrics:
    """One agent's measured turns in one trial, and what the SLO asks of them."""

    agent: int
    turns: int
    errors: int
    ttft_quantile_s: float | None
    output_speed: float | None

    def failures(self, slo: Slo) -> list[str]:
        """Why this agent misses ``slo`` (empty when it meets it)."""
        reasons = []
        if self.turns == 0:
            reasons.append("no turn sent in the measurement window")
        if self.errors:
            reasons.append(f"{self.errors} failed turns")
        if self.ttft_quantile_s is not None and self.ttft_quantile_s > slo.max_ttft_s:
            reasons.append(f"TTFT p{slo.ttft_quantile * 100:g} {self.ttft_quantile_s:.2f}s > {slo.max_ttft_s:g}s")
        if self.output_speed is None and self.turns > self.errors:
            reasons.append("no streamed decode to time")
        elif self.output_speed is not None and self.output_speed < slo.min_output_speed:
            reasons.append(f"output {self.output_speed:.1f} tok/s < {slo.min_output_speed:g}")
        return reasons


def nearest_rank(values: Sequence[float], quantile: float) -> float:
    """The nearest-rank ``quantile`` of ``values`` (non-empty)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(quantile * len(ordered)) - 1)]


def agent_metrics(records: Iterable[TurnRecord], concurrency: int, ttft_quantile: float) -> list[AgentMetrics]:
    """Metrics of agents ``0..concurrency-1`` over their measured turns (agents without one included)."""
    measured: dict[int, list[TurnRecord]] = {agent: [] for agent in range(concurrency)}
    for record in records:
        if record.measured:
            measured[record.agent].append(record)
    return [_metrics(agent, turns, ttft_quantile) for agent, turns in measured.items()]


def _metrics(agent: int, turns: list[TurnRecord], ttft_quantile: float) -> AgentMetrics:
    done = [turn for turn in turns if turn.error is None]
    ttfts = [turn.ttft_s for turn in done]
    decoded = [turn for turn in done if turn.output_tokens >= 2]
    decode_s = sum(turn.decode_s for turn in decoded)
    speed = sum(turn.output_tokens - 1 for turn in decoded) / decode_s if decode_s > 0 else None
    return AgentMetrics(
        agent=agent,
        turns=len(turns),
        errors=len(turns) - len(done),
        ttft_quantile_s=nearest_rank(ttfts, ttft_quantile) if ttfts else None,
        output_speed=speed,
    )


def meets(slo: Slo, agents: Sequence[AgentMetrics]) -> bool:
    """Whether a trial meets ``slo``: every agent does."""
    return all(not agent.failures(slo) for agent in agents)
