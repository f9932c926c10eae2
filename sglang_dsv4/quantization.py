"""Quantized checkpoints on this package's CPU platform: SGLang's FP8 methods' weights, dequantized per use.

A checkpoint whose ``quantization_config`` says ``fp8`` (DeepSeek's release) or a ``--quantization
fp8`` gets SGLang's :class:`Fp8Config`, as any SGLang model does; its ``get_quant_method`` picks
``Fp8LinearMethod`` for a linear layer and ``Fp8MoEMethod`` for ``FusedMoE`` (in its FP4-experts
mode when the routed experts are stored packed e2m1, SGLang's probe of the checkpoint). On CUDA those
run SGLang's kernels. On this package's CPU platform those kernels are Triton's and do not run, so
:func:`cpu_quant_method` (a hook on ``Fp8Config.get_quant_method``) returns methods that keep SGLang's
``create_weights`` — the same parameters, names, dtypes and weight loaders, so the resident bytes are
the quantized ones — and dequantize per use:

* :class:`Fp8DequantLinearMethod`: the FP8 weight and its 128 x 128 ``weight_scale_inv`` blocks,
  dequantized to the activations' dtype, then ``F.linear``;
* :class:`Fp4DequantMoEMethod`: packed e2m1 experts with their power-of-two 1 x 32 scales held as a
  byte each (as the release stores them; SGLang's CUDA default widens them to float32), the experts a
  forward routes to dequantized, then V4's grouped pass with its swiglu clamp; experts of other EP
  ranks (-1) add nothing.

``Fp8MoEMethod`` is not one of SGLang's fused ops, so there is no ``register_oot_forward`` seam for
it: the method choice is the hook. Since these methods compute in any float dtype, the platform also
accepts float32 activations for FP8 checkpoints (:func:`cpu_activation_dtypes`; SGLang's FP8 kernels
take bf16 and fp16 only).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput
from sglang.srt.layers.quantization.fp8 import Fp8Config, Fp8LinearMethod, Fp8MoEMethod
from torch import nn

from .model.block_formats import FP8_BLOCK, dequantize_fp4, dequantize_fp8
from .model.experts import grouped_experts
from .platform import on_torch_cpu_platform


class Fp8DequantLinearMethod(Fp8LinearMethod):
    """SGLang's FP8 linear weights (block-quantized), applied as ``F.linear`` of their dequantization."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Nothing: the weights stay as the checkpoint stores them (SGLang's processing prepares its kernels')."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        weight = dequantize_fp8(layer.weight, layer.weight_scale_inv).to(x.dtype)
        return F.linear(x, weight, bias)


# FP4 experts dequantized together in a CPU forward (4 of V4-Flash's: 0.4 GB of float32).
EXPERTS_PER_DEQUANTIZATION = 4


class Fp4DequantMoEMethod(Fp8MoEMethod):
    """SGLang's FP4-expert weights (``w13_weight``, ``w2_weight`` packed e2m1 as int8, their
    ``*_weight_scale_inv`` one UE8M0 byte per 32 inputs), run by V4's grouped pass on their dequantization."""

    def create_weights(
        self,
        layer: nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        with_bias: bool = False,
        **extra_weight_attrs,
    ) -> None:
        Fp8MoEMethod.create_fp8_moe_weight_(
            layer=layer,
            num_experts=num_experts,
            hidden_size=hidden_size,
            intermediate_size_per_partition=intermediate_size_per_partition,
            block_quant=self.block_quant,
            quant_config=self.quant_config,
            use_mxfp8=False,
            is_checkpoint_fp8_serialized=True,
            is_fp4_expert=True,
            params_dtype=params_dtype,
            with_bias=with_bias,
            fp4_scale_dtype=torch.float8_e8m0fnu,
            **extra_weight_attrs,
        )

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Nothing: the experts stay packed as loaded."""

    def apply(self, layer: nn.Module, dispatch_output) -> StandardCombineInput:
        config = layer.moe_runner_config
        if config.activation != "silu" or not config.is_gated or config.apply_router_weight_on_input:
            raise NotImplementedError(
                f"FP4 experts on the CPU platform run gated SiLU experts only (activation {config.activation!r})"
            )
        weights, experts, _ = dispatch_output.topk_output
        limit = config.swiglu_limit if config.swiglu_limit is not None else math.inf
        hidden = dequantized_grouped_experts(
            dispatch_output.hidden_states,
            weights,
            experts.long(),
            (layer.w13_weight, layer.w13_weight_scale_inv),
            (layer.w2_weight, layer.w2_weight_scale_inv),
            limit,
        )
        return StandardCombineInput(hidden_states=hidden)


def dequantized_grouped_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    w13: tuple[torch.Tensor, torch.Tensor],
    w2: tuple[torch.Tensor, torch.Tensor],
    limit: float,
) -> torch.Tensor:
    """:func:`~.model.experts.grouped_experts` over FP4 experts ``(packed, scales)``, of which only those some
    ``(token, slot)`` pair routes to are dequantized (one host read of which they are); -1 adds nothing.

    They are dequantized :data:`EXPERTS_PER_DEQUANTIZATION` at a time, each batch's pairs run
    and summed before the next: a prefill routes to every expert, and V4-Flash's 256 at once
    would be 25 GB of float32.
    """
    out = torch.zeros_like(x)
    for batch in experts[experts >= 0].unique().split(EXPERTS_PER_DEQUANTIZATION):
        compact = torch.full((w13[0].shape[0],), -1, dtype=torch.long, device=experts.device)
        compact[batch] = torch.arange(batch.numel(), device=experts.device)
        local = torch.where(experts >= 0, compact[experts.clamp(min=0)], -1)
        gate, up = dequantize_fp4(w13[0][batch], w13[1][batch]).to(x.dtype).chunk(2, dim=1)
        down = dequantize_fp4(w2[0][batch], w2[1][batch]).to(x.dtype)
        out += grouped_experts(x, weights, local, gate, down, up, limit)
    return out


def cpu_quant_method(original, config: Fp8Config, layer: nn.Module, prefix: str):
    """SGLang's choice for ``layer``; on the CPU platform its FP8 linear and FP4 MoE methods dequantizing per use."""
    method = original(config, layer, prefix)
    if not on_torch_cpu_platform() or type(method) not in (Fp8LinearMethod, Fp8MoEMethod):
        return method
    if type(method) is Fp8LinearMethod:
        if config.weight_block_size != [FP8_BLOCK, FP8_BLOCK]:
            raise NotImplementedError(
                f"{prefix}: FP8 runs on the CPU platform with {FP8_BLOCK}x{FP8_BLOCK} block scales only,"
                f" not weight_block_size {config.weight_block_size}"
            )
        return Fp8DequantLinearMethod(config)
    if not method.is_fp4_expert:
        raise NotImplementedError(f"{prefix}: FP8 routed experts do not run on the CPU platform (FP4 experts do)")
    return Fp4DequantMoEMethod(config)


def cpu_activation_dtypes(original, config: type[Fp8Config]) -> list[torch.dtype]:
    """SGLang's FP8 activation dtypes, and float32 on the CPU platform (its methods dequantize to any dtype)."""
    dtypes = original(config)
    return [*dtypes, torch.float32] if on_torch_cpu_platform() else dtypes
