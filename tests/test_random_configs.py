"""Random V4 configs (tests/random_configs.py): what SGLang builds our model from is the checkpoint's config.json,
read with transformers' defaults; a tensor-parallel size that does not divide it is refused, never padded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from random_configs import random_v4_config

from sglang_dsv4 import ConfigError, parse_config
from sglang_dsv4.config import check_tensor_parallel
from sglang_dsv4.served_config import release_keys, served_config
from sglang_dsv4.tiny import TINY_CONFIG

SEEDS = range(200)
SPLIT_KEYS = ("num_attention_heads", "num_key_value_heads", "moe_intermediate_size")


def write_config(directory: Path, raw: dict) -> Path:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(raw))
    return directory


def scheduler_model_config(path: Path, *, tp_size: int = 1, overrides: dict | None = None):
    """SGLang's ModelConfig of ``path`` after the model runner's CPU step, as a scheduler builds it before the model."""
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor import model_runner

    model_config = ModelConfig(str(path), model_override_args=json.dumps(overrides or {}))
    return model_runner.adjust_config_with_unaligned_cpu_tp(model_config, LoadConfig(), tp_size)


def test_generated_configs_span_the_architecture():
    raws = [random_v4_config(seed) for seed in SEEDS]
    configs = [parse_config(raw) for raw in raws]
    kinds = [[c.layer_kind(layer) for layer in range(c.num_layers)] for c in configs]
    assert any("window" in k[1:-1] and k[0] != "window" and k[-1] != "window" for k in kinds)  # between compressed
    assert any(k.index("hca") < k.index("csa") for k in kinds) and any(k.index("csa") < k.index("hca") for k in kinds)
    assert {c.hca_rate for c in configs} == {16, 32, 128}
    assert sum(len(raw.get("compress_ratios", [])) > raw["num_hidden_layers"] for raw in raws) >= 20  # MTP entry
    assert {c.num_hash_layers for c in configs} == {1, 2, 3}
    assert {c.o_groups for c in configs} > {1, 2, 3} and len({c.num_heads for c in configs}) >= 5
    assert len({c.rope_head_dim / c.head_dim for c in configs}) >= 20
    assert sum(c.moe_intermediate_size % 32 != 0 for c in configs) > 150
    assert min(c.index_n_heads for c in configs) >= 32 and len({c.index_topk for c in configs}) >= 10
    assert sum(c.swiglu_limit < 3 for c in configs) > 100  # clamps at this scale
    for key in ("sliding_window", "swiglu_limit", "routed_scaling_factor", "hc_mult", "rope_theta"):
        assert 20 <= sum(key not in raw for raw in raws) <= 180, key  # left to the default, or not
    assert any("layer_types" in raw for raw in raws) and any("compress_ratios" in raw for raw in raws)


def test_keys_left_out_read_as_transformers_defaults():
    from transformers import DeepseekV4Config as HFConfig

    # transformers fills every absent key in and writes them all out: the explicit dict is the oracle.
    for seed in SEEDS:
        raw = random_v4_config(seed)
        ours, theirs = parse_config(raw), parse_config(HFConfig.from_dict(raw).to_dict())
        # transformers has no MTP layer: it keeps num_nextn_predict_layers but drops compress_ratios' MTP entry.
        assert ours.without_mtp() == theirs.without_mtp() and ours.num_mtp_layers == theirs.num_mtp_layers, seed
    assert parse_config({}) == parse_config(HFConfig().to_dict())


def test_sglang_builds_the_model_from_the_checkpoint_config_unpadded(tmp_path, sglang_with_plugin):
    for seed in SEEDS:
        raw = random_v4_config(seed)
        model_config = scheduler_model_config(write_config(tmp_path / str(seed), raw), tp_size=1 + seed % 2)
        config = served_config(model_config.hf_config)
        assert config == parse_config(raw), seed
        # SGLang's own view is the same architecture, nothing padded for its CPU kernels.
        sglang_view = {key: getattr(model_config.hf_config, key) for key in release_keys(config)}
        assert sglang_view == release_keys(config), seed
        assert [sglang_view[key] for key in SPLIT_KEYS] == [raw[key] for key in SPLIT_KEYS], seed
        assert model_config.num_attention_heads == raw["num_attention_heads"], seed


def test_json_model_override_args_apply_to_the_served_model(tmp_path, sglang_with_plugin):
    # A user's override is deliberate: it reaches our model as it reaches SGLang's, a rope_scaling dict merged.
    overrides = {
        "routed_scaling_factor": 2.75,
        "swiglu_limit": 0.25,
        "sliding_window": 16,
        "rope_scaling": {"factor": 8},
    }
    model_config = scheduler_model_config(write_config(tmp_path / "tiny", TINY_CONFIG), overrides=overrides)
    expected = {**TINY_CONFIG, **overrides, "rope_scaling": {**TINY_CONFIG["rope_scaling"], "factor": 8}}
    assert served_config(model_config.hf_config) == parse_config(expected) != parse_config(TINY_CONFIG)
    bad = scheduler_model_config(write_config(tmp_path / "bad", TINY_CONFIG), overrides={"o_groups": 3})
    with pytest.raises(ConfigError, match=r"'o_groups' \(3\) must divide 'num_attention_heads' \(4\)"):
        served_config(bad.hf_config)


def test_tensor_parallel_sizes_that_do_not_divide_are_refused_naming_the_key():
    for seed in SEEDS:
        config = parse_config(random_v4_config(seed))
        for tp in (1, 2, 3, 4):
            sizes = {"num_attention_heads": config.num_heads, "o_groups": config.o_groups}
            sizes["moe_intermediate_size"] = config.moe_intermediate_size
            undivided = [key for key, size in sizes.items() if size % tp]
            if not undivided:
                check_tensor_parallel(config, tp)
                continue
            with pytest.raises(ConfigError) as error:
                check_tensor_parallel(config, tp)
            key = undivided[0]
            assert f"{key!r} ({sizes[key]}) is not divisible by tp = {tp}" in str(error.value), (seed, tp)


def test_block_quantized_intermediate_size_splits_in_whole_blocks():
    config = parse_config(
        {**TINY_CONFIG, "moe_intermediate_size": 384, "quantization_config": {"weight_block_size": [128, 128]}}
    )
    check_tensor_parallel(config, 1)
    with pytest.raises(
        ConfigError, match=r"'moe_intermediate_size' \(384\) is not divisible by tp x weight block = 2 x 128 = 256"
    ):
        check_tensor_parallel(config, 2)
    with pytest.raises(ConfigError, match="tensor-parallel size must be >= 1"):
        check_tensor_parallel(config, 0)
