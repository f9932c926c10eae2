"""What a run leaves behind: the JSON of everything, a markdown table, and the plot against concurrency."""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

from .benchmark import BenchmarkResult, ConfigurationResult
from .replay import TurnRecord


def write_all(result: BenchmarkResult, folder: Path) -> str:
    """``agentperf.json``, ``agentperf.md`` and ``agentperf.png`` in ``folder``; returns the markdown table."""
    folder.mkdir(parents=True, exist_ok=True)
    table = markdown_table(result)
    write_json(result, folder / "agentperf.json")
    (folder / "agentperf.md").write_text(table)
    plot(result, folder / "agentperf.png")
    return table


def write_json(result: BenchmarkResult, path: Path) -> None:
    """Settings, per-trial verdicts, per-agent metrics and every turn's timestamps."""
    path.write_text(json.dumps(dataclasses.asdict(result)) + "\n")


def markdown_table(result: BenchmarkResult) -> str:
    """The CPG of each configuration (with its ratio to the first), then each tested level's agents."""
    slo = result.settings.slo
    quantile = f"p{slo.ttft_quantile * 100:g}"
    lines = [
        f"SLO `{slo.name}`: every agent at least {slo.min_output_speed:g} tok/s after its first token and TTFT "
        f"{quantile} at most {slo.max_ttft_s:g} s; trace: {result.trace}; CPG = concurrency / {result.settings.gpus} "
        f"GPU(s).",
        "",
        "| configuration | CPG | ratio to first | levels (passed/trials) |",
        "|---|---|---|---|",
    ]
    for outcome in result.configurations:
        ratio = f"{outcome.ratio_to_first:.2f}" if outcome.ratio_to_first is not None else "n/a"
        cpg = f"{outcome.cpg:g}" + ("" if outcome.complete else " (incomplete: at least)")
        lines.append(f"| {outcome.configuration.name} | {cpg} | {ratio} | {_levels(outcome)} |")
    lines += [
        "",
        f"| configuration | concurrency | trials passed | agent tok/s (min / median) | agent TTFT {quantile} s "
        "(median / max) | measured turns | failed turns | prompt tokens cached |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for outcome in result.configurations:
        for concurrency in sorted({trial.concurrency for trial in outcome.trials}):
            lines.append(_level_row(outcome, concurrency))
    if result.stopped:
        lines += ["", f"Stopped early: {result.stopped}."]
    return "\n".join(lines) + "\n"


def _levels(outcome: ConfigurationResult) -> str:
    counts: dict[int, list[bool]] = {}
    for trial in outcome.trials:
        counts.setdefault(trial.concurrency, []).append(trial.passed)
    return ", ".join(f"{c}: {sum(passed)}/{len(passed)}" for c, passed in sorted(counts.items()))


def _level_row(outcome: ConfigurationResult, concurrency: int) -> str:
    trials = [trial for trial in outcome.trials if trial.concurrency == concurrency]
    agents = [agent for trial in trials for agent in trial.agents]
    speeds = [a.output_speed for a in agents if a.output_speed is not None]
    ttfts = [a.ttft_quantile_s for a in agents if a.ttft_quantile_s is not None]
    measured = [record for trial in trials for record in trial.records if record.measured]
    return (
        f"| {outcome.configuration.name} | {concurrency} | {sum(t.passed for t in trials)}/{len(trials)} | "
        f"{_two(min(speeds), statistics.median(speeds), '.1f') if speeds else 'n/a'} | "
        f"{_two(statistics.median(ttfts), max(ttfts), '.2f') if ttfts else 'n/a'} | {len(measured)} | "
        f"{sum(r.error is not None for r in measured)} | {_percent(cached_share(measured))} |"
    )


def cached_share(records: list[TurnRecord]) -> float | None:
    """Share of prompt tokens the server reports as prefix-cache hits (``None`` where it reports none)."""
    reported = [r for r in records if r.cached_tokens is not None and r.prompt_tokens]
    if not reported:
        return None
    return sum(r.cached_tokens for r in reported) / sum(r.prompt_tokens for r in reported)


def _percent(share: float | None) -> str:
    return "n/a" if share is None else f"{share:.0%}"


def _two(first: float, second: float, spec: str) -> str:
    return f"{first:{spec}} / {second:{spec}}"


def plot(result: BenchmarkResult, path: Path) -> None:
    """Per-agent output speed and TTFT quantile against concurrency, one colour per configuration, SLO lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    slo = result.settings.slo
    figure, (speed_axis, ttft_axis) = plt.subplots(1, 2, figsize=(11, 4.2))
    count = len(result.configurations)
    for index, outcome in enumerate(result.configurations):
        color = f"C{index}"
        offset = (index - (count - 1) / 2) * 0.08
        label = f"{outcome.configuration.name} (CPG {outcome.cpg:g})"
        for axis, metric in ((speed_axis, "output_speed"), (ttft_axis, "ttft_quantile_s")):
            points = [(trial.concurrency, getattr(agent, metric)) for trial in outcome.trials for agent in trial.agents]
            points = [(c, value) for c, value in points if value is not None]
            axis.scatter([c + offset for c, _ in points], [v for _, v in points], s=10, alpha=0.35, color=color)
            levels = sorted({c for c, _ in points})
            medians = [statistics.median(v for c, v in points if c == level) for level in levels]
            axis.plot(levels, medians, color=color, marker="o", label=label)
            if outcome.cpg_concurrency:
                axis.axvline(outcome.cpg_concurrency, color=color, linestyle=":", linewidth=1)
    speed_axis.axhline(
        slo.min_output_speed, color="black", linestyle="--", label=f"{slo.name}: {slo.min_output_speed:g} tok/s"
    )
    ttft_axis.axhline(slo.max_ttft_s, color="black", linestyle="--", label=f"{slo.name}: {slo.max_ttft_s:g} s")
    quantile = f"p{slo.ttft_quantile * 100:g}"
    speed_axis.set(
        xlabel="concurrent agents", ylabel="output speed per agent (tok/s)", title="Output speed (dots: agents)"
    )
    ttft_axis.set(
        xlabel="concurrent agents", ylabel=f"TTFT {quantile} per agent (s)", title=f"TTFT {quantile} (dots: agents)"
    )
    for axis in (speed_axis, ttft_axis):
        axis.set_ylim(bottom=0)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
