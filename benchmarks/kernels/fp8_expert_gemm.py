"""The routed experts' FP8 GEMMs on one GPU, against the emulator's roofline for them.

``python benchmarks/kernels/fp8_expert_gemm.py [--out DIR]`` on a CUDA host (the H200: torch 2.11, no SGLang).

The emulator (``sglang_dsv4.emulation.timing``) times a layer's routed experts on an H200 as the larger of their
weights' bytes and their FLOPs, each at an efficiency (``Rooflines``) taken from this measurement, since SGLang's
MoE kernels (DeepGEMM's grouped FP8 GEMMs) cannot run here. It measures a kernel of that class in their place:
torch's ``_scaled_grouped_mm`` (CUTLASS's grouped FP8 GEMM for Hopper, rowwise scales; DeepGEMM scales per
128x128 block) over one GPU's share of the experts (its EP rank: 64 of V4-Flash's 256 at EP4, upstream's H200
recipe; 32 at EP8; 24 of V4-Pro's 384 at EP16), with the assignments the emulator gives it: ``tokens x top-6``
per GPU under attention DP with equal loads, routed uniformly at random over its experts. Per layer: the gate and
up projections in one GEMM (N = 2I, K = H), then down (N = H, K = I); the activation between them (SGLang fuses
it with the FP8 quantisation of the second GEMM's input) is left out, as it is in the emulator. Two layouts:
``exact``, each expert's rows as routed; ``padded``, each expert's rows padded to 128 (DeepGEMM's contiguous
layout for prefill). Each is captured in a CUDA graph; the grouped GEMM is checked once against float32 products
of the same FP8 values. (A per-expert ``_scaled_mm`` loop was tried as a second opinion: cuBLASLt refuses rowwise
FP8 for an expert's row count that is not a multiple of 16, which is most of them.)

Printed per shape: the measured time, the emulator's, their ratio, and the measured bytes and FLOP rates; first the
ceilings measured on the card (a device copy, an 8192^3 bf16 product, an 8192^3 FP8 product).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from mhc_compressor import ceilings, time_eager, time_graph  # this folder's timing, one way for every kernel

from sglang_dsv4.config import named_config
from sglang_dsv4.emulation.timing import Deployment, ForwardShape, TimingModel

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
# (model, GPUs): the emulator's deployments of that model (EP4 is upstream's FP8 H200 recipe, the calibration's).
DEPLOYMENTS = (("flash", 4), ("flash", 8), ("pro", 16))
# Tokens a rank forwards: decode batches, then prefill chunks.
TOKENS = (1, 8, 16, 64, 128, 256, 2048, 8192)
PAD = 128


def quantize_rows(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 values with one float32 scale per row of the last two dimensions' rows."""
    scale = values.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
    return (values / scale[..., None]).to(FP8), scale.float()


def expert_weights(experts: int, out_features: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One projection of every expert: FP8 values laid out (experts, in, out) column-major, as the GEMM takes
    them, and a scale per output channel."""
    values, scale = quantize_rows(torch.randn(experts, out_features, in_features, device="cuda") * in_features**-0.5)
    return values.transpose(1, 2), scale


def group_ends(rows_per_expert: torch.Tensor, pad: int) -> tuple[torch.Tensor, int]:
    """Each expert's end row, its rows rounded up to a multiple of ``pad``, and the rows in all."""
    ends = ((rows_per_expert + pad - 1) // pad * pad).cumsum(0).to(torch.int32)
    return ends, int(ends[-1])


def routed_rows(tokens: int, local_experts: int, top_k: int) -> torch.Tensor:
    """How many of the GPU's ``tokens x top_k`` assignments each of its experts gets (uniform at random)."""
    experts = torch.randint(0, local_experts, (tokens * top_k,), device="cuda")
    return torch.zeros(local_experts, dtype=torch.int64, device="cuda").scatter_add_(
        0, experts, torch.ones_like(experts)
    )


def grouped(x, x_scale, weight, weight_scale, ends) -> torch.Tensor:
    return torch._scaled_grouped_mm(x, weight, x_scale, weight_scale, offs=ends, out_dtype=torch.bfloat16)


def check(hidden: int = 512, inner: int = 256, experts: int = 8) -> float:
    """The grouped FP8 GEMM against float32 products of the same FP8 values, expert by expert."""
    weight, weight_scale = expert_weights(experts, 2 * inner, hidden)
    rows = routed_rows(100, experts, 6)
    ends, total = group_ends(rows, 1)
    x, x_scale = quantize_rows(torch.randn(total, hidden, device="cuda"))
    bounds = expert_bounds(ends)
    out = grouped(x, x_scale, weight, weight_scale, ends).float()
    expected = torch.cat([
        (x[s:e].float() * x_scale[s:e, None]) @ (weight[g].float() * weight_scale[g][None, :])
        for g, (s, e) in enumerate(bounds)
    ])  # fmt: skip
    return float((out - expected).norm() / expected.norm())


def expert_bounds(ends: torch.Tensor) -> list[tuple[int, int]]:
    """Each expert's (first row, end row), read once to the host (outside graph capture)."""
    ends_list = ends.tolist()
    return list(zip([0] + ends_list[:-1], ends_list))


def fp8_flops_per_s(size: int = 8192) -> float:
    a, a_scale = quantize_rows(torch.randn(size, size, device="cuda"))
    b, b_scale = quantize_rows(torch.randn(size, size, device="cuda"))
    seconds = time_eager(
        lambda: torch._scaled_mm(a, b.T, a_scale[:, None], b_scale[None, :], out_dtype=torch.bfloat16)
    )
    return 2 * size**3 / seconds


def time_layer(model: str, gpus: int, tokens: int, ceiling: dict[str, float]) -> dict:
    config = named_config(model)
    hidden, inner, top_k = config.hidden_size, config.moe_intermediate_size, config.num_experts_per_tok
    local_experts = config.n_routed_experts // gpus
    up, up_scale = expert_weights(local_experts, 2 * inner, hidden)
    down, down_scale = expert_weights(local_experts, hidden, inner)
    rows = routed_rows(tokens, local_experts, top_k)
    touched = int((rows > 0).sum())
    row = {"model": model, "gpus": gpus, "local_experts": local_experts, "tokens": tokens,
           "assignments": tokens * top_k, "experts_touched": touched}  # fmt: skip
    for layout, pad in (("exact", 1), ("padded", PAD)):
        ends, total = group_ends(rows, pad)
        x, x_scale = quantize_rows(torch.randn(total, hidden, device="cuda"))
        h, h_scale = quantize_rows(torch.randn(total, inner, device="cuda"))
        seconds = time_graph([
            lambda: (grouped(x, x_scale, up, up_scale, ends), grouped(h, h_scale, down, down_scale, ends))
        ])  # fmt: skip
        row[f"{layout}_us"] = seconds * 1e6
    weight_bytes = touched * 3 * inner * hidden  # FP8, the scales aside
    activation_bytes = tokens * top_k * (hidden + 2 * inner + inner + hidden * 2)  # FP8 in, bf16 out, both GEMMs
    flops = 2 * tokens * top_k * 3 * inner * hidden
    deployment = Deployment(gpus=gpus, experts="fp8")
    emulated = TimingModel(config, model, deployment).forward(ForwardShape((tokens,), (tokens,)))
    row["emulated_us"] = emulated.parts["routed_experts"] / config.num_layers * 1e6
    row["exact_over_emulated"] = row["exact_us"] / row["emulated_us"]
    row["bytes_per_s"] = (weight_bytes + activation_bytes) / (row["exact_us"] * 1e-6)
    row["flops_per_s"] = flops / (row["exact_us"] * 1e-6)
    row["of_copy_rate"] = row["bytes_per_s"] / ceiling["copy_bytes_per_s"]
    row["of_fp8_rate"] = row["flops_per_s"] / ceiling["fp8_flops_per_s"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    results["ceilings"] = ceiling = ceilings() | {"fp8_flops_per_s": fp8_flops_per_s()}
    results["check_rel"] = check()
    print(json.dumps(results), flush=True)
    rows = results["timings"] = []
    for model, gpus in DEPLOYMENTS:
        for tokens in TOKENS:
            rows.append(time_layer(model, gpus, tokens, ceiling))
            print(json.dumps(rows[-1]), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "fp8_expert_gemm.json").write_text(json.dumps(results, indent=1))
    print(
        f"\n{results['device']}: copy {ceiling['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 "
        f"{ceiling['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s, FP8 {ceiling['fp8_flops_per_s'] / 1e12:.0f} TFLOP/s;"
        f" grouped vs float32 rel {results['check_rel']:.1e}"
    )
    print(f"{'model':5} {'EP':>3} {'tokens':>6} {'touched':>7} {'exact us':>9} {'padded us':>9}"
          f" {'emulated':>9} {'meas/emu':>8} {'TB/s':>5} {'TFLOP/s':>7}")  # fmt: skip
    for r in rows:
        print(
            f"{r['model']:5} {r['gpus']:>3} {r['tokens']:>6} {r['experts_touched']:>7} {r['exact_us']:9.1f}"
            f" {r['padded_us']:9.1f} {r['emulated_us']:9.1f} {r['exact_over_emulated']:8.2f}"
            f" {r['bytes_per_s'] / 1e12:5.2f} {r['flops_per_s'] / 1e12:7.0f}"
        )


if __name__ == "__main__":
    main()
