"""The batched core on CUDA (the Triton kernels) against its torch path on the CPU, at V4-Flash dims, on the H200.

``python benchmarks/core_vs_torch.py --out DIR`` (no SGLang). For each layer kind (window, ratio 4, ratio 128),
over bf16 pools and FP8 pools (DeepSeek's rows), from the same random pool contents and weights:

* a decode step of 4 requests at the context's last position (the CUDA graph's index build and kernels), and
* a prefill chunk of 512 tokens of one request ending at the context's end (the extend path),

run once on the GPU and once on the CPU through the torch path (``kernels/dispatch.py`` chooses by device), and
compared: the attention output, and every pool tensor the step wrote (window rows, entry and indexer-key rows,
compressor records), as relative errors in float64. Both sides read the same stored rows, so FP8 rows compare
FP8 decoding on both sides; what differs is the arithmetic (Triton's tiles and online softmax, bf16 matmuls).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

from sglang_dsv4.attention_backend import batched
from sglang_dsv4.config import named_config
from sglang_dsv4.memory_pool.ledger import KV_DTYPES

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "kernels"))
from engine_step import DEVICE, build_attention, build_pools  # noqa: E402

CONTEXT, REQUESTS, CHUNK = 8192, 4, 512


def moved(pools, device: str):
    """The pools' tensors on ``device`` (every field that holds tensors, nested in lists and dicts)."""

    def move(value):
        if torch.is_tensor(value):
            return value.to(device, copy=True)
        if isinstance(value, list):
            return [move(v) for v in value]
        if isinstance(value, dict):
            return {k: move(v) for k, v in value.items()}
        return value

    return dataclasses.replace(pools, **{f.name: move(getattr(pools, f.name)) for f in dataclasses.fields(pools)})


def relative(actual: torch.Tensor, expected: torch.Tensor, row_format=None) -> float:
    """``||actual - expected|| / ||expected||`` in float64 over finite values, rows decoded from ``row_format``."""
    if row_format is not None:
        actual, expected = row_format.decode(actual.cpu(), torch.float32), row_format.decode(expected, torch.float32)
    actual, expected = actual.double().cpu(), expected.double()
    finite = torch.isfinite(expected)
    return ((actual - expected)[finite].norm() / expected[finite].norm().clamp_min(1e-30)).item()


def step(attention, layer, config, pools, x, plan: batched.BatchPlan | None, device: str) -> torch.Tensor:
    if plan is None:
        rows = torch.arange(1, REQUESTS + 1, device=device)
        seq_lens = torch.full((REQUESTS,), CONTEXT, device=device)
        graph_index = batched.DecodeGraphIndex(REQUESTS, pools, config, device)
        graph_index.stage_checkpoints({})
        index = graph_index.build(rows, seq_lens)
    else:
        index = batched.build_index(plan, pools, config, device, staged=pools.formats.quantized)  # as served
    return batched.attend(attention, layer, x, index, pools)


@torch.no_grad()
def compare(kind: str, kv: str, prefill: bool) -> dict:
    config = named_config("flash")
    layer, attention = build_attention(config, kind)
    pools = build_pools(config, layer, REQUESTS, CONTEXT, KV_DTYPES[kv])
    tokens = CHUNK if prefill else REQUESTS
    plan = batched.BatchPlan([1], [CONTEXT - CHUNK], [CHUNK]) if prefill else None
    x = torch.randn(tokens, config.hidden_size, device=DEVICE, dtype=torch.bfloat16)
    cpu_pools = moved(pools, "cpu")
    cpu_attention = build_attention(config, kind)[1].to("cpu")
    cpu_attention.load_state_dict({k: v.cpu() for k, v in attention.state_dict().items()})
    gpu_out = step(attention, layer, config, pools, x, plan, "cuda")
    cpu_out = step(cpu_attention, layer, config, cpu_pools, x.cpu(), plan, "cpu")
    row = {"kind": kind, "kv": kv, "step": f"prefill {CHUNK}" if prefill else f"decode x{REQUESTS}"}
    row["output"] = relative(gpu_out, cpu_out.float())
    formats = pools.formats
    written = {"window": (pools.window[-1], cpu_pools.window[-1], formats.entries)}
    for key in pools.compressed:
        stored_as = formats.indexer_keys if key[1] == "indexer_keys" else formats.entries
        written[key[1]] = (pools.compressed[key], cpu_pools.compressed[key], stored_as)
    written |= {f"state {k[1]}": (pools.state[k], cpu_pools.state[k], None) for k in pools.state}
    for name, (gpu, cpu, stored_as) in written.items():
        row[name] = relative(gpu[1:], cpu[1:], stored_as)  # row 0: the padding row, written in no set order
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(16)
    rows = []
    for kv in ("bf16", "fp8"):
        for kind in ("window", "csa", "hca"):
            for prefill in (False, True):
                try:
                    rows.append(compare(kind, kv, prefill))
                except Exception as error:  # noqa: BLE001 - a case reports its failure and the run goes on
                    rows.append({"kind": kind, "kv": kv, "prefill": prefill, "error": repr(error)[:300]})
                print(json.dumps(rows[-1]), flush=True)
                if args.out:
                    args.out.mkdir(parents=True, exist_ok=True)
                    (args.out / "core_vs_torch.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
