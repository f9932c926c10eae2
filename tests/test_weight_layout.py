"""The weight layout: the checkpoint's tensors as the network defines them, the published sizes, per-rank shards."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_dsv4.config import ConfigError, named_config, parse_config
from sglang_dsv4.memory_pool.ledger import H200_BYTES, RankLedger
from sglang_dsv4.model.loader import release_state_dict
from sglang_dsv4.model.network import DeepseekV4
from sglang_dsv4.model.weight_layout import Format, Parallelism, Split, checkpoint_tensors
from sglang_dsv4.tiny import TINY_CONFIG


def meta_network(config) -> DeepseekV4:
    with torch.device("meta"):
        return DeepseekV4(config)


@pytest.mark.parametrize("mtp_ratio", [0, 4, 128])
def test_layout_lists_exactly_the_tensors_the_network_writes_under_release_names(mtp_ratio):
    config = parse_config({**TINY_CONFIG, "compress_ratios": [128, 0, 4, 4, mtp_ratio]})
    written = {name: tuple(t.shape) for name, t in release_state_dict(meta_network(config)).items()}
    listed = {spec.name: spec.shape for spec in checkpoint_tensors(config, quantized=False)}
    assert listed == written
    assert "mtp.0.e_proj.weight" in listed and ("mtp.0.attn.compressor.ape" in listed) == (mtp_ratio != 0)


@pytest.mark.parametrize(("name", "published"), [("flash", 284e9), ("pro", 1.6e12)])
def test_shipped_configs_have_the_published_parameter_counts(name, published):
    """The published counts are the main network's (the MTP layer's not included)."""
    config = named_config(name)
    specs = checkpoint_tensors(config, quantized=True)
    parameters = sum(math.prod(spec.shape) for spec in specs if not spec.name.startswith("mtp."))
    assert abs(parameters / published - 1) < 0.02, parameters



def test_release_formats_put_routed_experts_in_fp4_and_dense_projections_in_fp8():
    specs = {spec.name: spec for spec in checkpoint_tensors(named_config("flash"), quantized=True)}
    assert specs["layers.5.ffn.experts.7.w2.weight"].format is Format.FP4
    assert specs["layers.5.attn.wq_b.weight"].format is Format.FP8
    assert specs["layers.5.ffn.shared_experts.w1.weight"].format is Format.FP8
    assert specs["layers.5.attn.compressor.wkv.weight"].format is Format.MODEL
    assert specs["embed.weight"].format is Format.MODEL
    # 4096 x 2048 FP4 values, two a byte, and a scale byte per 32 inputs of each row.
    assert specs["layers.5.ffn.experts.7.w2.weight"].bytes_on_rank(Parallelism(), 2) == 4096 * 2048 // 2 + 4096 * 64
    # 2048 x 4096 FP8 values and a float32 scale per 128 x 128 block.
    assert specs["layers.5.ffn.shared_experts.w1.weight"].bytes_on_rank(Parallelism(), 2) == 2048 * 4096 + 16 * 32 * 4
    # Stored FP8, held in the model dtype: the grouped output projection reads it directly.
    wo_a = specs["layers.5.attn.wo_a.weight"]
    assert wo_a.format is Format.FP8 and wo_a.bytes_on_rank(Parallelism(), 2) == 2 * math.prod(wo_a.shape)


def test_tensor_parallel_ranks_split_heads_and_vocabulary_and_replicate_the_kv_head():
    specs = {spec.name: spec for spec in checkpoint_tensors(named_config("flash"), quantized=True)}
    eight = Parallelism(tp=8, ep=8)
    assert specs["layers.2.attn.wq_b.weight"].local_shape(eight) == (64 * 512 // 8, 1024)
    assert specs["layers.2.attn.wo_b.weight"].local_shape(eight) == (4096, 8 * 1024 // 8)
    assert specs["layers.2.attn.wkv.weight"].local_shape(eight) == (512, 4096)
    assert specs["layers.2.attn.indexer.wq_b.weight"].split is Split.REPLICATED
    assert specs["head.weight"].local_shape(eight) == (129280 // 8, 4096)
    # Under EP every expert stays whole; without it, each expert's intermediate dimension is split.
    assert specs["layers.2.ffn.experts.0.w1.weight"].local_shape(eight) == (2048, 4096)
    assert specs["layers.2.ffn.experts.0.w1.weight"].local_shape(Parallelism(tp=8)) == (2048 // 8, 4096)


def test_attention_data_parallel_ranks_split_heads_over_their_attention_group_only():
    specs = {spec.name: spec for spec in checkpoint_tensors(named_config("flash"), quantized=True)}
    two_groups = Parallelism(tp=8, ep=8, attn_dp=2)  # attention-TP 4
    assert specs["layers.2.attn.wq_b.weight"].local_shape(two_groups) == (64 * 512 // 4, 1024)
    assert specs["layers.2.attn.wo_b.weight"].local_shape(two_groups) == (4096, 8 * 1024 // 4)
    assert specs["layers.2.attn.attn_sink"].local_shape(two_groups) == (1, 64 // 4)
    # The shared expert and the head stay on the whole TP group; the embedding is whole per DP rank.
    assert specs["layers.2.ffn.shared_experts.w1.weight"].local_shape(two_groups) == (2048 // 8, 4096)
    assert specs["head.weight"].local_shape(two_groups) == (129280 // 8, 4096)
    assert specs["embed.weight"].local_shape(two_groups) == (129280, 4096)
    assert specs["embed.weight"].local_shape(Parallelism(tp=8, ep=8)) == (129280 // 8, 4096)
    with pytest.raises(ValueError, match=r"--attn-dp-size \(3\) must divide --tp \(8\)"):
        Parallelism(tp=8, attn_dp=3)


def test_a_dimension_that_does_not_divide_over_the_ranks_is_refused_naming_the_key_or_tensor():
    config = parse_config({**TINY_CONFIG, "num_attention_heads": 6, "o_groups": 3})
    with pytest.raises(ConfigError, match=r"'num_attention_heads' \(6\) is not divisible by tp = 4"):
        RankLedger(config, Parallelism(tp=4), quantized=False).weight_bytes()
    spec = next(s for s in checkpoint_tensors(config, quantized=False) if s.name == "layers.0.attn.wq_b.weight")
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.wq_b\.weight: .* its 6 heads do not divide over 4"):
        spec.local_shape(Parallelism(tp=4))
    # The vocabulary is padded, as SGLang's vocab-parallel layers pad it.
    head = next(s for s in checkpoint_tensors(config, quantized=False) if s.name == "head.weight")
    assert head.local_shape(Parallelism(tp=3)) == (342, 64)


def test_one_rank_unquantized_holds_what_the_network_allocates():
    config = parse_config(TINY_CONFIG)
    network = meta_network(config)
    allocated = sum(t.numel() * t.element_size() for t in [*network.parameters(), *network.buffers()])
    assert sum(RankLedger(config, Parallelism(), quantized=False, dtype=torch.float32).weight_bytes().values()) == (
        allocated
    )


def test_expert_parallel_ranks_hold_their_share_of_the_experts_and_all_of_the_rest():
    config = named_config("flash")
    one = RankLedger(config, Parallelism(), quantized=True).weight_bytes()
    eight = RankLedger(config, Parallelism(tp=8, ep=8), quantized=True).weight_bytes()
    assert eight["routed experts"] == round(one["routed experts"] / 8)
    assert eight["embedding"] == round(one["embedding"] / 8) and eight["head"] == round(one["head"] / 8)
    redundant = RankLedger(config, Parallelism(tp=8, ep=8), quantized=True, redundant_experts=32).weight_bytes()
    assert redundant["routed experts"] == round(one["routed experts"] * 288 / 256 / 8)


def test_flash_on_eight_h200s_leaves_most_of_the_static_memory_for_the_pools():
    ledger = RankLedger(named_config("flash"), Parallelism(tp=8, ep=8), quantized=True)
    weights = sum(ledger.weight_bytes().values())
    # The release checkpoint (~160 GB) over 8 GPUs, plus what every rank replicates.
    assert 155e9 / 8 < weights < 25 * 2**30
    assert ledger.pool_bytes(0.85) == 0.85 * H200_BYTES - weights
