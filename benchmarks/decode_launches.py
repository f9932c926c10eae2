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
4. **Every dtype at V4 dims**: the sparse attention at V4-Flash's and V4-Pro's heads and 512 dims in bf16, fp16
   and float32 (the tile :func:`~sglang_dsv4.kernels.attention.launch_shape` picks), against the torch
   reference in float64, timed; and the indexer's scoring likewise.
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
from sglang_dsv4.kernels import indexer, topk
from sglang_dsv4.kernels.indexer import exact_top_k
from sglang_dsv4.kernels.sparse_torch import top_k_earliest_ties
from sglang_dsv4.kernels.attention import choose_splits, launch_shape, sparse_decode_attention
from sglang_dsv4.kernels.indexer import index_scores, index_scores_reference
from sglang_dsv4.kernels.sparse_torch import sparse_decode_attention_reference
from sglang_dsv4.kernels.selection import KVSelection
from sglang_dsv4.memory_pool.ledger import KV_DTYPES

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "kernels"))
from attention_indexer import Timer, relative_error, same_sets  # noqa: E402
from engine_step import DEVICE, DTYPE, DecodeStep, build_attention, build_pools  # noqa: E402


def profile_step(kind: str, batch: int, context: int, kv: str = "bf16") -> dict:
    """Device kernels of the index build and of one layer's step over ``kv`` pools, eagerly: name -> (count,
    total µs)."""
    config = named_config("flash")
    layer, attention = build_attention(config, kind)
    step = DecodeStep(config, attention, layer, build_pools(config, layer, batch, context, KV_DTYPES[kv]), batch)
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
    return {"kind": kind, "batch": batch, "context": context, "kv": kv, **result}


def bench_top_k(timer: Timer, rows: int, width: int, k: int = 512) -> dict:
    scores = torch.randn(rows, width, device=DEVICE)
    lengths = torch.full((rows,), width - 1, dtype=torch.int32, device=DEVICE)
    expected = topk.top_k_reference(scores, lengths, k)
    row = {"rows": rows, "width": width, "torch_us": timer.graph_us(partial(topk.top_k_reference, scores, lengths, k))}
    variants = {"three_launch": partial(topk.top_k, scores, lengths, k)}
    variants["step"] = partial(exact_top_k, scores, lengths, k)
    if width <= indexer.WHOLE_ROW_TOP_K_MAX_WIDTH:
        variants["whole_row"] = partial(topk.whole_row_top_k, scores, lengths, k)
    else:
        for warps in (4, 8, 16):
            variants[f"wide_row_w{warps}"] = partial(topk.wide_row_top_k, scores, lengths, k, num_warps=warps)
    for name, run in variants.items():
        try:
            row[f"{name}_exact"] = same_sets(run(), expected, scores)
            row[f"{name}_us"] = timer.graph_us(run)
        except Exception as error:  # noqa: BLE001 - a variant that does not launch reports why
            row[f"{name}_error"] = repr(error)[:200]
    return row


def earliest_ties_on_device(rows: int = 8, width: int = 32769, k: int = 512) -> dict:
    """Every Triton top-k on rows built to tie at the k-th place (small integers; ReLU zeros with fewer than k
    positive; all equal; a run of equal high scores), against the CPU's earliest-slot rule
    (:func:`.sparse_torch.top_k_earliest_ties`)."""
    generator = torch.Generator().manual_seed(3)
    kinds = [
        torch.randint(0, 4, (width,), generator=generator).float(),
        torch.where(torch.rand(width, generator=generator) < k / (3 * width), torch.rand(width, generator=generator), 0),
        torch.zeros(width),
        torch.cat([torch.randn(width // 2, generator=generator), torch.full((width - width // 2,), 9.0)]),
    ]
    scores = torch.stack([kinds[r % 4] for r in range(rows)])
    lengths = torch.randint(width // 2, width + 1, (rows,), generator=generator, dtype=torch.int32)
    expected = []
    for r in range(rows):
        _, slots = top_k_earliest_ties(scores[r : r + 1, : int(lengths[r])], k)
        expected.append(sorted(slots[0].tolist()))
    on_device, device_lengths = scores.to(DEVICE), lengths.to(DEVICE)
    unrelated = topk.top_k(torch.randn_like(on_device), device_lengths, k)
    narrow, narrow_lengths = on_device[:, :8193].contiguous(), device_lengths.clamp(max=8193)
    paths = {
        "wide_row": partial(topk.wide_row_top_k, on_device, device_lengths, k),
        "three_launch": partial(topk.top_k, on_device, device_lengths, k),
        "temporal": partial(topk.temporal_top_k, on_device, device_lengths, k, unrelated),
        "whole_row_8193": partial(topk.whole_row_top_k, narrow, narrow_lengths, k),
    }
    result = {"rows": rows, "width": width, "k": k}
    for name, run in paths.items():
        chosen = run().cpu()
        if name == "whole_row_8193":
            want = [
                sorted(top_k_earliest_ties(scores[r : r + 1, : min(int(lengths[r]), 8193)], k)[1][0].tolist())
                for r in range(rows)
            ]
        else:
            want = expected
        result[name] = all(sorted(chosen[r].tolist()) == want[r] for r in range(rows))
    return result


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


def widened(selection: KVSelection) -> KVSelection:
    return KVSelection(selection.pool.double(), selection.indices, selection.lengths)


def bench_dtype(timer: Timer, model: str, dtype: torch.dtype, batch: int = 8, entries: int = 640) -> dict:
    """The attention and the indexer's scoring in ``dtype`` at the model's dims, against float64 torch."""
    config = named_config(model)
    heads, dim = config.num_heads, config.head_dim
    q = torch.randn(batch, heads, dim, device=DEVICE).to(dtype)
    pool = torch.randn(batch * entries, dim, device=DEVICE).to(dtype)
    rows = torch.arange(batch * entries, device=DEVICE).view(batch, entries).int()
    window = KVSelection(pool, rows[:, :128].contiguous(), torch.full((batch,), 128, dtype=torch.int32, device=DEVICE))
    compressed = KVSelection(pool, rows[:, 128:].contiguous(), torch.full((batch,), entries - 128, dtype=torch.int32, device=DEVICE))
    sink = torch.randn(heads, device=DEVICE)
    angles = torch.rand(batch, config.rope_head_dim // 2, device=DEVICE) * 6.28
    cos, sin = angles.cos(), angles.sin()
    attend = partial(sparse_decode_attention, q, window, compressed, sink, cos, sin, scale=dim**-0.5)
    expected = sparse_decode_attention_reference(
        q.double(), widened(window), widened(compressed), sink.double(), cos.double(), sin.double(), scale=dim**-0.5
    )
    row = {"model": model, "dtype": str(dtype), "launch": str(launch_shape(dtype, dim, DEVICE))}
    try:
        row["attention_error"] = relative_error(attend(), expected)
        row["attention_us"] = timer.graph_us(attend)
    except Exception as error:  # noqa: BLE001 - a launch that fails reports why
        row["attention_failed"] = repr(error)[:200]
    iq = torch.randn(batch, config.index_n_heads, config.index_head_dim, device=DEVICE).to(dtype)
    weights = torch.randn(batch, config.index_n_heads, device=DEVICE)
    keys = torch.randn(4096, config.index_head_dim, device=DEVICE).to(dtype)
    lengths = torch.full((batch,), 4096, dtype=torch.int32, device=DEVICE)
    score = partial(index_scores, iq, weights, keys, lengths, scale=0.1)
    try:
        row["scores_error"] = relative_error(score(), index_scores_reference(iq.double(), weights, keys.double(), lengths, scale=0.1))
        row["scores_us"] = timer.graph_us(score)
    except Exception as error:  # noqa: BLE001
        row["scores_failed"] = repr(error)[:200]
    return row


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--sections", default="top_k,splits,profile,dtypes")
    parser.add_argument("--kv-dtypes", default="bf16", help="the pools the profile section's steps read")
    parser.add_argument("--profile-batches", default="1,64")
    args = parser.parse_args()
    sections = args.sections.split(",")
    timer = Timer(budget_ms=100)
    results: dict[str, list] = {section: [] for section in sections + ["ties"]}

    def record(section: str, row: dict) -> None:
        results[section].append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "decode_launches.json").write_text(json.dumps(results, indent=1))

    if "top_k" in sections:
        record("ties", earliest_ties_on_device())
        for rows in (1, 64, 256):
            for width in (8193, 16385, 32769, 65537, 131073, 262145):
                record("top_k", bench_top_k(timer, rows, width))
    if "splits" in sections:
        for batch in (1, 8, 64):
            for compressed in (0, 64, 512, 1024):
                record("splits", bench_splits(timer, batch, compressed))
    if "dtypes" in sections:
        for model in ("flash", "pro"):
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                record("dtypes", bench_dtype(timer, model, dtype))
    if "profile" in sections:
        for batch in map(int, args.profile_batches.split(",")):
            for kind in ("window", "csa", "hca"):
                for kv in args.kv_dtypes.split(","):
                    record("profile", profile_step(kind, batch, 8192, kv))


if __name__ == "__main__":
    main()
