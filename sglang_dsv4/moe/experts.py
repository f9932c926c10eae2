"""The MoE feed-forward: routed SwiGLU experts (stacked weights) plus a shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import DeepseekV4Config
from .routing import Gate


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)``."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class SharedExpert(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, limit: float):
        super().__init__()
        self.limit = limit
        self.w1 = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.w2 = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.w3 = nn.Linear(hidden_size, intermediate_size, bias=False)

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
        out = torch.zeros_like(x)
        for expert in experts.unique().tolist():
            token, slot = (experts == expert).nonzero(as_tuple=True)
            hidden = clamped_swiglu(x[token] @ self.w1[expert].T, x[token] @ self.w3[expert].T, self.limit)
            out.index_add_(0, token, (hidden @ self.w2[expert].T) * weights[token, slot, None].to(x.dtype))
        return out


class MoE(nn.Module):
    def __init__(self, config: DeepseekV4Config, layer: int):
        super().__init__()
        self.gate = Gate(config, hashed=config.is_hash_layer(layer))
        self.experts = RoutedExperts(config)
        self.shared_experts = SharedExpert(config.hidden_size, config.moe_intermediate_size, config.swiglu_limit)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        weights, experts = self.gate(x, token_ids)
        return self.experts(x, weights, experts) + self.shared_experts(x)
