"""How long one forward of an attention-DP rank takes on an H200: the emulated device's clock.

A forward is a batch of requests, each with its new tokens and the context they attend to
(:class:`ForwardShape`). Its time is the sum over the config's layers of

* the attention layer of its kind (window, CSA, HCA) with its projections: **measured** on the H200
  by this project (``benchmarks/engine_step.py``: decode steps over a grid of batch x context;
  ``benchmarks/engine_prefill.py``: one 8K-token chunk at 64K context), interpolated
  (:class:`DecodeAttention`, :class:`PrefillAttention`);
* mHC, the MoE gate and the shared expert: **measured** beside them (``benchmarks/whole_layer_step.py``),
  interpolated in the batch's tokens, and never below the shared expert's FP8 roofline;
* the routed experts (FP4 weights, FP8 compute), the MoE's all-to-all and the sampler: **rooflines** with
  the efficiencies of :class:`Rooflines` (SGLang's CUDA kernels there were never run by this project);

plus the head, measured. The measured figures are package data (``h200_measurements.json``), extracted from the
benchmark result files by :func:`extract_measurements` (``tests/test_emulation_timing.py`` checks they agree).

The fit: decode attention is bilinear in (batch, context) between the grid's points (batch 1, 8, 64, 256;
context 8K and 128K), extended linearly beyond the grid and held at its 8K value below it; each inner batch
left out and interpolated from its neighbours comes within 11% of its measured step (V4-Flash, bf16; 9% V4-Pro:
:func:`leave_one_out_errors`).
Prefill attention scales the one measured chunk by tokens, its CSA indexer share by context, and is never
below a decode step of the same layer: one point, its error unknown away from it.

Nothing here imports SGLang or torch.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from ..config import DeepseekV4Config

KINDS = ("window", "csa", "hca")
MEASUREMENTS = "h200_measurements.json"
DECODE_GRID_CONTEXTS = (8192, 131072)
PREFILL_TOKENS, PREFILL_CONTEXT = 8192, 65536


@dataclass(frozen=True)
class ForwardShape:
    """One forward: per request, its new tokens and the context its last token attends to (prefix + new)."""

    new_tokens: tuple[int, ...]
    contexts: tuple[int, ...]

    @property
    def tokens(self) -> int:
        return sum(self.new_tokens)

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.new_tokens)


@dataclass(frozen=True)
class Rooflines:
    """The H200's ceilings and the share of them SGLang's CUDA kernels are assumed to reach.

    Peaks from NVIDIA's H200 SXM datasheet (HBM3e 4.8 TB/s, FP8 dense 1,979/2 TFLOPS, NVLink 900 GB/s both
    directions); the efficiencies are assumptions, not measurements: a grouped FP4-weight GEMM at 60% of HBM
    bandwidth when memory-bound and 50% of FP8 peak when compute-bound, DeepEP-class all-to-all at 40% of one
    direction of NVLink plus 25 us of latency per dispatch-and-combine, sampling 40 us a forward.
    """

    hbm_bytes_per_s: float = 4.8e12
    fp8_flops_per_s: float = 989e12
    nvlink_bytes_per_s: float = 450e9
    expert_bandwidth_efficiency: float = 0.6
    expert_compute_efficiency: float = 0.5
    all_to_all_efficiency: float = 0.4
    all_to_all_latency_s: float = 25e-6
    sampling_s: float = 40e-6


@dataclass(frozen=True)
class Deployment:
    """The GPUs a rank is one of: ``gpus`` attention-DP ranks of one GPU each, experts split over all of them."""

    gpus: int = 8
    kv_dtype: str = "bf16"


@dataclass
class ForwardTime:
    """A forward's seconds, by part."""

    parts: dict[str, float] = field(default_factory=dict)

    @property
    def total_s(self) -> float:
        return sum(self.parts.values())


class DecodeAttention:
    """One attention layer's decode step (us) by kind, batch and mean context, from the measured grid."""

    def __init__(self, grid: dict[str, dict[str, float]]):
        """``grid[kind]["batch,context"]``: measured ``layer_us``."""
        self.grid = {kind: {tuple(map(int, k.split(","))): v for k, v in points.items()} for kind, points in grid.items()}

    def kinds(self) -> set[str]:
        return set(self.grid)

    def layer_us(self, kind: str, batch: int, context: float) -> float:
        points = self.grid[kind]
        low, high = _bracket(sorted({b for b, _ in points}), batch)
        at_low = self._in_context(points, low, context)
        if low == high:
            return at_low
        return at_low + (batch - low) / (high - low) * (self._in_context(points, high, context) - at_low)

    @staticmethod
    def _in_context(points: dict[tuple[int, int], float], batch: int, context: float) -> float:
        short, long = DECODE_GRID_CONTEXTS
        context = max(context, short)
        return points[(batch, short)] + (context - short) / (long - short) * (
            points[(batch, long)] - points[(batch, short)]
        )


class PrefillAttention:
    """One attention layer's extend (us): the measured 8K-token chunk at 64K scaled to the forward's tokens."""

    def __init__(self, chunk_us: dict[str, float], decode: DecodeAttention):
        self.chunk_us, self.decode = chunk_us, decode

    def layer_us(self, kind: str, tokens: int, context: float) -> float:
        chunk = self.chunk_us[kind]
        if kind == "csa":  # the indexer scores every visible ratio-4 entry: its share grows with the context
            fixed = self.chunk_us.get("hca", chunk)
            chunk = fixed + (chunk - fixed) * context / PREFILL_CONTEXT
        return max(chunk * tokens / PREFILL_TOKENS, self.decode.layer_us(kind, 1, context))


@dataclass(frozen=True)
class LayerParts:
    """Measured per-layer parts besides attention (us, by batch tokens): mHC both sublayers, gate, shared expert,
    and the head once."""

    points: dict[str, dict[int, float]]

    def us(self, part: str, tokens: int) -> float:
        by_batch = self.points[part]
        batches = sorted(by_batch)
        low, high = _bracket(batches, tokens)
        if low == high:
            return by_batch[low]
        return by_batch[low] + (tokens - low) / (high - low) * (by_batch[high] - by_batch[low])


class TimingModel:
    """A forward's time on one H200 of a :class:`Deployment`, for one V4 config (see the module's docstring)."""

    def __init__(
        self,
        config: DeepseekV4Config,
        model: str,
        deployment: Deployment = Deployment(),
        rooflines: Rooflines = Rooflines(),
        measurements: dict | None = None,
    ):
        """``model``: which measured model's figures (``flash`` or ``pro``)."""
        data = (measurements or load_measurements())[model]
        self.config, self.deployment, self.rooflines = config, deployment, rooflines
        self.decode = DecodeAttention(data["decode_layer_us"][deployment.kv_dtype])
        self.prefill = PrefillAttention(data["prefill_chunk_us"], self.decode)
        self.parts = LayerParts({k: {int(b): v for b, v in p.items()} for k, p in data["layer_parts_us"].items()})
        kinds = [config.layer_kind(i) for i in range(config.num_layers)]
        self.layer_counts = {kind: kinds.count(kind) for kind in KINDS if kind in kinds}

    def forward(self, shape: ForwardShape) -> ForwardTime:
        time = ForwardTime()
        if not shape.new_tokens:
            return time
        tokens = shape.tokens
        mean_context = sum(shape.contexts) / len(shape.contexts)
        attention_us = 0.0
        for kind, count in self.layer_counts.items():
            measured_kind = kind if kind in self.decode.kinds() else "hca"
            if shape.is_decode:
                attention_us += count * self.decode.layer_us(measured_kind, tokens, mean_context)
            else:
                attention_us += count * sum(
                    self.prefill.layer_us(measured_kind, n, c) for n, c in zip(shape.new_tokens, shape.contexts)
                )
        layers = self.config.num_layers
        time.parts["attention"] = attention_us * 1e-6
        time.parts["mhc_gate_shared"] = layers * self._dense_us(tokens) * 1e-6
        time.parts["routed_experts"] = layers * self._routed_experts_s(tokens)
        time.parts["all_to_all"] = layers * self._all_to_all_s(tokens)
        time.parts["head"] = self.parts.us("head", len(shape.new_tokens)) * 1e-6
        time.parts["sampling"] = self.rooflines.sampling_s
        return time

    def _dense_us(self, tokens: int) -> float:
        measured = sum(self.parts.us(part, tokens) for part in ("mhc", "gate", "shared_expert"))
        config = self.config
        shared_flops = 2 * 3 * config.hidden_size * config.moe_intermediate_size * tokens  # one shared expert
        return max(measured, 1e6 * shared_flops / (self.rooflines.fp8_flops_per_s * self.rooflines.expert_compute_efficiency))

    def _routed_experts_s(self, tokens: int) -> float:
        """This rank's experts over the tokens every rank routes to them (the ranks' loads taken as equal)."""
        config, roof, gpus = self.config, self.rooflines, self.deployment.gpus
        assignments = tokens * config.num_experts_per_tok  # received from all ranks, equal loads
        experts_here = config.n_routed_experts / gpus
        touched = experts_here * (1 - (1 - 1 / config.n_routed_experts) ** (assignments * gpus))
        weights_per_expert = 3 * config.hidden_size * config.moe_intermediate_size
        read_bytes = touched * weights_per_expert * (0.5 + 1 / 32)  # FP4 values and one scale byte per 32
        flops = 2 * weights_per_expert * assignments
        return max(
            read_bytes / (roof.hbm_bytes_per_s * roof.expert_bandwidth_efficiency),
            flops / (roof.fp8_flops_per_s * roof.expert_compute_efficiency),
        )

    def _all_to_all_s(self, tokens: int) -> float:
        """Dispatch (FP8 hidden) and combine (bf16 hidden) of the assignments leaving the rank."""
        config, roof, gpus = self.config, self.rooflines, self.deployment.gpus
        if gpus == 1:
            return 0.0
        leaving = tokens * config.num_experts_per_tok * (gpus - 1) / gpus
        moved = leaving * config.hidden_size * (1 + 2)
        return roof.all_to_all_latency_s + moved / (roof.nvlink_bytes_per_s * roof.all_to_all_efficiency)


def _bracket(points: list[int], value: float) -> tuple[int, int]:
    """The two grid points around ``value``: the last two beyond the grid, the first point below it."""
    if value <= points[0]:
        return points[0], points[0]
    for low, high in zip(points, points[1:]):
        if value <= high:
            return low, high
    return points[-2], points[-1]


def load_measurements() -> dict:
    """The package's extract of the H200 measurements (``h200_measurements.json``)."""
    return json.loads(resources.files("sglang_dsv4.emulation").joinpath(MEASUREMENTS).read_text())


def extract_measurements(results: Path) -> dict:
    """From ``benchmarks/results``: per model, decode ``layer_us`` per KV dtype, the latest prefill chunk per kind,
    and the whole-layer step's per-layer parts by batch."""
    extract: dict[str, dict] = {}
    step_files = {"bf16": "engine_step.json", "fp8": "engine_step_fp8.json"}
    for kv, name in step_files.items():
        for row in json.loads((results / name).read_text())["rows"]:
            if row["context"] not in DECODE_GRID_CONTEXTS:
                continue
            grid = extract.setdefault(row["model"], {}).setdefault("decode_layer_us", {}).setdefault(kv, {})
            grid.setdefault(row["kind"], {})[f"{row['batch']},{row['context']}"] = round(row["layer_us"], 2)
    prefill = json.loads((results / "engine_prefill.json").read_text())
    for key in prefill:  # later runs (after_N) overwrite earlier ones
        for row in prefill[key]["rows"]:
            if row["kv"] == "bf16":
                extract[row["model"]].setdefault("prefill_chunk_us", {})[row["kind"]] = round(row["chunk_us"], 1)
    for row in json.loads((results / "whole_layer_step.json").read_text())["rows"]:
        parts = extract[row["model"]].setdefault("layer_parts_us", {})
        batch = str(row["batch"])
        parts.setdefault("mhc", {})[batch] = round(row["mhc_us"] / row["layers"], 2)
        parts.setdefault("gate", {})[batch] = row["gate_us"]
        parts.setdefault("shared_expert", {})[batch] = row["shared_expert_us"]
        parts.setdefault("head", {})[batch] = row["head_us"]
    return extract


def leave_one_out_errors(model: str, kv_dtype: str = "bf16", measurements: dict | None = None) -> dict[str, float]:
    """Relative error of the decode interpolation at each inner grid batch, interpolated without it."""
    grid = (measurements or load_measurements())[model]["decode_layer_us"][kv_dtype]
    errors = {}
    for kind, points in grid.items():
        batches = sorted({int(k.split(",")[0]) for k in points})
        for left_out in batches[1:-1]:
            kept = {k: v for k, v in points.items() if int(k.split(",")[0]) != left_out}
            attention = DecodeAttention({kind: kept})
            for context in DECODE_GRID_CONTEXTS:
                measured = points[f"{left_out},{context}"]
                errors[f"{kind} b{left_out} c{context}"] = attention.layer_us(kind, left_out, context) / measured - 1
    return errors
