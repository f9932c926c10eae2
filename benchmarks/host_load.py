"""Loading one agent session's V4 cache from pinned host memory, against the copy floor and against prefilling it.

``cd benchmarks && PYTHONPATH=.. python3 host_load.py [--out DIR] [--tokens 27648] [--kv-dtypes bf16,fp8]`` on a
CUDA host (no SGLang). For V4-Flash dims and a session of ``--tokens`` tokens (AgentPerf's sessions average about
27K), what a host tier brings back for it (issue 28): every compressed entry and indexer key of its complete
blocks (``tokens / ratio`` rows of each ratio-4 and ratio-128 buffer) and one checkpoint (``sliding_window`` window
rows in every layer and one compressor-state record), each row as the pools store it. In one run it measures

1. ``h2d_gbps``: the host-to-device copy rate of a 1 GiB pinned buffer (the ceiling);
2. ``floor_us``: the session's bytes at that rate;
3. ``one_copy_us``: the session packed in one pinned buffer, copied to one device buffer (the floor, measured);
4. ``packed_then_scatter_us``: the same copy, then each buffer's rows scattered to free pool rows on the device
   (``index_copy_``, one launch a buffer): a host tier that packs a session when it writes it back;
5. ``per_buffer_us``: each buffer's rows in a pinned tensor of its own, copied and scattered buffer by buffer;
6. ``prefill_us``: prefilling the same tokens through the batched core, every attention layer of the config (its
   projections, index build, compressors, indexer and sparse attention, and the output projection) in chunks of
   8,192 tokens as served, composed from each layer kind's chunks (``engine_prefill``'s step, eager). The MoE,
   mHC and the head are not in it, so recomputing a session costs more than this: ``prefill_over_load`` is a lower
   bound on what loading saves.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from engine_prefill import prefill_pools
from engine_step import DEVICE, DTYPE, KINDS, Timer, build_attention, kinds_of

from sglang_dsv4.attention_backend import batched
from sglang_dsv4.config import DeepseekV4Config, named_config
from sglang_dsv4.memory_pool.layout import PoolLayout
from sglang_dsv4.memory_pool.ledger import KV_DTYPES

CHUNK = 8192
POOL_SLACK = 4  # device pool rows per session row: the session's rows land scattered among others


@dataclass
class Buffer:
    """One buffer's rows of the session: on the host (pinned) and where they land in the device pool."""

    name: str
    host: torch.Tensor
    pool: torch.Tensor
    rows: torch.Tensor  # destination rows in ``pool``


def session_buffers(config: DeepseekV4Config, kv_dtype: torch.dtype, tokens: int) -> list[Buffer]:
    """Every buffer a session's load writes: entries and keys of its blocks, its checkpoint's window rows per
    layer and its record's state per compressor, with random pool rows as destinations."""
    layout = PoolLayout(config, kv_dtype)
    shapes: list[tuple[str, torch.Tensor]] = []
    for buffer in layout.compressed_buffers():
        values = torch.randn(tokens // buffer.ratio, buffer.dim, device=DEVICE, dtype=DTYPE)
        shapes.append((f"{buffer.kind}_{buffer.layer}", layout.format_of(buffer).encode(values)))
    for layer in layout.layers:
        window = torch.randn(config.sliding_window, config.head_dim, device=DEVICE, dtype=DTYPE)
        shapes.append((f"window_{layer}", layout.formats.entries.encode(window)))
    for state in layout.state_buffers():
        shapes.append((f"{state.kind}_state_{state.layer}", torch.randn(1, state.pools, 3, state.dim, device=DEVICE)))
    buffers = []
    for name, rows in shapes:
        pool = torch.zeros(POOL_SLACK * len(rows) + 1, *rows.shape[1:], dtype=rows.dtype, device=DEVICE)
        destinations = 1 + torch.randperm(len(pool) - 1, device=DEVICE)[: len(rows)]
        buffers.append(Buffer(name, rows.cpu().pin_memory(), pool, destinations))
    assert sum(b.host.nbytes for b in buffers) == session_bytes(layout, tokens)
    return buffers


def session_bytes(layout: PoolLayout, tokens: int) -> int:
    """What the ledger counts for a session held on the host: its blocks' rows and one checkpoint."""
    blocks = sum(layout.row_bytes(b) * (tokens // b.ratio) for b in layout.compressed_buffers())
    return blocks + layout.checkpoint_bytes


class PackedSession:
    """The session's rows in one pinned buffer (as a host tier that packs a session when it writes it back), one
    device buffer to copy it into, and each buffer's byte range in both."""

    def __init__(self, buffers: list[Buffer]):
        self.buffers = buffers
        self.offsets = [0]
        for buffer in buffers:
            self.offsets.append(self.offsets[-1] + buffer.host.nbytes)
        self.host = torch.empty(self.offsets[-1], dtype=torch.uint8).pin_memory()
        for buffer, start, end in zip(buffers, self.offsets, self.offsets[1:], strict=False):
            self.host[start:end] = buffer.host.flatten().view(torch.uint8)
        self.device = torch.empty_like(self.host, device=DEVICE)

    def copy(self) -> None:
        self.device.copy_(self.host, non_blocking=True)

    def copy_then_scatter(self) -> None:
        self.copy()
        for buffer, start, end in zip(self.buffers, self.offsets, self.offsets[1:], strict=False):
            rows = self.device[start:end].view(buffer.host.dtype).view(buffer.host.shape)
            buffer.pool.index_copy_(0, buffer.rows, rows)

    def landed_equal(self) -> bool:
        return all(torch.equal(b.pool[b.rows].cpu(), b.host) for b in self.buffers)


def per_buffer(buffers: list[Buffer], staging: list[torch.Tensor]) -> None:
    for buffer, rows in zip(buffers, staging, strict=True):
        rows.copy_(buffer.host, non_blocking=True)
        buffer.pool.index_copy_(0, buffer.rows, rows)


def h2d_gbps(timer: Timer) -> float:
    host = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
    device = torch.empty_like(host, device=DEVICE)
    return host.numel() / timer.median_us(lambda: device.copy_(host, non_blocking=True)) / 1e3


@torch.no_grad()
def prefill_us(config: DeepseekV4Config, tokens: int, timer: Timer) -> dict[str, float]:
    """Each layer kind's chunks of ``tokens`` prefilled, and the config's layers composed from them."""
    per_kind = {}
    for kind in kinds_of(config, list(KINDS)):
        layer, attention = build_attention(config, kind)
        pools = prefill_pools(config, layer, tokens, DTYPE)
        total = 0.0
        for start in range(0, tokens, CHUNK):
            length = min(CHUNK, tokens - start)
            plan = batched.BatchPlan([1], [start], [length])
            x = torch.randn(length, config.hidden_size, device=DEVICE, dtype=DTYPE)

            def run(plan=plan, x=x, layer=layer, attention=attention, pools=pools) -> torch.Tensor:
                index = batched.build_index(plan, pools, config, DEVICE)
                return attention.project_out(batched.attend(attention, layer, x, index, pools))

            total += timer.median_us(run)
        per_kind[kind] = total
    layers = [config.layer_kind(i) for i in range(config.num_layers)]
    return {"per_layer_kind_us": per_kind, "composed_us": sum(per_kind[k] for k in layers)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--model", default="flash")
    parser.add_argument("--tokens", type=int, default=27648)
    parser.add_argument("--kv-dtypes", default="bf16,fp8")
    args = parser.parse_args()
    timer = Timer(budget_ms=300)
    config = named_config(args.model)
    gbps = h2d_gbps(timer)
    result = {"model": args.model, "tokens": args.tokens, "h2d_gbps": gbps, "loads": []}
    print(json.dumps({"h2d_gbps": gbps}), flush=True)
    for kv in args.kv_dtypes.split(","):
        buffers = session_buffers(config, KV_DTYPES[kv], args.tokens)
        packed = PackedSession(buffers)
        staging = [torch.empty_like(b.host, device=DEVICE) for b in buffers]
        row = {"kv": kv, "bytes": packed.host.numel(), "buffers": len(buffers)}
        row["floor_us"] = row["bytes"] / gbps / 1e3
        row["one_copy_us"] = timer.median_us(packed.copy)
        row["packed_then_scatter_us"] = timer.median_us(packed.copy_then_scatter)
        row["packed_landed_equal"] = packed.landed_equal()
        for buffer in buffers:
            buffer.pool.zero_()
        row["per_buffer_us"] = timer.median_us(lambda buffers=buffers, staging=staging: per_buffer(buffers, staging))
        row["per_buffer_landed_equal"] = packed.landed_equal()
        result["loads"].append(row)
        print(json.dumps(row), flush=True)
        del buffers, packed, staging
        torch.cuda.empty_cache()
    result["prefill"] = prefill_us(config, args.tokens, timer)
    prefill = result["prefill"]["composed_us"]
    for row in result["loads"]:
        row["prefill_over_load"] = prefill / row["packed_then_scatter_us"]
        row["load_over_floor"] = row["packed_then_scatter_us"] / row["floor_us"]
    print(json.dumps({"prefill": result["prefill"], "loads": result["loads"]}), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "host_load.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
