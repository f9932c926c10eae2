"""V4 attention: shared-KV MQA over the sliding window and the compressed entries.

Every layer attends to the raw KV of the last ``sliding_window`` tokens. Ratio-4
(CSA) layers also attend to the compressed entries their indexer selects, ratio-128
(HCA) layers to every complete compressed entry. One softmax covers both, plus a
per-head attention sink. Keys double as values, so the rope on the values is undone
on the output (inverse rope at the query position) before the grouped output
projection.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import DeepseekV4Config
from ..kernels.dispatch import attend_visible, normalize_rope, rms_norm
from ..kernels.kv_format import RowFormat
from .compressor import Compressor, CompressorState
from .indexer import Indexer
from .linears import Layers, WholeLayers
from .norms import RMSNorm, rms_normalize
from .rope import ForwardRope, Rotary, apply_rope
from .state import LayerState


class Attention(nn.Module):
    def __init__(
        self,
        config: DeepseekV4Config,
        layer: int,
        plain_rotary: Rotary,
        compress_rotary: Rotary,
        layers: Layers = WholeLayers(),
    ):
        """Under tensor parallelism this rank's query heads and output groups (``1 / tp`` of each)."""
        super().__init__()
        name = f"{config.layer_name(layer)}.attn"
        self.kind = config.layer_kind(layer)
        self.num_heads = config.num_heads // layers.tp_size
        self.head_dim = config.head_dim
        self.window = config.sliding_window
        self.o_groups = config.o_groups // layers.tp_size
        self.eps = config.rms_norm_eps
        self.rotary = plain_rotary if self.kind == "window" else compress_rotary
        self.wq_a = layers.replicated(config.hidden_size, config.q_lora_rank, f"{name}.wq_a")
        self.q_norm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.wq_b = layers.column(config.q_lora_rank, config.num_heads * config.head_dim, f"{name}.wq_b")
        self.wkv = layers.replicated(config.hidden_size, config.head_dim, f"{name}.wkv")
        self.kv_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        group_width = config.num_heads * config.head_dim // config.o_groups
        self.wo_a = layers.column(group_width, config.o_groups * config.o_lora_rank, f"{name}.wo_a", quantized=False)
        self.wo_b = layers.row(config.o_groups * config.o_lora_rank, config.hidden_size, f"{name}.wo_b")
        self.attn_sink = layers.sharded(config.num_heads)
        self.compressor: Compressor | None = None
        self.indexer: Indexer | None = None
        if self.kind != "window":
            ratio = config.csa_rate if self.kind == "csa" else config.hca_rate
            self.compressor = Compressor(
                config.hidden_size, config.head_dim, ratio, self.kind == "csa", compress_rotary, config.rms_norm_eps
            )
        if self.kind == "csa":
            self.indexer = Indexer(config, compress_rotary, layers, f"{name}.indexer")

    def new_state(self, dtype: torch.dtype, device: torch.device | str) -> LayerState:
        window = torch.zeros(0, self.head_dim, dtype=dtype, device=device)
        compressor = self.compressor.new_state(dtype, device) if self.compressor is not None else None
        indexer = self.indexer.compressor.new_state(dtype, device) if self.indexer is not None else None
        return LayerState(window, compressor, indexer)

    def forward(self, x: torch.Tensor, start: int, state: LayerState) -> torch.Tensor:
        """Attend tokens ``start .. start + L - 1`` (``x``: ``[L, hidden]``), advancing ``state``."""
        length = x.shape[0]
        positions = torch.arange(start, start + length, device=x.device)
        rope = ForwardRope.at(positions, (self.rotary,))
        q_residual, q, kv, cos, sin = self.project(x, rope)
        if state.stored_as is not None:
            kv = state.stored_as.entries.round_trip(kv)

        keys = torch.cat([state.window, kv])
        key_positions = torch.arange(start - state.window.shape[0], start + length, device=x.device)
        offsets = positions[:, None] - key_positions[None, :]
        visible = (offsets >= 0) & (offsets < self.window)
        if self.compressor is not None:
            entries, entry_visible = self._compressed(x, q_residual, start, positions, rope, state)
            keys = torch.cat([keys, entries])
            visible = torch.cat([visible, entry_visible], dim=1)
        state.window = keys[: key_positions.shape[0]][-self.window :]
        state.added = kv

        out = attend_visible(self, q, keys, key_positions.shape[0], visible, cos, sin)
        return self.project_out(out)

    def project(
        self, x: torch.Tensor, rope: ForwardRope
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The projections of tokens ``x [L, hidden]`` roped at the forward's tables ``rope`` (at the tokens'
        positions): ``(q_residual, q, kv, cos, sin)``.

        ``q`` ``[L, heads, head_dim]`` and ``kv`` ``[L, head_dim]`` are normalised and roped;
        ``q_residual`` is the low-rank query the indexer reads; ``cos, sin`` are this layer's flavour of ``rope``.
        """
        cos, sin = rope.cos_sin(self.rotary)
        q_residual = self.low_rank_query(x)
        q, kv = self.project_heads(x, q_residual, cos, sin)
        return q_residual, q, kv, cos, sin

    def low_rank_query(self, x: torch.Tensor) -> torch.Tensor:
        """``q_residual [L, q_lora_rank]``: the normalised low-rank query that the attention's query projection and
        the indexer's read."""
        return rms_norm(self.q_norm, self.wq_a(x))

    def project_heads(
        self, x: torch.Tensor, q_residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q, kv)`` of :meth:`project`, from the low-rank query and this layer's flavour of the rope tables."""
        q = self.wq_b(q_residual).view(x.shape[0], self.num_heads, self.head_dim)
        q = normalize_rope(q, cos, sin, self._normalize_rope_queries, eps=self.eps)
        kv = self.wkv(x)[:, None]
        kv = normalize_rope(kv, cos, sin, self._normalize_rope_kv, eps=self.kv_norm.eps, weight=self.kv_norm.weight)
        return q, kv[:, 0]

    def _normalize_rope_queries(self, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The queries' norm and rope in torch (a torch path of :func:`.dispatch.normalize_rope`)."""
        return apply_rope(rms_normalize(q, self.eps), cos, sin)

    def _normalize_rope_kv(self, kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The KV row's norm and rope in torch (a torch path of :func:`.dispatch.normalize_rope`)."""
        return apply_rope(self.kv_norm(kv), cos, sin)

    def _compressed(
        self,
        x: torch.Tensor,
        q_residual: torch.Tensor,
        start: int,
        positions: torch.Tensor,
        rope: ForwardRope,
        state: LayerState,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Advance the compressors; return the entries and which of them each query reads."""
        assert self.compressor is not None and state.compressor is not None
        formats = state.stored_as
        appended = self.compressor.advance(x, start, state.compressor)
        _read_as_stored(state.compressor, appended, formats.entries if formats is not None else None)
        entries = state.compressor.entries
        ratio = self.compressor.ratio
        # An entry is readable once its whole block is in: (block + 1) * ratio <= position + 1.
        complete_blocks = (positions + 1) // ratio
        visible = torch.arange(entries.shape[0], device=x.device)[None, :] < complete_blocks[:, None]
        if self.indexer is not None:
            assert state.indexer is not None
            appended = self.indexer.compressor.advance(x, start, state.indexer)
            _read_as_stored(state.indexer, appended, formats.indexer_keys if formats is not None else None)
            visible = self.indexer.select(x, q_residual, rope, state.indexer, visible)
        return entries, visible

    def attend_reference(
        self, q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`_attend`, then the inverse rope at the queries' ``cos, sin`` (the torch path of
        :func:`~sglang_dsv4.kernels.dispatch.attend_visible`)."""
        return apply_rope(self._attend(q, keys, visible), cos, sin, inverse=True)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """Softmax over the visible keys and the sink; ``[L, heads, head_dim]``."""
        logits = torch.einsum("lhd,kd->lhk", q, keys) * self.head_dim**-0.5
        logits = logits.masked_fill(~visible[:, None, :], float("-inf"))
        sink = self.attn_sink.view(1, -1, 1).expand(q.shape[0], -1, 1).to(logits.dtype)
        probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
        return torch.einsum("lhk,kd->lhd", probs.to(keys.dtype), keys)

    def project_out(self, out: torch.Tensor) -> torch.Tensor:
        """Grouped output projection: each head group to ``o_lora_rank``, then to hidden (this rank's partial sum)."""
        length = out.shape[0]
        grouped = out.reshape(length, self.o_groups, -1)
        weight = self.wo_a.weight.view(self.o_groups, -1, grouped.shape[-1])
        mixed = torch.einsum("lgi,gri->lgr", grouped, weight)
        return self.wo_b(mixed.reshape(length, -1))


def _read_as_stored(state: CompressorState, appended: int, row_format: RowFormat | None) -> None:
    """The ``appended`` entries a forward added, as the pool stores them (``row_format``; None: as computed)."""
    if row_format is not None and appended:
        state.entries = torch.cat([state.entries[:-appended], row_format.round_trip(state.entries[-appended:])])
