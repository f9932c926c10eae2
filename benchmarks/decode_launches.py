"""Where a small decode step's fixed cost goes, and the variants that cut it (issue 31), on the H200.

``python benchmarks/decode_launches.py --out DIR`` on a CUDA host (no SGLang). In one run:

1. **Kernels of one step** (V4-Flash dims, batch 1 and 64, 8K): the decode index build and each layer
   kind's step run eagerly under ``torch.profiler``; every device kernel with its count and device time,
   so the fixed cost is attributed to launches rather than guessed.
2. **Top-k at the step's widths** (``context / 4 + 1`` scores a row, k = 512, 1 to 256 rows): ``torch.topk``
   (``topk.top_k_reference``), the three-launch Triton :func:`~sglang_dsv4.kernels.topk.top_k` and the
   one-launch :func:`~sglang_dsv4.kernels.topk.whole_row_top_k` at several warp counts, each checked to
   choose ``torch.topk``'s set, each timed as a replayed CUDA graph with the L2 flushed.
3. **Sparse attention splits at small batches**: V4-Flash's 64 heads x 512 over a window of 128 rows plus
   0 / 64 / 512 / 1,024 compressed rows (window, ratio 128 at 8K, ratio 4, ratio 128 at 128K), at batch 1,
   8 and 64, with the entries split over 1 to 32 programs against the split :func:`choose_splits` picks,
   each checked against the unsplit output.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from functools import partial
from pathlib import Path

import torch

from sglang_dsv4.config import named_config
from sglang_dsv4.kernels import topk
from sglang_dsv4.kernels.attention import choose_splits, sparse_decode_attention
from sglang_dsv4.kernels.selection import KVSelection

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "kernels"))
from attention_indexer import Timer, relative_error, same_sets  # noqa: E402
from engine_step import DEVICE, DTYPE, DecodeStep, build_attention, build_pools  # noqa: E402


def profile_step(kind: str, batch: int, context: int) -> dict:
    """Device kernels of the index build and of one layer's step, eagerly: name -> (count, total µs)."""
    config = named_config("flash")
    layer, attention = build_attention(config, kind)
    step = DecodeStep(config, attention, layer, build_pools(config, layer, batch, context), batch)
    index = step.graph_index.build(step.rows, step.seq_lens)
    parts = {"index": partial(step.graph_index.build, step.rows, step.seq_lens), "layer": partial(step.layer_step, index)}
    result = {}
    for name, run in parts.items():
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
            run()
            torch.cuda.synchronize()
        kernels: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        for event in profiler.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                kernels[event.name[:90]][0] += 1
                kernels[event.name[:90]][1] += event.device_time_total
        ranked = sorted(kernels.items(), key=lambda item: -item[1][1])
        result[name] = {
            "kernels": sum(count for count, _ in kernels.values()),
            "device_us": sum(us for _, us in kernels.values()),
            "top": [(n, c, round(us, 1)) for n, (c, us) in ranked[:25]],
        }
    return {"kind": kind, "batch": batch, "context": context, **result}


def bench_top_k(timer: Timer, rows: int, width: int, k: int = 512) -> dict:
    scores = torch.randn(rows, width, device=DEVICE)
    lengths = torch.full((rows,), width - 1, dtype=torch.int32, device=DEVICE)
    expected = topk.top_k_reference(scores, lengths, k)
    row = {"rows": rows, "width": width, "torch_us": timer.graph_us(partial(topk.top_k_reference, scores, lengths, k))}
    variants = {"three_launch": partial(topk.top_k, scores, lengths, k)}
    if width <= topk.WHOLE_ROW_MAX_WIDTH:
        for warps in (4, 8, 16, 32):
            variants[f"whole_row_w{warps}"] = partial(topk.whole_row_top_k, scores, lengths, k, num_warps=warps)
        variants["whole_row"] = partial(topk.whole_row_top_k, scores, lengths, k)
    for name, run in variants.items():
        try:
            row[f"{name}_exact"] = same_sets(run(), expected, scores)
            row[f"{name}_us"] = timer.graph_us(run)
        except Exception as error:  # noqa: BLE001 - a variant that does not launch reports why
            row[f"{name}_error"] = repr(error)[:200]
    return row


def bench_splits(timer: Timer, batch: int, compressed_rows: int) -> dict:
    config = named_config("flash")
    heads, dim, window = config.num_heads, config.head_dim, config.sliding_window
    q = torch.randn(batch, heads, dim, device=DEVICE, dtype=DTYPE)
    sink = torch.randn(heads, device=DEVICE)
    angles = torch.rand(batch, config.rope_head_dim // 2, device=DEVICE) * 6.28
    cos, sin = angles.cos(), angles.sin()
    pool = torch.randn(batch * (window + compressed_rows) + 1, dim, device=DEVICE, dtype=DTYPE)
    window_rows = torch.arange(batch * window, device=DEVICE).view(batch, window).int()
    entry_rows = batch * window + torch.arange(batch * compressed_rows, device=DEVICE).view(batch, -1).int()
    if compressed_rows == 0:
        entry_rows = torch.zeros(batch, 1, dtype=torch.int32, device=DEVICE)
    full = partial(torch.full, (batch,), dtype=torch.int32, device=DEVICE)
    selections = (KVSelection(pool, window_rows, full(window)), KVSelection(pool, entry_rows, full(compressed_rows)))

    def run(splits: int | None) -> torch.Tensor:
        return sparse_decode_attention(q, *selections, sink, cos, sin, scale=dim**-0.5, splits=splits)

    unsplit = run(1)
    width = window + entry_rows.shape[1]
    row = {"batch": batch, "compressed": compressed_rows, "auto_splits": choose_splits(batch, width, heads, DEVICE)}
    row["auto_us"] = timer.graph_us(partial(run, None))
    for splits in (1, 2, 4, 8, 16, 32):
        if splits * 16 > width:
            continue
        row[f"s{splits}_error"] = relative_error(run(splits), unsplit)
        row[f"s{splits}_us"] = timer.graph_us(partial(run, splits))
    return row


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    timer = Timer(budget_ms=100)
    results: dict[str, list] = {"profile": [], "top_k": [], "splits": []}

    def record(section: str, row: dict) -> None:
        results[section].append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "decode_launches.json").write_text(json.dumps(results, indent=1))

    for rows in (1, 8, 64, 256):
        for width in (2049, 8193, 32769, 262145):
            record("top_k", bench_top_k(timer, rows, width))
    for batch in (1, 8, 64):
        for compressed in (0, 64, 512, 1024):
            record("splits", bench_splits(timer, batch, compressed))
    for batch in (1, 64):
        for kind in ("window", "csa", "hca"):
            record("profile", profile_step(kind, batch, 8192))


if __name__ == "__main__":
    main()
