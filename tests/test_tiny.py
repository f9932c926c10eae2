"""The embedded tiny checkpoint: deterministic, every feature exercised, usable tokenizer."""

from __future__ import annotations

import hashlib
import math

from conftest import random_ids
from safetensors.torch import load_file

from sglang_dsv4 import load_config
from sglang_dsv4.tiny import build_checkpoint


def digest(path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


def test_build_is_deterministic_and_small(tmp_path, tiny_path):
    again = build_checkpoint(tmp_path / "again")
    assert digest(again) == digest(tiny_path)
    assert sum(f.stat().st_size for f in tiny_path.iterdir()) < 8 * 2**20


def test_config_keeps_every_v4_feature(tiny_path):
    config = load_config(tiny_path)
    kinds = {config.layer_kind(i) for i in range(config.num_layers)}
    assert kinds == {"window", "csa", "hca"} and config.hca_rate == 128
    assert 0 < config.num_hash_layers < config.num_layers  # hash-routed and gated MoE layers
    assert config.hc_mult == 4 and config.hc_sinkhorn_iters == 20
    assert config.index_n_heads >= 32 and config.yarn is not None


def test_feature_tensors_are_randomised(tiny_path):
    tensors = load_file(tiny_path / "model.safetensors")
    tid2eid = tensors["layers.0.ffn.gate.tid2eid"]
    assert tid2eid.unique().numel() == load_config(tiny_path).n_routed_experts
    assert all((row.unique().numel() == row.numel()) for row in tid2eid[:50])  # distinct experts per token
    for name in ("layers.1.attn.attn_sink", "layers.2.ffn.gate.bias", "layers.1.attn.compressor.ape", "hc_head_base"):
        assert tensors[name].std() > 0.1, name
    assert tensors["layers.0.hc_attn_scale"].std() > 0.05 and tensors["hc_head_scale"].item() != 1.0


def test_swiglu_limit_clamps(tiny_model):
    ids = random_ids(200, tiny_model.config.vocab_size, seed=40)
    clamped = tiny_model(ids, tiny_model.new_state())
    for block in tiny_model.layers:
        block.ffn.experts.limit = block.ffn.shared_experts.limit = math.inf
    try:
        unclamped = tiny_model(ids, tiny_model.new_state())
    finally:
        for block in tiny_model.layers:
            block.ffn.experts.limit = block.ffn.shared_experts.limit = tiny_model.config.swiglu_limit
    assert (clamped - unclamped).abs().max() > 0.1


def test_next_token_distributions_are_peaked(tiny_model):
    logits = tiny_model(random_ids(400, tiny_model.config.vocab_size, seed=41), tiny_model.new_state())
    top2 = logits.topk(2, dim=-1).values
    margins = top2[:, 0] - top2[:, 1]
    assert (margins > 1e-2).float().mean() > 0.9, f"median top-1 margin {margins.median():.3g}"


def test_tokenizer_loads_and_renders_agent_chats(tiny_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    config = load_config(tiny_path)
    assert len(tokenizer) == config.vocab_size
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (config.bos_token_id, config.eos_token_id)
    text = "def fix(path):\n    return open(path).read()  # ünïcode ✓"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    messages = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "List the files."},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": '{"cmd": "ls"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "README.md"},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<｜begin▁of▁sentence｜>You are a coding agent.<｜User｜>List the files.<｜Assistant｜>"
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>bash<｜tool▁sep｜>{"cmd": "ls"}<｜tool▁call▁end｜>'
        "<｜tool▁calls▁end｜><｜end▁of▁sentence｜><｜tool▁output▁begin｜>README.md<｜tool▁output▁end｜><｜Assistant｜>"
    )
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"]
    assert ids[0] == config.bos_token_id and max(ids) < config.vocab_size
