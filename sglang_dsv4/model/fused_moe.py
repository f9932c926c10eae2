"""The served model's routed experts: SGLang's ``FusedMoE``, with V4's routing in front of it.

V4's gate (:class:`~.expert_routing.Gate`: sqrt-softplus scores, the correction bias, hash routing by
token id, the routed scaling) picks logical experts; SGLang's expert placement maps them to
physical slots (``--init-expert-location``, ``--ep-dispatch-algorithm``, redundant experts) and
``FusedMoE`` runs them: its dispatcher (``--ep-size``: experts of other ranks become -1), its
weight loader (each rank loads its slots' experts), its quantization methods and, on CUDA, its
kernels with the ``swiglu_limit`` clamp.

On this package's CPU platform SGLang's own forward for unquantized experts
(``moe_forward_native``) loops over experts with host syncs, ignores the clamp and cannot
take the -1 of EP, so :func:`register_cpu_forward` puts V4's grouped pass
(:func:`~.experts.grouped_experts`) behind ``UnquantizedFusedMoEMethod`` for that platform.
"""

from __future__ import annotations

import math

import torch
from sglang.kernels.fused_op import BaseFusedOp
from sglang.srt.eplb.expert_location_dispatch import ExpertLocationDispatchInfo, topk_ids_logical_to_physical
from sglang.srt.layers.moe.ep_moe.layer import get_moe_impl_class
from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput
from sglang.srt.layers.moe.topk import StandardTopKOutput
from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod
from sglang.srt.runtime_context import get_exec
from torch import nn

from ..config import DeepseekV4Config
from .experts import grouped_experts

# The checkpoint's names of an expert's projections -> FusedMoE's shard ids (w1, w3 fill w13).
SHARDS = {"w1": "w1", "w2": "w2", "w3": "w3"}


class FusedRoutedExperts(nn.Module):
    """Layer ``layer``'s routed experts on SGLang's ``FusedMoE``; called as :class:`~.experts.RoutedExperts` is."""

    def __init__(self, config: DeepseekV4Config, layer: int, quant_config=None):
        super().__init__()
        self.layer = layer
        limit = config.swiglu_limit if math.isfinite(config.swiglu_limit) else None
        self.fused = get_moe_impl_class(quant_config)(
            num_experts=config.n_routed_experts + get_exec().moe.ep_num_redundant_experts,
            top_k=config.num_experts_per_tok,
            hidden_size=config.hidden_size,
            intermediate_size=config.moe_intermediate_size,
            layer_id=layer,
            quant_config=quant_config,
            swiglu_limit=limit,
            prefix=f"{config.layer_name(layer)}.ffn.experts",
        )

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """``x [T, H]`` through the logical ``experts [T, k]`` with ``weights [T, k]`` (already scaled)."""
        physical = topk_ids_logical_to_physical(experts, ExpertLocationDispatchInfo.init_new(layer_id=self.layer))
        # V4 routes before FusedMoE (hash layers by token id): there are no logits for it to route from.
        no_logits = x.new_empty(x.shape[0], 0)
        routing = StandardTopKOutput(topk_weights=weights.float(), topk_ids=physical.int(), router_logits=no_logits)
        return self.fused(x, routing)

    @property
    def quantized(self) -> bool:
        """Whether the experts are held as the checkpoint stores them, with block scales (FP4 experts)."""
        return hasattr(self.fused, "w13_weight_scale_inv")

    def load(self, expert: int, projection: str, tensor: torch.Tensor, *, scale: bool = False) -> None:
        """Checkpoint tensor ``experts.{expert}.{projection}.weight`` (or its block ``scale``), into every slot
        that holds the expert."""
        name = "weight_scale_inv" if scale else "weight"
        param = getattr(self.fused, f"{'w2' if projection == 'w2' else 'w13'}_{name}")
        self.fused.weight_loader(param, tensor, f"experts.{expert}.{projection}.{name}", SHARDS[projection], expert)


def grouped_cpu_forward(method: UnquantizedFusedMoEMethod, layer: nn.Module, dispatch_output) -> StandardCombineInput:
    """``FusedMoE``'s unquantized forward on the CPU platform: V4's grouped pass over the local experts."""
    config = layer.moe_runner_config
    if config.activation != "silu" or not config.is_gated or config.apply_router_weight_on_input:
        return method.forward_cpu(layer=layer, dispatch_output=dispatch_output)
    weights, experts, _ = dispatch_output.topk_output
    w1, w3 = layer.w13_weight.chunk(2, dim=1)
    limit = config.swiglu_limit if config.swiglu_limit is not None else math.inf
    hidden = grouped_experts(dispatch_output.hidden_states, weights, experts.long(), w1, layer.w2_weight, w3, limit)
    return StandardCombineInput(hidden_states=hidden)


def register_cpu_forward(platform_key: str) -> None:
    """Put :func:`grouped_cpu_forward` behind unquantized ``FusedMoE`` on the platform with this dispatch key."""
    BaseFusedOp.register_oot_forward(UnquantizedFusedMoEMethod, grouped_cpu_forward, platform_key)
