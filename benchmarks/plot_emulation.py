"""RESULTS' plots of the emulator: its CPG search per level and its calibration against upstream's figures.

Reads ``benchmarks/results/emulated_cpg/<run>.md`` (AgentPerf's per-level table), the trials' windows in
``<run>.json`` where it has them (the device's occupancy over the rank's clock per level), and
``benchmarks/results/emulated_calibration.json``; writes ``<run>.png`` beside the first and
``emulated_calibration.png`` beside the second.

    python benchmarks/plot_emulation.py [--cpg-run slo20_90s_host1.76]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SLO20 = {"tok_s": 20.0, "ttft_s": 10.0}
RATIO_TICKS = (0.25, 0.5, 1, 2, 4, 8)
METRICS = {"tpot_ms": "TPOT (median)", "total_tokens_per_s_per_gpu": "tok/s per GPU", "ttft_ms": "TTFT (median)"}


def level_rows(table: str) -> dict[str, list[tuple[int, float, float]]]:
    """Per configuration: (concurrency, slowest agent's tok/s, largest TTFT p90) from AgentPerf's level table."""
    rows: dict[str, list[tuple[int, float, float]]] = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) != 8 or not cells[1].isdigit() or cells[3] == "n/a":  # n/a: no turn measured at that level
            continue
        slowest = float(cells[3].split("/")[0])
        ttft_max = float(cells[4].split("/")[1])
        rows.setdefault(cells[0], []).append((int(cells[1]), slowest, ttft_max))
    return rows


def level_occupancy(summary: dict) -> dict[str, list[tuple[int, float]]]:
    """Per configuration: (concurrency, the device's occupancy over the rank's clock in that trial's window)."""
    return {
        name: sorted((t["concurrency"], t["window"]["occupancy"]) for t in outcome.get("trials", []))
        for name, outcome in summary["configurations"].items()
    }


def plot_cpg(run: str) -> Path:
    rows = level_rows((RESULTS / "emulated_cpg" / f"{run}.md").read_text())
    summary = RESULTS / "emulated_cpg" / f"{run}.json"
    occupancy = level_occupancy(json.loads(summary.read_text())) if summary.exists() else {}
    panels = 3 if any(occupancy.values()) else 2
    figure, axes = plt.subplots(1, panels, figsize=(4 * panels, 3.2))
    speed, ttft = axes[0], axes[1]
    for name, points in rows.items():
        levels = [p[0] for p in points]
        speed.plot(levels, [p[1] for p in points], marker="o", label=name)
        ttft.plot(levels, [p[2] for p in points], marker="o", label=name)
        if panels == 3:
            axes[2].plot(*zip(*occupancy[name]), marker="o", label=name)
    speed.axhline(SLO20["tok_s"], color="grey", linestyle="--", linewidth=1)
    ttft.axhline(SLO20["ttft_s"], color="grey", linestyle="--", linewidth=1)
    labels = ("slowest agent, tok/s (SLO: at least 20)", "largest TTFT p90, s (SLO: at most 10)")
    if panels == 3:
        axes[2].axhline(0.95, color="grey", linestyle="--", linewidth=1)
        axes[2].set_ylim(0, 1.02)
        labels += ("device busy over the rank's clock (target 0.95)",)
    for axis, label in zip(axes, labels):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrent agents on one H200 (emulated)")
        axis.set_ylabel(label, fontsize=8)
        axis.grid(alpha=0.3)
    ttft.set_yscale("log")
    speed.legend(fontsize=8)
    figure.suptitle(f"V4-Flash, one DP8/EP8 rank, recorded sessions ({run})", fontsize=9)
    figure.tight_layout()
    out = RESULTS / "emulated_cpg" / f"{run}.png"
    figure.savefig(out, dpi=80)
    return out


def plot_calibration() -> Path:
    runs = json.loads((RESULTS / "emulated_calibration.json").read_text())["runs"]
    names = list(runs)
    figure, axes = plt.subplots(1, len(METRICS), figsize=(10, 3.4), sharey=True)
    for axis, (metric, label) in zip(axes, METRICS.items()):
        ratios = [runs[n]["emulated_over_published"][metric] for n in names]
        colors = ["tab:orange" if runs[n]["published"]["speculation"] else "tab:blue" for n in names]
        axis.barh(names, ratios, color=colors)
        axis.axvspan(0.8, 1.2, color="green", alpha=0.15)
        axis.axvline(1.0, color="grey", linewidth=1)
        axis.set_xscale("log")
        axis.set_xticks(RATIO_TICKS, [f"{t:g}" for t in RATIO_TICKS])
        axis.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        axis.set_title(f"{label}: emulated / published", fontsize=8)
        axis.tick_params(labelsize=7)
    figure.suptitle(
        "V4-Flash H200, 8K in / 1K out; orange: published figure uses MTP, blue: none; green: ±20%", fontsize=9
    )
    figure.tight_layout()
    out = RESULTS / "emulated_calibration.png"
    figure.savefig(out, dpi=80)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpg-run", default="slo20_90s_host1.76")
    args = parser.parse_args()
    print(plot_cpg(args.cpg_run), plot_calibration())


if __name__ == "__main__":
    main()
