"""One thread of Python, timed: how much faster an H200 host's CPU runs the scheduler's kind of work than this one.

``python benchmarks/host_speed.py [--out FILE]`` on each host (no GPU, no SGLang needed). The work is what a
scheduler's thread does between forwards: small objects made and dropped, dicts and lists read and written,
sorting short lists, function calls, ``int`` arithmetic; the best of 7 runs of it, in seconds. The ratio of
two hosts' figures is the factor by which host time measured on one scales to the other.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Request:
    rid: int
    tokens: list[int]
    cached: int = 0


def scheduler_like_work(requests: int = 4000, rounds: int = 30) -> int:
    """A fixed workload: admit, look up, sort and retire requests, as a scheduler's loop does."""
    checksum = 0
    table: dict[int, Request] = {}
    for round_ in range(rounds):
        for rid in range(requests):
            table[rid] = Request(rid, [rid % 97, round_, rid ^ round_])
        running = sorted(table.values(), key=lambda r: (r.tokens[0], -r.rid))[: requests // 2]
        for request in running:
            request.cached = sum(request.tokens) % 256
            checksum += request.cached
        for rid in range(0, requests, 2):
            del table[rid]
        checksum ^= len(table)
    return checksum


def best_seconds(runs: int = 7) -> float:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        scheduler_like_work()
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    result = {
        "best_s": round(best_seconds(), 4),
        "python": platform.python_version(),
        "processor": platform.processor() or platform.machine(),
        "cpu": _cpu_model(),
    }
    print(json.dumps(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()
