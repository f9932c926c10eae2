"""The DeepSeek-V4 network for one request at a time, with explicit per-request state.

``model(input_ids, state)`` runs any number of new tokens (a prompt, a chunk of one,
or one decode step) after ``state.position`` tokens, returns their logits and advances
the state. Parameter names are the release checkpoint's (``embed``, ``layers.N.attn.wq_a``,
``layers.N.ffn.experts.w1`` stacked over experts, ``head``, ``mtp.0.e_proj``, ...).

A config with ``num_mtp_layers: 1`` adds the multi-token-prediction layer (:class:`MultiTokenPrediction`),
which drafts the token after next from the target's streams (:meth:`DeepseekV4.draft`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import nn

from ..config import DeepseekV4Config
from ..kernels.dispatch import mhc_post, mhc_post_pre, mhc_pre
from .attention import Attention
from .experts import MoE, RoutedExperts
from .linears import Layers, WholeLayers
from .mhc import HyperConnection, HyperHead
from .norms import RMSNorm
from .rope import Rotary, model_rotaries
from .state import RequestState

ExpertsFactory = Callable[[DeepseekV4Config, int], nn.Module]


class Block(nn.Module):
    """One layer: mHC around attention, then mHC around the MoE feed-forward (run by :func:`run_blocks`)."""

    def __init__(
        self,
        config: DeepseekV4Config,
        layer: int,
        plain_rotary: Rotary,
        compress_rotary: Rotary,
        routed_experts: ExpertsFactory,
        layers: Layers,
        attention_layers: Layers,
    ):
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config, layer, plain_rotary, compress_rotary, attention_layers)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ffn = MoE(config, layer, routed_experts(config, layer), layers)
        self.hc_attn = HyperConnection(config)
        self.hc_ffn = HyperConnection(config)


class MultiTokenPrediction(Block):
    """V4's multi-token-prediction layer ``mtp.I`` (layer ``num_layers + I``): from the target's streams of
    token ``t`` (before its ``hc_head``) and the embedding of token ``t + 1``, the streams that predict token ``t + 2``::

        h = h_proj(hnorm(streams_t))           each of the hc_mult streams
        e = e_proj(enorm(embed(token_t+1)))    the target's embedding, added to every stream
        streams' = Block(h + e)                one V4 block at position t: its own window (and compressors when
                                               its compress ratio is not 0), gated MoE
        logits_t+2 = head(norm(hc_head'(streams')))   its own hc_head and norm, the target's head

    The block's tensors are named as a main layer's, under ``mtp.I`` (``mtp.0.attn.wq_a``, ``mtp.0.hc_ffn_fn``).
    """

    def __init__(
        self,
        config: DeepseekV4Config,
        layer: int,
        plain_rotary: Rotary,
        compress_rotary: Rotary,
        routed_experts: ExpertsFactory,
        layers: Layers,
        attention_layers: Layers,
    ):
        super().__init__(config, layer, plain_rotary, compress_rotary, routed_experts, layers, attention_layers)
        name, hidden = config.layer_name(layer), config.hidden_size
        self.enorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, config.rms_norm_eps)
        self.e_proj = layers.replicated(hidden, hidden, f"{name}.e_proj")
        self.h_proj = layers.replicated(hidden, hidden, f"{name}.h_proj")
        self.hc_head = HyperHead(config)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)

    def forward(
        self, target_streams: torch.Tensor, next_embedding: torch.Tensor, next_ids: torch.Tensor, state: RequestState
    ) -> torch.Tensor:
        """``streams'`` ``[L, n, hidden]`` from ``target_streams [L, n, hidden]`` of tokens ``state.position ..``
        and ``next_embedding [L, hidden]`` of the tokens after each; advances ``state`` (this layer's)."""
        start = state.position
        mixed = self.h_proj(self.hnorm(target_streams)) + self.e_proj(self.enorm(next_embedding)).unsqueeze(1)
        streams = run_blocks(
            [self],
            mixed.contiguous(),
            attend=lambda layer, block, x: block.attn(x, start, state.layers[0]),
            feed_forward=lambda layer, block, x: block.ffn(x, next_ids),
        )
        state.position = start + target_streams.shape[0]
        return streams

    def hidden(self, streams: torch.Tensor) -> torch.Tensor:
        """The head's input ``norm(hc_head'(streams'))``, ``[L, hidden]``."""
        return self.norm(self.hc_head(streams))


Sublayer = Callable[[int, Block, torch.Tensor], torch.Tensor]


class Residual(Protocol):
    """Where the mHC residual streams live between sublayers, and how a sublayer's output reaches them.

    A sublayer's output is this process's partial sum (the whole output on one process, a
    rank's share under tensor parallelism: :mod:`.mhc_communicator`); the next sublayer's
    normed input ``x`` is returned for every token.
    """

    def pre(self, hc: HyperConnection, norm: RMSNorm, streams: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """From the embedded ``streams`` of every token: ``(held streams, x, post, comb)``."""
        ...

    def post_pre(
        self,
        output: torch.Tensor,
        streams: torch.Tensor,
        post: torch.Tensor,
        comb: torch.Tensor,
        next_hc: HyperConnection,
        next_norm: RMSNorm,
    ) -> tuple[torch.Tensor, ...]:
        """A sublayer's post fused with the next one's pre: ``(held streams, x, post, comb)``."""
        ...

    def post(self, output: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """The last sublayer's post: the held streams."""
        ...

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """Every token's rows of a tensor computed per token from the held streams."""
        ...


class WholeResidual:
    """Every token's streams in this process; a sublayer's output is already the whole sum."""

    def pre(self, hc: HyperConnection, norm: RMSNorm, streams: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (streams, *mhc_pre(hc, norm, streams))

    post_pre = staticmethod(mhc_post_pre)
    post = staticmethod(mhc_post)

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        return rows


def run_blocks(
    layers: Sequence[Block],
    streams: torch.Tensor,
    attend: Sublayer,
    feed_forward: Sublayer,
    residual: Residual = WholeResidual(),
) -> torch.Tensor:
    """The streams after every block; ``attend`` / ``feed_forward`` map ``(layer, block, normed input)`` to output.

    Each sublayer's mHC post is fused with the next sublayer's pre and input norm
    (:func:`sglang_dsv4.kernels.dispatch.mhc_post_pre`), across block boundaries too.
    """
    streams, x, post, comb = residual.pre(layers[0].hc_attn, layers[0].attn_norm, streams)
    for layer, block in enumerate(layers):
        attended = attend(layer, block, x)
        streams, x, post, comb = residual.post_pre(attended, streams, post, comb, block.hc_ffn, block.ffn_norm)
        output = feed_forward(layer, block, x)
        if layer + 1 < len(layers):
            following = layers[layer + 1]
            streams, x, post, comb = residual.post_pre(
                output, streams, post, comb, following.hc_attn, following.attn_norm
            )
    return residual.post(output, streams, post, comb)


class DeepseekV4(nn.Module):
    """The network; ``routed_experts(config, layer)`` builds each layer's routed experts (the torch
    reference's stacked weights unless the SGLang model passes its ``FusedMoE``), ``layers`` its
    projections, embedding and head (whole, unless the SGLang model passes its parallel layers), and
    ``attention_layers`` the attention's projections (``layers`` unless attention runs on a group of
    its own: the attention-TP group under attention data parallelism)."""

    def __init__(
        self,
        config: DeepseekV4Config,
        routed_experts: ExpertsFactory = lambda config, layer: RoutedExperts(config),
        layers: Layers = WholeLayers(),
        attention_layers: Layers | None = None,
    ):
        super().__init__()
        self.config = config
        plain, compress = model_rotaries(config)
        self.embed = layers.embedding(config.vocab_size, config.hidden_size, "embed")
        attention_layers = attention_layers or layers
        self.layers = nn.ModuleList(
            Block(config, i, plain, compress, routed_experts, layers, attention_layers)
            for i in range(config.num_layers)
        )
        self.hc_head = HyperHead(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = layers.head(config.vocab_size, config.hidden_size, "head")
        self.mtp = nn.ModuleList(
            MultiTokenPrediction(
                config, config.num_layers + i, plain, compress, routed_experts, layers, attention_layers
            )
            for i in range(config.num_mtp_layers)
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def new_state(self) -> RequestState:
        """The state of a request that has seen no token yet (with its MTP layer's, if the model has one)."""
        mtp = RequestState(0, [layer.attn.new_state(self.dtype, self.device) for layer in self.mtp]) if self.mtp else None
        return RequestState(0, [block.attn.new_state(self.dtype, self.device) for block in self.layers], mtp)

    def restore(self, snapshot: RequestState) -> RequestState:
        """A state that continues from ``snapshot`` (which stays reusable)."""
        if len(snapshot.layers) != len(self.layers):
            raise ValueError(f"snapshot has {len(snapshot.layers)} layers; this model has {len(self.layers)}")
        return snapshot.snapshot()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, state: RequestState) -> torch.Tensor:
        """Logits ``[len(input_ids), vocab]`` (float32) of the new tokens; advances ``state``."""
        return self.logits(input_ids, state)

    def logits(self, input_ids: torch.Tensor, state: RequestState) -> torch.Tensor:
        """:meth:`forward` with autograd (training): the same network, gradients kept."""
        return self.head_logits(self.streams(input_ids, state))

    def head_logits(self, streams: torch.Tensor) -> torch.Tensor:
        """Logits (float32) from the streams after the last layer: ``head(norm(hc_head(streams)))``."""
        return self.head(self.norm(self.hc_head(streams))).float()

    @torch.inference_mode()
    def draft(
        self, target_streams: torch.Tensor, next_ids: torch.Tensor, mtp_state: RequestState
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP layer's ``(logits [L, vocab] (float32), streams' [L, n, hidden])`` for the tokens after
        ``next_ids``, from the streams of the tokens before them (the target's :meth:`streams`, or a previous
        draft's ``streams'``) at positions ``mtp_state.position ..`` (a request's ``state.mtp``); advances it."""
        return self.draft_logits(target_streams, next_ids, mtp_state)

    def draft_logits(
        self, target_streams: torch.Tensor, next_ids: torch.Tensor, mtp_state: RequestState
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`draft` with autograd (training)."""
        if not self.mtp:
            raise ValueError("this model has no MTP layer (num_nextn_predict_layers: 0, or no mtp.* tensors)")
        mtp = self.mtp[0]
        next_ids = next_ids.to(self.device)
        streams = mtp(target_streams, self.embed(next_ids), next_ids, mtp_state)
        return self.head(mtp.hidden(streams)).float(), streams

    def streams(self, input_ids: torch.Tensor, state: RequestState) -> torch.Tensor:
        """The streams ``[L, n, hidden]`` of the new tokens after the last layer (before ``hc_head``): what
        the MTP layer reads; advances ``state``."""
        if input_ids.dim() != 1 or input_ids.numel() == 0:
            raise ValueError(
                f"input_ids must be 1-D and non-empty (one request's new tokens), got shape {tuple(input_ids.shape)}"
            )
        vocab = self.config.vocab_size
        if int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab:
            raise ValueError(
                f"token ids must be in [0, {vocab}); got min {int(input_ids.min())}, max {int(input_ids.max())}"
            )
        input_ids = input_ids.to(self.device)
        start = state.position
        streams = self.embed(input_ids).unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()
        streams = run_blocks(
            self.layers,
            streams,
            attend=lambda layer, block, x: block.attn(x, start, state.layers[layer]),
            feed_forward=lambda layer, block, x: block.ffn(x, input_ids),
        )
        state.position = start + input_ids.shape[0]
        return streams
