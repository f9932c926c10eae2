"""Config parsing: release and HF spellings of the same architecture, and named errors."""

from __future__ import annotations

import copy
import json

import pytest

from sglang_dsv4 import ConfigError, load_config, parse_config
from sglang_dsv4.config import check_tensor_parallel
from sglang_dsv4.tiny import TINY_CONFIG


def release_config(**changes) -> dict:
    raw = copy.deepcopy(TINY_CONFIG)
    raw.update(changes)
    return raw


def hf_style(raw: dict) -> dict:
    """The same architecture in the spelling transformers' save_pretrained writes."""
    names = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
    hf = {
        k: v
        for k, v in raw.items()
        if k not in ("compress_ratios", "num_hash_layers", "qk_rope_head_dim", "rope_scaling")
    }
    hf["layer_types"] = [names[r] for r in raw["compress_ratios"]]
    hf["compress_rates"] = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    hf["mlp_layer_types"] = ["hash_moe"] * raw["num_hash_layers"] + ["moe"] * (
        raw["num_hidden_layers"] - raw["num_hash_layers"]
    )
    hf["partial_rotary_factor"] = raw["qk_rope_head_dim"] / raw["head_dim"]
    yarn = {k: v for k, v in raw["rope_scaling"].items() if k != "type"}
    hf["rope_parameters"] = {
        "main": {"rope_type": "default", "rope_theta": raw["rope_theta"]},
        "compress": {"rope_type": "yarn", "rope_theta": raw["compress_rope_theta"], "attention_factor": 1.0, **yarn},
    }
    return hf


def test_release_and_hf_spellings_give_the_same_config():
    assert parse_config(hf_style(TINY_CONFIG)) == parse_config(TINY_CONFIG)


def test_release_config_reads_layer_kinds_hash_layers_and_yarn():
    config = parse_config(TINY_CONFIG)
    assert [config.layer_kind(i) for i in range(4)] == ["window", "csa", "hca", "csa"]
    assert [config.is_hash_layer(i) for i in range(4)] == [True, True, False, False]
    assert config.rope_head_dim == 16 and config.yarn is not None and config.yarn.factor == 16


def test_hf_config_written_by_transformers_parses(tmp_path, tiny_path):
    from transformers import DeepseekV4Config as HFConfig

    HFConfig.from_pretrained(tiny_path).save_pretrained(tmp_path)
    assert load_config(tmp_path) == load_config(tiny_path)


def test_mtp_entries_of_compress_ratios_are_the_mtp_layers():
    raw = release_config(num_nextn_predict_layers=1, compress_ratios=TINY_CONFIG["compress_ratios"] + [4])
    config = parse_config(raw)
    assert config.compress_ratios == tuple(TINY_CONFIG["compress_ratios"]) and config.mtp_compress_ratios == (4,)
    assert config.layer_kind(config.num_layers) == "csa" and config.layer_name(config.num_layers) == "mtp.0"
    # Without its entry the MTP layer is window only, as the releases have it.
    config = parse_config(release_config(num_nextn_predict_layers=1))
    assert config.mtp_compress_ratios == (0,) and config.layer_kind(config.num_layers) == "window"
    assert not config.is_hash_layer(config.num_layers)  # its MoE is gated


def test_more_than_one_mtp_layer_is_refused():
    with pytest.raises(ConfigError, match="'num_nextn_predict_layers' is 2; allowed: 0 or 1"):
        parse_config(release_config(num_nextn_predict_layers=2))


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (release_config(compress_ratios=[0, 4, 64, 4]), "'compress_ratios[2]' is 64; allowed: [0, 4, 128]"),
        (release_config(compress_ratios=[0, 4, 128]), "'compress_ratios' has 3 entries; 'num_hidden_layers' is 4"),
        (release_config(norm_topk_prob=False), "'norm_topk_prob' is false; allowed: true"),
        (release_config(n_shared_experts=2), "'n_shared_experts' is 2; allowed: 1"),
        (release_config(swiglu_limit="1"), "'swiglu_limit' must be a number"),
        (
            release_config(quantization_config={"weight_block_size": [128, 64]}),
            "'quantization_config.weight_block_size' is [128, 64]",
        ),
        (
            {
                **hf_style(TINY_CONFIG),
                "rope_parameters": {
                    "main": {},
                    "compress": {"rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 4096},
                },
            },
            "'rope_parameters.compress.attention_factor' is 1.27726",
        ),
        (release_config(o_groups=3), "'o_groups' (3) must divide 'num_attention_heads' (4)"),
        (release_config(qk_rope_head_dim=15), "'qk_rope_head_dim' is 15"),
        (release_config(qk_rope_head_dim=128), "'qk_rope_head_dim' is 128"),
        (release_config(index_head_dim=8), "'index_head_dim' is 8"),
        (release_config(num_hash_layers=5), "'num_hash_layers' is 5"),
        (release_config(num_experts_per_tok=9), "'num_experts_per_tok' (9) exceeds 'n_routed_experts' (8)"),
        (release_config(scoring_func="softmax"), "'scoring_func' is 'softmax'"),
        (release_config(hidden_size="64"), "'hidden_size' must be an integer"),
        (release_config(rope_scaling={"type": "linear", "factor": 2}), "'rope_scaling.type' is 'linear'"),
        (release_config(rope_scaling={"type": "yarn", "factor": 2}), "'rope_scaling.original_max_position_embeddings'"),
        ({**hf_style(TINY_CONFIG), "layer_types": ["sliding_attention"] * 3}, "'layer_types' has 3 entries"),
        (
            {**hf_style(TINY_CONFIG), "layer_types": ["sliding_attention"] * 3 + ["full_attention"]},
            "'layer_types[3]' is 'full_attention'",
        ),
        ({**hf_style(TINY_CONFIG), "mlp_layer_types": ["moe"] * 5}, "'mlp_layer_types' has 5 entries"),
        (
            {**hf_style(TINY_CONFIG), "mlp_layer_types": ["moe", "hash_moe", "moe", "moe"]},
            "every 'hash_moe' layer must come before",
        ),
        (
            {**hf_style(TINY_CONFIG), "compress_rates": {"compressed_sparse_attention": 8}},
            "'compress_rates.compressed_sparse_attention' is 8",
        ),
    ],
)
def test_invalid_config_names_the_key(raw, message):
    with pytest.raises(ConfigError) as error:
        parse_config(raw)
    assert message in str(error.value)


def test_declared_hca_rate_is_allowed_in_release_ratios():
    raw = release_config(compress_rate_hca=32, compress_ratios=[0, 4, 32, 4])
    assert parse_config(raw).layer_kind(2) == "hca"


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(release_config(vocab_size=0)))
    with pytest.raises(ConfigError, match="'vocab_size' must be >= 1"):
        load_config(tmp_path)


def test_shipped_flash_config_is_v4_flash():
    from sglang_dsv4.config import named_config

    flash = named_config("flash")
    kinds = [flash.layer_kind(i) for i in range(flash.num_layers)]
    assert (kinds.count("window"), kinds.count("csa"), kinds.count("hca")) == (2, 21, 20)
    assert (flash.hidden_size, flash.num_heads, flash.head_dim, flash.index_topk) == (4096, 64, 512, 512)
    with pytest.raises(ConfigError, match="no shipped config 'ultra'"):
        named_config("ultra")


def test_attention_data_parallelism_divides_only_the_attention_dimensions_by_the_attention_tp_size():
    # One output group (odd): attention-TP 1 keeps it whole, TP 2 without attention DP would split it.
    config = parse_config({**TINY_CONFIG, "o_groups": 1})
    check_tensor_parallel(config, 2, attn_dp_size=2)
    with pytest.raises(ConfigError, match=r"'o_groups' \(1\) is not divisible by tp = 2"):
        check_tensor_parallel(config, 2)
    with pytest.raises(
        ConfigError, match=r"'o_groups' \(1\) is not divisible by attention-TP = tp / attn-dp-size = 4 / 2 = 2"
    ):
        check_tensor_parallel(config, 4, attn_dp_size=2)
    # The experts' intermediate dimension stays on the whole TP group (the shared expert runs there).
    uneven = parse_config({**TINY_CONFIG, "moe_intermediate_size": 6})
    with pytest.raises(ConfigError, match=r"'moe_intermediate_size' \(6\) is not divisible by tp = 4"):
        check_tensor_parallel(uneven, 4, attn_dp_size=4)


def test_an_attention_dp_size_that_does_not_divide_tp_is_refused():
    with pytest.raises(ConfigError, match=r"--attn-dp-size \(3\) must divide --tp \(4\)"):
        check_tensor_parallel(parse_config(TINY_CONFIG), 4, attn_dp_size=3)
