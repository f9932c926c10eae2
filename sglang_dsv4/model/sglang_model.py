"""DeepSeek-V4 as an SGLang model: the network's modules driven by SGLang's forward batch.

Everything but attention runs batched over all new tokens of the batch (embedding, mHC,
norms, MoE, head); attention goes through the attention backend, which reads and writes
each request's state in the V4 pool.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from sglang.srt.eplb.expert_location import ModelConfigForExpertLocation, get_global_expert_location_metadata
from sglang.srt.eplb.expert_location_dispatch import ExpertLocationDispatchInfo, topk_ids_logical_to_physical
from sglang.srt.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.model_executor.forward_context import get_attn_backend
from torch import nn

from ..served_config import served_config
from .loader import load_weights
from .network import DeepseekV4, run_blocks


class DeepseekV4ForCausalLM(nn.Module):
    """Registered under the checkpoint's architecture name, ``DeepseekV4ForCausalLM``."""

    def __init__(self, config, quant_config=None, prefix: str = ""):
        from ..plugin import require_hooks_applied

        require_hooks_applied()
        super().__init__()
        self.config = config
        self.v4_config = served_config(config)
        self.network = DeepseekV4(self.v4_config)
        self.logits_processor = LogitsProcessor(config)

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: ForwardBatch,
        input_embeds: torch.Tensor | None = None,
        **kwargs,
    ) -> LogitsProcessorOutput:
        if input_embeds is not None:
            raise ValueError(
                "DeepSeek-V4 routes its first MoE layers by token id (hash routing): it needs input_ids, "
                "not input embeddings"
            )
        network = self.network
        attention_backend = get_attn_backend()
        streams = network.embed(input_ids).unsqueeze(1).expand(-1, self.v4_config.hc_mult, -1).contiguous()
        streams = run_blocks(
            network.layers,
            streams,
            attend=lambda layer, block, x: attention_backend.attend(block.attn, layer, x, forward_batch),
            feed_forward=lambda layer, block, x: self._moe(layer, block.ffn, x, input_ids),
        )
        hidden = network.norm(network.hc_head(streams))
        return self.logits_processor(input_ids, hidden, network.head, forward_batch)

    @staticmethod
    def _moe(layer: int, moe, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """The MoE, routed through SGLang's expert placement when one is in force.

        Logical experts are mapped to physical slots as SGLang's dispatcher chooses
        (``--init-expert-location``, ``--ep-dispatch-algorithm``); on one device every slot
        holds its logical expert's weights, so the slot is read back as that expert.
        """
        weights, experts = moe.gate(x, input_ids)
        dispatch = ExpertLocationDispatchInfo.init_new(layer_id=layer)
        if dispatch is not None:
            physical = topk_ids_logical_to_physical(experts, dispatch)
            placement = get_global_expert_location_metadata()
            experts = placement.physical_to_logical_map[layer].to(experts.device)[physical].long()
        return moe.experts(x, weights, experts) + moe.shared_experts(x)

    @classmethod
    def get_model_config_for_expert_location(cls, config) -> ModelConfigForExpertLocation:
        """What SGLang's expert-location loader (``--init-expert-location``) plans over."""
        v4_config = served_config(config)
        return ModelConfigForExpertLocation(
            num_layers=v4_config.num_layers, num_logical_experts=v4_config.n_routed_experts, num_groups=None
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_weights(self.network, weights, dtype=self.network.dtype)
