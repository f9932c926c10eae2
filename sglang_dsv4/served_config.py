"""The config a V4 checkpoint is served with: its own ``config.json``, never SGLang's reading of it.

SGLang 0.5.23 reads ``model_type: deepseek_v4`` through a ``DeepseekV3Config`` alias with V3's defaults (a
``config.json`` without ``routed_scaling_factor`` reads 2.5 there, 1.5 in transformers' ``DeepseekV4Config``;
without ``hidden_size``, 7168 against 4096), and on a CPU device its model runner pads unaligned dimensions
into that object (``adjust_config_with_unaligned_cpu_tp``). So a hook on SGLang's ``get_config``
(:func:`attach_checkpoint_config`) keeps the checkpoint's ``config.json`` — with ``--json-model-override-args``
over it, a user's deliberate change, applied as SGLang applies it — on the config object SGLang passes around,
and everything the plugin builds (the network, the pools, the expert-location plan) reads :func:`served_config`:
that dict parsed with transformers' defaults, exactly as ``load_model`` parses the same file. SGLang's object
gets the same values under the release keys its own V4 code reads (:func:`release_keys`).
"""

from __future__ import annotations

from typing import Any

from .config import ConfigError, DeepseekV4Config, parse_config

ARCHITECTURE = "DeepseekV4ForCausalLM"
CHECKPOINT_CONFIG = "dsv4_checkpoint_config"
"""The attribute of SGLang's config object that holds the checkpoint's config dict (overrides applied)."""
_MERGED_OVERRIDES = ("rope_scaling", "rope_parameters")


def is_v4_checkpoint(hf_config: Any) -> bool:
    return ARCHITECTURE in (getattr(hf_config, "architectures", None) or [])


def with_overrides(raw: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``config.json`` with ``--json-model-override-args`` over it, key by key as SGLang's ``get_config`` does:
    a dict given for ``rope_scaling`` / ``rope_parameters`` updates the checkpoint's, any other value replaces it."""
    merged = dict(raw)
    for key, value in overrides.items():
        current = merged.get(key)
        if key in _MERGED_OVERRIDES and isinstance(value, dict) and isinstance(current, dict):
            merged[key] = {**current, **value}
        else:
            merged[key] = value
    return merged


def attach_checkpoint_config(
    hf_config: Any,
    model: str,
    trust_remote_code: bool = False,
    revision: str | None = None,
    model_override_args: dict | None = None,
    model_config_parser: str = "auto",
    **kwargs: Any,
) -> None:
    """AFTER hook on SGLang's ``get_config``: a V4 config object gets the checkpoint's own config dict."""
    if not is_v4_checkpoint(hf_config):
        return
    from transformers import PretrainedConfig

    raw, _ = PretrainedConfig.get_config_dict(model, revision=revision, **kwargs)
    source = with_overrides(raw, model_override_args or {})
    setattr(hf_config, CHECKPOINT_CONFIG, source)
    try:
        config = parse_config(source)
    except ConfigError:
        return  # the launcher refuses it, naming the key (plugin._server_arg_overrides)
    for key, value in release_keys(config).items():
        setattr(hf_config, key, value)


def release_keys(config: DeepseekV4Config) -> dict[str, Any]:
    """The architecture in release (hub) keys, which SGLang's own V4 code reads off its config object (an HF-style
    config.json has no ``compress_ratios`` or ``qk_rope_head_dim``; an absent size would read V3's default)."""
    return {
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": 1,
        "head_dim": config.head_dim,
        "qk_rope_head_dim": config.rope_head_dim,
        "q_lora_rank": config.q_lora_rank,
        "o_groups": config.o_groups,
        "o_lora_rank": config.o_lora_rank,
        "sliding_window": config.sliding_window,
        "compress_ratios": list(config.compress_ratios),
        "index_n_heads": config.index_n_heads,
        "index_head_dim": config.index_head_dim,
        "index_topk": config.index_topk,
        "n_routed_experts": config.n_routed_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "moe_intermediate_size": config.moe_intermediate_size,
        "num_hash_layers": config.num_hash_layers,
        "routed_scaling_factor": config.routed_scaling_factor,
        "swiglu_limit": config.swiglu_limit,
        "hc_mult": config.hc_mult,
        "hc_sinkhorn_iters": config.hc_sinkhorn_iters,
        "max_position_embeddings": config.max_position_embeddings,
    }


def served_config(hf_config: Any) -> DeepseekV4Config:
    """The V4 config the server builds from, given the config object SGLang loaded."""
    raw = getattr(hf_config, CHECKPOINT_CONFIG, None)
    if raw is None:
        raise RuntimeError(
            f"sglang-dsv4: this {type(hf_config).__name__} was not loaded through SGLang's get_config with the "
            "plugin's hook, so the checkpoint's config.json is unknown (is the plugin registered?)"
        )
    return parse_config(raw)
