"""The network against Hugging Face transformers' DeepseekV4ForCausalLM on the same checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import assert_close_to_scale, hf_logits, load_hf, random_ids

from sglang_dsv4 import load_config, load_model
from sglang_dsv4.tiny import build_checkpoint

# A second architecture used by no other test: HF-style config, a declared HCA rate of 16,
# a 32-token window, one hash layer, two window-only layers.
OTHER_CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 512,
    "hidden_size": 48,
    "num_hidden_layers": 5,
    "layer_types": [
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "sliding_attention",
        "compressed_sparse_attention",
        "sliding_attention",
    ],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    "mlp_layer_types": ["hash_moe", "moe", "moe", "moe", "moe"],
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "partial_rotary_factor": 0.25,
    "q_lora_rank": 24,
    "o_groups": 2,
    "o_lora_rank": 16,
    "sliding_window": 32,
    "index_n_heads": 32,
    "index_head_dim": 16,
    "index_topk": 6,
    "n_routed_experts": 6,
    "n_shared_experts": 1,
    "num_experts_per_tok": 3,
    "moe_intermediate_size": 24,
    "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 2.0,
    "swiglu_limit": 0.7,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "compress_rope_theta": 40000.0,
    "rope_parameters": {
        "rope_type": "yarn",
        "factor": 8,
        "original_max_position_embeddings": 256,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 8192,
    "bos_token_id": 0,
    "eos_token_id": 1,
}

LOGIT_TOLERANCE = 1e-4  # of the logit scale


@pytest.fixture(scope="module")
def other_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("other"), OTHER_CONFIG, seed=7)


def test_tiny_full_sequence_logits_match_hf(tiny_path, tiny_model, hf_tiny):
    ids = random_ids(640, tiny_model.config.vocab_size, seed=1)
    config = load_config(tiny_path)
    # The indexer really selects: more ratio-4 entries are visible than it keeps.
    assert len(ids) // config.csa_rate > 4 * config.index_topk
    assert len(ids) // config.hca_rate >= 4
    logits = tiny_model(ids, tiny_model.new_state())
    assert_close_to_scale(logits, hf_logits(hf_tiny, ids), LOGIT_TOLERANCE)


def test_second_architecture_logits_match_hf(other_path):
    model, hf = load_model(other_path), load_hf(other_path)
    assert model.config.hca_rate == 16 and model.config.sliding_window == 32
    ids = random_ids(300, model.config.vocab_size, seed=2)
    assert_close_to_scale(model(ids, model.new_state()), hf_logits(hf, ids), LOGIT_TOLERANCE)


def test_prefill_then_decode_matches_hf_full_forward(tiny_model, hf_tiny):
    ids = random_ids(300, tiny_model.config.vocab_size, seed=3)
    state = tiny_model.new_state()
    steps = [tiny_model(ids[:260], state)] + [tiny_model(ids[i : i + 1], state) for i in range(260, 300)]
    assert state.position == 300
    assert_close_to_scale(torch.cat(steps), hf_logits(hf_tiny, ids), LOGIT_TOLERANCE)


def test_chunked_prefill_off_block_boundaries_matches_hf(tiny_model, hf_tiny):
    ids = random_ids(420, tiny_model.config.vocab_size, seed=4)
    state = tiny_model.new_state()
    chunks = [tiny_model(ids[:250], state), tiny_model(ids[250:400], state), tiny_model(ids[400:403], state)]
    chunks += [tiny_model(ids[i : i + 1], state) for i in range(403, 420)]
    assert_close_to_scale(torch.cat(chunks), hf_logits(hf_tiny, ids), LOGIT_TOLERANCE)


def test_hf_incremental_decoding_agrees_with_its_full_forward(tiny_model, hf_tiny):
    """The oracle is consistent with itself across a 128-token compression boundary."""
    ids = random_ids(140, tiny_model.config.vocab_size, seed=5)
    full = hf_logits(hf_tiny, ids)
    with torch.no_grad():
        out = hf_tiny(ids[None, :120], use_cache=True)
        steps = [out.logits[0]]
        cache = out.past_key_values
        for i in range(120, 140):
            out = hf_tiny(ids[None, i : i + 1], past_key_values=cache, use_cache=True)
            steps.append(out.logits[0])
    assert_close_to_scale(torch.cat(steps), full, LOGIT_TOLERANCE)
