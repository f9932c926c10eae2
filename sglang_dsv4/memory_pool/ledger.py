"""The KV ledger: what one V4 request costs, per token of context and fixed per request.

Two layouts side by side, for any V4 config:

* the *reference* layout, DeepSeek's own serving layout, which the published figures
  describe (V4-Flash: 3,850 B/token, 14.7 MiB per request; V4-Pro: 5,511 B/token,
  22.2 MiB): FP8-packed KV entries, FP8 indexer keys, and the compressors' partial blocks
  kept as raw float32 rows;
* *ours*, read from :class:`~.layout.PoolLayout` — the definitions :class:`~.storage.V4PoolStorage`
  allocates from, so the figure a user reads is the figure the server uses: entries, window
  rows and indexer keys in the KV dtype (under FP8, the reference's rows, indexer keys padded from 132 to 144 B:
  :mod:`sglang_dsv4.kernels.kv_format`), the window as a per-request ring, and the compressor
  state as float32 online softmax pools (DESIGN.md, "The state of one request").

A third table, per GPU (:class:`RankLedger`): the weights each of ``tp`` ranks keeps
resident, read from :mod:`sglang_dsv4.model.weight_layout` (release formats and splits),
what ``--mem-fraction-static`` of an H200 leaves for the pools, and how many sessions of a
given length fit there. The KV pools are whole on every rank of an attention-TP group (one
KV head, replicated as MLA's latent is): its ``tp / attn_dp`` GPUs hold the *same*
sessions, so a GPU's distinct sessions are its pools' sessions over the attention-TP size.
Without attention DP that group is the whole TP group; with ``--attn-dp-size D`` each of
the D groups holds its own sessions.

``dsv4 ledger --config {flash,pro,PATH} [--tp N --attn-dp-size D --ep M --quantization fp8|none
--speculative-num-draft-tokens K]``
prints the tables (:func:`run`).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import ConfigError, DeepseekV4Config, check_tensor_parallel, load_config, named_config, parse_config
from ..kernels.kv_format import FP8, REFERENCE_KEY_ROW_ALIGNMENT, PoolFormats, pool_formats
from ..model.weight_layout import Parallelism, TensorSpec, checkpoint_tensors
from .layout import CHECKPOINT_WINDOWS_PER_REQUEST_ROW, PoolLayout

# The multi-token-prediction layer's weights (its experts included): what speculative decoding adds.
MTP_PART = "MTP layer (speculative decoding)"
KV_DTYPES = {"fp8": FP8, "bf16": torch.bfloat16, "fp32": torch.float32}
DEFAULT_CONTEXTS = (131072, 1048576)
# What nvidia-smi reports for one H200 (its datasheet's "141 GB").
H200_BYTES = 143771 * 2**20
DEFAULT_MEM_FRACTION_STATIC = 0.85
GPUS_PER_NODE = 8  # an H200 node
# --quantization: the release checkpoints' formats (FP8 dense, FP4 experts), or none (model dtype).
QUANTIZATIONS = {"fp8": True, "none": False}

# Reference KV entries and indexer keys: DeepSeek's FP8 rows (kernels/kv_format.py), the rows our pools store
# under --kv-cache-dtype fp8_e4m3. A KV entry: the non-rope dims in FP8 with one UE8M0 scale byte per 64 of
# them, the rope dims in BF16, one pad byte (448 + 64 * 2 + 7 + 1 = 584 bytes for head_dim 512, rope 64).
# An indexer key: FP8 values with one float32 scale per 128 of them (128 + 4 = 132 bytes for index_head_dim
# 128; an FP4 packing would be 128 / 2 + 128 / 32 = 68 bytes). Our pools pad a key row to 144 bytes
# (kv_format.KEY_ROW_ALIGNMENT: its codes load in 16-byte words), 63 B more per V4-Flash token.
# Reference compressor state, per request and layer, as raw float32 rows: a ratio-r
# compressor keeps the tokens of its partial block, each row holding the projected KV and
# its gate score (2 series); the overlapping ratio-4 compressor keeps two blocks' worth of
# rows (2 * r) and two halves per row, for the compressor and the indexer's compressor.
REFERENCE_STATE_BYTES = 4
SERIES = 2  # KV and score
OVERLAP = 2


@dataclass(frozen=True)
class ReferenceLayout:
    """DeepSeek's serving layout of a V4 config; the published figures are computed from it."""

    config: DeepseekV4Config

    @property
    def formats(self) -> PoolFormats:
        config = self.config
        return pool_formats(
            FP8, config.head_dim, config.rope_head_dim, config.index_head_dim, REFERENCE_KEY_ROW_ALIGNMENT
        )

    @property
    def entry_bytes(self) -> int:
        """One FP8-packed KV entry (a window row or a compressed entry): 584 B for V4."""
        return self.formats.entries.row_bytes

    @property
    def indexer_key_bytes(self) -> int:
        """One FP8 indexer key with its float32 scales: 132 B for V4."""
        return self.formats.indexer_keys.row_bytes

    @property
    def bytes_per_token(self) -> float:
        """Compressed entries (and, at ratio 4, indexer keys) per token of context."""
        config, total = self.config, 0.0
        for layer in range(config.num_layers):
            kind = config.layer_kind(layer)
            if kind == "csa":
                total += (self.entry_bytes + self.indexer_key_bytes) / config.csa_rate
            elif kind == "hca":
                total += self.entry_bytes / config.hca_rate
        return total

    @property
    def window_bytes_per_request(self) -> int:
        config = self.config
        return config.num_layers * config.sliding_window * self.entry_bytes

    @property
    def state_bytes_per_request(self) -> int:
        config, floats = self.config, 0
        for layer in range(config.num_layers):
            kind = config.layer_kind(layer)
            if kind == "csa":
                rows = OVERLAP * config.csa_rate
                floats += rows * SERIES * OVERLAP * (config.head_dim + config.index_head_dim)
            elif kind == "hca":
                floats += config.hca_rate * SERIES * config.head_dim
        return floats * REFERENCE_STATE_BYTES

    @property
    def running_bytes_per_request(self) -> int:
        """Fixed bytes per running request: every layer's window and the compressor states."""
        return self.window_bytes_per_request + self.state_bytes_per_request

    def bytes_for(self, context: int) -> float:
        return self.bytes_per_token * context + self.running_bytes_per_request


@dataclass(frozen=True)
class KVLedger:
    """A V4 config's memory in the reference layout and in ours (KV dtype ``kv_dtype``; under speculation,
    ``verify_tokens`` per verify forward, ours also holds the MTP layer's KV and the rollback records)."""

    config: DeepseekV4Config
    kv_dtype: torch.dtype = torch.bfloat16
    verify_tokens: int = 0

    @property
    def reference(self) -> ReferenceLayout:
        return ReferenceLayout(self.config)

    @property
    def ours(self) -> PoolLayout:
        return PoolLayout(self.config, self.kv_dtype, self.verify_tokens)

    @property
    def fixed_ratio(self) -> float:
        """Our fixed bytes per running request over the reference's."""
        return self.ours.running_bytes_per_request / self.reference.running_bytes_per_request

    def table(self, contexts: Sequence[int] = DEFAULT_CONTEXTS, title: str = "DeepSeek-V4") -> str:
        """The two layouts side by side: per token, fixed per request, total per context length."""
        config, reference, ours = self.config, self.reference, self.ours
        kinds = [config.layer_kind(layer) for layer in range(config.num_layers)]
        dtype_name = str(self.kv_dtype).removeprefix("torch.")
        rows = [
            ("", "reference", f"ours ({dtype_name})"),
            ("bytes per token", *(f"{layout.bytes_per_token:,.0f} B" for layout in (reference, ours))),
            ("fixed bytes per request", *(_mib(layout.running_bytes_per_request) for layout in (reference, ours))),
            ("  sliding window", *(_mib(layout.window_bytes_per_request) for layout in (reference, ours))),
            ("  compressor state", *(_mib(layout.state_bytes_per_request) for layout in (reference, ours))),
            *self._speculation_rows(),
            ("fixed per request / reference", "1", _three_digits(self.fixed_ratio)),
            ("one checkpoint (window + state)", "-", _mib(ours.checkpoint_bytes)),
            *(
                (f"total at {context:,} tokens", _gib(reference.bytes_for(context)), _gib(ours.bytes_for(context)))
                for context in contexts
            ),
        ]
        heading = (
            f"{title}: {config.num_layers} layers ({kinds.count('window')} window-only,"
            f" {kinds.count('csa')} ratio-{config.csa_rate}, {kinds.count('hca')} ratio-{config.hca_rate}),"
            f" window {config.sliding_window}"
        )
        reference_note = (
            f"reference: KV entries FP8-packed ({reference.entry_bytes} B), indexer keys FP8"
            f" ({reference.indexer_key_bytes} B), compressor state as raw float32 rows"
        )
        stored = f"in {dtype_name}"
        if ours.formats.quantized:
            stored = f"FP8-packed as the reference's (indexer keys padded to {ours.formats.indexer_keys.row_bytes} B)"
        ours_note = (
            f"ours: KV entries, window rows and indexer keys {stored}, window slots per token (a running request"
            " holds window + 1), compressor state as float32 online pools; the server also allocates"
            f" {CHECKPOINT_WINDOWS_PER_REQUEST_ROW} checkpoint windows and {ours.checkpoint_records_per_request_row}"
            f" checkpoint state records per request row for the prefix cache"
            f" ({_mib(ours.checkpoint_bytes_per_request)})"
        )
        lines = [heading, *_aligned(rows), reference_note, ours_note]
        if self.verify_tokens:
            lines.append(
                f"ours under speculation ({self.verify_tokens} tokens a verify forward): the MTP layer's KV in every"
                " per-token and window figure, and a running request's rollback records in its compressor state"
            )
        return "\n".join(lines)

    def _speculation_rows(self) -> list[tuple[str, str, str]]:
        """The rollback records' share of a running request's compressor state, under speculation."""
        ours = self.ours
        if not self.verify_tokens:
            return []
        rollback = ours.rollback_records_per_request_row * ours.record_bytes
        return [(f"    of it rollback records ({ours.rollback_records_per_request_row})", "-", _mib(rollback))]


@dataclass(frozen=True)
class RankLedger:
    """What one of ``parallel.tp`` GPUs holds: its shard of the weights and the KV pools' room.

    Routed experts: ``(n_routed_experts + redundant_experts) / ep`` slots a rank per MoE
    layer, SGLang's EP layout with ``--ep-num-redundant-experts``.
    """

    config: DeepseekV4Config
    parallel: Parallelism
    quantized: bool
    dtype: torch.dtype = torch.bfloat16
    kv_dtype: torch.dtype = torch.bfloat16
    redundant_experts: int = 0
    verify_tokens: int = 0

    @property
    def experts_per_rank(self) -> int:
        slots = self.config.n_routed_experts + self.redundant_experts
        if slots % self.parallel.ep:
            raise ValueError(
                f"n_routed_experts + redundant experts ({slots}) must divide over --ep-size {self.parallel.ep}"
            )
        return slots // self.parallel.ep

    def weight_bytes(self) -> dict[str, int]:
        """Resident weight bytes on one rank, by part (:data:`WEIGHT_PARTS`)."""
        check_tensor_parallel(self.config, self.parallel.tp, self.parallel.attn_dp)
        dtype_bytes = torch.empty(0, dtype=self.dtype).element_size()
        share = self.experts_per_rank / self.config.n_routed_experts  # exact: experts are equal in size
        parts = dict.fromkeys(WEIGHT_PARTS, 0.0)
        for spec in checkpoint_tensors(self.config, quantized=self.quantized):
            size = spec.bytes_on_rank(self.parallel, dtype_bytes)
            parts[_weight_part(spec)] += size * share if spec.expert else size
        return {name: round(size) for name, size in parts.items()}

    @property
    def kv(self) -> PoolLayout:
        return PoolLayout(self.config, self.kv_dtype, self.verify_tokens)

    def static_bytes(self, mem_fraction_static: float) -> float:
        """SGLang's static share of an H200: the weights and the pools."""
        return mem_fraction_static * H200_BYTES

    def pool_bytes(self, mem_fraction_static: float) -> float:
        """What SGLang's static share of an H200 leaves for the pools once the weights are in."""
        return self.static_bytes(mem_fraction_static) - sum(self.weight_bytes().values())

    def fits(self, mem_fraction_static: float) -> bool:
        """Whether the weights leave room for the pools in the static share."""
        return self.pool_bytes(mem_fraction_static) > 0

    def fitting_attention_tp_sizes(self, mem_fraction_static: float) -> list[int]:
        """The attention-TP sizes (divisors of ``tp``, smallest first) whose weights fit, the rest as here."""
        parallel, sizes = self.parallel, []
        for attention_tp in range(1, parallel.tp + 1):
            if parallel.tp % attention_tp:
                continue
            layout = Parallelism(parallel.tp, parallel.ep, parallel.tp // attention_tp)
            candidate = RankLedger(
                self.config, layout, self.quantized, self.dtype, self.kv_dtype, self.redundant_experts,
                self.verify_tokens,
            )
            try:
                if candidate.fits(mem_fraction_static):
                    sizes.append(attention_tp)
            except ValueError:  # heads or output groups that do not divide (ConfigError is one)
                continue
        return sizes

    @property
    def device_table_bytes(self) -> int:
        """A request row's request tables on the GPU, at the served context (the config's, SGLang's default)."""
        return self.kv.request_table_bytes(self.config.max_position_embeddings)

    def session_bytes(self, context: int) -> float:
        """One running session at ``context`` tokens with its share of the prefix cache's checkpoints,
        and its row's request tables."""
        return self.kv.bytes_per_token * context + self.kv.bytes_per_request + self.device_table_bytes

    def pool_sessions(self, mem_fraction_static: float, context: int) -> int:
        """Sessions of ``context`` tokens one GPU's pools hold (the same on every GPU of its attention-TP group)."""
        return max(0, math.floor(self.pool_bytes(mem_fraction_static) / self.session_bytes(context)))

    def host_session_bytes(self, context: int) -> int:
        """What a session evicted to the host tier keeps there: its blocks' entries and keys, and one checkpoint."""
        return math.ceil(self.kv.bytes_per_token * context) + self.kv.checkpoint_bytes

    def host_tier_bytes(self, mem_fraction_static: float, hicache_ratio: float, hicache_size_gb: float) -> float:
        """The host tier of one GPU's pools: ``--hicache-size`` GB, else ``--hicache-ratio`` times the pools' bytes
        (the tier mirrors their window slots, records and entry rows: all but the running requests' state)."""
        if hicache_size_gb > 0:
            return hicache_size_gb * 1e9
        return hicache_ratio * max(self.pool_bytes(mem_fraction_static), 0)

    def distinct_sessions_per_gpu(self, mem_fraction_static: float, context: int) -> float:
        """Sessions per GPU that no other GPU also holds: the pools' sessions over the attention-TP size."""
        return self.pool_sessions(mem_fraction_static, context) / self.parallel.attention_tp

    def distinct_sessions_per_node(self, mem_fraction_static: float, context: int) -> int:
        """Distinct sessions on a node of :data:`GPUS_PER_NODE` GPUs."""
        return self.pool_sessions(mem_fraction_static, context) * GPUS_PER_NODE // self.parallel.attention_tp

    def table(self, mem_fraction_static: float, contexts: Sequence[int], title: str, host_tier_bytes: float = 0) -> str:
        """``host_tier_bytes``: the host tier below one GPU's pools (``--enable-hierarchical-cache``; 0: none)."""
        weights = self.weight_bytes()
        pools = self.pool_bytes(mem_fraction_static)
        parallel, kv = self.parallel, self.kv
        formats = "FP8 dense, FP4 experts" if self.quantized else f"all {_dtype_name(self.dtype)}"
        attention_tp = parallel.attention_tp
        rows = [
            ("weights on one GPU", _gib(sum(weights.values()))),
            *((f"  {name} ({_split_of(name, parallel)})", _gib(size)) for name, size in weights.items()),
            (
                f"static memory ({mem_fraction_static} of an H200's {_gib(H200_BYTES)})",
                _gib(self.static_bytes(mem_fraction_static)),
            ),
            ("left for the KV pools", _gib(pools) if pools > 0 else "none: does not fit"),
            (
                f"KV bytes per token ({_dtype_name(self.kv_dtype)}, whole on each GPU of an attention-TP group)",
                f"{kv.bytes_per_token:,.0f} B",
            ),
            ("fixed bytes per request (running, with its checkpoints)", _mib(kv.bytes_per_request)),
            (
                f"request tables per request row ({self.config.max_position_embeddings:,} positions)",
                _mib(self.device_table_bytes),
            ),
        ]
        for context in contexts:
            sessions = self.pool_sessions(mem_fraction_static, context)
            rows += [
                (f"{context:,}-token sessions in one GPU's pools", f"{sessions:,}"),
                (
                    f"  distinct per GPU (/ attention-TP {attention_tp})",
                    _sessions(self.distinct_sessions_per_gpu(mem_fraction_static, context)),
                ),
                (
                    f"  distinct per node of {GPUS_PER_NODE} GPUs",
                    f"{self.distinct_sessions_per_node(mem_fraction_static, context):,}",
                ),
            ]
            if host_tier_bytes > 0:
                held = math.floor(host_tier_bytes / self.host_session_bytes(context))
                rows.append((f"  kept once evicted, in a host tier of {_gib(host_tier_bytes)}", f"{held:,}"))
        if parallel.attn_dp == 1:
            mode = (
                f"no attention DP: the {parallel.tp} GPUs of the TP group share their sessions (each holds all of them)"
            )
        else:
            mode = (
                f"attention DP {parallel.attn_dp}: each attention-TP group of {attention_tp} GPU(s) holds its own"
                " sessions"
            )
        heading = (
            f"{title} per GPU: tp {parallel.tp}, attention DP {parallel.attn_dp} (attention-TP {attention_tp}),"
            f" ep {parallel.ep} ({self.experts_per_rank} expert slots of {self.config.n_routed_experts} per MoE"
            f" layer), weights {formats}"
        )
        lines = [heading, *_aligned(rows), mode]
        if pools <= 0:
            lines.append(self._not_fitting(mem_fraction_static))
        return "\n".join(lines)

    def _not_fitting(self, mem_fraction_static: float) -> str:
        weights = sum(self.weight_bytes().values())
        sizes = self.fitting_attention_tp_sizes(mem_fraction_static)
        fitting = (
            ", ".join(f"{size} (--attn-dp-size {self.parallel.tp // size})" for size in sizes)
            if sizes
            else f"none at --tp {self.parallel.tp}"
        )
        return (
            f"does not fit: the weights ({_gib(weights)}) exceed the static share"
            f" ({_gib(self.static_bytes(mem_fraction_static))}); attention-TP sizes that fit: {fitting}"
        )


WEIGHT_PARTS = ("attention", "shared expert, routers, norms, mHC", "routed experts", "embedding", "head", MTP_PART)


def _weight_part(spec: TensorSpec) -> str:
    if spec.name.startswith("mtp."):
        return MTP_PART
    if spec.expert:
        return "routed experts"
    if spec.name == "embed.weight":
        return "embedding"
    if spec.name == "head.weight":
        return "head"
    if spec.name.startswith("layers.") and spec.name.split(".")[2] in ("attn", "attn_norm"):
        return "attention"
    return "shared expert, routers, norms, mHC"


def _split_of(part: str, parallel: Parallelism) -> str:
    """How a weight part is divided over the GPUs, as the table prints it."""
    splits = {
        "attention": f"heads / attention-TP {parallel.attention_tp}",
        "shared expert, routers, norms, mHC": f"shared expert / TP {parallel.tp}",
        "routed experts": f"/ EP {parallel.ep}" + (f", MoE-TP {parallel.moe_tp}" if parallel.moe_tp > 1 else ""),
        "embedding": "whole" if parallel.attn_dp > 1 else f"/ TP {parallel.tp}",
        "head": f"/ TP {parallel.tp}",
        MTP_PART: f"attention / attention-TP {parallel.attention_tp}, experts / EP {parallel.ep}",
    }
    return splits[part]


def _sessions(count: float) -> str:
    return f"{count:,.0f}" if count == int(count) else f"{count:,.1f}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def resolve_config(spec: str) -> DeepseekV4Config:
    """A shipped config by name (``flash``, ``pro``), else a checkpoint directory or a config.json path.

    Shipped names win; spell a local directory of the same name as a path (``./pro``).
    """
    try:
        return named_config(spec)
    except ConfigError as unknown_name:
        path = Path(spec)
        if path.is_dir():
            return load_config(path)
        if path.is_file():
            return parse_config(json.loads(path.read_text()))
        raise ConfigError(f"--config {spec!r}: no such file or directory, and {unknown_name}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", required=True, help="a shipped config (flash, pro), a checkpoint directory or a config.json"
    )
    parser.add_argument(
        "--kv-dtype", choices=list(KV_DTYPES), default="bf16", help="KV dtype of our layout (default: bf16)"
    )
    parser.add_argument(
        "--context",
        type=_context_length,
        nargs="+",
        default=list(DEFAULT_CONTEXTS),
        help="context lengths to total (default: 131072 1048576)",
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs (SGLang's --tp; default 1)")
    parser.add_argument(
        "--attn-dp-size",
        type=int,
        default=1,
        help="attention data-parallel groups (SGLang's --attn-dp-size): each of D groups of tp / D GPUs holds its"
        " own sessions (default 1: the whole TP group shares them)",
    )
    parser.add_argument("--ep", type=int, default=1, help="of those, expert-parallel (SGLang's --ep-size; default 1)")
    parser.add_argument(
        "--ep-num-redundant-experts", type=int, default=0, help="redundant expert slots per MoE layer (default 0)"
    )
    parser.add_argument(
        "--quantization",
        choices=list(QUANTIZATIONS),
        default="fp8",
        help="weights as released (fp8: FP8 dense, FP4 experts; the default) or none (all in bf16)",
    )
    parser.add_argument(
        "--speculative-num-draft-tokens",
        type=int,
        default=0,
        help="tokens a speculative verify forward runs per request (SGLang's flag; default 0: no speculation):"
        " the MTP layer's KV and each running request's rollback records join our layout",
    )
    parser.add_argument(
        "--enable-hierarchical-cache",
        action="store_true",
        help="a host tier below each GPU's pools (SGLang's flag): the sessions it keeps once evicted",
    )
    parser.add_argument(
        "--hicache-ratio", type=float, default=2.0, help="host bytes per device pool byte (SGLang's; default 2.0)"
    )
    parser.add_argument(
        "--hicache-size", type=float, default=0, help="host tier GB per GPU (SGLang's; overrides the ratio)"
    )
    parser.add_argument(
        "--mem-fraction-static",
        type=float,
        default=DEFAULT_MEM_FRACTION_STATIC,
        help=f"SGLang's static share of GPU memory, weights and pools (default {DEFAULT_MEM_FRACTION_STATIC})",
    )


def run(args: argparse.Namespace) -> None:
    try:
        config = resolve_config(args.config)
    except ConfigError as error:
        raise SystemExit(f"dsv4 ledger: {error}") from None
    title = f"DeepSeek-V4 {args.config}"
    if args.speculative_num_draft_tokens < 0:
        raise SystemExit("dsv4 ledger: --speculative-num-draft-tokens must be 0 or more")
    ledger = KVLedger(config, KV_DTYPES[args.kv_dtype], args.speculative_num_draft_tokens)
    try:
        rank = RankLedger(
            config,
            Parallelism(args.tp, args.ep, args.attn_dp_size),
            QUANTIZATIONS[args.quantization],
            kv_dtype=ledger.kv_dtype,
            redundant_experts=args.ep_num_redundant_experts,
            verify_tokens=ledger.verify_tokens,
        )
        host = 0.0
        if args.enable_hierarchical_cache:
            host = rank.host_tier_bytes(args.mem_fraction_static, args.hicache_ratio, args.hicache_size)
        per_gpu = rank.table(args.mem_fraction_static, args.context, title, host)
    except ValueError as error:
        raise SystemExit(f"dsv4 ledger: {error}") from None
    print(ledger.table(args.context, title=title))
    print()
    print(per_gpu)


def _context_length(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"context length {text!r} is not a positive integer")
    return value


def _aligned(rows: list[tuple[str, ...]]) -> list[str]:
    """Label column left-aligned, figure columns right-aligned, two spaces apart."""
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    return [
        "  ".join(
            [row[0].ljust(widths[0]), *(cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True))]
        )
        for row in rows
    ]


def _three_digits(value: float) -> str:
    """Three significant digits, without switching to exponent notation."""
    if value == 0:
        return "0"
    decimals = max(0, 2 - math.floor(math.log10(abs(value))))
    return f"{value:,.{decimals}f}"


def _mib(num_bytes: float) -> str:
    return f"{_three_digits(num_bytes / 2**20)} MiB"


def _gib(num_bytes: float) -> str:
    return f"{_three_digits(num_bytes / 2**30)} GiB"
