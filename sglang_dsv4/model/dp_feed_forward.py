"""The MoE feed-forward under attention data parallelism: every DP rank's rows in, each rank's own rows out.

Each DP rank runs attention (and mHC) on its own requests' rows; the FFN's experts are split
over the whole TP group (EP, MoE-TP, the shared expert's intermediate dimension), so each
rank needs every DP rank's rows. Through SGLang's DP-attention gather
(:mod:`sglang.srt.layers.dp_attention`)::

    rows   = dp_gather_replicate(x)           # every DP rank's normed input, in DP rank order
    ids    = dp_gather_replicate(input_ids)   # once per forward: the hash layers route by token id
    output = all_reduce_TP(ffn(rows, ids))    # this rank's partial sum, summed over the TP group
    mine   = dp_scatter(output)               # this DP rank's rows

The attention-TP group's ranks hold the same rows; the gather takes them once (attention-TP
rank 0's copy) and every rank gets its rows back whole. The residual sums its sublayer
outputs over the attention-TP group (:class:`~.mhc_communicator.TokenShardedResidual`), so
the other ranks of that group hand it zeros.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from sglang.srt.distributed.parallel_state import get_tp_group
from sglang.srt.layers.dp_attention import (
    dp_gather_replicate,
    dp_scatter,
    get_global_dp_buffer,
    get_global_dp_buffer_len,
    get_local_dp_buffer,
)
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.runtime_context import get_parallel
from torch import nn


class GatheredFeedForward:
    """One forward's DP gather: :meth:`__call__` runs a layer's MoE over every DP rank's rows."""

    def __init__(self, input_ids: torch.Tensor, forward_batch: ForwardBatch):
        self.forward_batch = forward_batch
        self.tp = get_tp_group()
        self.first_of_attention_group = get_parallel().attn_tp_rank == 0
        ids = input_ids.new_empty(get_global_dp_buffer_len(), 1)
        dp_gather_replicate(ids, input_ids[:, None].clone(), forward_batch)
        self.input_ids = ids.squeeze(1)

    def __call__(self, ffn: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``ffn``'s output for this rank's rows ``x [tokens, hidden]``, as this rank's share of the
        attention-TP group's sum."""
        rows = get_global_dp_buffer(self.tp)
        dp_gather_replicate(rows, x.contiguous(), self.forward_batch)
        output = ffn(rows, self.input_ids).contiguous()
        dist.all_reduce(output, group=self.tp.device_group)
        mine = get_local_dp_buffer(self.tp)
        dp_scatter(mine, output, self.forward_batch)
        return mine if self.first_of_attention_group else torch.zeros_like(mine)
