"""CPG of the shipped tiny V4 on this CPU host, servers started with different flags compared in one run.

``--comparison speculation``: one server plain, one with ``--speculative-algorithm EAGLE --speculative-num-steps
3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4``. ``--comparison routing``: two servers at
attention-DP 2 (``--tp 2 --attn-dp-size 2 --ep-size 2``), one routing turns by SGLang's ``round_robin``, one by
ours (the default under attention DP). ``--comparison host-tier``: two servers with a 6,144-token device pool, below
the sessions' working set, one with the host tier (``--enable-hierarchical-cache --hicache-write-policy write_back
--hicache-ratio 8``), one without. Both servers of a comparison are started the way a user starts them,
then ``dsv4 agentperf compare`` runs on the 84 recorded sessions at CPU scale with the two as its
configurations, trials interleaved (the first server's figures are the ratios' base). The JSON, table and plot
go to ``benchmarks/results/agentperf/<comparison>/``.

Every server has a 16,384-token pool (per rank; 6,144 in the host-tier comparison), reports cache hits in each
reply's usage, runs one torch thread (``ONE_TORCH_THREAD``) and sleeps when idle (``--sleep-on-idle``, which
``running_server`` passes: idle schedulers and DP controllers would otherwise poll, taking cores from the server
being measured); only one of them is busy at a time.

    python benchmarks/agentperf_servers.py --comparison speculation|routing|host-tier [--max-seconds 2400]

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
OUT = REPOSITORY / "benchmarks" / "results" / "agentperf"
SERVER_ARGS = ("--dtype", "float32", "--enable-cache-report")
POOL_TOKENS = 16384
DP_ARGS = ("--tp", "2", "--attn-dp-size", "2", "--ep-size", "2")
# A device pool below the sessions' working set (the host-tier comparison): about 6 sessions at the cpu scale's
# 1,024-token contexts, against 8 and more running.
SMALL_POOL_TOKENS = 6144
HOST_TIER = ("--enable-hierarchical-cache", "--hicache-write-policy", "write_back", "--hicache-ratio", "8")
COMPARISONS = {
    "speculation": {"plain": (), "eagle-k3": SPECULATION},
    "routing": {"round-robin": (*DP_ARGS, "--load-balance-method", "round_robin"), "dsv4-cache-aware": DP_ARGS},
    "host-tier": {"device-only": (), "host-tier": HOST_TIER},
}
POOLS = {"host-tier": SMALL_POOL_TOKENS}
STARTUP_TIMEOUT_S = 900  # a DP server's or a speculating server's start takes minutes on this host


def compare_arguments(urls: dict[str, str], out: Path, max_seconds: float) -> list[str]:
    arguments = ["agentperf", "compare", "--scale", "cpu", "--trace", "sessions", "--trace-path", str(SESSIONS)]
    arguments += ["--max-seconds", f"{max_seconds:g}", "--out", str(out)]
    for name, url in urls.items():
        arguments += ["--config", f"name={name},url={url}"]
    return arguments


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--comparison", choices=list(COMPARISONS), required=True)
    parser.add_argument("--max-seconds", type=float, default=2400.0, help="the whole comparison's time limit")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch, contextlib.ExitStack() as servers:
        pool = POOLS.get(args.comparison, POOL_TOKENS)
        urls = {
            name: servers.enter_context(
                running_server(
                    shipped_checkpoint(), *SERVER_ARGS, "--max-total-tokens", str(pool), *extra,
                    log_path=Path(scratch) / f"{name}.log",
                    env=ONE_TORCH_THREAD, startup_timeout_s=STARTUP_TIMEOUT_S,
                )
            )
            for name, extra in COMPARISONS[args.comparison].items()
        }  # fmt: skip
        arguments = compare_arguments(urls, OUT / args.comparison, args.max_seconds)
        print("dsv4 " + shlex.join(arguments), flush=True)
        dsv4(arguments)


if __name__ == "__main__":
    main()
