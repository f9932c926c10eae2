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
from dataclasses import dataclass
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
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    num_hash_layers: int
    routed_scaling_factor: float
    norm_topk_prob: bool
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

    def layer_kind(self, layer: int) -> str:
        """``"window"``, ``"csa"`` (ratio-4 with indexer) or ``"hca"`` (ratio-128, all entries)."""
        ratio = self.compress_ratios[layer]
        if ratio == WINDOW_ONLY:
            return "window"
        return "csa" if ratio == self.csa_rate else "hca"

    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.num_hash_layers

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


def parse_config(raw: dict[str, Any]) -> DeepseekV4Config:
    """Build a validated config from a release-style or HF-style ``config.json`` dict."""
    reader = _Reader(raw)
    num_layers = reader.positive_int("num_hidden_layers")
    csa_rate, hca_rate = _compression_rates(reader)
    if "compress_ratios" in raw:
        compress_ratios = _release_compress_ratios(reader, num_layers, csa_rate, hca_rate)
        num_hash_layers = reader.int("num_hash_layers", default=3, minimum=0)
    elif "layer_types" in raw:
        compress_ratios = _hf_compress_ratios(reader, num_layers, csa_rate, hca_rate)
        num_hash_layers = _hf_num_hash_layers(reader, num_layers)
    else:
        raise ConfigError("missing required key 'compress_ratios' (release style) or 'layer_types' (HF style)")
    if num_hash_layers > num_layers:
        raise ConfigError(f"'num_hash_layers' is {num_hash_layers}, above 'num_hidden_layers' ({num_layers})")

    hidden_size = reader.positive_int("hidden_size")
    num_heads = reader.positive_int("num_attention_heads")
    head_dim = reader.positive_int("head_dim")
    rope_head_dim = _rope_head_dim(reader, head_dim)
    o_groups = reader.positive_int("o_groups")
    _require_divides("o_groups", o_groups, "num_attention_heads", num_heads)
    scoring = reader.str("scoring_func", default="sqrtsoftplus")
    if scoring not in _SCORING_FUNCS:
        raise ConfigError(f"'scoring_func' is {scoring!r}; allowed: {list(_SCORING_FUNCS)}")
    num_experts = reader.positive_int("n_routed_experts")
    top_k = reader.positive_int("num_experts_per_tok")
    if top_k > num_experts:
        raise ConfigError(f"'num_experts_per_tok' ({top_k}) exceeds 'n_routed_experts' ({num_experts})")
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
        n_shared_experts=reader.int("n_shared_experts", default=1, minimum=0),
        num_experts_per_tok=top_k,
        moe_intermediate_size=reader.positive_int("moe_intermediate_size"),
        num_hash_layers=num_hash_layers,
        routed_scaling_factor=reader.float("routed_scaling_factor", default=1.0),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        swiglu_limit=reader.float("swiglu_limit", default=math.inf),
        hc_mult=reader.positive_int("hc_mult"),
        hc_sinkhorn_iters=reader.positive_int("hc_sinkhorn_iters"),
        hc_eps=reader.float("hc_eps", default=1e-6),
        rms_norm_eps=reader.float("rms_norm_eps", default=1e-6),
        rope_theta=rope_theta,
        compress_rope_theta=compress_rope_theta,
        yarn=yarn,
        max_position_embeddings=reader.positive_int("max_position_embeddings"),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=_first_eos(raw.get("eos_token_id")),
    )


class _Reader:
    """Typed access to a raw config dict, with errors that name the key."""

    def __init__(self, raw: dict[str, Any]):
        self.raw = raw

    def require(self, key: str) -> Any:
        if key not in self.raw or self.raw[key] is None:
            raise ConfigError(f"missing required key {key!r}")
        return self.raw[key]

    def int(self, key: str, *, default: int | None = None, minimum: int = 0) -> int:
        value = self.raw.get(key, default) if default is not None else self.require(key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key!r} must be an integer, got {value!r}")
        if value < minimum:
            raise ConfigError(f"{key!r} must be >= {minimum}, got {value}")
        return value

    def positive_int(self, key: str) -> int:
        return self.int(key, minimum=1)

    def float(self, key: str, *, default: float) -> float:
        value = self.raw.get(key, default)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key!r} must be a number, got {value!r}")
        return float(value)

    def str(self, key: str, *, default: str) -> str:
        value = self.raw.get(key, default)
        if not isinstance(value, str):
            raise ConfigError(f"{key!r} must be a string, got {value!r}")
        return value


def _compression_rates(reader: _Reader) -> tuple[int, int]:
    """The CSA (overlapping) and HCA (disjoint) rates: 4 and 128 unless the config declares others."""
    rates = reader.raw.get("compress_rates") or {}
    if not isinstance(rates, dict):
        raise ConfigError(f"'compress_rates' must be a mapping of layer type to rate, got {rates!r}")
    csa = rates.get("compressed_sparse_attention", reader.raw.get("compress_rate_csa", CSA_RATE))
    hca = rates.get("heavily_compressed_attention", reader.raw.get("compress_rate_hca", HCA_RATE))
    if csa != CSA_RATE:
        raise ConfigError(f"'compress_rates.compressed_sparse_attention' is {csa!r}; allowed: {CSA_RATE}")
    if not isinstance(hca, int) or isinstance(hca, bool) or hca <= CSA_RATE:
        raise ConfigError(
            f"'compress_rates.heavily_compressed_attention' is {hca!r}; allowed: an integer above {CSA_RATE}"
        )
    return csa, hca


def _release_compress_ratios(reader: _Reader, num_layers: int, csa: int, hca: int) -> tuple[int, ...]:
    ratios = reader.require("compress_ratios")
    if not isinstance(ratios, list):
        raise ConfigError(f"'compress_ratios' must be a list, got {ratios!r}")
    mtp_layers = reader.int("num_nextn_predict_layers", default=0, minimum=0)
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


def _hf_compress_ratios(reader: _Reader, num_layers: int, csa: int, hca: int) -> tuple[int, ...]:
    layer_types = reader.require("layer_types")
    _require_length("layer_types", layer_types, num_layers)
    rate_of = {"window": WINDOW_ONLY, "csa": csa, "hca": hca}
    ratios = []
    for layer, layer_type in enumerate(layer_types):
        if layer_type not in _HF_LAYER_TYPES:
            raise ConfigError(f"'layer_types[{layer}]' is {layer_type!r}; allowed: {list(_HF_LAYER_TYPES)}")
        ratios.append(rate_of[_HF_LAYER_TYPES[layer_type]])
    return tuple(ratios)


def _hf_num_hash_layers(reader: _Reader, num_layers: int) -> int:
    mlp_types = reader.raw.get("mlp_layer_types")
    if mlp_types is None:
        return reader.int("num_hash_layers", default=3, minimum=0)
    _require_length("mlp_layer_types", mlp_types, num_layers)
    for layer, mlp_type in enumerate(mlp_types):
        if mlp_type not in _HF_MLP_LAYER_TYPES:
            raise ConfigError(f"'mlp_layer_types[{layer}]' is {mlp_type!r}; allowed: {list(_HF_MLP_LAYER_TYPES)}")
    num_hash = sum(1 for t in mlp_types if t == "hash_moe")
    if list(mlp_types[:num_hash]) != ["hash_moe"] * num_hash:
        raise ConfigError("'mlp_layer_types': every 'hash_moe' layer must come before the first 'moe' layer")
    return num_hash


def _rope_head_dim(reader: _Reader, head_dim: int) -> int:
    if "qk_rope_head_dim" in reader.raw:
        rope_dim = reader.positive_int("qk_rope_head_dim")
    elif reader.raw.get("partial_rotary_factor") is not None:
        rope_dim = int(head_dim * reader.float("partial_rotary_factor", default=0.0))
    else:
        raise ConfigError("missing required key 'qk_rope_head_dim' (or HF's 'partial_rotary_factor')")
    if rope_dim % 2 or rope_dim > head_dim or rope_dim <= 0:
        raise ConfigError(f"'qk_rope_head_dim' is {rope_dim}; allowed: an even number in [2, head_dim={head_dim}]")
    return rope_dim


def _rope(reader: _Reader) -> tuple[float, float, YarnScaling | None]:
    """(plain theta, compressed layers' theta, YaRN of compressed layers) from either spelling."""
    params = reader.raw.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("compress"), dict):
        main, compress = params.get("main") or {}, params["compress"]
        theta = float(main.get("rope_theta", reader.float("rope_theta", default=10000.0)))
        compress_theta = float(compress.get("rope_theta", reader.float("compress_rope_theta", default=160000.0)))
        scaling = compress
    else:
        theta = reader.float("rope_theta", default=10000.0)
        compress_theta = reader.float("compress_rope_theta", default=160000.0)
        scaling = reader.raw.get("rope_scaling") or params or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in ("default", None):
        return theta, compress_theta, None
    if kind != "yarn":
        raise ConfigError(f"'rope_scaling.type' is {kind!r}; allowed: 'yarn' or none")
    for key in ("factor", "original_max_position_embeddings"):
        if key not in scaling:
            raise ConfigError(f"missing required key 'rope_scaling.{key}' for YaRN")
    yarn = YarnScaling(
        factor=float(scaling["factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        beta_fast=float(scaling.get("beta_fast") or 32.0),
        beta_slow=float(scaling.get("beta_slow") or 1.0),
    )
    return theta, compress_theta, yarn


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
