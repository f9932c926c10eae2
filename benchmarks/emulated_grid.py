"""The emulator's whole CPG grid in one run, at one commit: every cell a closed search of ``emulated_cpg.py``.

    python benchmarks/emulated_grid.py [--parallel 2] [--cells flash-bf16-slo20 ...] [--logs /tmp/grid]

Every cell runs AgentPerf's search (one trial a level, doubling from 1 and bisecting to adjacent levels) with a
90-s window after 10 s of warm-up, host time at the H200 host's speed (``--host-speed 1.76``), the server's
``--context-length 196608`` (the recorded sessions' longest turns pass 131,072), and at most 45 minutes
(``--max-seconds 2700``: a search that has not closed by then says so). The cells (``CELLS``):

* V4-Flash on 8 H200s, bf16 and FP8 KV, at ``slo20`` and ``slo60``: ours against upstream-like;
* V4-Pro on 16 H200s, bf16 KV, at ``slo20`` and ``slo60``: ours against upstream-like;
* V4-Flash, bf16, ``slo20``, on AgentPerf's synthetic trace (128 trajectories): ours against upstream-like;
* V4-Flash, bf16, ``slo20``, the device pool capped at 300,000 slots: ours against ours with a 200-GB host tier.

``--parallel N`` runs N cells at a time, longest expected first. A cell is one emulated server (two for the host
tier's) and one client; every trial reports the scheduler's run-queue wait and how far the wall fell behind the
rank's clock, so what running cells side by side costs is in each cell's figures. Writes each cell's results to
``results/emulated_cpg/grid/CELL.{json,md}`` and the grid's summary (each cell's CPG per configuration, its
trials and run time, the grid's wall time, the commit) to ``results/emulated_cpg/grid.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]
OUT = REPOSITORY / "benchmarks" / "results" / "emulated_cpg"
COMMON = ("--measure-s", "90", "--warmup-s", "10", "--host-speed", "1.76", "--context-length", "196608",
          "--max-seconds", "2700")  # fmt: skip


@dataclass(frozen=True)
class Cell:
    name: str
    arguments: tuple[str, ...]
    expected_min: int
    """About how long its search took alone (RESULTS), for the order cells start in."""


CELLS = (
    Cell("flash-fp8-slo20", ("--kv-cache-dtype", "fp8_e4m3"), 35),
    Cell("flash-bf16-slo20-synthetic", ("--trace", "synthetic", "--trajectories", "128"), 35),
    Cell("flash-bf16-slo20", (), 32),
    Cell("flash-bf16-slo20-host-tier", ("--max-total-tokens", "300000", "--configurations", "ours",
                                        "ours+host-tier", "--host-tier", "200"), 25),  # fmt: skip
    Cell("pro16-bf16-slo20", ("--config", "pro", "--gpus", "16"), 19),
    Cell("flash-fp8-slo60", ("--slo", "slo60", "--kv-cache-dtype", "fp8_e4m3"), 18),
    Cell("flash-bf16-slo60", ("--slo", "slo60"), 18),
    Cell("pro16-bf16-slo60", ("--config", "pro", "--gpus", "16", "--slo", "slo60"), 4),
)


def run_grid(cells: list[Cell], parallel: int, logs: Path) -> dict:
    """Run ``cells``, ``parallel`` at a time in the order given; each one's outcome and the grid's time."""
    logs.mkdir(parents=True, exist_ok=True)
    waiting, running, done = list(cells), {}, {}
    started = time.monotonic()
    while waiting or running:
        while waiting and len(running) < parallel:
            cell = waiting.pop(0)
            command = [sys.executable, str(REPOSITORY / "benchmarks" / "emulated_cpg.py"), *COMMON, *cell.arguments,
                       "--out", str(OUT / "grid" / cell.name)]  # fmt: skip
            log = (logs / f"{cell.name}.log").open("w")
            running[cell.name] = (subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT), time.monotonic())
            print(f"{time.strftime('%H:%M:%S')} started {cell.name}", flush=True)
        time.sleep(5)
        for name, (process, began) in list(running.items()):
            if process.poll() is None:
                continue
            del running[name]
            done[name] = {"returncode": process.returncode, "wall_s": round(time.monotonic() - began, 1)}
            print(f"{time.strftime('%H:%M:%S')} {name} ended ({process.returncode})", flush=True)
    return {"cells": done, "grid_wall_s": round(time.monotonic() - started, 1)}


def summary(cells: list[Cell], ran: dict, parallel: int) -> dict:
    """Each cell's CPG per configuration from its results, beside its run."""
    commit = subprocess.run(["git", "-C", str(REPOSITORY), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()  # fmt: skip
    rows = {}
    for cell in cells:
        outcome = ran["cells"][cell.name]
        path = OUT / "grid" / f"{cell.name}.json"
        if outcome["returncode"] != 0 or not path.exists():
            rows[cell.name] = {**outcome, "arguments": list(cell.arguments)}
            continue
        result = json.loads(path.read_text())
        rows[cell.name] = {
            **outcome,
            "arguments": list(cell.arguments),
            "search_s": result["run_s"],
            "stopped": result["stopped"],
            "cpg": {name: c["cpg"] for name, c in result["configurations"].items()},
            "complete": {name: c["complete"] for name, c in result["configurations"].items()},
            "trials": sum(len(c["trials"]) for c in result["configurations"].values()),
            "boundary": {name: boundary(c) for name, c in result["configurations"].items()},
            "wall_behind_rank_max": max(
                (t["window"]["wall_behind_rank_share"] for c in result["configurations"].values()
                 for t in c["trials"] if t["window"]),
                default=0.0,
            ),  # fmt: skip
        }
    return {"commit": commit, "common": list(COMMON), "parallel": parallel, "grid_wall_s": ran["grid_wall_s"],
            "cells": rows}  # fmt: skip


BOUNDARY_FIGURES = ("occupancy", "device_step_ms", "host_ms_per_forward_scaled")


def boundary(configuration: dict) -> dict | None:
    """The measured window of the passing trial at a configuration's CPG: the device's occupancy over the rank's
    clock, its time a forward, the scheduler's host time a forward at the H200 host's speed."""
    passing = [t for t in configuration["trials"] if t["passed"] and t["concurrency"] == configuration["cpg"]]
    if not passing or not passing[-1]["window"]:
        return None
    window = passing[-1]["window"]
    return {k: window[k] for k in BOUNDARY_FIGURES}


def table(grid: dict) -> str:
    lines = [
        f"Grid at `{grid['commit']}`, {len(grid['cells'])} cells, {grid['parallel']} at a time: "
        f"{grid['grid_wall_s'] / 60:.1f} min. Common arguments: `{' '.join(grid['common'])}`.",
        "",
        "| cell | arguments | CPG per configuration | ratio | trials | search min | closed | wall behind, most |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, row in grid["cells"].items():
        arguments = " ".join(row["arguments"]) or "(none)"
        if "cpg" not in row:
            lines.append(f"| {name} | `{arguments}` | failed (exit {row['returncode']}) | | | "
                         f"{row['wall_s'] / 60:.1f} | |")  # fmt: skip
            continue
        cpgs = list(row["cpg"].values())
        ratio = f"{cpgs[0] / cpgs[1]:.2f}x" if len(cpgs) == 2 and cpgs[1] else "-"
        shown = ", ".join(f"{k} {v:g}" for k, v in row["cpg"].items())
        closed = "yes" if all(row["complete"].values()) and not row["stopped"] else f"no ({row['stopped']})"
        lines.append(f"| {name} | `{arguments}` | {shown} | {ratio} | {row['trials']} | "
                     f"{row['search_s'] / 60:.1f} | {closed} | {row['wall_behind_rank_max']:.1%} |")  # fmt: skip
    lines += [
        "",
        "At each boundary (the passing trial at the CPG): device busy over the rank's clock, its time a forward, the "
        "scheduler's host time a forward at the H200 host's speed.",
        "",
        "| cell | configuration | occupancy | device ms a forward | host ms a forward |",
        "|---|---|---|---|---|",
    ]
    for name, row in grid["cells"].items():
        for configuration, figures in row.get("boundary", {}).items():
            if figures:
                occupancy, device, host = (figures[k] for k in BOUNDARY_FIGURES)
                lines.append(f"| {name} | {configuration} | {occupancy:.3f} | {device:.1f} | {host:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parallel", type=int, default=1, help="cells run at a time")
    parser.add_argument("--cells", nargs="+", choices=[c.name for c in CELLS], help="a part of the grid (default all)")
    parser.add_argument("--logs", type=Path, default=Path("/tmp/emulated_grid"), help="each cell's output")
    args = parser.parse_args()
    cells = [c for c in CELLS if args.cells is None or c.name in args.cells]
    ran = run_grid(cells, args.parallel, args.logs)
    grid = summary(cells, ran, args.parallel)
    (OUT / "grid.json").write_text(json.dumps(grid, indent=1) + "\n")
    (OUT / "grid.md").write_text(table(grid))
    print(table(grid))


if __name__ == "__main__":
    main()
