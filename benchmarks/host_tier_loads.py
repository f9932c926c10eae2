"""The host tier's loads on CUDA, through its own code: one agent session's rows back from pinned host memory while a
forward runs on another stream.

``cd benchmarks && PYTHONPATH=.. python3 host_tier_loads.py [--out DIR] [--tokens 27648] [--kv-dtypes bf16,fp8]``
on a CUDA host (no SGLang). A V4-Flash pool (:class:`~sglang_dsv4.memory_pool.storage.V4PoolStorage`) on the GPU
and its host twins (:class:`~sglang_dsv4.memory_pool.host_pools.HostPools`, pinned); one session of ``--tokens``
tokens written to the host as the tier writes a node back (every entry row of its blocks, one checkpoint's window
slots and record), then loaded into other device rows. Streams as SGLang's overlap scheduler has them: loads are
issued under a schedule stream, the stand-in for the previous batch's forward (bf16 GEMMs, about twice a load) runs
on a forward stream. In one run:

1. ``h2d_gbps``: the host-to-device rate of a 1 GiB pinned buffer, and ``floor_ms``: the session's bytes at it;
2. ``synchronous_ms``: the load as the tier copied before (gather into pageable memory, copy, scatter, each
   buffer in turn on the schedule stream), and ``asynchronous_ms``: through :class:`DeviceLoads` (the tier's own
   ``restore``), its host rows as a fresh tier hands them out (one run per kind: read in place); and
   ``asynchronous_scattered_ms``: the same rows paired in a random order (gathered into pinned memory first, as
   after churn); ``issue_ms`` / ``issue_scattered_ms``: the host thread's time to issue those;
3. ``forward_ms`` alone, and the forward with each load issued after it: ``overlap`` is the share of the shorter
   of the two hidden by the other, ``(forward + load - both) / min(forward, load)`` (0: serialised, 1: hidden);
4. ``landed_equal``: every loaded row equal, byte for byte, to the row written back, read on the schedule stream
   right after the load is issued (no synchronisation in between), with the forward running.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from sglang_dsv4.config import named_config
from sglang_dsv4.memory_pool.host_pools import RECORDS, WINDOW_SLOTS, HostPools, device_kinds, entry_kind
from sglang_dsv4.memory_pool.ledger import KV_DTYPES
from sglang_dsv4.memory_pool.storage import V4PoolStorage

DEVICE = torch.device("cuda")
REPEATS = 9


class Session:
    """A pool with one session written back to the host, and free device rows to load it into."""

    def __init__(self, kv_dtype: torch.dtype, tokens: int):
        config = named_config("flash")
        self.storage = V4PoolStorage(
            config, kv_dtype, num_tokens=3 * tokens, max_requests=2, max_context=2 * tokens, device=DEVICE
        )
        kinds = device_kinds(self.storage)
        counts = {WINDOW_SLOTS: config.sliding_window, RECORDS: 1}
        counts |= {entry_kind(r): tokens // r for r in self.storage.entry_rows}
        for _, buffers in kinds.values():
            for buffer in buffers:
                buffer.view(torch.uint8).random_(0, 256)
        self.pools = HostPools(self.storage, counts)
        self.kinds = self.pools.kinds()
        self.sources = {name: kinds[name][0].alloc(count) for name, count in counts.items()}
        self.host_rows = {name: self.kinds[name].save(rows) for name, rows in self.sources.items()}
        self.targets = {name: kinds[name][0].alloc(count) for name, count in counts.items()}
        self.bytes = sum(self.kinds[name].row_bytes * count for name, count in counts.items())
        self.buffers = sum(len(kind.device_buffers) for kind in self.kinds.values())

    def scatter(self) -> None:
        """Pair the rows in a random order, so that no kind's host rows form a run."""
        for name, rows in self.host_rows.items():
            order = torch.randperm(len(rows))
            self.host_rows[name], self.sources[name], self.targets[name] = (
                rows[order],
                self.sources[name][order],
                self.targets[name][order],
            )

    def load(self) -> None:
        """The tier's own load (:meth:`HostRowKind.restore`)."""
        for name, kind in self.kinds.items():
            kind.restore(self.host_rows[name], self.targets[name])

    def load_synchronously(self) -> None:
        """The load as the tier did it before :class:`DeviceLoads`."""
        for name, kind in self.kinds.items():
            for host, device in zip(kind.host_buffers, kind.device_buffers, strict=True):
                rows = host.index_select(0, self.host_rows[name]).to(DEVICE)
                device.index_copy_(0, self.targets[name].to(DEVICE), rows)

    def clear_targets(self) -> None:
        for name, kind in self.kinds.items():
            for device in kind.device_buffers:
                device[self.targets[name].to(DEVICE)] = 0

    def landed_equal(self) -> bool:
        """Every target row equal to its source row, byte for byte (read on the current stream)."""
        for name, kind in self.kinds.items():
            for device in kind.device_buffers:
                loaded = device[self.targets[name].to(DEVICE)].view(torch.uint8)
                if not torch.equal(loaded, device[self.sources[name].to(DEVICE)].view(torch.uint8)):
                    return False
        return True


class Forward:
    """The previous batch's forward, stood in for by bf16 GEMMs on a stream of their own."""

    def __init__(self, stream: torch.cuda.Stream, gemms: int):
        self.stream, self.gemms = stream, gemms
        self.a = torch.randn(8192, 8192, device=DEVICE, dtype=torch.bfloat16)
        self.out = torch.empty_like(self.a)

    def launch(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for _ in range(self.gemms):
                torch.matmul(self.a, self.a, out=self.out)


def timed_ms(run) -> tuple[float, float]:
    """Median wall times of ``run`` from a synchronised start: until it returns (the host thread's issue), and
    until everything it launched has finished."""
    issued, finished = [], []
    for _ in range(REPEATS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        issued.append((time.perf_counter() - start) * 1e3)
        torch.cuda.synchronize()
        finished.append((time.perf_counter() - start) * 1e3)
    return statistics.median(issued), statistics.median(finished)


def wall_ms(run) -> float:
    return timed_ms(run)[1]


def h2d_gbps() -> float:
    host = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
    device = torch.empty_like(host, device=DEVICE)
    return host.numel() / wall_ms(lambda: device.copy_(host, non_blocking=True)) / 1e6


def overlap(forward: float, load: float, both: float) -> float:
    return (forward + load - both) / min(forward, load)


def add_overlap(row: dict, name: str, forward: Forward, load) -> None:
    def both() -> None:
        forward.launch()
        load()

    row[f"forward_and_{name}_ms"] = wall_ms(both)
    row[f"{name}_overlap"] = overlap(row["forward_ms"], row[f"{name}_ms"], row[f"forward_and_{name}_ms"])


def check_landed(row: dict, name: str, session: Session, forward: Forward) -> None:
    session.clear_targets()
    forward.launch()
    session.load()
    row[name] = session.landed_equal()


def measure(kv: str, tokens: int, gbps: float, schedule: torch.cuda.Stream, forward_stream: torch.cuda.Stream) -> dict:
    session = Session(KV_DTYPES[kv], tokens)
    row = {"kv": kv, "tokens": tokens, "bytes": session.bytes, "buffers": session.buffers}
    row["floor_ms"] = session.bytes / gbps / 1e6
    with torch.cuda.stream(schedule):
        row["synchronous_ms"] = wall_ms(session.load_synchronously)
        row["issue_ms"], row["asynchronous_ms"] = timed_ms(session.load)
        per_gemm = wall_ms(Forward(forward_stream, 1).launch)
        forward = Forward(forward_stream, max(1, round(2 * row["asynchronous_ms"] / per_gemm)))
        row["forward_ms"] = wall_ms(forward.launch)
        for name, load in (("synchronous", session.load_synchronously), ("asynchronous", session.load)):
            add_overlap(row, name, forward, load)
        check_landed(row, "landed_equal", session, forward)
        session.scatter()
        row["issue_scattered_ms"], row["asynchronous_scattered_ms"] = timed_ms(session.load)
        add_overlap(row, "asynchronous_scattered", forward, session.load)
        check_landed(row, "scattered_landed_equal", session, forward)
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--tokens", type=int, default=27648)
    parser.add_argument("--kv-dtypes", default="bf16,fp8")
    args = parser.parse_args()
    gbps = h2d_gbps()
    schedule, forward_stream = torch.cuda.Stream(), torch.cuda.Stream()
    rows = [measure(kv, args.tokens, gbps, schedule, forward_stream) for kv in args.kv_dtypes.split(",")]
    result = {"model": "flash", "h2d_gbps": gbps, "loads": rows}
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "host_tier_loads.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
