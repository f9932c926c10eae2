"""Every tensor of a V4 checkpoint: its release name, shape, stored format and split over ranks.

The one definition of where a V4 model's weights live. For a config it lists, under the
release names, what a release checkpoint holds (:func:`checkpoint_tensors`) and how each
tensor is divided over ``tp`` tensor-parallel and ``ep`` expert-parallel ranks:

* attention query heads and output groups over the attention TP group — ``wq_b`` and
  ``wo_a`` by rows (column-parallel), ``wo_b`` by columns (row-parallel), the sinks by
  head; the single KV head, the compressors and the indexer stay whole on every rank,
  as MLA keeps its latent KV (the indexer's heads too: its top-k needs the score summed
  over all of them, and an all-reduce of ``tokens x context/4`` scores per layer would
  cost more than the replicated ``wq_b``);
* the output head by vocabulary rows over all ``tp`` ranks (padded to whole rows per rank, as
  SGLang's vocab-parallel layers pad them), the embedding too without attention DP and whole
  on every rank with it (each DP rank embeds its own tokens, as upstream's DeepSeek models do);
* routed experts whole over the ``ep`` ranks (``n_routed_experts / ep`` each), and inside
  each expert the intermediate dimension over the remaining ``tp / ep`` ranks (SGLang's
  MoE TP); the shared expert's intermediate dimension over all ``tp`` ranks;
* routers, norms and mHC everywhere.

Formats are the release checkpoint's (V4-Flash / V4-Pro): FP8 E4M3 dense projections with
one float32 scale per 128 x 128 block, FP4 e2m1 routed experts (two values a byte) with one
power-of-two byte per 32 inputs, the rest in the model's dtype. Unquantized (``quantized=
False``), every floating tensor is in the model's dtype, as the tiny checkpoint stores them.
A rank holds each tensor as stored except ``wo_a``, which the grouped output projection reads
directly (not through a linear method) and so holds dequantized in the model's dtype.

The weight ledger (:mod:`sglang_dsv4.memory_pool.ledger`) sums these per rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from ..config import DeepseekV4Config

FP8_BLOCK = 128  # FP8 weights: one scale per FP8_BLOCK x FP8_BLOCK block
FP4_BLOCK = 32  # FP4 experts: one scale per FP4_BLOCK inputs of a row
FP8_SCALE_BYTES = 4  # float32
FP4_SCALE_BYTES = 1  # UE8M0, a power of two
INDEX_BYTES = 8  # tid2eid: int64, as the router keeps it


class Format(Enum):
    """How a tensor is stored: ``model`` in the serving dtype, or quantized with block scales."""

    MODEL = "model dtype"
    FP8 = "fp8 e4m3, 128x128 block scales"
    FP4 = "fp4 e2m1, 1x32 block scales"
    INDEX = "int64"


class Split(Enum):
    """Which dimension a tensor is cut along, over which ranks."""

    REPLICATED = "whole on every rank"
    VOCABULARY = "vocabulary rows over the tensor-parallel ranks, padded"
    EMBEDDING = "vocabulary rows over the tensor-parallel ranks, padded; whole on every rank under attention DP"
    ROWS = "rows over the tensor-parallel ranks"
    COLUMNS = "columns over the tensor-parallel ranks"
    ATTENTION_ROWS = "rows over the attention-TP ranks"
    ATTENTION_COLUMNS = "columns over the attention-TP ranks"
    EXPERT_ROWS = "whole experts over EP, rows over the MoE-TP ranks"
    EXPERT_COLUMNS = "whole experts over EP, columns over the MoE-TP ranks"


@dataclass(frozen=True)
class TensorSpec:
    name: str  # release name
    shape: tuple[int, ...]
    format: Format
    split: Split
    # What the split dimension is cut into: whole query heads, output groups, rows.
    unit: tuple[int, str] = (1, "rows")
    # How a rank holds it, where that is not as stored (dequantized at load).
    resident: Format | None = None

    def bytes_on_rank(self, parallel: Parallelism, dtype_bytes: int) -> int:
        """Resident bytes of this tensor (and its scales) on one rank."""
        rows, columns = self.local_shape(parallel)
        held = self.resident or self.format
        if held is Format.FP8:
            return rows * columns + math.ceil(rows / FP8_BLOCK) * math.ceil(columns / FP8_BLOCK) * FP8_SCALE_BYTES
        if held is Format.FP4:
            return rows * columns // 2 + rows * math.ceil(columns / FP4_BLOCK) * FP4_SCALE_BYTES
        element = INDEX_BYTES if held is Format.INDEX else dtype_bytes
        return rows * columns * element

    def local_shape(self, parallel: Parallelism) -> tuple[int, int]:
        """``(rows, columns)`` held by one rank (a 1-D tensor is one row)."""
        rows, columns = (1, self.shape[0]) if len(self.shape) == 1 else self.shape
        if self.split is Split.VOCABULARY or (self.split is Split.EMBEDDING and parallel.attn_dp == 1):
            return -(-rows // parallel.tp), columns
        if self.split is Split.ROWS:
            return self._part(rows, parallel.tp), columns
        if self.split is Split.COLUMNS:
            return rows, self._part(columns, parallel.tp)
        if self.split is Split.ATTENTION_ROWS:
            return self._part(rows, parallel.attention_tp), columns
        if self.split is Split.ATTENTION_COLUMNS:
            return rows, self._part(columns, parallel.attention_tp)
        if self.split is Split.EXPERT_ROWS:
            return self._part(rows, parallel.moe_tp), columns
        if self.split is Split.EXPERT_COLUMNS:
            return rows, self._part(columns, parallel.moe_tp)
        return rows, columns

    def _part(self, size: int, ranks: int) -> int:
        width, what = self.unit
        if (size // width) % ranks:
            raise ValueError(
                f"{self.name}: {self.split.value}, but its {size // width} {what} do not divide over {ranks}"
            )
        return size // ranks

    @property
    def expert(self) -> bool:
        return self.split in (Split.EXPERT_ROWS, Split.EXPERT_COLUMNS)


@dataclass(frozen=True)
class Parallelism:
    """``tp`` tensor-parallel ranks, ``ep`` of which split the routed experts (SGLang's ``--ep-size``),
    in ``attn_dp`` attention data-parallel groups (SGLang's ``--attn-dp-size``)."""

    tp: int = 1
    ep: int = 1
    attn_dp: int = 1

    def __post_init__(self) -> None:
        if self.tp < 1 or self.ep < 1 or self.tp % self.ep:
            raise ValueError(f"--ep-size ({self.ep}) must divide --tp ({self.tp}), both at least 1")
        if self.attn_dp < 1 or self.tp % self.attn_dp:
            raise ValueError(f"--attn-dp-size ({self.attn_dp}) must divide --tp ({self.tp}), both at least 1")

    @property
    def attention_tp(self) -> int:
        """Ranks of one attention-TP group: they split the query heads and hold the same requests' KV."""
        return self.tp // self.attn_dp

    @property
    def moe_tp(self) -> int:
        """Ranks that split each expert's intermediate dimension."""
        return self.tp // self.ep


def checkpoint_tensors(config: DeepseekV4Config, *, quantized: bool) -> list[TensorSpec]:
    """Every tensor of the network and its MTP layer (``mtp.0.*``, if the config has one), routed experts one
    spec per expert."""
    dense = Format.FP8 if quantized else Format.MODEL
    experts = Format.FP4 if quantized else Format.MODEL
    hidden, vocab = config.hidden_size, config.vocab_size
    specs = [TensorSpec("embed.weight", (vocab, hidden), Format.MODEL, Split.EMBEDDING)]
    for layer in range(config.num_layers):
        specs += _block(config, layer, dense, experts)
    specs += _mhc(config, "hc_head", sublayer=False)
    specs += [
        TensorSpec("norm.weight", (hidden,), Format.MODEL, Split.REPLICATED),
        TensorSpec("head.weight", (vocab, hidden), Format.MODEL, Split.VOCABULARY),
    ]
    for layer in range(config.num_layers, config.num_layers + config.num_mtp_layers):
        specs += _multi_token_prediction(config, layer, dense, experts)
    return specs


def attention_tensors(config: DeepseekV4Config, layer: int, *, quantized: bool) -> list[TensorSpec]:
    """Layer ``layer``'s attention tensors (its norm, projections, compressors and indexer)."""
    return _attention(config, layer, Format.FP8 if quantized else Format.MODEL)


def _block(config: DeepseekV4Config, layer: int, dense: Format, experts: Format) -> list[TensorSpec]:
    prefix = config.layer_name(layer)
    return [
        *_attention(config, layer, dense),
        *_feed_forward(config, layer, dense, experts),
        *_mhc(config, f"{prefix}.hc_attn", sublayer=True),
        *_mhc(config, f"{prefix}.hc_ffn", sublayer=True),
    ]


def _multi_token_prediction(config: DeepseekV4Config, layer: int, dense: Format, experts: Format) -> list[TensorSpec]:
    """The MTP layer: its input norms and projections, one block, its own ``hc_head`` and norm (the embedding and
    head are the target's). ``e_proj`` / ``h_proj`` are dense projections, FP8 in the release format."""
    prefix, hidden = config.layer_name(layer), config.hidden_size
    return [
        TensorSpec(f"{prefix}.enorm.weight", (hidden,), Format.MODEL, Split.REPLICATED),
        TensorSpec(f"{prefix}.hnorm.weight", (hidden,), Format.MODEL, Split.REPLICATED),
        TensorSpec(f"{prefix}.e_proj.weight", (hidden, hidden), dense, Split.REPLICATED),
        TensorSpec(f"{prefix}.h_proj.weight", (hidden, hidden), dense, Split.REPLICATED),
        *_block(config, layer, dense, experts),
        *_mhc(config, f"{prefix}.hc_head", sublayer=False),
        TensorSpec(f"{prefix}.norm.weight", (hidden,), Format.MODEL, Split.REPLICATED),
    ]


def _attention(config: DeepseekV4Config, layer: int, dense: Format) -> list[TensorSpec]:
    prefix = config.layer_name(layer)
    heads, head_dim, q_rank = config.num_heads, config.head_dim, config.q_lora_rank
    hidden, groups, o_rank = config.hidden_size, config.o_groups, config.o_lora_rank
    specs = [
        TensorSpec(f"{prefix}.attn_norm.weight", (hidden,), Format.MODEL, Split.REPLICATED),
        TensorSpec(f"{prefix}.attn.wq_a.weight", (q_rank, hidden), dense, Split.REPLICATED),
        TensorSpec(f"{prefix}.attn.q_norm.weight", (q_rank,), Format.MODEL, Split.REPLICATED),
        TensorSpec(
            f"{prefix}.attn.wq_b.weight", (heads * head_dim, q_rank), dense, Split.ATTENTION_ROWS, (head_dim, "heads")
        ),
        TensorSpec(f"{prefix}.attn.wkv.weight", (head_dim, hidden), dense, Split.REPLICATED),
        TensorSpec(f"{prefix}.attn.kv_norm.weight", (head_dim,), Format.MODEL, Split.REPLICATED),
        TensorSpec(
            f"{prefix}.attn.wo_a.weight",
            (groups * o_rank, heads * head_dim // groups),
            dense,
            Split.ATTENTION_ROWS,
            (o_rank, "output groups"),
            # Read by the grouped output projection's einsum, not through a linear method: held in the model
            # dtype (as upstream does without its FP8 einsum).
            resident=Format.MODEL,
        ),
        TensorSpec(
            f"{prefix}.attn.wo_b.weight",
            (hidden, groups * o_rank),
            dense,
            Split.ATTENTION_COLUMNS,
            (o_rank, "output groups"),
        ),
        TensorSpec(f"{prefix}.attn.attn_sink", (heads,), Format.MODEL, Split.ATTENTION_COLUMNS, (1, "heads")),
    ]
    kind = config.layer_kind(layer)
    if kind == "window":
        return specs
    ratio = config.csa_rate if kind == "csa" else config.hca_rate
    specs += _compressor(config, f"{prefix}.attn.compressor", head_dim, ratio, overlapping=kind == "csa")
    if kind == "csa":
        index_heads, index_dim = config.index_n_heads, config.index_head_dim
        specs += [
            TensorSpec(
                f"{prefix}.attn.indexer.wq_b.weight", (index_heads * index_dim, q_rank), dense, Split.REPLICATED
            ),
            TensorSpec(
                f"{prefix}.attn.indexer.weights_proj.weight", (index_heads, hidden), Format.MODEL, Split.REPLICATED
            ),
        ]
        specs += _compressor(config, f"{prefix}.attn.indexer.compressor", index_dim, ratio, overlapping=True)
    return specs


def _compressor(config: DeepseekV4Config, prefix: str, dim: int, ratio: int, overlapping: bool) -> list[TensorSpec]:
    width = (2 if overlapping else 1) * dim
    return [
        TensorSpec(f"{prefix}.wkv.weight", (width, config.hidden_size), Format.MODEL, Split.REPLICATED),
        TensorSpec(f"{prefix}.wgate.weight", (width, config.hidden_size), Format.MODEL, Split.REPLICATED),
        TensorSpec(f"{prefix}.ape", (ratio, width), Format.MODEL, Split.REPLICATED),
        TensorSpec(f"{prefix}.norm.weight", (dim,), Format.MODEL, Split.REPLICATED),
    ]


def _feed_forward(config: DeepseekV4Config, layer: int, dense: Format, experts: Format) -> list[TensorSpec]:
    prefix, hidden, inner = config.layer_name(layer), config.hidden_size, config.moe_intermediate_size
    router = (
        TensorSpec(f"{prefix}.ffn.gate.tid2eid", (config.vocab_size, config.num_experts_per_tok), Format.INDEX,
                   Split.REPLICATED)
        if config.is_hash_layer(layer)
        else TensorSpec(f"{prefix}.ffn.gate.bias", (config.n_routed_experts,), Format.MODEL, Split.REPLICATED)
    )  # fmt: skip
    specs = [
        TensorSpec(f"{prefix}.ffn_norm.weight", (hidden,), Format.MODEL, Split.REPLICATED),
        TensorSpec(f"{prefix}.ffn.gate.weight", (config.n_routed_experts, hidden), Format.MODEL, Split.REPLICATED),
        router,
    ]
    for expert in range(config.n_routed_experts):
        name = f"{prefix}.ffn.experts.{expert}"
        specs += [
            TensorSpec(f"{name}.w1.weight", (inner, hidden), experts, Split.EXPERT_ROWS),
            TensorSpec(f"{name}.w2.weight", (hidden, inner), experts, Split.EXPERT_COLUMNS),
            TensorSpec(f"{name}.w3.weight", (inner, hidden), experts, Split.EXPERT_ROWS),
        ]
    return [
        *specs,
        TensorSpec(f"{prefix}.ffn.shared_experts.w1.weight", (inner, hidden), dense, Split.ROWS),
        TensorSpec(f"{prefix}.ffn.shared_experts.w2.weight", (hidden, inner), dense, Split.COLUMNS),
        TensorSpec(f"{prefix}.ffn.shared_experts.w3.weight", (inner, hidden), dense, Split.ROWS),
    ]


def _mhc(config: DeepseekV4Config, stem: str, sublayer: bool) -> list[TensorSpec]:
    """mHC mixing weights: a sublayer's pre, post and residual maps, or the head's collapse."""
    n = config.hc_mult
    outputs, scales = ((2 + n) * n, 3) if sublayer else (n, 1)
    return [
        TensorSpec(f"{stem}_fn", (outputs, n * config.hidden_size), Format.MODEL, Split.REPLICATED),
        TensorSpec(f"{stem}_base", (outputs,), Format.MODEL, Split.REPLICATED),
        TensorSpec(f"{stem}_scale", (scales,), Format.MODEL, Split.REPLICATED),
    ]
