"""CPG of the tiny V4 on this CPU host in sglang-dsv4's four prefix-cache modes, interleaved on one server.

Starts ``sglang.launch_server`` on the tiny checkpoint, or uses ``--url``, and runs ``dsv4 agentperf compare``
on the 84 recorded sessions at CPU scale with four configurations of that one server: ``dsv4_prefix_hits``
exact | aligned x ``dsv4_window_policy`` per_request | all_committed, switched through ``/set_internal_state``
(and the cache flushed) before every trial. The JSON, table and plot go to ``benchmarks/results/agentperf/modes/``.

The server (``SERVER_ARGS``) has a 16,384-token pool, so agents' histories can stay cached through their
tool waits, and reports cache hits in each reply's usage; it runs one torch thread (``ONE_TORCH_THREAD``).

    python benchmarks/agentperf_modes.py [--url http://127.0.0.1:PORT] [--max-seconds 3600]

It prints the ``dsv4 agentperf compare`` command it runs, which does the same against any running server.
"""

from __future__ import annotations

import argparse
import shlex
import tempfile
from pathlib import Path

from sglang_dsv4.cli import main as dsv4
from sglang_dsv4.launch import ONE_TORCH_THREAD, running_server
from sglang_dsv4.tiny import build_checkpoint

REPOSITORY = Path(__file__).resolve().parents[1]
SESSIONS = REPOSITORY.parent / "shared" / "data" / "agentic_trajectories.jsonl.gz"
OUT = REPOSITORY / "benchmarks" / "results" / "agentperf" / "modes"
SERVER_ARGS = ("--dtype", "float32", "--max-total-tokens", "16384", "--enable-cache-report")
MODES = [(hits, policy) for hits in ("exact", "aligned") for policy in ("per_request", "all_committed")]


def compare_arguments(url: str, max_seconds: float) -> list[str]:
    arguments = ["agentperf", "compare", "--scale", "cpu", "--trace", "sessions", "--trace-path", str(SESSIONS)]
    arguments += ["--max-seconds", f"{max_seconds:g}", "--out", str(OUT)]
    for hits, policy in MODES:
        spec = f"name={hits}/{policy},url={url},dsv4_prefix_hits={hits},dsv4_window_policy={policy}"
        arguments += ["--config", spec]
    return arguments


def run(url: str, max_seconds: float) -> None:
    arguments = compare_arguments(url, max_seconds)
    print("dsv4 " + shlex.join(arguments), flush=True)
    dsv4(arguments)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running sglang-dsv4 server (default: start the tiny one)")
    parser.add_argument("--max-seconds", type=float, default=3600.0, help="the whole comparison's time limit")
    args = parser.parse_args()
    if args.url:
        run(args.url, args.max_seconds)
        return
    with tempfile.TemporaryDirectory() as scratch:
        model = build_checkpoint(Path(scratch) / "tiny")
        with running_server(model, *SERVER_ARGS, log_path=Path(scratch) / "server.log", env=ONE_TORCH_THREAD) as url:
            run(url, args.max_seconds)


if __name__ == "__main__":
    main()
