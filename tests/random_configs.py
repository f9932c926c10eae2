"""Seeded small random DeepSeek-V4 configs, across the architecture's degrees of freedom.

:func:`random_v4_config` draws head counts and dims, the rotary share, LoRA ranks, output groups,
the layer-kind order (window-only, ratio-4 and ratio-HCA layers in any order, one MTP layer, sometimes with
its entry at the end of ``compress_ratios``), 1-3 hash layers, expert counts, top-k and intermediate sizes off the 32/64/128
grid, indexer heads (>= 32: fewer make exact ReLU ties, DESIGN.md) / dims / top-k, the sliding
window, a clamping ``swiglu_limit``, in the release or the HF spelling, and leaves some keys out so
that transformers' defaults fill them in. Weights come from :func:`sglang_dsv4.tiny.build_checkpoint`
(randomised ``tid2eid``, sinks, biases, mHC scales, a head gain for clear top-1 margins).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from sglang_dsv4.tiny import build_checkpoint

_LAYER_TYPE = {0: "sliding_attention", 4: "compressed_sparse_attention"}
_HCA_LAYER_TYPE = "heavily_compressed_attention"


def random_v4_config(seed: int) -> dict[str, Any]:
    """A config.json dict transformers' ``DeepseekV4Config`` accepts and this package can serve."""
    rng = random.Random(seed)
    hf_spelling = rng.random() < 0.5
    num_layers = rng.randint(2, 5)
    # Declared HCA rates other than 128 only exist in the HF spelling (transformers maps legacy
    # compress_ratios through a fixed {0, 4, 128} table).
    hca_rate = rng.choice([128, 128, 16, 32]) if hf_spelling else 128
    ratios = [rng.choice([0, 4, hca_rate]) for _ in range(num_layers)]
    csa_layer, hca_layer = rng.sample(range(num_layers), 2)
    ratios[csa_layer], ratios[hca_layer] = 4, hca_rate
    num_heads = rng.choice([1, 2, 3, 4, 6, 8])
    head_dim = rng.choice([16, 24, 32, 48, 64])
    rope_dim = _rope_dim(rng, head_dim)
    num_experts = rng.randint(2, 12)
    raw: dict[str, Any] = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": rng.choice([384, 512]),
        "hidden_size": rng.choice([32, 40, 48, 56, 64, 72]),
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": 1,
        "head_dim": head_dim,
        "q_lora_rank": rng.randint(8, 48),
        "o_groups": rng.choice([d for d in range(1, num_heads + 1) if num_heads % d == 0]),
        "o_lora_rank": rng.randint(8, 48),
        "index_n_heads": rng.choice([32, 40, 48, 64]),
        "index_head_dim": rng.randrange(max(rope_dim, 8), 65, 2),
        "index_topk": rng.randint(1, 24),
        "n_routed_experts": num_experts,
        "num_experts_per_tok": rng.randint(1, min(4, num_experts)),
        "moe_intermediate_size": rng.randint(8, 80),
    }
    num_hash = rng.randint(1, min(3, num_layers))
    optional = {
        "sliding_window": rng.choice([8, 16, 24, 32, 64]),
        "swiglu_limit": round(rng.uniform(0.3, 3.0), 3),
        "routed_scaling_factor": round(rng.uniform(0.5, 3.0), 3),
        "n_shared_experts": 1,
        "hc_mult": rng.choice([2, 3, 4]),
        "hc_sinkhorn_iters": rng.choice([3, 10, 20]),
        "hc_eps": rng.choice([1e-6, 1e-5]),
        "rms_norm_eps": rng.choice([1e-6, 1e-5]),
        "rope_theta": rng.choice([10000.0, 50000.0]),
        "compress_rope_theta": rng.choice([40000.0, 160000.0]),
        "scoring_func": "sqrtsoftplus",
        "norm_topk_prob": True,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
        "max_position_embeddings": 65536,
    }
    # Each optional key is left to transformers' default with probability 1/4.
    raw.update({key: value for key, value in optional.items() if rng.random() >= 0.25})
    yarn = (
        {
            "factor": rng.choice([4, 16]),
            "original_max_position_embeddings": rng.choice([64, 256, 4096]),
            "beta_fast": 32,
            "beta_slow": 1,
        }
        if rng.random() < 0.6
        else None
    )
    if hf_spelling:
        _spell_hf(raw, rng, ratios, hca_rate, num_hash, rope_dim, yarn)
    else:
        _spell_release(raw, rng, ratios, num_hash, rope_dim, yarn)
    return raw


def build_random_checkpoint(out_dir: Path, seed: int) -> tuple[Path, dict[str, Any]]:
    """Config :func:`random_v4_config` (``seed``) with random weights and a tokenizer, in the release layout."""
    raw = random_v4_config(seed)
    return build_checkpoint(out_dir, raw, seed=seed), raw


def _rope_dim(rng: random.Random, head_dim: int) -> int:
    # transformers keeps the rotary share as a float factor and truncates head_dim * factor; a
    # pair where that loses a dim would make transformers disagree with the config, not with us.
    while True:
        rope_dim = rng.randrange(2, head_dim + 1, 2)
        if int(head_dim * (rope_dim / head_dim)) == rope_dim:
            return rope_dim


def _spell_release(raw, rng, ratios, num_hash, rope_dim, yarn) -> None:
    raw["num_nextn_predict_layers"] = 1
    if rng.random() < 0.4:  # the MTP layer's entry at the end, as the released configs have it
        ratios = ratios + [rng.choice([0, 4, 128])]
    raw["compress_ratios"] = ratios
    if num_hash != min(3, raw["num_hidden_layers"]) or rng.random() < 0.5:
        raw["num_hash_layers"] = num_hash
    if rope_dim * 8 != raw["head_dim"] or rng.random() < 0.5:
        raw["qk_rope_head_dim"] = rope_dim
    if yarn is not None:
        raw["rope_scaling"] = {"type": "yarn", **yarn}


def _spell_hf(raw, rng, ratios, hca_rate, num_hash, rope_dim, yarn) -> None:
    raw["num_nextn_predict_layers"] = 1
    raw["layer_types"] = [_LAYER_TYPE.get(ratio, _HCA_LAYER_TYPE) for ratio in ratios]
    if hca_rate != 128 or rng.random() < 0.5:
        raw["compress_rates"] = {"compressed_sparse_attention": 4, "heavily_compressed_attention": hca_rate}
    raw["mlp_layer_types"] = ["hash_moe"] * num_hash + ["moe"] * (raw["num_hidden_layers"] - num_hash)
    if rope_dim * 8 != raw["head_dim"] or rng.random() < 0.5:
        raw["partial_rotary_factor"] = rope_dim / raw["head_dim"]
    if yarn is not None:
        if rng.random() < 0.5:
            raw["rope_parameters"] = {"rope_type": "yarn", **yarn}
        else:
            # Nested, as transformers writes it: each part carries its rotary share.
            share = {"partial_rotary_factor": rope_dim / raw["head_dim"]}
            main = {"rope_type": "default", "rope_theta": raw.get("rope_theta", 10000.0), **share}
            compress = {"rope_type": "yarn", "rope_theta": raw.get("compress_rope_theta", 160000.0), **yarn, **share}
            compress["attention_factor"] = 1.0
            raw["rope_parameters"] = {"main": main, "compress": compress}
            raw.update(share)
