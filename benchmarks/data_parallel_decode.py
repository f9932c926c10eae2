"""Served decode throughput of attention data parallelism against tensor parallelism, in one run.

Two servers of the shipped tiny checkpoint on this host, both two ranks with the experts split by
EP: ``--tp 2 --ep-size 2`` (both ranks hold every request) and ``--tp 2 --attn-dp-size 2
--ep-size 2`` (each rank its own requests, attention-TP 1; SGLang's DP controller deals requests
round robin). The same concurrent load on each: ``CONCURRENCY`` requests sent together, each a
``PROMPT``-token prompt and ``NEW_TOKENS`` greedy tokens (ignore_eos); decode time = the batch's
time minus that of the same batch generating one token. The servers are measured in turn for
``ROUNDS`` rounds, keeping each one's best (the host is shared: the best round is the least
disturbed).

    python benchmarks/data_parallel_decode.py
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from pathlib import Path

import torch
from serving_decode import timed_batch

from sglang_dsv4.launch import running_server
from sglang_dsv4.tiny import shipped_checkpoint

PROMPT, NEW_TOKENS = 64, 64
CONCURRENCY = 8
ROUNDS = 2
LAYOUTS = {
    "--tp 2 --ep-size 2": ("--tp", "2", "--ep-size", "2"),
    "--tp 2 --attn-dp-size 2 --ep-size 2": ("--tp", "2", "--attn-dp-size", "2", "--ep-size", "2"),
}


def decode_tokens_per_second(url: str) -> float:
    """Decode tokens/s of the whole concurrent batch: the time beyond a prefill-only run of the same batch."""
    prompts = [
        torch.randint(0, 1024, (PROMPT,), generator=torch.Generator().manual_seed(i)).tolist()
        for i in range(CONCURRENCY)
    ]
    prefill = timed_batch(url, prompts, 1)
    full = timed_batch(url, prompts, NEW_TOKENS)
    return CONCURRENCY * (NEW_TOKENS - 1) / (full - prefill)


def main() -> None:
    os.environ.pop("SGLANG_CPU_OMP_THREADS_BIND", None)
    with tempfile.TemporaryDirectory() as scratch, contextlib.ExitStack() as servers:
        urls = {}
        for name, args in LAYOUTS.items():
            log = Path(scratch) / f"{len(urls)}.log"
            started = time.perf_counter()
            urls[name] = servers.enter_context(running_server(shipped_checkpoint(), "--dtype", "float32", *args,
                                                              log_path=log))  # fmt: skip
            print(f"server start ({name}): {time.perf_counter() - started:.1f}s")
        for url in urls.values():
            decode_tokens_per_second(url)  # warm-up
        best = dict.fromkeys(urls, 0.0)
        for round_ in range(ROUNDS):
            for name, url in urls.items():
                measured = decode_tokens_per_second(url)
                print(f"  round {round_}, {name}: {measured:.1f} decode tok/s")
                best[name] = max(best[name], measured)
    for name, tokens_per_second in best.items():
        print(f"{name}: {tokens_per_second:.1f} decode tok/s at concurrency {CONCURRENCY}")
    tp, dp = best.values()
    print(f"attention DP / TP: {dp / tp:.2f}x")


if __name__ == "__main__":
    main()
