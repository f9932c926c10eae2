"""The DeepSeek-V4 architecture as one typed, validated config.

Two spellings of the same architecture reach us:

* release style (DeepSeek's own ``config.json``): per-layer ``compress_ratios``
  (0 / 4 / 128), ``num_hash_layers``, ``qk_rope_head_dim``, ``rope_scaling``;
* Hugging Face style (what transformers' ``save_pretrained`` writes): ``layer_types``,
  ``compress_rates``, ``mlp_layer_types``, ``partial_rotary_factor``, nested
  ``rope_parameters`` keyed ``main`` / ``compress``.

:func:`parse_config` reads either and raises :class:`ConfigError` naming the key and
what is allowed when the input is not a V4 architecture we can run.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

WINDOW_ONLY = 0
CSA_RATE = 4
HCA_RATE = 128

_HF_LAYER_TYPES = {
    "sliding_attention": "window",
    "compressed_sparse_attention": "csa",
    "heavily_compressed_attention": "hca",
}
_HF_MLP_LAYER_TYPES = ("hash_moe", "moe")
_SCORING_FUNCS = ("sqrtsoftplus",)


class ConfigError(ValueError):
    """A V4 config that cannot be run; the message names the key and what is allowed."""


@dataclass(frozen=True)
class YarnScaling:
    """YaRN parameters of the compressed layers' rope (window-only layers use plain rope)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class DeepseekV4Config:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    # Per layer: 0 (window only), ``csa_rate`` (overlapping, with indexer) or ``hca_rate``.
    compress_ratios: tuple[int, ...]
    csa_rate: int
    hca_rate: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    num_hash_layers: int
    routed_scaling_factor: float
    swiglu_limit: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    rope_theta: float
    compress_rope_theta: float
    yarn: YarnScaling | None
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_id: int | None
    # Edge of the square blocks of a block-quantized checkpoint (FP8: 128); None when unquantized.
    weight_block: int | None
    # Multi-token-prediction layers (``num_nextn_predict_layers``: 0 or 1), numbered after the main layers as
    # DeepSeek's reference numbers them (layer ``num_layers`` is ``mtp.0``), and their compress ratios (the
    # extra ``compress_ratios`` entries; 0, window only, where the config gives none, as the releases have it).
    num_mtp_layers: int
    mtp_compress_ratios: tuple[int, ...]

    def layer_kind(self, layer: int) -> str:
        """``"window"``, ``"csa"`` (ratio-4 with indexer) or ``"hca"`` (ratio-128, all entries); ``layer`` may be
        an MTP layer's number (``num_layers + i``)."""
        ratio = (self.compress_ratios + self.mtp_compress_ratios)[layer]
        if ratio == WINDOW_ONLY:
            return "window"
        return "csa" if ratio == self.csa_rate else "hca"

    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.num_hash_layers

    def without_mtp(self) -> DeepseekV4Config:
        """The same network with no MTP layer (for a checkpoint that holds none, and the served model, which
        drafts nothing yet)."""
        return replace(self, num_mtp_layers=0, mtp_compress_ratios=())

    def layer_name(self, layer: int) -> str:
        """The release prefix of layer ``layer``'s tensors: ``layers.N``, or ``mtp.I`` for MTP layer
        ``num_layers + I``."""
        return f"layers.{layer}" if layer < self.num_layers else f"mtp.{layer - self.num_layers}"

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.rope_head_dim


def load_config(model_dir: str | Path) -> DeepseekV4Config:
    """Read ``config.json`` from a checkpoint directory."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: no config.json in the checkpoint directory")
    return parse_config(json.loads(path.read_text()))


def named_config(name: str) -> DeepseekV4Config:
    """A config shipped with the package: ``"flash"`` (DeepSeek-V4-Flash)."""
    shipped = resources.files("sglang_dsv4.configs")
    names = sorted(p.name.removesuffix(".json") for p in shipped.iterdir() if p.name.endswith(".json"))
    if name not in names:
        raise ConfigError(f"no shipped config {name!r}; shipped: {names}")
    return parse_config(json.loads(shipped.joinpath(f"{name}.json").read_text()))


# transformers 5.19's ``DeepseekV4Config`` defaults: a key a config.json leaves out means
# the same network here as in transformers (tests/test_random_configs.py builds HF's config
# from the same dicts and compares).
DEFAULTS: dict[str, Any] = {
    "vocab_size": 129280,
    "hidden_size": 4096,
    "num_hidden_layers": 43,
    "num_attention_heads": 64,
    "head_dim": 512,
    "partial_rotary_factor": 64 / 512,
    "q_lora_rank": 1024,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "sliding_window": 128,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 2048,
    "num_hash_layers": 3,
    "num_nextn_predict_layers": 1,
    "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5,
    "norm_topk_prob": True,
    "swiglu_limit": 10.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "max_position_embeddings": 1048576,
    "bos_token_id": 0,
    "eos_token_id": 1,
}


def parse_config(raw: dict[str, Any]) -> DeepseekV4Config:
    """Build a validated config from a release-style or HF-style ``config.json`` dict.

    Where both spellings of a key are present, transformers' precedence holds:
    ``layer_types`` over ``compress_ratios``, ``mlp_layer_types`` over ``num_hash_layers``,
    ``partial_rotary_factor`` over ``qk_rope_head_dim``.
    """
    reader = _Reader(raw)
    num_layers = reader.positive_int("num_hidden_layers")
    csa_rate, hca_rate = _compression_rates(reader)
    compress_ratios = _compress_ratios(reader, num_layers, csa_rate, hca_rate)
    num_mtp_layers = reader.int("num_nextn_predict_layers")
    if num_mtp_layers > 1:
        raise ConfigError(
            f"'num_nextn_predict_layers' is {num_mtp_layers}; allowed: 0 or 1 (V4 releases carry one MTP layer)"
        )
    num_hash_layers = _num_hash_layers(reader, num_layers)

    hidden_size = reader.positive_int("hidden_size")
    num_heads = reader.positive_int("num_attention_heads")
    head_dim = reader.positive_int("head_dim")
    rope_head_dim = _rope_head_dim(reader, head_dim)
    o_groups = reader.positive_int("o_groups")
    _require_divides("o_groups", o_groups, "num_attention_heads", num_heads)
    scoring = reader.str("scoring_func")
    if scoring not in _SCORING_FUNCS:
        raise ConfigError(f"'scoring_func' is {scoring!r}; allowed: {list(_SCORING_FUNCS)}")
    num_experts = reader.positive_int("n_routed_experts")
    top_k = reader.positive_int("num_experts_per_tok")
    if top_k > num_experts:
        raise ConfigError(f"'num_experts_per_tok' ({top_k}) exceeds 'n_routed_experts' ({num_experts})")
    if reader.int("n_shared_experts") != 1:
        raise ConfigError(
            f"'n_shared_experts' is {reader.value('n_shared_experts')}; allowed: 1 (transformers' DeepseekV4 builds one "
            "shared expert of 'moe_intermediate_size' whatever the key says; DeepSeek's reference, that many)"
        )
    if not reader.bool("norm_topk_prob"):
        raise ConfigError(
            "'norm_topk_prob' is false; allowed: true (V4 renormalises the chosen experts' weights, as "
            "transformers' DeepseekV4 does whatever the key says)"
        )
    rope_theta, compress_rope_theta, yarn = _rope(reader)

    return DeepseekV4Config(
        vocab_size=reader.positive_int("vocab_size"),
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        head_dim=head_dim,
        rope_head_dim=rope_head_dim,
        q_lora_rank=reader.positive_int("q_lora_rank"),
        o_groups=o_groups,
        o_lora_rank=reader.positive_int("o_lora_rank"),
        sliding_window=reader.positive_int("sliding_window"),
        compress_ratios=compress_ratios,
        csa_rate=csa_rate,
        hca_rate=hca_rate,
        index_n_heads=reader.positive_int("index_n_heads"),
        index_head_dim=_even(reader, "index_head_dim", minimum=rope_head_dim),
        index_topk=reader.positive_int("index_topk"),
        n_routed_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=reader.positive_int("moe_intermediate_size"),
        num_hash_layers=num_hash_layers,
        routed_scaling_factor=reader.float("routed_scaling_factor"),
        swiglu_limit=reader.float("swiglu_limit"),
        hc_mult=reader.positive_int("hc_mult"),
        hc_sinkhorn_iters=reader.positive_int("hc_sinkhorn_iters"),
        hc_eps=reader.float("hc_eps"),
        rms_norm_eps=reader.float("rms_norm_eps"),
        rope_theta=rope_theta,
        compress_rope_theta=compress_rope_theta,
        yarn=yarn,
        max_position_embeddings=reader.positive_int("max_position_embeddings"),
        bos_token_id=reader.raw.get("bos_token_id", DEFAULTS["bos_token_id"]),
        eos_token_id=_first_eos(reader.raw.get("eos_token_id", DEFAULTS["eos_token_id"])),
        weight_block=_weight_block(reader),
        num_mtp_layers=num_mtp_layers,
        mtp_compress_ratios=_mtp_compress_ratios(reader, num_layers, num_mtp_layers),
    )


def check_tensor_parallel(config: DeepseekV4Config, tp_size: int, attn_dp_size: int = 1) -> None:
    """Refuse a parallel layout that does not divide what it splits: V4 is never padded.

    Query heads and output-projection groups are split over the attention-TP group
    (``tp_size / attn_dp_size`` ranks, SGLang's ``--attn-dp-size``; the whole TP group without
    attention DP); the experts' intermediate dimension over the whole TP group (the shared
    expert runs there, the routed experts on its MoE-TP part), in whole quantization blocks
    when the checkpoint is block-quantized (``quantization_config.weight_block_size``).
    """
    if tp_size < 1:
        raise ConfigError(f"the tensor-parallel size must be >= 1, got {tp_size}")
    if attn_dp_size < 1 or tp_size % attn_dp_size:
        raise ConfigError(f"--attn-dp-size ({attn_dp_size}) must divide --tp ({tp_size}), both at least 1")
    attention_tp = tp_size // attn_dp_size
    per_rank = f"tp = {tp_size}"
    per_attention_rank = per_rank
    if attn_dp_size > 1:
        per_attention_rank = f"attention-TP = tp / attn-dp-size = {tp_size} / {attn_dp_size} = {attention_tp}"
    per_block = f"tp x weight block = {tp_size} x {config.weight_block} = {tp_size * (config.weight_block or 1)}"
    splits = (
        ("num_attention_heads", config.num_heads, attention_tp, per_attention_rank),
        ("o_groups", config.o_groups, attention_tp, per_attention_rank),
        (
            "moe_intermediate_size",
            config.moe_intermediate_size,
            tp_size * (config.weight_block or 1),
            per_block if config.weight_block else per_rank,
        ),
    )
    for key, value, divisor, divisor_name in splits:
        if value % divisor:
            raise ConfigError(
                f"{key!r} ({value}) is not divisible by {divisor_name}: DeepSeek-V4 splits it over those "
                "ranks and never pads it; choose a --tp (or --attn-dp-size) that divides it"
            )


class _Reader:
    """Typed access to a raw config dict, with errors that name the key; absent keys read as :data:`DEFAULTS`."""

    def __init__(self, raw: dict[str, Any]):
        self.raw = raw

    def value(self, key: str) -> Any:
        value = self.raw.get(key)
        return DEFAULTS[key] if value is None else value

    def int(self, key: str, *, minimum: int = 0) -> int:
        value = self.value(key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key!r} must be an integer, got {value!r}")
        if value < minimum:
            raise ConfigError(f"{key!r} must be >= {minimum}, got {value}")
        return value

    def positive_int(self, key: str) -> int:
        return self.int(key, minimum=1)

    def float(self, key: str) -> float:
        value = self.value(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key!r} must be a number, got {value!r}")
        return float(value)

    def bool(self, key: str) -> bool:
        value = self.value(key)
        if not isinstance(value, bool):
            raise ConfigError(f"{key!r} must be true or false, got {value!r}")
        return value

    def str(self, key: str) -> str:
        value = self.value(key)
        if not isinstance(value, str):
            raise ConfigError(f"{key!r} must be a string, got {value!r}")
        return value


def _compression_rates(reader: _Reader) -> tuple[int, int]:
    """The CSA (overlapping) and HCA (disjoint) rates: 4 and 128 unless the config declares others.

    Top-level ``compress_rate_csa`` / ``compress_rate_hca`` (older configs) win over
    ``compress_rates``, as in transformers.
    """
    rates = reader.raw.get("compress_rates") or {}
    if not isinstance(rates, dict):
        raise ConfigError(f"'compress_rates' must be a mapping of layer type to rate, got {rates!r}")
    csa = reader.raw.get("compress_rate_csa", rates.get("compressed_sparse_attention", CSA_RATE))
    hca = reader.raw.get("compress_rate_hca", rates.get("heavily_compressed_attention", HCA_RATE))
    if csa != CSA_RATE:
        raise ConfigError(f"'compress_rates.compressed_sparse_attention' is {csa!r}; allowed: {CSA_RATE}")
    if not isinstance(hca, int) or isinstance(hca, bool) or hca <= CSA_RATE:
        raise ConfigError(
            f"'compress_rates.heavily_compressed_attention' is {hca!r}; allowed: an integer above {CSA_RATE}"
        )
    return csa, hca


def _compress_ratios(reader: _Reader, num_layers: int, csa: int, hca: int) -> tuple[int, ...]:
    """Per-layer rates from ``layer_types``, else ``compress_ratios``, else transformers' default
    schedule (two HCA layers, then HCA and CSA alternating)."""
    if reader.raw.get("layer_types") is not None:
        return _hf_compress_ratios(reader, num_layers, csa, hca)
    if reader.raw.get("compress_ratios") is not None:
        return _release_compress_ratios(reader, num_layers, csa, hca)
    return tuple(hca if layer < 2 or layer % 2 == 0 else csa for layer in range(num_layers))


def _release_compress_ratios(reader: _Reader, num_layers: int, csa: int, hca: int) -> tuple[int, ...]:
    ratios = reader.raw["compress_ratios"]
    if not isinstance(ratios, list):
        raise ConfigError(f"'compress_ratios' must be a list, got {ratios!r}")
    mtp_layers = reader.int("num_nextn_predict_layers")
    allowed_lengths = sorted({num_layers, num_layers + mtp_layers})
    if len(ratios) not in allowed_lengths:
        raise ConfigError(
            f"'compress_ratios' has {len(ratios)} entries; 'num_hidden_layers' is {num_layers}"
            f" (allowed lengths: {allowed_lengths}, the extra entries being the MTP layers')"
        )
    allowed = (WINDOW_ONLY, csa, hca)
    for layer, ratio in enumerate(ratios):
        if ratio not in allowed:
            raise ConfigError(f"'compress_ratios[{layer}]' is {ratio!r}; allowed: {list(allowed)}")
    return tuple(int(r) for r in ratios[:num_layers])


def _mtp_compress_ratios(reader: _Reader, num_layers: int, num_mtp_layers: int) -> tuple[int, ...]:
    """The MTP layers' entries at the end of release-style ``compress_ratios``, else window only."""
    ratios = reader.raw.get("compress_ratios")
    if reader.raw.get("layer_types") is None and isinstance(ratios, list) and len(ratios) == num_layers + num_mtp_layers:
        return tuple(int(r) for r in ratios[num_layers:])
    return (WINDOW_ONLY,) * num_mtp_layers


def _hf_compress_ratios(reader: _Reader, num_layers: int, csa: int, hca: int) -> tuple[int, ...]:
    layer_types = reader.raw["layer_types"]
    _require_length("layer_types", layer_types, num_layers)
    rate_of = {"window": WINDOW_ONLY, "csa": csa, "hca": hca}
    ratios = []
    for layer, layer_type in enumerate(layer_types):
        if layer_type not in _HF_LAYER_TYPES:
            raise ConfigError(f"'layer_types[{layer}]' is {layer_type!r}; allowed: {list(_HF_LAYER_TYPES)}")
        ratios.append(rate_of[_HF_LAYER_TYPES[layer_type]])
    return tuple(ratios)


def _num_hash_layers(reader: _Reader, num_layers: int) -> int:
    """From ``mlp_layer_types``, else ``num_hash_layers`` (by default 3, or every layer of a shallower model)."""
    mlp_types = reader.raw.get("mlp_layer_types")
    if mlp_types is None:
        if reader.raw.get("num_hash_layers") is None:
            return min(DEFAULTS["num_hash_layers"], num_layers)
        num_hash = reader.int("num_hash_layers")
        if num_hash > num_layers:
            raise ConfigError(f"'num_hash_layers' is {num_hash}, above 'num_hidden_layers' ({num_layers})")
        return num_hash
    _require_length("mlp_layer_types", mlp_types, num_layers)
    for layer, mlp_type in enumerate(mlp_types):
        if mlp_type not in _HF_MLP_LAYER_TYPES:
            raise ConfigError(f"'mlp_layer_types[{layer}]' is {mlp_type!r}; allowed: {list(_HF_MLP_LAYER_TYPES)}")
    num_hash = sum(1 for t in mlp_types if t == "hash_moe")
    if list(mlp_types[:num_hash]) != ["hash_moe"] * num_hash:
        raise ConfigError("'mlp_layer_types': every 'hash_moe' layer must come before the first 'moe' layer")
    return num_hash


def _rope_head_dim(reader: _Reader, head_dim: int) -> int:
    """``head_dim * partial_rotary_factor`` (truncated, as transformers does), else ``qk_rope_head_dim``."""
    if reader.raw.get("partial_rotary_factor") is None and reader.raw.get("qk_rope_head_dim") is not None:
        rope_dim = reader.positive_int("qk_rope_head_dim")
    else:
        rope_dim = int(head_dim * reader.float("partial_rotary_factor"))
    if rope_dim % 2 or rope_dim > head_dim or rope_dim <= 0:
        raise ConfigError(f"'qk_rope_head_dim' is {rope_dim}; allowed: an even number in [2, head_dim={head_dim}]")
    return rope_dim


def _rope(reader: _Reader) -> tuple[float, float, YarnScaling | None]:
    """(plain theta, compressed layers' theta, YaRN of compressed layers) from either spelling."""
    params = reader.raw.get("rope_parameters")
    nested = isinstance(params, dict) and isinstance(params.get("compress"), dict)
    if nested:
        main, compress = params.get("main") or {}, params["compress"]
        theta = float(main.get("rope_theta", reader.float("rope_theta")))
        compress_theta = float(compress.get("rope_theta", reader.float("compress_rope_theta")))
        scaling = compress
    else:
        theta = reader.float("rope_theta")
        compress_theta = reader.float("compress_rope_theta")
        scaling = reader.raw.get("rope_scaling") or params or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in ("default", None):
        return theta, compress_theta, None
    if kind != "yarn":
        raise ConfigError(f"'rope_scaling.type' is {kind!r}; allowed: 'yarn' or none")
    for key in ("factor", "original_max_position_embeddings"):
        if key not in scaling:
            raise ConfigError(f"missing required key 'rope_scaling.{key}' for YaRN")
    attention_factor = _yarn_attention_factor(scaling, nested)
    if attention_factor != 1.0:
        raise ConfigError(
            f"'rope_parameters.compress.attention_factor' is {attention_factor:.6g} (given, or transformers' YaRN "
            "default for a nested rope_parameters without it); allowed: 1.0 (V4 does not rescale attention)"
        )
    yarn = YarnScaling(
        factor=float(scaling["factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        beta_fast=float(scaling.get("beta_fast") or 32.0),
        beta_slow=float(scaling.get("beta_slow") or 1.0),
    )
    return theta, compress_theta, yarn


def _yarn_attention_factor(scaling: dict[str, Any], nested: bool) -> float:
    """The factor transformers scales YaRN's cos/sin by: as given; else 1.0 for a flat (release) spelling,
    which its DeepseekV4Config sets; else YaRN's default ``0.1 ln(factor) + 1`` (or its mscale ratio)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    if not nested:
        return 1.0

    def mscale(factor: float, scale: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0

    factor, scale, scale_all_dims = float(scaling["factor"]), scaling.get("mscale"), scaling.get("mscale_all_dim")
    if scale and scale_all_dims:
        return mscale(factor, scale) / mscale(factor, scale_all_dims)
    return mscale(factor)


def _weight_block(reader: _Reader) -> int | None:
    """The block edge of ``quantization_config.weight_block_size`` (square blocks), None when unquantized."""
    quantization = reader.raw.get("quantization_config") or {}
    block = quantization.get("weight_block_size") if isinstance(quantization, dict) else None
    if block is None:
        return None
    if not isinstance(block, list) or not 1 <= len(block) <= 2 or len(set(block)) != 1:
        raise ConfigError(f"'quantization_config.weight_block_size' is {block!r}; allowed: [B] or [B, B]")
    if isinstance(block[0], bool) or not isinstance(block[0], int) or block[0] < 1:
        raise ConfigError(f"'quantization_config.weight_block_size' is {block!r}; allowed: positive integers")
    return block[0]


def _even(reader: _Reader, key: str, *, minimum: int) -> int:
    value = reader.positive_int(key)
    if value % 2 or value < minimum:
        raise ConfigError(f"{key!r} is {value}; allowed: an even number >= {minimum} (the rope dims)")
    return value


def _require_length(key: str, values: Any, num_layers: int) -> None:
    if not isinstance(values, list):
        raise ConfigError(f"{key!r} must be a list, got {values!r}")
    if len(values) != num_layers:
        raise ConfigError(f"{key!r} has {len(values)} entries; 'num_hidden_layers' is {num_layers}")


def _require_divides(divisor_key: str, divisor: int, key: str, value: int) -> None:
    if value % divisor:
        raise ConfigError(f"{divisor_key!r} ({divisor}) must divide {key!r} ({value})")


def _first_eos(eos: Any) -> int | None:
    return eos[0] if isinstance(eos, list) and eos else eos
