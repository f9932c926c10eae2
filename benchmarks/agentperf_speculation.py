"""CPG of the shipped tiny V4 on this CPU host with and without speculation (EAGLE with the MTP layer), in one run.

Starts two servers of the shipped checkpoint the way a user starts them, one plain and one with
``--speculative-algorithm EAGLE --speculative-num-steps 3 --speculative-eagle-topk 1
--speculative-num-draft-tokens 4``, and runs ``dsv4 agentperf compare`` on the 84 recorded sessions at CPU scale
with the two as its configurations, trials interleaved (the plain server first, so ratios are speculative /
plain). The JSON, table and plot go to ``benchmarks/agentperf/speculation/``.

Both servers have a 16,384-token pool, report cache hits in each reply's usage and run one torch thread
(``ONE_TORCH_THREAD``); only one of them is busy at a time.

    python benchmarks/agentperf_speculation.py [--max-seconds 1500]

It prints the ``dsv4 agentperf compare`` command it runs, which does the same against any two running servers.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import tempfile
from pathlib import Path

from sglang_dsv4.cli import main as dsv4
from sglang_dsv4.launch import ONE_TORCH_THREAD, running_server
from sglang_dsv4.speculation import SPECULATION
from sglang_dsv4.tiny import shipped_checkpoint

REPOSITORY = Path(__file__).resolve().parents[1]
SESSIONS = REPOSITORY.parent / "shared" / "data" / "agentic_trajectories.jsonl.gz"
OUT = REPOSITORY / "benchmarks" / "agentperf" / "speculation"
SERVER_ARGS = ("--dtype", "float32", "--max-total-tokens", "16384", "--enable-cache-report")
SERVERS = {"plain": (), "eagle-k3": SPECULATION}
STARTUP_TIMEOUT_S = 600.0  # the speculating server loads the MTP layer as a second model


def compare_arguments(urls: dict[str, str], max_seconds: float) -> list[str]:
    arguments = ["agentperf", "compare", "--scale", "cpu", "--trace", "sessions", "--trace-path", str(SESSIONS)]
    arguments += ["--max-seconds", f"{max_seconds:g}", "--out", str(OUT)]
    for name, url in urls.items():
        arguments += ["--config", f"name={name},url={url}"]
    return arguments


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-seconds", type=float, default=1500.0, help="the whole comparison's time limit")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch, contextlib.ExitStack() as servers:
        urls = {
            name: servers.enter_context(
                running_server(
                    shipped_checkpoint(), *SERVER_ARGS, *extra, log_path=Path(scratch) / f"{name}.log",
                    env=ONE_TORCH_THREAD, startup_timeout_s=STARTUP_TIMEOUT_S,
                )
            )
            for name, extra in SERVERS.items()
        }  # fmt: skip
        arguments = compare_arguments(urls, args.max_seconds)
        print("dsv4 " + shlex.join(arguments), flush=True)
        dsv4(arguments)


if __name__ == "__main__":
    main()
