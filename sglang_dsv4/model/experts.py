"""The MoE feed-forward: routed SwiGLU experts (stacked weights) plus a shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import DeepseekV4Config
from .expert_routing import Gate
from .linears import Layers, WholeLayers


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)``."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class SharedExpert(nn.Module):
    """The clamped SwiGLU every token runs; under TP its intermediate dimension is split and the
    output is this rank's partial sum."""

    def __init__(self, hidden_size: int, intermediate_size: int, limit: float, layers: Layers, name: str):
        super().__init__()
        self.limit = limit
        self.w1 = layers.column(hidden_size, intermediate_size, f"{name}.w1")
        self.w2 = layers.row(intermediate_size, hidden_size, f"{name}.w2")
        self.w3 = layers.column(hidden_size, intermediate_size, f"{name}.w3")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(clamped_swiglu(self.w1(x), self.w3(x), self.limit))


class RoutedExperts(nn.Module):
    """All routed experts of a layer as stacked ``w1, w3 [E, I, H]`` and ``w2 [E, H, I]``."""

    def __init__(self, config: DeepseekV4Config):
        super().__init__()
        experts, hidden, inner = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.limit = config.swiglu_limit
        self.w1 = nn.Parameter(torch.zeros(experts, inner, hidden))
        self.w2 = nn.Parameter(torch.zeros(experts, hidden, inner))
        self.w3 = nn.Parameter(torch.zeros(experts, inner, hidden))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """``sum_j weights[t, j] * expert_{experts[t, j]}(x[t])``; an expert id of -1 (not on this rank) adds nothing."""
        return grouped_experts(x, weights, experts, self.w1, self.w2, self.w3, self.limit)


def grouped_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """The routed experts as one grouped pass: ``x [T, H]``, ``weights, experts [T, k]`` -> ``[T, H]``.

    The ``(token, slot)`` pairs are sorted by expert, so each expert's tokens are one contiguous
    group and every expert runs one GEMM per projection over its group
    (:func:`~sglang_dsv4.kernels.dispatch.grouped_gated_mlp`: a grouped GEMM on CUDA, a loop over the
    groups on the CPU after one read of their sizes). Pairs routed to -1 (an expert on another
    rank) sort last, outside every group, and add nothing; the results are weighted and summed
    back per token.
    """
    from ..kernels.dispatch import grouped_gated_mlp

    num_experts, top_k = w1.shape[0], experts.shape[1]
    flat = experts.reshape(-1)
    pair_expert = torch.where(flat >= 0, flat, num_experts)  # elsewhere: one past the last expert
    pairs = torch.argsort(pair_expert, stable=True)  # (token, slot) pair indices, grouped by expert
    # A scatter, not bincount: bincount reads its input's maximum back to the host.
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=x.device)
    group_sizes = counts.scatter_add_(0, pair_expert, torch.ones_like(pair_expert))[:num_experts]
    token_of_pair = pairs // top_k
    hidden = grouped_gated_mlp(
        x[token_of_pair], group_sizes, w1, w3, w2, lambda gate, up: clamped_swiglu(gate, up, limit)
    )
    local = (pair_expert[pairs] < num_experts)[:, None]
    scaled = torch.where(local, hidden * weights.reshape(-1)[pairs, None].to(hidden.dtype), 0)
    return torch.zeros_like(x).index_add_(0, token_of_pair, scaled.to(x.dtype))


class MoE(nn.Module):
    def __init__(self, config: DeepseekV4Config, layer: int, experts: nn.Module, layers: Layers = WholeLayers()):
        """``experts``: the layer's routed experts, called as ``experts(x, weights, expert ids)``; under TP
        they return this rank's partial sum, as the shared expert does (the residual sums them: ``network.Residual``)."""
        super().__init__()
        self.gate = Gate(config, hashed=config.is_hash_layer(layer))
        self.experts = experts
        self.shared_experts = SharedExpert(
            config.hidden_size,
            config.moe_intermediate_size,
            config.swiglu_limit,
            layers,
            f"{config.layer_name(layer)}.ffn.shared_experts",
        )

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        weights, experts = self.gate(x, token_ids)
        return self.experts(x, weights, experts) + self.shared_experts(x)
