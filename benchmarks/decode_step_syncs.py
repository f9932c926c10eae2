"""Our per-decode-step bookkeeping on a GPU under ``torch.cuda.set_sync_debug_mode('error')``: any host-device
synchronisation in it raises (no SGLang needed; torch, Triton and this package).

A V4 pool of the tiny config on ``cuda`` (:class:`~sglang_dsv4.memory_pool.storage.V4PoolStorage`, its cache
manager, snapshots every 16 tokens so that steps plan checkpoints too) with ``--requests`` rows prefilled to 200
tokens (outside the check), then ``--steps`` decode steps, each running what SGLang calls of ours per step, in
its order, inside the check:

1. the decode check's window slots (``CacheManager.room_for_windows``, as ``admission._decode_within_window_slots``);
2. ``CacheManager.alloc_to_lengths`` with SGLang's host copies of the rows and new lengths;
3. the CUDA-graph hooks: ``init_forward_metadata_out_graph`` (the tables' flush, the pending checkpoints staged)
   and ``init_forward_metadata_in_graph`` (``DecodeGraphIndex.build`` from the batch's device tensors);
4. the eager metadata's index (``batched.build_index`` of the decode plan, as ``init_forward_metadata`` builds it
   past the graphs' batch size; its ``request_spans`` reads SGLang's batch and is listed in
   ``tests/test_per_step_syncs.py``).

    python benchmarks/decode_step_syncs.py [--requests 128] [--steps 40]   # on the device machine; prints OK
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from sglang_dsv4.attention_backend import batched
from sglang_dsv4.config import load_config
from sglang_dsv4.memory_pool.storage import V4PoolStorage
from sglang_dsv4.prefix_cache.manager import CacheManager

TINY = Path(__file__).resolve().parents[1] / "sglang_dsv4" / "checkpoints" / "tiny"
PROMPT = 200


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    device, config, n = torch.device("cuda"), load_config(TINY), args.requests
    context = PROMPT + args.steps + 8
    storage = V4PoolStorage(
        config, torch.float32, num_tokens=n * context, max_requests=n, max_context=context, device=device
    )
    manager = CacheManager(storage)
    manager.checkpoints.interval = 16
    rows = list(range(1, n + 1))
    for row in rows:
        manager.start(row, PROMPT)
    graph_index = batched.DecodeGraphIndex(n, storage.tables.on_device, config, device)
    rows_cpu, lengths_cpu = torch.tensor(rows), torch.full((n,), PROMPT)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    for _ in range(args.steps):
        lengths_cpu = lengths_cpu + 1
        manager.room_for_windows(n * manager.window_slots_for_forward(1))
        manager.alloc_to_lengths(req_pool_indices_cpu=rows_cpu, target_seq_lens_cpu=lengths_cpu)
        # SGLang's forward batch: the rows and lengths on the device.
        rows_device = rows_cpu.to(device, non_blocking=True)
        lengths_device = lengths_cpu.to(device, non_blocking=True)
        storage.tables.begin_forward()  # init_forward_metadata_out_graph
        graph_index.stage_checkpoints(manager.checkpoints.pending)
        graph_index.build(rows_device, lengths_device)  # init_forward_metadata_in_graph
        starts = [length - 1 for length in lengths_cpu.tolist()]  # host values (request_spans: seq_lens_cpu)
        snapshots = [
            batched.Snapshot(i, c.position, c.record)
            for i, (row, start) in enumerate(zip(rows, starts, strict=True))
            for c in manager.checkpoints.between(row, start, start + 1)
        ]
        plan = batched.BatchPlan(rows, starts, [1] * n, snapshots)
        batched.build_index(plan, storage.tables.on_device, config, device, True)
        for row in rows:  # the tree takes each step's snapshots at the step's end (host bookkeeping)
            for checkpoint in manager.checkpoints.take(row, starts[0] + 1):
                manager.checkpoints.release(checkpoint)
    torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    print(f"OK: {args.steps} decode steps of {n} requests, no host-device synchronisation in our bookkeeping")


if __name__ == "__main__":
    main()
