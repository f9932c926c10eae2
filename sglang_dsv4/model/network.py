"""The DeepSeek-V4 network for one request at a time, with explicit per-request state.

``model(input_ids, state)`` runs any number of new tokens (a prompt, a chunk of one,
or one decode step) after ``state.position`` tokens, returns their logits and advances
the state. Parameter names are the release checkpoint's (``embed``, ``layers.N.attn.wq_a``,
``layers.N.ffn.experts.w1`` stacked over experts, ``head``, ...).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import nn

from ..config import DeepseekV4Config
from ..moe import MoE
from ..moe.experts import RoutedExperts
from .attention import Attention
from .kernel_calls import mhc_post, mhc_post_pre, mhc_pre
from .linears import Layers, WholeLayers
from .mhc import HyperConnection, HyperHead
from .norms import RMSNorm
from .rope import Rotary
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
    (:func:`sglang_dsv4.model.kernel_calls.mhc_post_pre`), across block boundaries too.
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
        plain = Rotary(config.rope_head_dim, config.rope_theta, None)
        compress = Rotary(config.rope_head_dim, config.compress_rope_theta, config.yarn)
        self.embed = layers.embedding(config.vocab_size, config.hidden_size, "embed")
        self.layers = nn.ModuleList(
            Block(config, i, plain, compress, routed_experts, layers, attention_layers or layers)
            for i in range(config.num_layers)
        )
        self.hc_head = HyperHead(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = layers.head(config.vocab_size, config.hidden_size, "head")

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def new_state(self) -> RequestState:
        """The state of a request that has seen no token yet."""
        return RequestState(0, [block.attn.new_state(self.dtype, self.device) for block in self.layers])

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
        return self.head(self.norm(self.hc_head(streams))).float()
