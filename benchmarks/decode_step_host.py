"""Our host work per decode step, before and after, side by side in one run (no server, no GPU).

Drives the per-decode-step path SGLang calls into this plugin, in-process over a V4 pool of the tiny
config (:class:`~sglang_dsv4.memory_pool.storage.V4PoolStorage` and its cache manager), for 32, 128 and
256 running requests of 200-token prompts, then decode steps, all requests decoding together:

* ``hooks``: the decode check's window slots (``admission._decode_within_window_slots`` asks the tree, which
  asks :meth:`CacheManager.room_for_windows` for one slot per request);
* ``cache_manager``: :meth:`CacheManager.alloc_to_lengths`, SGLang's request pool's aux cache before every
  forward (window slots, entry rows, snapshot planning);
* ``request_tables``: :meth:`RequestTables.begin_forward` (the device twins' flush; the CPU's is a no-op);
* ``index_build``: the rest of ``BatchedBackend.init_forward_metadata`` (the batch's spans and plan, the
  forward's index tensors).

Each version runs in its own subprocess: ``--before REV`` (default ``main``) is the package extracted at that
git revision into a temp dir (``git archive``) and put first on ``PYTHONPATH``; after is this checkout. The
versions alternate per batch size and round, so both see the same host load; per-step medians of each function
are printed with the ratios after/before and written to ``benchmarks/results/decode_step_host.json``.

    .venv/bin/python benchmarks/decode_step_host.py [--before main] [--steps 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
BATCHES = (32, 128, 256)
PROMPT = 200
FUNCTIONS = ("hooks", "cache_manager", "request_tables", "index_build")


def worker(batch: int, steps: int, warmup: int) -> dict[str, list[float]]:
    """Per-step seconds of each of our functions, ``steps`` decode steps of ``batch`` requests (in this process's
    ``sglang_dsv4``, whichever version ``PYTHONPATH`` puts first)."""
    import torch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from sglang_dsv4.attention_backend.batched_backend import BatchedBackend
    from sglang_dsv4.config import load_config
    from sglang_dsv4.memory_pool.storage import V4PoolStorage
    from sglang_dsv4.prefix_cache.manager import CacheManager

    torch.set_num_threads(1)
    config = load_config(ROOT / "sglang_dsv4" / "checkpoints" / "tiny")
    context = PROMPT + warmup + steps + 8
    storage = V4PoolStorage(
        config, torch.float32, num_tokens=batch * context, max_requests=batch, max_context=context, device="cpu"
    )
    manager = CacheManager(storage)
    manager.checkpoints.interval, manager.checkpoints.before_extend_end = 1024, True  # the server's defaults
    rows = torch.arange(1, batch + 1)
    for row in rows.tolist():
        manager.start(row, PROMPT)
        for checkpoint in manager.checkpoints.take(row, PROMPT):  # what the tree takes at the prefill's end
            manager.checkpoints.release(checkpoint)
    backend = SimpleNamespace(token_to_kv_pool=SimpleNamespace(storage=storage, checkpoints=manager.checkpoints))
    lengths = torch.full((batch,), PROMPT)
    times: dict[str, list[float]] = {name: [] for name in FUNCTIONS}
    for step in range(warmup + steps):
        lengths = lengths + 1
        clock = [time.perf_counter()]
        manager.room_for_windows(batch * manager.window_slots_for_forward(1))
        clock.append(time.perf_counter())
        manager.alloc_to_lengths(req_pool_indices_cpu=rows, target_seq_lens_cpu=lengths)
        clock.append(time.perf_counter())
        storage.tables.begin_forward()
        clock.append(time.perf_counter())
        forward_batch = SimpleNamespace(
            forward_mode=ForwardMode.DECODE, req_pool_indices=rows, seq_lens=lengths, seq_lens_cpu=lengths,
            positions=lengths - 1,
        )  # fmt: skip
        BatchedBackend.init_forward_metadata(backend, forward_batch)  # its begin_forward again: nothing new to flush
        clock.append(time.perf_counter())
        if step >= warmup:
            for name, before, after in zip(FUNCTIONS, clock[:-1], clock[1:], strict=True):
                times[name].append(after - before)
    return times


def extract(revision: str, into: Path) -> Path:
    """The package at ``revision``, extracted under ``into`` (the directory to put on ``PYTHONPATH``)."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", revision, "sglang_dsv4"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def run_version(pythonpath: Path, batch: int, steps: int, warmup: int) -> dict[str, list[float]]:
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    command = [sys.executable, __file__, "--worker", str(batch), "--steps", str(steps), "--warmup", str(warmup)]
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", default="main", help="git revision of the version before")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="*", default=list(BATCHES))
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "decode_step_host.json")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.steps, args.warmup)))
        return
    revision = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", args.before], check=True, capture_output=True, text=True
    ).stdout.strip()
    after_revision = subprocess.run(
        ["git", "-C", str(ROOT), "describe", "--always", "--dirty"], check=True, capture_output=True, text=True
    ).stdout.strip()
    results = {"before": revision, "after": after_revision, "steps": args.steps, "prompt": PROMPT, "batches": {}}
    with tempfile.TemporaryDirectory() as temp:
        versions = {"before": extract(args.before, Path(temp)), "after": ROOT}
        for batch in args.batches:
            samples = {version: {name: [] for name in FUNCTIONS} for version in versions}
            for _ in range(args.rounds):
                for version, path in versions.items():
                    for name, values in run_version(path, batch, args.steps, args.warmup).items():
                        samples[version][name].extend(values)
            figures = {}
            for version, by_name in samples.items():
                per_step = [sum(step) for step in zip(*by_name.values(), strict=True)]
                figures[version] = {name: statistics.median(values) * 1e3 for name, values in by_name.items()}
                figures[version]["ours_total"] = statistics.median(per_step) * 1e3
                figures[version]["ours_total_mean"] = statistics.fmean(per_step) * 1e3
            ratios = {name: figures["after"][name] / figures["before"][name] for name in figures["after"]}
            results["batches"][batch] = {**figures, "ratio_after_over_before": ratios}
            print(f"{batch} running requests, per decode step (ms, medians of {args.rounds}x{args.steps} steps):")
            for name in (*FUNCTIONS, "ours_total", "ours_total_mean"):
                before, after = figures["before"][name], figures["after"][name]
                print(f"  {name:16s} before {before:8.3f}  after {after:8.3f}  ratio {ratios[name]:.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
