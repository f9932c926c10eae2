"""DeepSeek-V4 as an SGLang model: the network's modules driven by SGLang's forward batch.

Everything but attention runs batched over all new tokens of the batch (embedding, mHC,
norms, MoE, head); attention goes through the attention backend, which reads and writes
each request's state in the V4 pool. Under ``--tp`` the projections, embedding and head are
SGLang's parallel layers (:mod:`.sglang_layers`): each rank holds its query heads, output
groups and vocabulary rows, the pools hold the replicated KV head, and the mHC residual
streams are sharded by tokens between sublayers (:class:`~.mhc_communicator.TokenShardedResidual`).

Under attention data parallelism (``--attn-dp-size D``) each DP rank has its own requests: the
embedding is whole, attention and mHC run on the rank's rows over its attention-TP group
(``tp / D`` ranks), and the MoE over every DP rank's rows (:mod:`.dp_feed_forward`); the head is
SGLang's, whose logits processor gathers the DP ranks' rows itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from sglang.srt.eplb.expert_location import ModelConfigForExpertLocation
from sglang.srt.layers.dp_attention import get_dp_tp_group, is_dp_attention_enabled
from sglang.srt.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.model_executor.forward_context import get_attn_backend
from torch import nn

from ..required_hooks import require_hooks_applied
from ..served_config import served_config
from .checkpoint_check import check_checkpoint, shard_files
from .dp_feed_forward import GatheredFeedForward
from .fused_moe import FusedRoutedExperts
from .loader import load_weights, read_safetensors
from .mhc_communicator import TokenShardedResidual, TokenShards
from .network import DeepseekV4, Residual, Sublayer, WholeResidual, run_blocks
from .sglang_layers import SGLangLayers


class DeepseekV4ForCausalLM(nn.Module):
    """Registered under the checkpoint's architecture name, ``DeepseekV4ForCausalLM``."""

    def __init__(self, config, quant_config=None, prefix: str = ""):
        require_hooks_applied()
        super().__init__()
        self.config = config
        self.v4_config = served_config(config)
        # The MTP layer is the draft model's (sglang_draft.py): its tensors are checked here and skipped.
        self.network = DeepseekV4(
            self.v4_config.without_mtp(),
            routed_experts=lambda config, layer: FusedRoutedExperts(config, layer, quant_config),
            layers=SGLangLayers(quant_config),
            attention_layers=attention_layers(quant_config),
        )
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
        residual = residual_of_attention_group(input_ids.shape[0])
        streams = run_blocks(
            network.layers,
            streams,
            attend=lambda layer, block, x: attention_backend.attend(block.attn, layer, x, forward_batch),
            feed_forward=parallel_feed_forward(input_ids, forward_batch),
            residual=residual,
        )
        hidden = residual.gather(network.norm(network.hc_head(streams)))
        # The streams before hc_head are what an EAGLE draft (the MTP layer) reads; SGLang keeps them only
        # when its forward asks for hidden states.
        capture = forward_batch.capture_hidden_mode
        before_head = residual.gather(streams.flatten(1)) if capture is not None and capture.need_capture() else None
        return self.logits_processor(
            input_ids, hidden, network.head, forward_batch, hidden_states_before_norm=before_head
        )

    def get_embed_and_head(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The embedding and head weights SGLang's draft worker shares with the MTP layer."""
        return self.network.embed.weight, self.network.head.weight

    @classmethod
    def get_model_config_for_expert_location(cls, config) -> ModelConfigForExpertLocation:
        """What SGLang's expert-location loader (``--init-expert-location``) plans over."""
        v4_config = served_config(config)
        return ModelConfigForExpertLocation(
            num_layers=v4_config.num_layers, num_logical_experts=v4_config.n_routed_experts, num_groups=None
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The checkpoint folder's tensors one at a time, after its headers are checked (nothing read yet).

        SGLang's default safetensors reader keeps about ten whole shard files in flight (its
        multi-threaded window), each ~5 GB in a release checkpoint; read here, a rank holds one
        tensor beyond its own shard of the model. SGLang's iterator (a generator, not started)
        is used only when the model is not a local folder.
        """
        folder = Path(getattr(self.config, "_name_or_path", ""))
        if (folder / "config.json").is_file():
            check_checkpoint(folder, self.v4_config)
            weights = read_safetensors(shard_files(folder))
        load_weights(self.network, weights, dtype=self.network.dtype)


def attention_layers(quant_config=None) -> SGLangLayers:
    """The attention's projections: split over the ranks that hold the same requests (the TP group, or under
    attention DP the attention-TP group)."""
    return SGLangLayers(quant_config, "attn_tp" if is_dp_attention_enabled() else "tp")


def residual_of_attention_group(tokens: int) -> Residual:
    """Where a forward of ``tokens`` keeps its streams. One rank per request group: the whole streams.
    Otherwise this rank's token shard of them, within the group holding the same requests (the TP group, or
    under attention DP the attention-TP group; mHC fused with the communicator, :mod:`.mhc_communicator`)."""
    group = get_dp_tp_group()
    if group is None or group.world_size == 1:
        return WholeResidual()
    return TokenShardedResidual(TokenShards(tokens, group.world_size, group.rank_in_group), group.device_group)


def parallel_feed_forward(input_ids: torch.Tensor, forward_batch: ForwardBatch) -> Sublayer:
    """A forward's MoE sublayer: on this rank's rows, or under attention DP over every DP rank's
    (:class:`~.dp_feed_forward.GatheredFeedForward`, whose collectives every DP rank joins, idle ones too)."""
    if not is_dp_attention_enabled():
        return lambda layer, block, x: block.ffn(x, input_ids)
    gathered = GatheredFeedForward(input_ids, forward_batch)
    return lambda layer, block, x: gathered(block.ffn, x)
