"""The embedded tiny checkpoint: deterministic, every feature exercised, usable tokenizer."""

from __future__ import annotations

import hashlib
import json
import math

import pytest
import torch
from conftest import random_ids
from safetensors.torch import load_file

from sglang_dsv4 import load_config, load_model
from sglang_dsv4.chat_template import DSML, SPECIAL_TOKENS, TOOLS_CLOSING
from sglang_dsv4.model.block_formats import FP4_BLOCK, FP8_BLOCK
from sglang_dsv4.model.loader import release_state_dict
from sglang_dsv4.model.weight_layout import Format, checkpoint_tensors
from sglang_dsv4.tiny import RELEASE_QUANTIZATION, build_checkpoint, random_model


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


def test_tokenizer_round_trips_text_and_keeps_the_configs_ids(tiny_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    config = load_config(tiny_path)
    assert len(tokenizer) == config.vocab_size
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (config.bos_token_id, config.eos_token_id)
    text = "def fix(path):\n    return open(path).read()  # ünïcode ✓"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


AGENT_CHAT = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "List the files, then count them."},
    {
        "role": "assistant",
        "content": "Listing.",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": {"command": "ls", "depth": 2}}},
            {"id": "c2", "type": "function", "function": {"name": "read", "arguments": {"opts": {"all": True}}}},
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "README.md\nsetup.py"},
    {"role": "tool", "tool_call_id": "c2", "content": "[]"},
    {"role": "assistant", "content": "Two files."},
    {"role": "user", "content": "Thanks."},
]
TOOLS = [
    {
        "type": "function",
        "function": {"name": "bash", "description": "Run a command.", "parameters": {"type": "object"}},
    },
    {"type": "function", "function": {"name": "read", "parameters": {"type": "object", "properties": {}}}},
]


def v4_encoder_prompt(messages: list[dict], tools: list[dict]) -> str:
    """The conversation as DeepSeek-V4's own encoder (``deepseek_recipe``, SGLang's dependency) renders it."""
    import deepseek_recipe as recipe

    def message(m: dict):
        if m["role"] == "system":
            return recipe.SystemMessage(m["content"])
        if m["role"] == "user":
            return recipe.UserMessage(m["content"])
        if m["role"] == "tool":
            return recipe.ToolMessage(m["content"], tool_call_id=m["tool_call_id"])
        calls = [
            recipe.ToolCall(id=c["id"], name=c["function"]["name"], arguments=json.dumps(c["function"]["arguments"]))
            for c in m.get("tool_calls", [])
        ]
        return recipe.AssistantMessage(m["content"], tool_calls=calls or None)

    definitions = [recipe.ToolDefinition(name=t["function"]["name"], description=t["function"].get("description"),
                                         parameters=t["function"]["parameters"]) for t in tools]  # fmt: skip
    conversation = recipe.Conversation([message(m) for m in messages], thinking_mode=False, tools=definitions)
    return recipe.DeepseekV4Encoding().render_conversation(conversation).prompt


def without_tool_prose(prompt: str, closing: str) -> str:
    """The prompt with the tools section's instructions cut out: what stays is V4's layout and the schema lines."""
    head, rest = prompt.split("\n\n## Tools\n\n", 1)
    schemas = rest.split("### Available Tool Schemas\n\n", 1)[1].split(closing, 1)[0]
    return head + "|" + schemas + "|" + rest[rest.index("<｜User｜>") :]


def test_chat_template_renders_tools_calls_and_results_as_deepseek_v4_does(tiny_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    ours = tokenizer.apply_chat_template(AGENT_CHAT, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    theirs = v4_encoder_prompt(AGENT_CHAT, TOOLS)
    assert '<｜DSML｜parameter name="depth" string="false">2</｜DSML｜parameter>' in ours
    assert without_tool_prose(ours, TOOLS_CLOSING.rstrip("\n")) == without_tool_prose(theirs, "\n\nYou MUST")
    assert ours.removeprefix(ours.split("<｜User｜>")[0]) == theirs.removeprefix(theirs.split("<｜User｜>")[0])
    plain = [m for m in AGENT_CHAT if m["role"] in ("system", "user")]
    no_tools = tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
    assert no_tools == v4_encoder_prompt(plain, [])


def test_special_tokens_of_the_format_are_single_ids(tiny_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    rendered = tokenizer.apply_chat_template(AGENT_CHAT, tools=TOOLS, add_generation_prompt=True)["input_ids"]
    for token in SPECIAL_TOKENS:
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1, token
    dsml = tokenizer.convert_tokens_to_ids(DSML)
    assert rendered[0] == tokenizer.bos_token_id and rendered.count(dsml) > 10


def test_tool_call_arguments_given_as_a_string_are_refused(tiny_path):
    from transformers import AutoTokenizer

    call = {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}
    messages = [{"role": "user", "content": "ls"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    with pytest.raises(Exception, match="arguments must be a JSON object"):
        AutoTokenizer.from_pretrained(tiny_path).apply_chat_template(messages, tokenize=False)


def test_quantized_checkpoint_stores_the_release_formats_in_whole_blocks(quantized_tiny_path):
    raw = json.loads((quantized_tiny_path / "config.json").read_text())
    assert raw["quantization_config"] == RELEASE_QUANTIZATION
    tensors = load_file(quantized_tiny_path / "model.safetensors")
    specs = checkpoint_tensors(load_config(quantized_tiny_path), quantized=True)
    assert {spec.format for spec in specs} >= {Format.FP8, Format.FP4}
    for spec in specs:
        weight, scale = tensors[spec.name], tensors.get(spec.name.removesuffix(".weight") + ".scale")
        rows, cols = spec.shape if len(spec.shape) == 2 else (1, spec.shape[0])
        if spec.format is Format.FP8:
            assert rows % FP8_BLOCK == 0 and cols % FP8_BLOCK == 0, spec.name
            assert weight.dtype == torch.float8_e4m3fn and weight.shape == spec.shape, spec.name
            assert scale.dtype == torch.float32 and scale.shape == (rows // FP8_BLOCK, cols // FP8_BLOCK), spec.name
        elif spec.format is Format.FP4:
            assert weight.dtype == torch.int8 and weight.shape == (rows, cols // 2), spec.name
            assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (rows, cols // FP4_BLOCK), spec.name
        else:
            assert scale is None and weight.shape == spec.shape, spec.name
    assert len(tensors) == len(specs) + sum(spec.format in (Format.FP8, Format.FP4) for spec in specs)


def test_dequantized_twin_is_the_quantized_model_and_near_the_unquantized_one(quantized_tiny_path, twin_path):
    twin = load_file(twin_path / "model.safetensors")
    assert "quantization_config" not in json.loads((twin_path / "config.json").read_text())
    assert all(tensor.dtype in (torch.float32, torch.int64) for tensor in twin.values())
    ids = random_ids(200, load_config(twin_path).vocab_size, seed=41)
    quantized, dequantized = load_model(quantized_tiny_path), load_model(twin_path)
    assert torch.equal(quantized(ids, quantized.new_state()), dequantized(ids, dequantized.new_state()))
    assert torch.equal(drafted_logits(quantized, ids), drafted_logits(dequantized, ids))  # the MTP layer's too
    # The same seed unquantized: the twin differs from it by the quantization's rounding only.
    original = random_model(json.loads((quantized_tiny_path / "config.json").read_text()), seed=0)
    assert any(not torch.equal(twin[name], tensor) for name, tensor in release_state_dict(original).items())
    for name, tensor in release_state_dict(original).items():
        error = (twin[name] - tensor).abs().max() / tensor.abs().max()
        # FP4: off by at most a block's scale, a third of its largest value at most; FP8: e4m3's 2^-4.
        assert error <= (1 / 3 if ".ffn.experts." in name else 2**-4), name


@torch.inference_mode()
def drafted_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """The MTP layer's logits over ``ids``, each position reading the target's streams and the next token."""
    state = model.new_state()
    streams = model.streams(ids, state)
    return model.draft(streams[:-1], ids[1:], state.mtp)[0]
