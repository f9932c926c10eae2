"""The lightning indexer of ratio-4 (CSA) layers: which compressed entries each query reads.

It keeps its own overlapping compressor at ``index_head_dim`` (its entries are the
indexer keys), scores every key visible to a query as
``sum_h w_h * ReLU(q_h . k) / sqrt(index_head_dim)`` with per-token head weights
``w = weights_proj(x) / sqrt(index_n_heads)``, and keeps the ``index_topk`` best.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import DeepseekV4Config
from ..kernels.dispatch import normalize_rope, select_visible
from ..kernels.sparse_torch import top_k_earliest_ties
from .compressor import Compressor, CompressorState
from .linears import Layers, WholeLayers
from .rope import ForwardRope, Rotary, apply_rope


class Indexer(nn.Module):
    def __init__(self, config: DeepseekV4Config, rotary: Rotary, layers: Layers = WholeLayers(), name: str = "indexer"):
        super().__init__()
        self.num_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.topk = config.index_topk
        self.rotary = rotary
        # Whole on every rank: the top-k needs the score summed over all heads (model/weight_layout.py).
        self.wq_b = layers.replicated(config.q_lora_rank, self.num_heads * self.head_dim, f"{name}.wq_b")
        self.weights_proj = nn.Linear(config.hidden_size, self.num_heads, bias=False)
        self.compressor = Compressor(
            config.hidden_size, self.head_dim, config.csa_rate, True, rotary, config.rms_norm_eps
        )

    def queries(
        self, x: torch.Tensor, q_residual: torch.Tensor, rope: ForwardRope
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Index queries ``[L, heads, head_dim]`` roped at the forward's tables ``rope``, and their head weights
        ``[L, heads]`` (float32)."""
        q = self.wq_b(q_residual).view(x.shape[0], self.num_heads, self.head_dim)
        cos, sin = rope.cos_sin(self.rotary)
        head_weights = self.weights_proj(x).float() * self.num_heads**-0.5
        return normalize_rope(q, cos, sin, apply_rope), head_weights

    def scores(self, x: torch.Tensor, q_residual: torch.Tensor, rope: ForwardRope, keys: torch.Tensor) -> torch.Tensor:
        """Index scores ``[L, num_keys]`` of every query against every key (float32)."""
        q, head_weights = self.queries(x, q_residual, rope)
        dots = torch.einsum("lhd,kd->lhk", q.float(), keys.float()).relu() * self.head_dim**-0.5
        return torch.einsum("lhk,lh->lk", dots, head_weights)

    def select(
        self,
        x: torch.Tensor,
        q_residual: torch.Tensor,
        rope: ForwardRope,
        state: CompressorState,
        visible: torch.Tensor,
    ) -> torch.Tensor:
        """Boolean ``[L, num_keys]``: the top-k visible keys of each query (``rope``: the tables at its position).

        ``state`` must already hold the keys of every block complete at the chunk's end;
        ``visible`` marks the keys whose block is complete at each query's position.
        """
        keys = state.entries
        if keys.shape[0] == 0:
            return visible
        return select_visible(self, x, q_residual, rope, keys, visible)

    def select_reference(
        self,
        x: torch.Tensor,
        q_residual: torch.Tensor,
        rope: ForwardRope,
        keys: torch.Tensor,
        visible: torch.Tensor,
    ) -> torch.Tensor:
        """:meth:`select` in torch, over keys ``[num_keys, index_head_dim]``; of keys with equal scores the
        earliest are taken (:func:`~sglang_dsv4.kernels.sparse_torch.top_k_earliest_ties`)."""
        scores = self.scores(x, q_residual, rope, keys).masked_fill(~visible, float("-inf"))
        _, top = top_k_earliest_ties(scores, self.topk)
        chosen = torch.zeros_like(visible).scatter_(-1, top, True)
        return chosen & visible
