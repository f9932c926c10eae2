"""Routed experts of one V4 MoE layer on the GPU: the grouped pass against the per-expert loop it replaced.

``python benchmarks/kernels/moe_experts.py [--out DIR]`` on a CUDA host (the H200: torch 2.11, no SGLang).
In one run it

1. measures the ceilings: device-to-device copy bandwidth (bytes read + written) and an 8192^3
   bf16 matrix product;
2. checks :func:`sglang_dsv4.model.experts.grouped_experts` on the GPU (bf16, torch's grouped GEMM)
   against every (token, slot) pair computed on its own in float32, with experts of -1 (another
   rank's) among them;
3. times, at V4-Flash and V4-Pro shapes (256 / 384 experts, top 6, intermediate 2048 / 3072, hidden
   4096 / 7168, bf16) and 64, 256, 1024 and 4096 tokens routed uniformly at random to distinct
   experts (hash routing with a random ``tid2eid``): the grouped pass captured in a CUDA graph (it
   has no host sync), and the per-expert loop (``unique().tolist()`` and a ``nonzero`` per expert,
   the code before it) eagerly; each against its floor: the bytes of the touched experts' weights
   over the copy bandwidth, or the FLOPs over the matrix rate.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from mhc_compressor import ceilings, time_eager, time_graph  # this folder's timing, one way for every kernel

from sglang_dsv4.model.experts import clamped_swiglu, grouped_experts

MODELS = {"flash": (256, 2048, 4096), "pro": (384, 3072, 7168)}  # experts, intermediate, hidden
TOP_K, LIMIT = 6, 10.0
TOKENS = (64, 256, 1024, 4096)
DTYPE = torch.bfloat16


def expert_weights(experts: int, inner: int, hidden: int, dtype=DTYPE):
    scale = hidden**-0.5
    return tuple(
        (torch.randn(experts, *shape, device="cuda", dtype=dtype) * scale)
        for shape in ((inner, hidden), (hidden, inner), (inner, hidden))
    )


def routing(tokens: int, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct random experts per token (a random hash table's routing), with sqrt-softplus-like weights."""
    chosen = torch.rand(tokens, experts, device="cuda").argsort(dim=1)[:, :TOP_K]
    weights = torch.rand(tokens, TOP_K, device="cuda")
    return weights / weights.sum(1, keepdim=True), chosen


def per_expert_loop(x, weights, experts, w1, w2, w3, limit):
    """The code the grouped pass replaced: one host sync, then one per expert."""
    out = torch.zeros_like(x)
    for expert in experts.unique().tolist():
        token, slot = (experts == expert).nonzero(as_tuple=True)
        hidden = clamped_swiglu(x[token] @ w1[expert].T, x[token] @ w3[expert].T, limit)
        out.index_add_(0, token, (hidden @ w2[expert].T) * weights[token, slot, None].to(x.dtype))
    return out


def check() -> dict[str, float]:
    w1, w2, w3 = expert_weights(16, 256, 512, torch.float32)
    x = torch.randn(333, 512, device="cuda")
    weights, experts = routing(333, 16)
    experts[::5, 2] = -1
    ours = grouped_experts(x.to(DTYPE), weights, experts, w1.to(DTYPE), w2.to(DTYPE), w3.to(DTYPE), 0.5).float()
    on_rank = experts >= 0
    chosen = experts.clamp(min=0)
    gate, up = torch.einsum("th,tkih->tki", x, w1[chosen]), torch.einsum("th,tkih->tki", x, w3[chosen])
    pairs = torch.einsum("tki,tkhi->tkh", clamped_swiglu(gate, up, 0.5), w2[chosen])
    expected = (pairs * (weights * on_rank)[..., None]).sum(1)
    return {"grouped_bf16_vs_float32_rel": float((ours - expected).norm() / expected.norm())}


def time_layer(model: str, tokens: int, ceiling: dict[str, float]) -> dict:
    experts, inner, hidden = MODELS[model]
    w1, w2, w3 = expert_weights(experts, inner, hidden)
    x = torch.randn(tokens, hidden, device="cuda", dtype=DTYPE)
    weights, chosen = routing(tokens, experts)
    touched = int(torch.unique(chosen).numel())
    ours = time_graph([lambda: grouped_experts(x, weights, chosen, w1, w2, w3, LIMIT)])
    loop = time_eager(lambda: per_expert_loop(x, weights, chosen, w1, w2, w3, LIMIT))
    weight_bytes = touched * 3 * inner * hidden * 2
    flops = 2 * tokens * TOP_K * 3 * inner * hidden
    floor = max(weight_bytes / ceiling["copy_bytes_per_s"], flops / ceiling["bf16_flops_per_s"])
    bound = "memory" if weight_bytes / ceiling["copy_bytes_per_s"] >= flops / ceiling["bf16_flops_per_s"] else "compute"
    return {
        "model": model, "tokens": tokens, "experts_touched": touched, "grouped_ms": ours * 1e3,
        "loop_ms": loop * 1e3, "loop_over_grouped": loop / ours, "floor_ms": floor * 1e3, "bound": bound,
        "grouped_of_floor": floor / ours,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    results["ceilings"] = ceiling = ceilings()
    results["check"] = check()
    print(json.dumps(results), flush=True)
    rows = results["timings"] = []
    for model in MODELS:
        for tokens in TOKENS:
            rows.append(time_layer(model, tokens, ceiling))
            print(json.dumps(rows[-1]), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "moe_experts.json").write_text(json.dumps(results, indent=1))
    print(
        f"\ncopy {ceiling['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 {ceiling['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s"
    )
    print(
        f"{'model':5} {'tokens':>6} {'touched':>7} {'grouped ms':>10} {'loop ms':>8} {'loop/grp':>8} {'floor ms':>8} of floor"
    )
    for r in rows:
        print(
            f"{r['model']:5} {r['tokens']:>6} {r['experts_touched']:>7} {r['grouped_ms']:10.3f} {r['loop_ms']:8.2f}"
            f" {r['loop_over_grouped']:8.1f} {r['floor_ms']:8.3f} {r['grouped_of_floor']:7.1%} {r['bound']}"
        )


if __name__ == "__main__":
    main()
