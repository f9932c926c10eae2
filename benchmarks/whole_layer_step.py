"""A whole decode step of one attention-DP rank of V4 on the GPU, composed from its parts, each in a CUDA graph.

``cd benchmarks && PYTHONPATH=.. python3 whole_layer_step.py [--models flash,pro] [--batches 1,8,32,64]
[--context 8192] [--out DIR]`` on a CUDA host (the H200: torch 2.11, Triton 3.6, no SGLang).

Under attention data parallelism over an EP-8 node (``--tp 8 --dp-size 8 --enable-dp-attention --ep 8``) each
rank runs its own ``batch`` requests through attention and gets, through the MoE all-to-all, the tokens of all
eight ranks routed to the experts it holds. One rank's step is therefore, per layer:

- the attention layer step (``engine_step.py``'s: projections, compressors, indexer, top-k, sparse attention and
  pool writes, over its ``batch`` requests at ``context`` tokens), bf16 weights and KV;
- mHC twice (before the attention and before the MoE: the previous sublayer's post and this one's pre, fused);
- the router's gate projection of its tokens, the shared expert over its tokens;
- its share of the routed experts: ``8 x batch`` tokens (every rank's), top 6 of 256 (Flash) / 384 (Pro) experts
  at random (a random hash table's routing), of which the rank holds one eighth; pairs for other ranks' experts
  are -1 and cost nothing (:func:`sglang_dsv4.model.experts.grouped_experts`, bf16 weights: the release's FP4
  experts would read a quarter of these bytes);

plus, once a step, the decode index build and the head (the final norm and the vocabulary projection of its own
tokens, the whole vocabulary on the rank). Each part is timed alone, replayed as a graph with the L2 flushed;
the step is their sum. Not counted: the all-to-all dispatch and combine of the MoE and any DP gather (one GPU
here), sampling, the embedding, and the scheduler. *Ours* is the part this package writes (the attention layer
steps without their projections, the index build): its share of the whole.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from engine_step import DTYPE, Timer, guarded, kinds_of, measure_ceilings
from mhc_compressor import time_mhc  # on the path engine_step puts the kernel benchmarks on

from sglang_dsv4.config import DeepseekV4Config, named_config
from sglang_dsv4.model.experts import clamped_swiglu, grouped_experts

EP = 8  # ranks of the node: attention-DP 8, experts over 8
TOP_K = 6


def routed_share_us(config: DeepseekV4Config, batch: int, timer: Timer) -> float:
    """One rank's routed experts over every rank's ``batch`` tokens, its eighth of the experts held."""
    experts, inner, hidden = config.n_routed_experts, config.moe_intermediate_size, config.hidden_size
    held = experts // EP
    tokens = EP * batch
    scale = hidden**-0.5
    w1, w2, w3 = (
        torch.randn(held, *shape, device="cuda", dtype=DTYPE) * scale
        for shape in ((inner, hidden), (hidden, inner), (inner, hidden))
    )
    x = torch.randn(tokens, hidden, device="cuda", dtype=DTYPE)
    chosen = torch.rand(tokens, experts, device="cuda").argsort(dim=1)[:, :TOP_K]
    local = torch.where(chosen < held, chosen, -1)  # the rank holds experts 0 .. held - 1
    weights = torch.rand(tokens, TOP_K, device="cuda")
    return timer.graph_us(lambda: grouped_experts(x, weights, local, w1, w2, w3, config.swiglu_limit))


def projection_us(rows: int, inner: int, out: int, timer: Timer) -> float:
    """A ``rows x inner -> out`` projection (bf16)."""
    weight = torch.randn(out, inner, device="cuda", dtype=DTYPE) * inner**-0.5
    x = torch.randn(rows, inner, device="cuda", dtype=DTYPE)
    return timer.graph_us(lambda: x @ weight.T)


def shared_expert_us(config: DeepseekV4Config, batch: int, timer: Timer) -> float:
    """V4's one shared expert over the rank's own tokens (a gated MLP of the routed experts' width)."""
    hidden, inner = config.hidden_size, config.moe_intermediate_size
    w1, w3 = (torch.randn(inner, hidden, device="cuda", dtype=DTYPE) * hidden**-0.5 for _ in range(2))
    w2 = torch.randn(hidden, inner, device="cuda", dtype=DTYPE) * inner**-0.5
    x = torch.randn(batch, hidden, device="cuda", dtype=DTYPE)
    limit = config.swiglu_limit
    return timer.graph_us(lambda: clamped_swiglu(x @ w1.T, x @ w3.T, limit) @ w2.T)


def rank_step(model: str, batch: int, context: int, timer: Timer, ceilings: dict) -> dict:
    config = named_config(model)
    kinds = kinds_of(config, ["window", "csa", "hca"])
    attention = {kind: guarded(model, kind, batch, context, timer, ceilings) for kind in kinds}
    failed = {kind: row["error"] for kind, row in attention.items() if "error" in row}
    if failed:
        return {"model": model, "batch": batch, "context": context, "errors": failed}
    parts = {
        "mhc_post_pre_us": time_mhc(model, batch, None, with_reference=False)[0]["us"],
        "gate_us": projection_us(batch, config.hidden_size, config.n_routed_experts, timer),
        "shared_expert_us": shared_expert_us(config, batch, timer),
        "routed_share_us": routed_share_us(config, batch, timer),
        "head_us": projection_us(batch, config.hidden_size, config.vocab_size, timer),
    }
    layers = [config.layer_kind(i) for i in range(config.num_layers)]
    per_layer_rest = (
        2 * parts["mhc_post_pre_us"] + parts["gate_us"] + parts["shared_expert_us"] + parts["routed_share_us"]
    )
    index = attention[layers[-1]]["index_us"]
    attention_us = sum(attention[kind]["layer_us"] for kind in layers)
    ours = index + sum(attention[kind]["layer_us"] - attention[kind]["projections_us"] for kind in layers)
    step = index + attention_us + len(layers) * per_layer_rest + parts["head_us"]
    return {
        "model": model, "batch": batch, "context": context, "layers": len(layers), **parts,
        "attention_layer_us": {kind: row["layer_us"] for kind, row in attention.items()},
        "index_us": index, "attention_us": attention_us, "mhc_us": len(layers) * 2 * parts["mhc_post_pre_us"],
        "moe_us": len(layers) * (parts["gate_us"] + parts["shared_expert_us"] + parts["routed_share_us"]),
        "step_us": step, "ours_us": ours, "ours_share": ours / step,
        "rank_tokens_per_s": batch / step * 1e6,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="flash,pro")
    parser.add_argument("--batches", default="1,8,32,64", help="requests per attention-DP rank")
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    timer = Timer(budget_ms=150)
    ceilings = measure_ceilings(timer)
    rows = []
    for model in args.models.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            rows.append(rank_step(model, batch, args.context, timer, ceilings))
            print(json.dumps(rows[-1]), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "whole_layer_step.json").write_text(json.dumps({"ceilings": ceilings, "rows": rows}, indent=1))
    print(f"\n{'model':5} {'batch':>5} {'step ms':>8} {'attention':>9} {'mHC':>6} {'MoE':>6} {'head':>6} "
          f"{'ours':>6} {'ours %':>6} {'tok/s/rank':>10}")  # fmt: skip
    for r in rows:
        if "errors" in r:
            print(r["model"], r["batch"], r["errors"])
            continue
        print(
            f"{r['model']:5} {r['batch']:>5} {r['step_us'] / 1e3:8.2f} {r['attention_us'] / 1e3:9.2f}"
            f" {r['mhc_us'] / 1e3:6.2f} {r['moe_us'] / 1e3:6.2f} {r['head_us'] / 1e3:6.2f} {r['ours_us'] / 1e3:6.2f}"
            f" {r['ours_share']:6.1%} {r['rank_tokens_per_s']:10.0f}"
        )


if __name__ == "__main__":
    main()
