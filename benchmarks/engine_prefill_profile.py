"""Where the time of one batched prefill chunk goes: the CUDA kernels of ``engine_prefill.py``'s chunk, by total time.

``python benchmarks/engine_prefill_profile.py [--out DIR]`` on a CUDA host (no SGLang): for each layer kind
of V4-Flash, the 8,192-token chunk at 64K context of ``engine_prefill.py`` (its pools, plan and index
build), run under ``torch.profiler`` after a warm-up; prints the kernels that take most of its device time,
grouped by name, with their share of the chunk.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from engine_prefill import CONTEXT, TOKENS, prefill_pools
from engine_step import DEVICE, DTYPE, KINDS, build_attention, kinds_of
from torch.profiler import ProfilerActivity, profile

from sglang_dsv4.attention_backend import batched
from sglang_dsv4.config import named_config

TOP = 12


@torch.no_grad()
def kernel_times(model: str, kind: str) -> dict:
    config = named_config(model)
    layer, attention = build_attention(config, kind)
    pools = prefill_pools(config, layer, CONTEXT)
    plan = batched.BatchPlan([1], [CONTEXT - TOKENS], [TOKENS])
    x = torch.randn(TOKENS, config.hidden_size, device=DEVICE, dtype=DTYPE)

    def run() -> torch.Tensor:
        index = batched.build_index(plan, pools, config, DEVICE, staged=pools.formats.quantized)  # as served
        return attention.project_out(batched.attend(attention, layer, x, index, pools))

    for _ in range(2):
        run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        run()
        torch.cuda.synchronize()
    events = [e for e in profiler.key_averages() if e.device_time_total > 0]
    total = sum(e.device_time_total for e in events)
    top = sorted(events, key=lambda e: e.device_time_total, reverse=True)[:TOP]
    return {
        "model": model,
        "kind": kind,
        "device_us": total,
        "kernels": [
            {
                "name": e.key[:90],
                "calls": e.count,
                "us": round(e.device_time_total),
                "share": e.device_time_total / total,
            }
            for e in top
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--models", default="flash")
    args = parser.parse_args()
    rows = []
    for model in args.models.split(","):
        for kind in kinds_of(named_config(model), list(KINDS)):
            rows.append(kernel_times(model, kind))
            torch.cuda.empty_cache()
            print(json.dumps(rows[-1], indent=1), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "engine_prefill_profile.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
