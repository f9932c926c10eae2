"""FP8 linears and FP4 experts on SGLang's own layers, as SGLang selects their methods for the release checkpoint.

Each check runs in fresh processes (SGLang's process-wide config and gloo groups, the plugin's hooks applied):
at tp 1, and on two ranks with ``--ep-size 2``. On this package's CPU platform the methods are the
dequantize-per-use ones (``sglang_dsv4.quantization``): outputs equal the dequantized weights', resident
bytes are the quantized ones. SGLang's CUDA methods cannot run here; what is checked is that their
``create_weights`` and weight loaders take every rank's release tensors, names, shapes and formats.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from safetensors.torch import load_file

from sglang_dsv4.config import load_config
from sglang_dsv4.launch import free_port
from sglang_dsv4.model.block_formats import dequantize_fp4, dequantize_fp8
from sglang_dsv4.model.weight_layout import Parallelism, checkpoint_tensors

LAYER = 2  # a gated (not hash-routed) MoE layer of the tiny config


def sglang_process(rank: int, world: int, port: int, path: Path, **server_args):
    """This process as SGLang's scheduler rank ``rank`` of ``world`` (tp = world), the plugin's hooks applied."""
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    from sglang_dsv4 import plugin

    plugin.register()
    HookRegistry.apply_hooks()
    args = ServerArgs(model_path=str(path), device="cpu", dtype="float32", tp_size=world, **server_args)
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=rank, gpu_id=0))
    init_distributed_environment(
        world_size=world, rank=rank, local_rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo"
    )
    initialize_model_parallel()
    return args


def selected_quant_config(args):
    """The quantization config SGLang's model loader builds for these server arguments."""
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import _get_quantization_config

    return _get_quantization_config(ModelConfig.from_server_args(args), LoadConfig())


def release_weight(tensors: dict, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    return tensors[f"{name}.weight"], tensors[f"{name}.scale"]


def fp8_linears_on_ranks(rank: int, world: int, port: int, path: Path, quantization: str | None) -> None:
    from sglang.srt.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
    from sglang.srt.layers.quantization.fp8 import Fp8Config

    from sglang_dsv4.model.block_formats import FP8_BLOCK
    from sglang_dsv4.platform import on_torch_cpu_platform
    from sglang_dsv4.quantization import Fp8DequantLinearMethod

    args = sglang_process(rank, world, port, path, quantization=quantization)
    assert on_torch_cpu_platform()
    config = selected_quant_config(args)
    assert isinstance(config, Fp8Config) and config.weight_block_size == [128, 128] and config.is_fp4_experts
    tensors = load_file(path / "model.safetensors")
    specs = {spec.name: spec for spec in checkpoint_tensors(load_config(path), quantized=True)}
    generator = torch.Generator().manual_seed(3)
    for kind, name, split in [
        (ReplicatedLinear, "layers.1.attn.wq_a", None),
        (ColumnParallelLinear, "layers.1.attn.wq_b", 0),  # this rank's rows
        (RowParallelLinear, "layers.1.attn.wo_b", 1),  # this rank's columns, the outputs all-reduced
    ]:
        weight, scale = release_weight(tensors, name)
        layer = kind(weight.shape[1], weight.shape[0], bias=False, quant_config=config, prefix=name)
        assert isinstance(layer.quant_method, Fp8DequantLinearMethod), name
        assert dict(layer.named_parameters()).keys() == {"weight", "weight_scale_inv"}, name
        layer.weight.weight_loader(layer.weight, weight)
        layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, scale)
        layer.quant_method.process_weights_after_loading(layer)
        shard, scale_shard = weight, scale
        if split is not None:
            shard = weight.chunk(world, dim=split)[rank]
            scale_shard = scale.chunk(world, dim=split)[rank]
            assert scale_shard.shape[split] * FP8_BLOCK == shard.shape[split], name  # whole blocks per rank
        assert layer.weight.dtype == torch.float8_e4m3fn, name
        assert torch.equal(layer.weight.view(torch.uint8), shard.view(torch.uint8)), name
        assert torch.equal(layer.weight_scale_inv, scale_shard), name
        resident = sum(p.numel() * p.element_size() for p in layer.parameters())
        assert resident == specs[f"{name}.weight"].bytes_on_rank(Parallelism(tp=world), 4), name
        x = torch.randn(5, weight.shape[1], generator=generator)
        expected = F.linear(x, dequantize_fp8(weight, scale))
        if split == 0:
            expected = expected.chunk(world, dim=1)[rank]
        output = layer(x.chunk(world, dim=1)[rank] if split == 1 else x)
        output = output[0] if isinstance(output, tuple) else output
        torch.testing.assert_close(output, expected, rtol=1e-6, atol=1e-5, msg=name)


@pytest.mark.parametrize(
    ("ranks", "quantization"),
    [(1, None), (1, "fp8"), (2, None)],
    ids=["tp1-checkpoint-config", "tp1---quantization-fp8", "tp2-checkpoint-config"],
)
def test_fp8_linears_keep_sglangs_fp8_weights_and_equal_their_dequantization(quantized_tiny_path, ranks, quantization):
    mp.spawn(fp8_linears_on_ranks, args=(ranks, free_port(), quantized_tiny_path, quantization), nprocs=ranks)


def load_experts(module, tensors: dict, experts: int) -> None:
    for expert in range(experts):
        for projection in ("w1", "w2", "w3"):
            weight, scale = release_weight(tensors, f"layers.{LAYER}.ffn.experts.{expert}.{projection}")
            module.load(expert, projection, weight, scale=False)
            module.load(expert, projection, scale, scale=True)


def fp4_experts_on_ranks(rank: int, world: int, port: int, path: Path) -> None:
    import torch.distributed as dist
    from sglang.srt.layers.quantization.fp8 import Fp8MoEMethod

    from sglang_dsv4.model.experts import grouped_experts
    from sglang_dsv4.model.fused_moe import FusedRoutedExperts
    from sglang_dsv4.quantization import Fp4DequantMoEMethod

    args = sglang_process(rank, world, port, path, ep_size=world)
    quant_config = selected_quant_config(args)
    config = load_config(path)
    tensors = load_file(path / "model.safetensors")
    experts = FusedRoutedExperts(config, LAYER, quant_config)
    assert isinstance(experts.fused.quant_method, Fp4DequantMoEMethod) and experts.quantized
    load_experts(experts, tensors, config.n_routed_experts)
    local = config.n_routed_experts // world
    held = range(rank * local, (rank + 1) * local)
    for slot, expert in enumerate(held):  # this rank's experts, as stored: packed bytes and UE8M0 scales
        w1, s1 = release_weight(tensors, f"layers.{LAYER}.ffn.experts.{expert}.w1")
        w3, s3 = release_weight(tensors, f"layers.{LAYER}.ffn.experts.{expert}.w3")
        w2, s2 = release_weight(tensors, f"layers.{LAYER}.ffn.experts.{expert}.w2")
        assert torch.equal(experts.fused.w13_weight[slot], torch.cat([w1, w3]))
        assert torch.equal(experts.fused.w2_weight[slot], w2)
        assert experts.fused.w13_weight_scale_inv.dtype == torch.float8_e8m0fnu
        assert torch.equal(experts.fused.w13_weight_scale_inv[slot].float(), torch.cat([s1, s3]).float())
        assert torch.equal(experts.fused.w2_weight_scale_inv[slot].float(), s2.float())
    specs = checkpoint_tensors(config, quantized=True)
    per_expert = sum(
        spec.bytes_on_rank(Parallelism(), 4) for spec in specs if spec.name.startswith(f"layers.{LAYER}.ffn.experts.0.")
    )
    assert sum(p.numel() * p.element_size() for p in experts.parameters()) == local * per_expert

    # The forward: every rank's partial sum (its experts only) adds up to the whole layer's, dequantized.
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(6, config.hidden_size, generator=generator)
    routed = torch.stack([torch.randperm(config.n_routed_experts, generator=generator)[:2] for _ in range(6)])
    weights = torch.rand(6, 2, generator=generator)
    output = experts(x, weights, routed)
    dist.all_reduce(output)

    def dequantized(projection: str) -> torch.Tensor:
        pairs = [
            release_weight(tensors, f"layers.{LAYER}.ffn.experts.{e}.{projection}")
            for e in range(config.n_routed_experts)
        ]
        return torch.stack([dequantize_fp4(w, s) for w, s in pairs])

    expected = grouped_experts(
        x, weights, routed, dequantized("w1"), dequantized("w2"), dequantized("w3"), config.swiglu_limit
    )
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)

    # SGLang's own FP4-expert method (what CUDA runs) takes the same tensors into its layout.
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    sglang_method = Fp8MoEMethod(quant_config)
    fused = FusedMoE(
        num_experts=config.n_routed_experts,
        top_k=config.num_experts_per_tok,
        hidden_size=config.hidden_size,
        intermediate_size=config.moe_intermediate_size,
        layer_id=LAYER,
        quant_config=quant_config,
        quant_method=sglang_method,
        prefix=f"layers.{LAYER}.ffn.experts",
    )
    experts.fused = fused
    load_experts(experts, tensors, config.n_routed_experts)
    for slot, expert in enumerate(held):
        w2, s2 = release_weight(tensors, f"layers.{LAYER}.ffn.experts.{expert}.w2")
        assert torch.equal(fused.w2_weight[slot], w2) and torch.equal(fused.w2_weight_scale_inv[slot], s2.float())
    assert math.prod(fused.w13_weight.shape) == local * 2 * config.moe_intermediate_size * config.hidden_size // 2


@pytest.mark.parametrize("ranks", [1, 2], ids=["tp1", "tp2-ep2"])
def test_fp4_experts_stay_packed_and_their_grouped_pass_equals_the_dequantized_experts(quantized_tiny_path, ranks):
    mp.spawn(fp4_experts_on_ranks, args=(ranks, free_port(), quantized_tiny_path), nprocs=ranks)
