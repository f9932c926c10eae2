"""Manifold-constrained hyper-connections (mHC): ``hc_mult`` residual streams per token.

Before each sublayer, a small projection of the (RMS-normalised, flattened) streams
gives three sets of weights: ``pre`` collapses the streams into the sublayer's input,
``post`` spreads the sublayer's output back over the streams, and ``comb`` mixes the
streams into each other. ``comb`` is pushed towards a doubly-stochastic matrix by
Sinkhorn iterations so the residual mixing cannot blow up across layers. All of it
is computed in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import DeepseekV4Config
from ..kernels.dispatch import mix_post
from .norms import rms_normalize


class HyperConnection(nn.Module):
    """The mHC around one sublayer. Parameters are a checkpoint's ``hc_{attn,ffn}_{fn,base,scale}``."""

    def __init__(self, config: DeepseekV4Config):
        super().__init__()
        n = config.hc_mult
        self.streams = n
        self.sinkhorn_iters = config.hc_sinkhorn_iters
        self.hc_eps = config.hc_eps
        self.norm_eps = config.rms_norm_eps
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * config.hidden_size))
        self.base = nn.Parameter(torch.zeros((2 + n) * n))
        self.scale = nn.Parameter(torch.ones(3))

    def pre(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``streams [L, n, hidden]`` -> ``(sublayer input [L, hidden], post [L, n], comb [L, n, n])``."""
        n = self.streams
        flat = rms_normalize(streams.flatten(1).float(), self.norm_eps)
        mixes = F.linear(flat, self.fn.float())
        pre_logits, post_logits, comb_logits = mixes.split([n, n, n * n], dim=-1)
        pre_base, post_base, comb_base = self.base.float().split([n, n, n * n])
        pre_scale, post_scale, comb_scale = self.scale.float().unbind(0)

        pre = torch.sigmoid(pre_logits * pre_scale + pre_base) + self.hc_eps
        post = 2 * torch.sigmoid(post_logits * post_scale + post_base)
        comb_logits = comb_logits.view(-1, n, n) * comb_scale + comb_base.view(n, n)
        comb = sinkhorn(torch.softmax(comb_logits, dim=-1) + self.hc_eps, self.sinkhorn_iters, self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return collapsed, post, comb

    # New streams ``post[k] * output + sum_j comb[j, k] * streams[j]``: it reads no parameter, so its torch
    # form is the kernels' own (dispatch.mhc_post chooses between it and the Triton kernel).
    post = staticmethod(mix_post)


def sinkhorn(matrix: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Alternate column and row normalisation: columns first, ``iters`` column passes in all."""
    matrix = matrix / (matrix.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        matrix = matrix / (matrix.sum(dim=-1, keepdim=True) + eps)
        matrix = matrix / (matrix.sum(dim=-2, keepdim=True) + eps)
    return matrix


class HyperHead(nn.Module):
    """The final collapse of the streams before the output norm (``hc_head_{fn,base,scale}``)."""

    def __init__(self, config: DeepseekV4Config):
        super().__init__()
        n = config.hc_mult
        self.hc_eps = config.hc_eps
        self.norm_eps = config.rms_norm_eps
        self.fn = nn.Parameter(torch.zeros(n, n * config.hidden_size))
        self.base = nn.Parameter(torch.zeros(n))
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = rms_normalize(streams.flatten(1).float(), self.norm_eps)
        pre = torch.sigmoid(F.linear(flat, self.fn.float()) * self.scale.float() + self.base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
