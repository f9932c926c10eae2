"""How long one forward of an attention-DP rank takes on an H200: the emulated device's clock.

A forward is a batch of requests, each with its new tokens and the context they attend to
(:class:`ForwardShape`). Its time is the sum over the config's layers of

* the attention layer of its kind (window, CSA, HCA) with its projections: **measured** on the H200
  by this project (``benchmarks/engine_step.py``: decode steps over a grid of batch x context;
  ``benchmarks/engine_prefill.py``: one 8K-token chunk at 64K context), interpolated
  (:class:`MeasuredAttention`); or, for calibration against upstream SGLang, **upstream's kernels' roofline**
  (:class:`RooflineAttention`, ``attention="flashmla"``: FP8 projections and FP8 KV at their bytes or FLOPs
  floor with the efficiencies of :class:`Rooflines`);
* mHC, the MoE gate and the shared expert: **measured** beside them (``benchmarks/whole_layer_step.py``),
  interpolated in the batch's tokens, and never below the shared expert's FP8 roofline;
* the routed experts (FP4 or FP8 weights, FP8 compute): **rooflines** at the efficiencies a grouped FP8 GEMM
  was measured to reach (:class:`Rooflines`); the MoE's all-to-all (or a TP group's all-reduces) and the
  sampler: rooflines at assumed efficiencies (SGLang's CUDA kernels there were never run by this project);

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
from ..model.weight_layout import Parallelism, attention_tensors

KINDS = ("window", "csa", "hca")
MEASUREMENTS = "h200_measurements.json"
DECODE_GRID_CONTEXTS = (8192, 131072)
PREFILL_TOKENS, PREFILL_CONTEXT = 8192, 65536
ATTENTION_MODELS = ("measured", "flashmla")
EXPERT_BYTES_PER_WEIGHT = {"fp4": 0.5 + 1 / 32, "fp8": 1 + 4 / 128**2}  # values and their block scales
# DeepSeek's FP8 KV layout (memory_pool.ledger.ReferenceLayout): an entry (448 FP8 values, 64 bf16 rope values and
# scales) and an indexer key (128 FP8 values and a float32 scale).
REFERENCE_ENTRY_BYTES, REFERENCE_INDEXER_KEY_BYTES = 584, 132


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
    """The H200's ceilings and the share of them SGLang's CUDA kernels reach (measured for the routed experts).

    Peaks from NVIDIA's H200 SXM datasheet (HBM3e 4.8 TB/s, NVLink 900 GB/s both directions); the FP8 figure,
    989 TFLOP/s, is half the datasheet's dense FP8 (1,979; 3,958 with sparsity), a reference the efficiencies
    below are taken against.

    The routed experts' efficiencies are **measured** (``benchmarks/kernels/fp8_expert_gemm.py``,
    ``results/fp8_expert_gemm_h100.json``: CUTLASS's grouped FP8 GEMM through torch, the class of SGLang's
    DeepGEMM, over one GPU's experts at V4-Flash EP4 / EP8 and V4-Pro EP16, on an H100, the H200 device being
    refused that day): once a decode batch touches every expert the weights stream at 2.21-2.31 TB/s, 0.73-0.77 of
    that card's copy rate, which on an H200 (copy 4.27 TB/s) is 3.2 TB/s, 0.67 of 4.8; an 8K-token chunk a rank
    computes at 890-1,001 TFLOP/s, 0.90-1.01 of 989 (FP8 compute is the same on both cards). Against the H100's
    times with the memory-bound ones scaled to the H200's copy rate, the larger of the two floors is 0.84-1.12x
    from 8 decode tokens to 8K-token chunks, and 0.6-0.8x at one decode token (a launch's fixed cost). FP4
    weights are taken at FP8's efficiencies (never measured). The rest are assumptions: DeepEP-class all-to-all at 40% of one direction of NVLink plus
    25 us of latency per dispatch-and-combine (or per layer's two all-reduces under tensor parallelism), sampling
    40 us a forward. Upstream's attention layer (:class:`RooflineAttention`): its bytes at 70% of HBM bandwidth
    (FlashMLA's decode reaches about 90% on its own; the layer's small FP8 GEMMs less), its FLOPs at 50% of
    989 TFLOP/s, plus 10 us a layer for its kernels' launch gaps in a CUDA graph.
    """

    hbm_bytes_per_s: float = 4.8e12
    fp8_flops_per_s: float = 989e12
    nvlink_bytes_per_s: float = 450e9
    expert_bandwidth_efficiency: float = 0.67
    expert_compute_efficiency: float = 0.9
    all_to_all_efficiency: float = 0.4
    all_to_all_latency_s: float = 25e-6
    sampling_s: float = 40e-6
    attention_bandwidth_efficiency: float = 0.7
    attention_compute_efficiency: float = 0.5
    attention_layer_latency_s: float = 10e-6


@dataclass(frozen=True)
class Deployment:
    """The GPUs a rank is one of.

    ``attention_tp`` 1 (the default): ``gpus`` attention-DP ranks of one GPU each, the routed experts split over
    all of them (EP, an all-to-all a layer). ``attention_tp == gpus``: one tensor-parallel group (upstream's
    low-latency recipes), every GPU holding 1/gpus of the attention's heads and of every expert, two all-reduces a
    layer; a rank is then the group. ``experts``: the routed experts' weights, ``fp4`` as released or ``fp8`` as
    upstream's H200 FP8 recipes load them. ``lockstep``: the attention-DP ranks run every forward together (each
    layer's MoE all-to-all joins them), so the other ranks' extends stall this one's steps; with the ranks' loads
    taken as equal, each extend of this rank stands for one of every rank, their time added to it (an upper
    bound: this rank's own decode tokens in those steps are not counted).
    """

    gpus: int = 8
    kv_dtype: str = "bf16"
    attention_tp: int = 1
    experts: str = "fp4"
    lockstep: bool = False

    def __post_init__(self) -> None:
        if self.attention_tp not in (1, self.gpus):
            raise ValueError(f"attention TP {self.attention_tp}: 1 (attention DP) or all {self.gpus} GPUs (TP)")
        if self.experts not in EXPERT_BYTES_PER_WEIGHT:
            raise ValueError(f"experts {self.experts!r}: one of {', '.join(EXPERT_BYTES_PER_WEIGHT)}")

    @property
    def tensor_parallel(self) -> bool:
        return self.attention_tp > 1

    @property
    def ranks(self) -> int:
        """Attention-DP ranks."""
        return self.gpus // self.attention_tp

    @property
    def parallelism(self) -> Parallelism:
        """SGLang's ``--tp/--ep-size/--attn-dp-size`` for this deployment."""
        if self.tensor_parallel:
            return Parallelism(self.gpus, 1, 1)
        return Parallelism(self.gpus, self.gpus, self.gpus)


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


class MeasuredAttention:
    """One attention layer of a forward from this project's H200 measurements (attention DP: one GPU's whole
    attention). A config's window layers take the HCA figures where none were measured (V4-Pro)."""

    def __init__(self, data: dict, kv_dtype: str):
        self.decode = DecodeAttention(data["decode_layer_us"][kv_dtype])
        self.prefill = PrefillAttention(data["prefill_chunk_us"], self.decode)

    def layer_us(self, kind: str, shape: ForwardShape) -> float:
        kind = kind if kind in self.decode.kinds() else "hca"
        if shape.is_decode:
            return self.decode.layer_us(kind, shape.tokens, sum(shape.contexts) / len(shape.contexts))
        return sum(self.prefill.layer_us(kind, n, c) for n, c in zip(shape.new_tokens, shape.contexts))


class RooflineAttention:
    """One attention layer of a forward as upstream's kernels (FlashMLA-class sparse attention, DeepGEMM FP8
    projections) would run it at their roofline: the layer's FP8 weights on this GPU and every request's FP8 KV
    it reads (window rows, CSA's top-k entries and all its indexer keys, all HCA entries) at the attention's
    share of HBM bandwidth, or its FLOPs (projections, the attended entries over this GPU's heads, the indexer's
    scores) at its share of FP8 peak, whichever is longer, plus a fixed launch cost per layer."""

    def __init__(self, config: DeepseekV4Config, deployment: Deployment, rooflines: Rooflines):
        self.config, self.rooflines = config, rooflines
        self.heads = config.num_heads / deployment.attention_tp
        parallel = deployment.parallelism
        self.weight_bytes, self.weights = {}, {}
        for kind in KINDS:
            layer = next((i for i in range(config.num_layers) if config.layer_kind(i) == kind), None)
            if layer is None:
                continue
            specs = attention_tensors(config, layer, quantized=True)
            self.weight_bytes[kind] = sum(spec.bytes_on_rank(parallel, 2) for spec in specs)
            self.weights[kind] = sum(math.prod(spec.local_shape(parallel)) for spec in specs)

    def layer_us(self, kind: str, shape: ForwardShape) -> float:
        roof = self.rooflines
        read = self.weight_bytes[kind] + sum(self._kv_bytes(kind, c) for c in shape.contexts)
        flops = 2 * self.weights[kind] * shape.tokens + sum(
            n * self._flops_per_token(kind, c - n / 2) for n, c in zip(shape.new_tokens, shape.contexts)
        )
        seconds = max(
            read / (roof.hbm_bytes_per_s * roof.attention_bandwidth_efficiency),
            flops / (roof.fp8_flops_per_s * roof.attention_compute_efficiency),
        )
        return 1e6 * (roof.attention_layer_latency_s + seconds)

    def _entries(self, kind: str, context: float) -> tuple[float, float]:
        """KV entries a token at ``context`` attends to, and indexer keys it scores."""
        config = self.config
        window = min(context, config.sliding_window)
        if kind == "csa":
            return window + min(context / config.csa_rate, config.index_topk), context / config.csa_rate
        if kind == "hca":
            return window + context / config.hca_rate, 0.0
        return window, 0.0

    def _kv_bytes(self, kind: str, context: float) -> float:
        entries, keys = self._entries(kind, context)
        return entries * REFERENCE_ENTRY_BYTES + keys * REFERENCE_INDEXER_KEY_BYTES

    def _flops_per_token(self, kind: str, context: float) -> float:
        config = self.config
        entries, keys = self._entries(kind, context)
        attend = entries * self.heads * 2 * 2 * config.head_dim  # scores and values
        return attend + keys * config.index_n_heads * config.index_head_dim * 2


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
        attention: str = "measured",
    ):
        """``model``: which measured model's figures (``flash`` or ``pro``); ``attention``: ``measured`` (this
        project's kernels, attention DP only) or ``flashmla`` (upstream's kernels' roofline)."""
        data = (measurements or load_measurements())[model]
        self.config, self.deployment, self.rooflines = config, deployment, rooflines
        if attention == "measured":
            if deployment.tensor_parallel:
                raise ValueError("the measured attention is one GPU's whole attention: attention DP only")
            self.attention = MeasuredAttention(data, deployment.kv_dtype)
        elif attention == "flashmla":
            self.attention = RooflineAttention(config, deployment, rooflines)
        else:
            raise ValueError(f"attention {attention!r}: one of {', '.join(ATTENTION_MODELS)}")
        self.attention_model = attention
        self.parts = LayerParts({k: {int(b): v for b, v in p.items()} for k, p in data["layer_parts_us"].items()})
        kinds = [config.layer_kind(i) for i in range(config.num_layers)]
        self.layer_counts = {kind: kinds.count(kind) for kind in KINDS if kind in kinds}

    def forward(self, shape: ForwardShape) -> ForwardTime:
        time = ForwardTime()
        if not shape.new_tokens:
            return time
        tokens, layers = shape.tokens, self.config.num_layers
        attention_us = sum(count * self.attention.layer_us(kind, shape) for kind, count in self.layer_counts.items())
        time.parts["attention"] = attention_us * 1e-6
        time.parts["mhc_gate_shared"] = layers * self._dense_us(tokens) * 1e-6
        time.parts["routed_experts"] = layers * self._routed_experts_s(tokens)
        time.parts["all_to_all"] = layers * self._all_to_all_s(tokens)
        time.parts["head"] = self.parts.us("head", len(shape.new_tokens)) * 1e-6 / self.deployment.attention_tp
        time.parts["sampling"] = self.rooflines.sampling_s
        if self.deployment.lockstep and not shape.is_decode:
            time.parts["peer_extends"] = (self.deployment.ranks - 1) * sum(time.parts.values())
        return time

    def _dense_us(self, tokens: int) -> float:
        """mHC and the gate as measured; the shared expert as measured (split over a TP group's GPUs), never below
        its FP8 roofline."""
        config, tp = self.config, self.deployment.attention_tp
        mhc_gate = sum(self.parts.us(part, tokens) for part in ("mhc", "gate"))
        shared_flops = 2 * 3 * config.hidden_size * config.moe_intermediate_size * tokens / tp  # one shared expert
        shared_floor = 1e6 * shared_flops / (self.rooflines.fp8_flops_per_s * self.rooflines.expert_compute_efficiency)
        return mhc_gate + max(self.parts.us("shared_expert", tokens) / tp, shared_floor)

    def _routed_experts_s(self, tokens: int) -> float:
        """This GPU's share of the routed experts: under attention DP, its 1/N of the experts over the tokens every
        rank routes to them (the ranks' loads taken as equal); under TP, 1/N of every expert the group's tokens
        touch."""
        config, roof, deployment = self.config, self.rooflines, self.deployment
        gpus, experts = deployment.gpus, config.n_routed_experts
        weights_per_expert = 3 * config.hidden_size * config.moe_intermediate_size
        assignments = tokens * config.num_experts_per_tok
        if deployment.tensor_parallel:
            touched = experts * (1 - (1 - 1 / experts) ** assignments) / gpus
            flops = 2 * weights_per_expert * assignments / gpus
        else:  # received from all ranks, equal loads
            touched = experts / gpus * (1 - (1 - 1 / experts) ** (assignments * gpus))
            flops = 2 * weights_per_expert * assignments
        read_bytes = touched * weights_per_expert * EXPERT_BYTES_PER_WEIGHT[deployment.experts]
        return max(
            read_bytes / (roof.hbm_bytes_per_s * roof.expert_bandwidth_efficiency),
            flops / (roof.fp8_flops_per_s * roof.expert_compute_efficiency),
        )

    def _all_to_all_s(self, tokens: int) -> float:
        """Attention DP: dispatch (FP8 hidden) and combine (bf16 hidden) of the assignments leaving the rank. TP:
        two ring all-reduces (bf16 hidden) of the group's tokens."""
        config, roof, gpus = self.config, self.rooflines, self.deployment.gpus
        if gpus == 1:
            return 0.0
        if self.deployment.tensor_parallel:
            moved = 2 * tokens * config.hidden_size * 2 * 2 * (gpus - 1) / gpus
        else:
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
