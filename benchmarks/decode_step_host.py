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

Both versions run in this one process: ``--before REV`` (default ``main``) is the package at that git revision,
extracted into a temp dir (``git archive``) and imported as ``sglang_dsv4_before`` (its imports are relative);
after is this checkout's ``sglang_dsv4``. Each has its own pool driven through the same steps, the two
versions' steps alternating, so both see the same moment of the host's load; per-step medians of each function
are printed with the ratios after/before and written to ``benchmarks/results/decode_step_host.json``.

    .venv/bin/python benchmarks/decode_step_host.py [--before main] [--steps 48]
"""

from __future__ import annotations

import argparse
import importlib
import json
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


class Driver:
    """``batch`` requests prefilled to ``PROMPT`` tokens in a pool of the version of this package named
    ``package`` (``sglang_dsv4``, or the version before, extracted under another name); :meth:`step` runs one
    decode step's per-step path and returns each function's seconds."""

    def __init__(self, package: str, batch: int, context: int):
        import torch
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        load_config = importlib.import_module(f"{package}.config").load_config
        storage_type = importlib.import_module(f"{package}.memory_pool.storage").V4PoolStorage
        self.backend_type = importlib.import_module(f"{package}.attention_backend.batched_backend").BatchedBackend
        manager_type = importlib.import_module(f"{package}.prefix_cache.manager").CacheManager
        config = load_config(ROOT / "sglang_dsv4" / "checkpoints" / "tiny")
        self.storage = storage_type(
            config, torch.float32, num_tokens=batch * context, max_requests=batch, max_context=context, device="cpu"
        )
        manager = self.manager = manager_type(self.storage)
        manager.checkpoints.interval, manager.checkpoints.before_extend_end = 1024, True  # the server's defaults
        self.rows = torch.arange(1, batch + 1)
        for row in self.rows.tolist():
            manager.start(row, PROMPT)
            for checkpoint in manager.checkpoints.take(row, PROMPT):  # what the tree takes at the prefill's end
                manager.checkpoints.release(checkpoint)
        self.backend = SimpleNamespace(
            token_to_kv_pool=SimpleNamespace(storage=self.storage, checkpoints=manager.checkpoints)
        )
        self.lengths = torch.full((batch,), PROMPT)
        self.decode = ForwardMode.DECODE

    def step(self) -> list[float]:
        manager, rows, batch = self.manager, self.rows, self.rows.shape[0]
        self.lengths = lengths = self.lengths + 1
        clock = [time.perf_counter()]
        manager.room_for_windows(batch * manager.window_slots_for_forward(1))
        clock.append(time.perf_counter())
        manager.alloc_to_lengths(req_pool_indices_cpu=rows, target_seq_lens_cpu=lengths)
        clock.append(time.perf_counter())
        self.storage.tables.begin_forward()
        clock.append(time.perf_counter())
        forward_batch = SimpleNamespace(
            forward_mode=self.decode, req_pool_indices=rows, seq_lens=lengths, seq_lens_cpu=lengths,
            positions=lengths - 1,
        )  # fmt: skip
        self.backend_type.init_forward_metadata(self.backend, forward_batch)  # its begin_forward: nothing new
        clock.append(time.perf_counter())
        return [after - before for before, after in zip(clock[:-1], clock[1:], strict=True)]


def measure(batch: int, steps: int, warmup: int) -> dict[str, dict[str, list[float]]]:
    """Per version, per function, the seconds of each of ``steps`` decode steps of ``batch`` requests; the two
    versions' steps alternate (which goes first too), so that both see the same moment of the host's load."""
    context = PROMPT + warmup + steps + 8
    drivers = {version: Driver(package, batch, context) for version, package in VERSIONS.items()}
    times = {version: {name: [] for name in FUNCTIONS} for version in VERSIONS}
    for step in range(warmup + steps):
        order = list(drivers) if step % 2 == 0 else list(reversed(drivers))
        for version in order:
            seconds = drivers[version].step()
            if step >= warmup:
                for name, value in zip(FUNCTIONS, seconds, strict=True):
                    times[version][name].append(value)
    return times


VERSIONS = {"before": "sglang_dsv4_before", "after": "sglang_dsv4"}


def extract(revision: str, into: Path) -> None:
    """The package at ``revision``, importable as ``sglang_dsv4_before`` from ``into`` (its imports are relative)."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", revision, "sglang_dsv4"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    (into / "sglang_dsv4").rename(into / VERSIONS["before"])


def main() -> None:
    import torch

    parser = argparse.ArgumentParser()
    parser.add_argument("--before", default="main", help="git revision of the version before")
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--batches", type=int, nargs="*", default=list(BATCHES))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "decode_step_host.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    git = ["git", "-C", str(ROOT)]
    revision = subprocess.run([*git, "rev-parse", "--short", args.before], check=True, capture_output=True, text=True)
    after = subprocess.run([*git, "describe", "--always", "--dirty"], check=True, capture_output=True, text=True)
    results = {
        "before": revision.stdout.strip(), "after": after.stdout.strip(), "steps": args.steps, "prompt": PROMPT,
        "batches": {},
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as temp:
        extract(args.before, Path(temp))
        sys.path.insert(0, temp)
        for batch in args.batches:
            samples = measure(batch, args.steps, args.warmup)
            figures = {}
            for version, by_name in samples.items():
                per_step = [sum(step) for step in zip(*by_name.values(), strict=True)]
                figures[version] = {name: statistics.median(values) * 1e3 for name, values in by_name.items()}
                figures[version]["ours_total"] = statistics.median(per_step) * 1e3
                figures[version]["ours_total_mean"] = statistics.fmean(per_step) * 1e3
            ratios = {name: figures["after"][name] / figures["before"][name] for name in figures["after"]}
            results["batches"][batch] = {**figures, "ratio_after_over_before": ratios}
            print(f"{batch} running requests, per decode step (ms, medians of {args.steps} steps, one process):")
            for name in (*FUNCTIONS, "ours_total", "ours_total_mean"):
                before, after_ms = figures["before"][name], figures["after"][name]
                print(f"  {name:16s} before {before:8.3f}  after {after_ms:8.3f}  ratio {ratios[name]:.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
