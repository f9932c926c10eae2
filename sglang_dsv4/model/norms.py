"""RMS normalisation, with and without a learned scale."""

from __future__ import annotations

import torch
from torch import nn


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Scale ``x`` to unit root-mean-square over its last dim (computed in float32)."""
    inv_rms = torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps)
    return x * inv_rms.to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm with a learned per-channel scale."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)
