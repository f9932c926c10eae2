"""One batched prefill chunk of one attention layer on the GPU: 8,192 tokens at 64K context, against its floors.

``python benchmarks/engine_prefill.py [--out DIR] [--kv-dtypes bf16,fp8]`` on a CUDA host (no SGLang). For
V4-Flash and V4-Pro dims and each layer kind, one request's chunk covers positions 57,344 .. 65,535, its first
57,344 tokens already in the pools (rows of its own): the forward's index built from the plan (:func:`batched.build_index`), then
:func:`batched.attend` and the output projection, eagerly (SGLang captures decode only). Times the median
and reads ``torch.cuda.max_memory_allocated`` above what the pools and weights hold: the chunk's
intermediates, to set beside a dense ``[tokens x context]`` float32 mask (2 GiB).

FLOP floor: the projections 2 x tokens x weights; the attention 4 x heads x head_dim x keys read per token
(window, then ratio-4 layers the top-k entries, ratio-128 layers every complete entry); ratio-4 layers'
indexer scoring 2 x index heads x index_head_dim x visible keys per token. Bytes: the weights, every KV row
and key read once as the pools store it (bf16, or DeepSeek's FP8 rows: 584 B a window row or entry, 144 B a key).

``--kv-dtypes bf16,fp8``: each chunk over bf16 pools and over FP8 pools holding the same values, in one run; an
FP8 row reports its output's largest difference from the bf16 pools' output (relative to the output's largest
value): what FP8 rows change, not an error of the kernels (``core_vs_torch.py`` checks those).
"""

from __future__ import annotations

import argparse
import json
from itertools import product
from pathlib import Path

import torch
from engine_step import (  # engine_step puts the kernel benchmarks' timer and ceilings on the path
    DEVICE,
    DTYPE,
    KINDS,
    LayerPools,
    Timer,
    build_attention,
    floor_us,
    kinds_of,
    measure_ceilings,
    weight_bytes,
)

from sglang_dsv4.attention_backend import batched
from sglang_dsv4.config import DeepseekV4Config, named_config
from sglang_dsv4.memory_pool.layout import STATE_DTYPE, PoolLayout
from sglang_dsv4.memory_pool.ledger import KV_DTYPES

CONTEXT, TOKENS = 65536, 8192


def prefill_pools(config: DeepseekV4Config, layer: int, context: int, kv_dtype: torch.dtype) -> LayerPools:
    """Request row 1 (row 0 is the padding row) with a window slot per position and an entry row per block, stored
    as ``kv_dtype`` stores them; the same values for every ``kv_dtype``."""
    torch.manual_seed(layer)
    layout = PoolLayout(config, kv_dtype)
    window_table = torch.zeros(2, context + 1, dtype=torch.int64, device=DEVICE)
    window_table[1, :context] = 1 + torch.arange(context, device=DEVICE)
    window_rows = layout.formats.entries.encode(torch.randn(1 + context, config.head_dim, device=DEVICE, dtype=DTYPE))
    ratios = (config.csa_rate, config.hca_rate)
    entry_table = {r: torch.zeros(2, context // r + 1, dtype=torch.int64, device=DEVICE) for r in ratios}
    compressed = {}
    for buffer in layout.compressed_buffers():
        if buffer.layer == layer:
            blocks = context // buffer.ratio
            entry_table[buffer.ratio][1, :blocks] = 1 + torch.arange(blocks, device=DEVICE)
            values = torch.randn(1 + blocks, buffer.dim, device=DEVICE, dtype=DTYPE)
            compressed[(layer, buffer.kind)] = layout.format_of(buffer).encode(values)
    records = {
        (b.layer, b.kind): torch.zeros(2, b.pools, 3, b.dim, dtype=STATE_DTYPE, device=DEVICE)
        for b in layout.state_buffers()
        if b.layer == layer
    }
    copies = [{k: v.clone() for k, v in records.items()} for _ in range(2)]
    window = [window_rows] * (layer + 1)
    return LayerPools(window, compressed, records, *copies, window_table, entry_table, layout.formats)


def chunk_flops(config: DeepseekV4Config, kind: str, weights: int, start: int, tokens: int) -> float:
    positions = torch.arange(start, start + tokens, dtype=torch.float64)
    keys = torch.clamp(positions + 1, max=config.sliding_window)
    flops = 2 * tokens * weights / DTYPE.itemsize
    if kind == "csa":
        visible = torch.div(positions + 1, 4, rounding_mode="floor")
        keys += visible.clamp(max=config.index_topk)
        flops += 2 * config.index_n_heads * config.index_head_dim * visible.sum().item()
    elif kind == "hca":
        keys += torch.div(positions + 1, 128, rounding_mode="floor")
    return flops + 4 * config.num_heads * config.head_dim * keys.sum().item()


def chunk_bytes(config: DeepseekV4Config, kind: str, weights: int, context: int, pools: LayerPools) -> float:
    """The weights, every window row (the chunk's own and the window before it), entry and key at most once."""
    entry, key = pools.formats.entries.row_bytes, pools.formats.indexer_keys.row_bytes
    rows = context * entry
    if kind == "csa":
        rows += context // 4 * (entry + key)
    elif kind == "hca":
        rows += context // 128 * entry
    return weights + rows


@torch.no_grad()
def bench(model: str, kind: str, kv: str, timer: Timer, ceilings: dict, outputs: dict) -> dict:
    """One chunk's row; its output kept in ``outputs`` by (model, kind, kv) to set the FP8 pools' beside the
    bf16 pools'."""
    config = named_config(model)
    layer, attention = build_attention(config, kind)
    pools = prefill_pools(config, layer, CONTEXT, KV_DTYPES[kv])
    start = CONTEXT - TOKENS
    plan = batched.BatchPlan([1], [start], [TOKENS])
    x = torch.randn(TOKENS, config.hidden_size, device=DEVICE, dtype=DTYPE)

    def run() -> torch.Tensor:
        index = batched.build_index(plan, pools, config, DEVICE, staged=pools.formats.quantized)  # as served
        return attention.project_out(batched.attend(attention, layer, x, index, pools))

    outputs[(model, kind, kv)] = run().float().cpu()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    row = {"model": model, "kind": kind, "kv": kv, "tokens": TOKENS, "context": CONTEXT}
    row["peak_above_pools_mib"] = (torch.cuda.max_memory_allocated() - held) / 2**20
    row["chunk_us"] = timer.median_us(run)
    weights = weight_bytes(attention)
    row["floor_us"], row["bound"] = floor_us(
        chunk_bytes(config, kind, weights, CONTEXT, pools), chunk_flops(config, kind, weights, start, TOKENS), ceilings
    )
    row["of_floor"] = row["floor_us"] / row["chunk_us"]
    row["kv_bytes_floor_us"] = chunk_bytes(config, kind, 0, CONTEXT, pools) / ceilings["copy_tbps"] / 1e6
    if kv != "bf16" and (model, kind, "bf16") in outputs:
        ours, bf16 = outputs[(model, kind, kv)], outputs[(model, kind, "bf16")]
        row["vs_bf16_pools"] = ((ours - bf16).abs().max() / bf16.abs().max()).item()
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--models", default="flash,pro")
    parser.add_argument("--kv-dtypes", default="bf16", help="pools to build, in turn: bf16, fp8 (DeepSeek's FP8 rows)")
    args = parser.parse_args()
    timer = Timer(budget_ms=300)
    ceilings = measure_ceilings(timer)
    print(json.dumps(ceilings), flush=True)
    rows, outputs = [], {}
    for model in args.models.split(","):
        for kind, kv in product(kinds_of(named_config(model), list(KINDS)), args.kv_dtypes.split(",")):
            rows.append(bench(model, kind, kv, timer, ceilings, outputs))
            torch.cuda.empty_cache()
            print(json.dumps(rows[-1]), flush=True)
            if args.out:
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / "engine_prefill.json").write_text(
                    json.dumps({"ceilings": ceilings, "rows": rows}, indent=1)
                )


if __name__ == "__main__":
    main()
