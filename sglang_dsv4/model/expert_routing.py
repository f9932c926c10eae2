"""Expert routing: the sqrt-softplus gate, learned top-k selection and hash routing.

Every MoE layer scores all experts with ``sqrt(softplus(x . W_e))``. Learned-gate
layers pick the top-k experts by score plus a correction bias (the bias only picks;
weights come from the unbiased scores). The first ``num_hash_layers`` layers pick by
a fixed table instead: ``tid2eid[token_id]`` (vocabulary x top-k). Weights are the
chosen scores, renormalised to sum to one and multiplied by ``routed_scaling_factor``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import DeepseekV4Config


def sqrt_softplus(logits: torch.Tensor) -> torch.Tensor:
    return F.softplus(logits).sqrt()


class Gate(nn.Module):
    """Router of one MoE layer (release names: ``gate.weight`` and ``gate.bias`` or ``gate.tid2eid``)."""

    def __init__(self, config: DeepseekV4Config, hashed: bool):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.scaling = config.routed_scaling_factor
        self.hashed = hashed
        self.weight = nn.Parameter(torch.zeros(config.n_routed_experts, config.hidden_size))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(config.vocab_size, self.top_k, dtype=torch.long))
        else:
            self.bias = nn.Parameter(torch.zeros(config.n_routed_experts))

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, top_k], expert ids [T, top_k])`` for tokens ``x [T, hidden]``."""
        scores = sqrt_softplus(F.linear(x, self.weight))
        if self.hashed:
            experts = self.tid2eid[token_ids].long()
        else:
            experts = (scores + self.bias).topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, experts
