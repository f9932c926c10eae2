"""The checkpoint loader: three naming layouts, FP8 / FP4 dequantization, and named errors."""

from __future__ import annotations

import json
import logging
import math
import shutil
import weakref
from pathlib import Path

import pytest
import torch
from conftest import random_ids
from safetensors.torch import load_file, save_file

from sglang_dsv4 import CheckpointError, load_model
from sglang_dsv4.config import load_config
from sglang_dsv4.model import loader
from sglang_dsv4.model.checkpoint_check import check_checkpoint
from sglang_dsv4.model.loader import FP4_BLOCK, FP8_BLOCK

FP8_MAX = 448.0
E2M1_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def copy_with_tensors(src: Path, dst: Path, tensors: dict[str, torch.Tensor]) -> Path:
    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    save_file(tensors, dst / "model.safetensors")
    return dst


def logits_of(path: Path, ids: torch.Tensor) -> torch.Tensor:
    model = load_model(path)
    return model(ids, model.new_state())


@pytest.fixture(scope="module")
def ids(tiny_model) -> torch.Tensor:
    return random_ids(200, tiny_model.config.vocab_size, seed=30)


@pytest.fixture(scope="module")
def release_tensors(tiny_path) -> dict[str, torch.Tensor]:
    return load_file(tiny_path / "model.safetensors")


@pytest.mark.parametrize("original_format", [True, False], ids=["hf-default-save", "hf-module-names"])
def test_hf_saved_checkpoints_give_the_release_logits(tmp_path, tiny_path, hf_tiny, ids, original_format):
    hf_tiny.save_pretrained(tmp_path, save_original_format=original_format)
    names = load_file(tmp_path / "model.safetensors").keys()
    if original_format:  # release names under "model.", with a few HF names mixed in
        assert "model.layers.1.attn.norm.weight" in names and "model.embed_tokens.weight" in names
    else:
        assert (
            "model.layers.1.self_attn.q_a_proj.weight" in names and "model.layers.1.mlp.experts.gate_up_proj" in names
        )
    expected = logits_of(tiny_path, ids)
    assert torch.equal(logits_of(tmp_path, ids), expected)


def quantize_fp8(weight: torch.Tensor, ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise FP8 e4m3 with 128x128 scales (powers of two when ``ue8m0``)."""
    rows, cols = weight.shape
    blocks = torch.nn.functional.pad(weight, (0, -cols % FP8_BLOCK, 0, -rows % FP8_BLOCK))
    blocks = blocks.view(blocks.shape[0] // FP8_BLOCK, FP8_BLOCK, -1, FP8_BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    expanded = scale.repeat_interleave(FP8_BLOCK, 0)[:rows].repeat_interleave(FP8_BLOCK, 1)[:, :cols]
    quantized = (weight / expanded).to(torch.float8_e4m3fn)
    return quantized, scale.to(torch.float8_e8m0fnu) if ue8m0 else scale


def quantize_fp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e2m1 with one power-of-two scale per 32 inputs, two values per byte (even one low)."""
    rows, cols = weight.shape
    blocks = weight.view(rows, cols // FP4_BLOCK, FP4_BLOCK)
    scale = torch.exp2(torch.ceil(torch.log2(blocks.abs().amax(-1).clamp(min=1e-12) / 6.0)))
    scaled = (blocks / scale[..., None]).flatten(1)
    magnitude = (scaled.abs()[..., None] - E2M1_MAGNITUDES).abs().argmin(-1)
    codes = (magnitude | ((scaled < 0).long() << 3)).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.view(torch.float4_e2m1fn_x2), scale.to(torch.float8_e8m0fnu)


def dequantized_by_hand(quantized: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    if quantized.dtype == torch.float8_e4m3fn:
        values = quantized.float()
    else:
        codes = quantized.view(torch.uint8)
        nibbles = torch.stack([codes & 15, codes >> 4], -1).flatten(1).long()
        values = E2M1_MAGNITUDES[nibbles & 7] * torch.where(nibbles >= 8, -1.0, 1.0)
    rows, cols = values.shape
    return values * scale.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]


FP8_TENSORS = (
    ".attn.wq_a.",
    ".attn.wq_b.",
    ".attn.wkv.",
    ".attn.wo_a.",
    ".attn.wo_b.",
    ".indexer.wq_b.",
    ".shared_experts.",
)


@pytest.mark.parametrize("ue8m0", [True, False], ids=["ue8m0-scales", "float-scales"])
def test_fp8_checkpoint_loads_dequantized(tmp_path, tiny_path, release_tensors, ids, ue8m0):
    quantized, by_hand = {}, {}
    for name, tensor in release_tensors.items():
        if name.endswith(".weight") and any(part in name for part in FP8_TENSORS):
            weight, scale = quantize_fp8(tensor, ue8m0)
            quantized[name], quantized[name.removesuffix(".weight") + ".scale"] = weight, scale
            by_hand[name] = dequantized_by_hand(weight, scale, (FP8_BLOCK, FP8_BLOCK))
        else:
            quantized[name] = by_hand[name] = tensor
    fp8 = logits_of(copy_with_tensors(tiny_path, tmp_path / "fp8", quantized), ids)
    assert torch.equal(fp8, logits_of(copy_with_tensors(tiny_path, tmp_path / "ref", by_hand), ids))
    # Against the unquantized weights, each value is off by at most e4m3's rounding: half a
    # unit in the last of 3 mantissa bits (2^-4 relative), or half the smallest subnormal step.
    for name, tensor in release_tensors.items():
        if name in quantized and name.removesuffix(".weight") + ".scale" in quantized:
            step = quantized[name.removesuffix(".weight") + ".scale"].float().max().item() * 2.0**-9
            bound = tensor.abs() * 2.0**-4 + step / 2
            assert ((by_hand[name] - tensor).abs() <= bound + 1e-12).all(), name
    exact = logits_of(tiny_path, ids)
    relative = ((fp8 - exact).abs().max() / exact.abs().max()).item()
    agree = (fp8.argmax(-1) == exact.argmax(-1)).float().mean().item()
    scales = "ue8m0" if ue8m0 else "float"
    print(f"FP8 ({scales} scales): max logit error {relative:.3f} of the scale, top-1 agreement {agree:.2%}")
    assert relative > 0


def test_fp4_experts_load_dequantized(tmp_path, tiny_path, release_tensors, ids):
    quantized, by_hand = {}, {}
    for name, tensor in release_tensors.items():
        if ".ffn.experts." in name:
            weight, scale = quantize_fp4(tensor)
            quantized[name], quantized[name.removesuffix(".weight") + ".scale"] = weight, scale
            by_hand[name] = dequantized_by_hand(weight, scale, (1, FP4_BLOCK))
        else:
            quantized[name] = by_hand[name] = tensor
    fp4 = logits_of(copy_with_tensors(tiny_path, tmp_path / "fp4", quantized), ids)
    assert torch.equal(fp4, logits_of(copy_with_tensors(tiny_path, tmp_path / "ref", by_hand), ids))
    assert not torch.equal(fp4, logits_of(tiny_path, ids))


def test_mtp_tensors_under_a_config_without_an_mtp_layer_are_skipped_with_one_log_line(
    tmp_path, tiny_path, release_tensors, ids, caplog
):
    path = copy_with_tensors(tiny_path, tmp_path / "mtp", dict(release_tensors))
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(raw | {"num_nextn_predict_layers": 0}))
    mtp_tensors = sum(name.startswith("mtp.") for name in release_tensors)
    with caplog.at_level(logging.INFO, logger="sglang_dsv4.model.loader"):
        model = load_model(path)
    assert [r.message for r in caplog.records if "mtp" in r.message] == [
        f"skipped {mtp_tensors} multi-token-prediction (mtp.*) tensors"
    ]
    assert len(model.mtp) == 0
    assert torch.equal(model(ids, model.new_state()), logits_of(tiny_path, ids))


def test_checkpoint_without_mtp_tensors_loads_without_an_mtp_layer(tmp_path, tiny_path, release_tensors, ids):
    main_only = {name: tensor for name, tensor in release_tensors.items() if not name.startswith("mtp.")}
    model = load_model(copy_with_tensors(tiny_path, tmp_path / "main", main_only))
    assert load_config(tiny_path).num_mtp_layers == 1 and len(model.mtp) == 0
    assert model.new_state().mtp is None
    assert torch.equal(model(ids, model.new_state()), logits_of(tiny_path, ids))


def test_mtp_layer_loads_from_release_names_with_the_targets_embedding_and_head_copies(tiny_path, release_tensors):
    model = load_model(tiny_path)
    assert torch.equal(model.mtp[0].e_proj.weight, release_tensors["mtp.0.e_proj.weight"])
    assert torch.equal(model.mtp[0].ffn.experts.w2[3], release_tensors["mtp.0.ffn.experts.3.w2.weight"])
    assert torch.equal(model.mtp[0].hc_head.fn, release_tensors["mtp.0.hc_head_fn"])


def without(tensors: dict, *names: str) -> dict:
    return {k: v for k, v in tensors.items() if k not in names}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda t: without(t, "layers.1.attn.indexer.wq_b.weight"),
            "missing tensors: ['layers.1.attn.indexer.wq_b.weight']",
        ),
        (lambda t: without(t, "layers.2.ffn.experts.5.w2.weight"), "layers.2.ffn.experts.w2: missing experts [5]"),
        (
            lambda t: t | {"layers.0.attn.extra.weight": torch.zeros(2)},
            "unexpected tensors: ['layers.0.attn.extra.weight']",
        ),
        (
            lambda t: t | {"layers.9.attn_norm.weight": torch.zeros(64)},
            "unexpected tensors: ['layers.9.attn_norm.weight']",
        ),
        (
            lambda t: t | {"head.weight": torch.zeros(3, 64)},
            "head.weight: shape (3, 64) in the checkpoint, (1024, 64) expected",
        ),
        (
            lambda t: t | {"layers.0.attn.wq_a.weight": t["layers.0.attn.wq_a.weight"].to(torch.float8_e4m3fn)},
            "layers.0.attn.wq_a.weight is torch.float8_e4m3fn but has no '.scale' block scales",
        ),
        (
            lambda t: (
                t
                | {
                    "layers.0.attn.wq_a.weight": t["layers.0.attn.wq_a.weight"].to(torch.float8_e4m3fn),
                    "layers.0.attn.wq_a.scale": torch.ones(2, 2),
                }
            ),
            "layers.0.attn.wq_a: FP8 weight (32, 64) needs scales of shape (1, 1)",
        ),
        (lambda t: without(t, "mtp.0.h_proj.weight"), "missing tensors: ['mtp.0.h_proj.weight']"),
        (lambda t: without(t, "mtp.0.ffn.experts.2.w1.weight"), "mtp.0.ffn.experts.w1: missing experts [2]"),
        (
            lambda t: t | {"mtp.0.e_proj.weight": torch.zeros(64, 32)},
            "mtp.0.e_proj.weight: shape (64, 32) in the checkpoint, (64, 64) expected",
        ),
    ],
    ids=[
        "missing",
        "missing-expert",
        "unexpected",
        "extra-layer",
        "wrong-shape",
        "fp8-no-scale",
        "fp8-bad-scale",
        "mtp-missing",
        "mtp-missing-expert",
        "mtp-wrong-shape",
    ],
)
def test_bad_checkpoint_raises_a_named_error(tmp_path, tiny_path, release_tensors, change, message):
    path = copy_with_tensors(tiny_path, tmp_path / "bad", change(dict(release_tensors)))
    with pytest.raises(CheckpointError) as error:
        load_model(path)
    assert message in str(error.value)


def test_directory_without_weights_is_named(tmp_path, tiny_path):
    shutil.copy(tiny_path / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="no \\*.safetensors files"):
        load_model(tmp_path)


def test_quantization_helpers_round_trip_exactly_representable_values():
    weight = torch.tensor([[0.5, -1.0, 6.0, 0.0] * 8])
    packed, scale = quantize_fp4(weight)
    assert torch.equal(dequantized_by_hand(packed, scale, (1, FP4_BLOCK)), weight)
    assert math.isclose(scale.float().item(), 1.0)


def sharded_copy(src: Path, dst: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """The checkpoint as two shards with an index, as release checkpoints come."""
    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, part in shards.items():
        save_file({name: tensors[name] for name in part}, dst / file)
        weight_map |= dict.fromkeys(part, file)
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


def test_sharded_checkpoint_loads_the_same_logits(tmp_path, tiny_path, release_tensors, ids):
    path = sharded_copy(tiny_path, tmp_path / "sharded", dict(release_tensors))
    assert torch.equal(logits_of(path, ids), logits_of(tiny_path, ids))


def test_missing_shard_is_named_with_the_tensors_it_holds(tmp_path, tiny_path, release_tensors):
    path = sharded_copy(tiny_path, tmp_path / "sharded", dict(release_tensors))
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"names shards that are not there: model-00002-of-00002\.safetensors"):
        check_checkpoint(path, load_config(path))


def test_routing_table_naming_experts_that_do_not_exist_is_refused(tmp_path, tiny_path, release_tensors):
    table = release_tensors["layers.1.ffn.gate.tid2eid"].clone()
    table[7, 1] = 8  # the tiny config has experts 0..7
    path = copy_with_tensors(tiny_path, tmp_path / "bad", release_tensors | {"layers.1.ffn.gate.tid2eid": table})
    with pytest.raises(CheckpointError, match=r"layers\.1\.ffn\.gate\.tid2eid: routes to expert ids in \[0, 8\]"):
        check_checkpoint(path, load_config(path))


def test_bad_checkpoints_are_refused_before_any_weight_is_read(tmp_path, tiny_path, release_tensors, monkeypatch):
    read = []
    monkeypatch.setattr(loader, "read_safetensors", lambda files: read.append(files) or iter(()))
    path = copy_with_tensors(tiny_path, tmp_path / "bad", without(dict(release_tensors), "head.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors: \['head\.weight'\]"):
        load_model(path)
    path = copy_with_tensors(tiny_path, tmp_path / "bad-mtp", without(dict(release_tensors), "mtp.0.enorm.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors: \['mtp\.0\.enorm\.weight'\]"):
        load_model(path)
    assert read == []


def test_loading_holds_one_checkpoint_tensor_beyond_the_model(tiny_path, release_tensors):
    """Each tensor is placed before the next is read: routed experts are not gathered to be stacked."""
    model = load_model(tiny_path)
    held_most = 0

    def tracked():
        nonlocal held_most
        alive: list[weakref.ref] = []
        for name, tensor in release_tensors.items():
            tensor = tensor.clone()
            storages = {p.untyped_storage().data_ptr() for p in [*model.parameters(), *model.buffers()]}
            held = sum(1 for r in alive if r() is not None and r().untyped_storage().data_ptr() not in storages)
            held_most = max(held_most, held)
            alive.append(weakref.ref(tensor))
            yield name, tensor

    loader.load_weights(model, tracked(), dtype=torch.float32)
    assert held_most <= 1


def test_mtp_layer_in_hf_module_names_loads_as_in_release_names(tmp_path, tiny_path, release_tensors, ids):
    experts = range(load_config(tiny_path).n_routed_experts)
    renamed = {name: t for name, t in release_tensors.items() if not name.startswith("mtp.0.ffn.experts.")}
    stacked = {which: torch.stack([release_tensors[f"mtp.0.ffn.experts.{e}.{which}.weight"] for e in experts])
               for which in ("w1", "w2", "w3")}  # fmt: skip
    renamed["model.mtp.0.mlp.experts.gate_up_proj"] = torch.cat([stacked["w1"], stacked["w3"]], dim=1)
    renamed["model.mtp.0.mlp.experts.down_proj"] = stacked["w2"]
    for release, hf in [
        ("mtp.0.attn_norm.weight", "model.mtp.0.input_layernorm.weight"),
        ("mtp.0.attn.wq_a.weight", "model.mtp.0.self_attn.q_a_proj.weight"),
        ("mtp.0.attn.attn_sink", "model.mtp.0.self_attn.sinks"),
        ("mtp.0.hc_attn_fn", "model.mtp.0.attn_hc.fn"),
        ("mtp.0.hc_head_fn", "model.mtp.0.hc_head.hc_fn"),
        ("mtp.0.ffn.shared_experts.w1.weight", "model.mtp.0.mlp.shared_experts.gate_proj.weight"),
    ]:
        renamed[hf] = renamed.pop(release)
    hf_named = load_model(copy_with_tensors(tiny_path, tmp_path / "hf-mtp", renamed))
    assert torch.equal(drafted(hf_named, ids), drafted(load_model(tiny_path), ids))


@torch.inference_mode()
def drafted(model, ids: torch.Tensor) -> torch.Tensor:
    state = model.new_state()
    streams = model.streams(ids, state)
    return model.draft(streams[:-1], ids[1:], state.mtp)[0]
