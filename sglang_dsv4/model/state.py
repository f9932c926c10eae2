"""The state of one request at token position P: the single definition the pools follow.

Per layer:

* ``window``: the raw (normed, roped) KV of the last ``sliding_window`` tokens —
  transient, only this window is ever read again;
* ``compressor.entries``: one compressed entry per complete block (ratio 4 or 128) —
  persistent, shared by every continuation of the prefix;
* ``indexer.entries`` (ratio-4 layers): the indexer keys, one per complete block — persistent;
* the compressors' online partial-block pools (float32, O(dim) per layer whatever P is).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config import DeepseekV4Config
from ..kernels.kv_format import PoolFormats
from .compressor import CompressorState


@dataclass
class LayerState:
    window: torch.Tensor
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None
    # The raw KV of the tokens the last forward added (the pool stores every one of them;
    # the window keeps only the last ``sliding_window``).
    added: torch.Tensor | None = None
    # How a pool stores this state's rows: a forward then attends its new rows as stored, as a later
    # forward reading them from the pool will (None: as computed, the network on its own).
    stored_as: PoolFormats | None = None

    def clone(self) -> LayerState:
        return LayerState(
            self.window.clone(),
            self.compressor.clone() if self.compressor is not None else None,
            self.indexer.clone() if self.indexer is not None else None,
            stored_as=self.stored_as,
        )

    def compressors(self) -> list[CompressorState]:
        return [c for c in (self.compressor, self.indexer) if c is not None]


@dataclass
class RequestState:
    """Everything needed to continue a request after ``position`` tokens.

    ``mtp``: the multi-token-prediction layer's own state (its window, at its own position: it has read the
    target's streams of every token but the last, whose next token it waits for), or None in a model without one.
    The byte counts below are the main layers' (what the pools hold).
    """

    position: int = 0
    layers: list[LayerState] = field(default_factory=list)
    mtp: RequestState | None = None

    def snapshot(self) -> RequestState:
        """A detached copy: advancing either one leaves the other as it was."""
        mtp = self.mtp.snapshot() if self.mtp is not None else None
        return RequestState(self.position, [layer.clone() for layer in self.layers], mtp)

    @property
    def compressor_state_nbytes(self) -> int:
        """Bytes of the online partial-block pools, over all layers."""
        return sum(c.online_nbytes for layer in self.layers for c in layer.compressors())

    @property
    def nbytes(self) -> int:
        """Bytes of the whole state: windows, compressed entries, indexer keys, online pools."""
        total = self.compressor_state_nbytes
        for layer in self.layers:
            total += _tensor_bytes(layer.window)
            total += sum(_tensor_bytes(c.entries) for c in layer.compressors())
        return total


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def online_state_floats(config: DeepseekV4Config) -> int:
    """Float32 values of the compressors' partial-block state, over all layers.

    A ratio-128 layer keeps one pool (max, denominator, weighted sum) per channel of
    ``head_dim``; a ratio-4 layer keeps three pools (the current block's two halves and
    the previous block's first half) for its compressor (``head_dim``) and its
    indexer's compressor (``index_head_dim``).
    """
    floats = 0
    for layer in range(config.num_layers):
        kind = config.layer_kind(layer)
        if kind == "hca":
            floats += 3 * config.head_dim
        elif kind == "csa":
            floats += 3 * 3 * (config.head_dim + config.index_head_dim)
    return floats


def state_nbytes(config: DeepseekV4Config, position: int, kv_bytes: int) -> int:
    """Bytes of a request's state at ``position`` (KV stored in ``kv_bytes`` per value)."""
    total = 4 * online_state_floats(config)
    window = min(position, config.sliding_window)
    for layer in range(config.num_layers):
        total += window * config.head_dim * kv_bytes
        kind = config.layer_kind(layer)
        if kind == "hca":
            total += (position // config.hca_rate) * config.head_dim * kv_bytes
        elif kind == "csa":
            total += (position // config.csa_rate) * (config.head_dim + config.index_head_dim) * kv_bytes
    return total
