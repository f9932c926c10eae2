"""DeepSeek-V4's MTP layer as SGLang's EAGLE draft model, ``DeepseekV4ForCausalLMNextN``.

SGLang's draft worker loads the target's checkpoint a second time under this architecture (its
``--speculative-algorithm EAGLE``, or ``NEXTN``) and hands the forward batch the target's streams of each
token before its ``hc_head`` (``spec_info.hidden_states``, ``[tokens, hc_mult * hidden]``: what the target
returns as ``hidden_states_before_norm``), or during drafting the previous draft step's own. Per token ``t``
with the next token ``input_ids[t]`` (:class:`~.network.MultiTokenPrediction`)::

    streams' = Block(h_proj(hnorm(streams_t)) + e_proj(enorm(embed(input_ids_t))))
    logits   = head(norm(hc_head'(streams')))

Embedding and head are the target's (SGLang calls :meth:`set_embed_and_head` with the target's
:meth:`~.sglang_model.DeepseekV4ForCausalLM.get_embed_and_head`). The layer's attention state lives in the
target's V4 pool as its last layer (``num_layers``), at the target's positions and through the same request
tables (the draft's attention backend is built over the target's pool).

SGLang runs the draft in the target's parallel layout, and so does the layer (:mod:`.sglang_model`'s helpers):
its attention split over the ranks that hold the same requests, its streams token-sharded within them, and under
attention DP its MoE over every DP rank's rows.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from sglang.srt.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.model_executor.forward_context import get_attn_backend
from torch import nn

from ..served_config import served_config
from .checkpoint_check import check_checkpoint, shard_files
from .fused_moe import FusedRoutedExperts
from .loader import load_weights, read_safetensors, release_name
from .network import MultiTokenPrediction, run_blocks
from .rope import model_rotaries
from .sglang_layers import SGLangLayers
from .sglang_model import attention_layers, parallel_feed_forward, residual_of_attention_group

DRAFT_ARCHITECTURE = "DeepseekV4ForCausalLMNextN"


class MultiTokenPredictionLayers(nn.Module):
    """The MTP layers alone, named as in the checkpoint (``mtp.0.*``): what the loader fills for the draft."""

    def __init__(self, config, quant_config=None):
        super().__init__()
        plain, compress = model_rotaries(config)
        self.mtp = nn.ModuleList(
            MultiTokenPrediction(
                config,
                config.num_layers + i,
                plain,
                compress,
                lambda config, layer: FusedRoutedExperts(config, layer, quant_config),
                SGLangLayers(quant_config),
                attention_layers(quant_config),
            )
            for i in range(config.num_mtp_layers)
        )


class DeepseekV4ForCausalLMNextN(nn.Module):
    """Registered under the draft architecture SGLang gives a V4 checkpoint's MTP layer."""

    def __init__(self, config, quant_config=None, prefix: str = ""):
        # Built after the target model (DeepseekV4ForCausalLM), which refused to start if a hook did not apply.
        super().__init__()
        self.config = config
        self.v4_config = served_config(config)
        if self.v4_config.num_mtp_layers != 1:
            raise ValueError("the draft model needs the checkpoint's MTP layer (num_nextn_predict_layers: 1)")
        self.network = MultiTokenPredictionLayers(self.v4_config, quant_config)
        layers = SGLangLayers(quant_config)
        hidden = self.v4_config.hidden_size
        # Placeholders until SGLang hands over the target's (set_embed_and_head): not loaded, not counted.
        self.embed = layers.embedding(self.v4_config.vocab_size, hidden, "embed")
        self.head = layers.head(self.v4_config.vocab_size, hidden, "head")
        self.logits_processor = LogitsProcessor(config)

    @property
    def pool_layer(self) -> int:
        """The MTP layer's number in the pool (after the target's layers)."""
        return self.v4_config.num_layers

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: ForwardBatch,
        input_embeds: torch.Tensor | None = None,
        **kwargs,
    ) -> LogitsProcessorOutput:
        mtp = self.network.mtp[0]
        config = self.v4_config
        attention_backend = get_attn_backend()
        tokens = input_ids.shape[0]
        before = forward_batch.spec_info.hidden_states.view(tokens, config.hc_mult, config.hidden_size)
        mixed = mtp.h_proj(mtp.hnorm(before.to(self.embed.weight.dtype)))
        mixed = mixed + mtp.e_proj(mtp.enorm(self.embed(input_ids))).unsqueeze(1)
        residual = residual_of_attention_group(tokens)
        streams = run_blocks(
            [mtp],
            mixed.contiguous(),
            attend=lambda layer, block, x: attention_backend.attend(block.attn, self.pool_layer, x, forward_batch),
            feed_forward=parallel_feed_forward(input_ids, forward_batch),
            residual=residual,
        )
        return self.logits_processor(
            input_ids,
            residual.gather(mtp.hidden(streams)),
            self.head,
            forward_batch,
            hidden_states_before_norm=residual.gather(streams.flatten(1)),
        )

    def set_embed_and_head(self, embed: torch.Tensor, head: torch.Tensor) -> None:
        """The target's embedding and head weights, shared (SGLang's draft worker calls this after loading)."""
        del self.embed.weight
        del self.head.weight
        self.embed.weight = embed
        self.head.weight = head

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The checkpoint's ``mtp.*`` tensors (the target loads the rest)."""
        folder = Path(getattr(self.config, "_name_or_path", ""))
        if (folder / "config.json").is_file():
            check_checkpoint(folder, self.v4_config)
            weights = read_safetensors(shard_files(folder))
        mtp_only = ((name, tensor) for name, tensor in weights if release_name(name).startswith("mtp."))
        load_weights(self.network, mtp_only, dtype=self.embed.weight.dtype)
