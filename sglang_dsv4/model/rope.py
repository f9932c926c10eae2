"""Rotary position embedding on the trailing rope dims, with interleaved pairs.

Window-only layers use plain rope at ``rope_theta``; compressed layers (their
attention, compressor and indexer) use ``compress_rope_theta`` with YaRN frequency
interpolation and no attention rescaling. A forward's tokens take each flavour's
``cos, sin`` once (:class:`ForwardRope`), read by every layer of that flavour.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ..config import DeepseekV4Config, YarnScaling

# What sets a rope's tables: (rope_dim, theta, YaRN scaling or None).
RopeFlavour = tuple[int, float, YarnScaling | None]


def rope_frequencies(rope_dim: int, theta: float, yarn: YarnScaling | None) -> torch.Tensor:
    """Inverse frequencies ``[rope_dim // 2]``, one per rotated pair."""
    # Explicit device: models are built under torch.device("meta") before loading.
    exponents = torch.arange(0, rope_dim, 2, dtype=torch.float32, device="cpu") / rope_dim
    base_freq = 1.0 / (theta**exponents)
    if yarn is None:
        return base_freq

    # YaRN: interpolate (divide by `factor`) the low frequencies, keep the high ones,
    # with a linear ramp between the dims that turn beta_fast and beta_slow times
    # over the original context.
    def dim_turning(turns: float) -> float:
        wavelength = yarn.original_max_position_embeddings / (turns * 2 * math.pi)
        return rope_dim * math.log(wavelength) / (2 * math.log(theta))

    low = max(math.floor(dim_turning(yarn.beta_fast)), 0)
    high = min(math.ceil(dim_turning(yarn.beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    keep_original = 1 - ramp
    return base_freq / yarn.factor * ramp + base_freq * keep_original


class Rotary:
    """Cos/sin tables for one rope flavour, computed for the positions asked."""

    def __init__(self, rope_dim: int, theta: float, yarn: YarnScaling | None):
        self.rope_dim = rope_dim
        self.flavour: RopeFlavour = (rope_dim, theta, yarn)
        self.inv_freq = rope_frequencies(rope_dim, theta, yarn)
        self._inv_freq_copies: dict[torch.device, torch.Tensor] = {}

    def inv_freq_on(self, device: torch.device) -> torch.Tensor:
        """``inv_freq`` on ``device``, copied there once (a copy per call would wait on the device)."""
        if device not in self._inv_freq_copies:
            self._inv_freq_copies[device] = self.inv_freq.to(device)
        return self._inv_freq_copies[device]

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` of shape ``[len(positions), rope_dim // 2]`` in float32."""
        angles = self._angles(positions)
        return angles.cos(), angles.sin()

    def write_cos_sin(self, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """:meth:`cos_sin` written into ``cos, sin`` (tensors of its shape), with no allocation of theirs."""
        angles = self._angles(positions)
        torch.cos(angles, out=cos)
        torch.sin(angles, out=sin)

    def _angles(self, positions: torch.Tensor) -> torch.Tensor:
        return positions.to(torch.float32)[:, None] * self.inv_freq_on(positions.device)[None, :]


def model_rotaries(config: DeepseekV4Config) -> tuple[Rotary, Rotary]:
    """The model's two flavours, ``(plain, compressed)``: window-only layers' and compressed layers'. One pair per
    set of parameters in the process, so that each keeps its device copy of ``inv_freq``."""
    return _rotaries(config.rope_head_dim, config.rope_theta, config.compress_rope_theta, config.yarn)


@functools.cache
def _rotaries(rope_dim: int, theta: float, compress_theta: float, yarn: YarnScaling | None) -> tuple[Rotary, Rotary]:
    return Rotary(rope_dim, theta, None), Rotary(rope_dim, compress_theta, yarn)


@dataclass(frozen=True)
class CosSin:
    """One flavour's tables at a forward's positions, ``[tokens, rope_dim // 2]`` float32 (:meth:`Rotary.cos_sin`)."""

    cos: torch.Tensor
    sin: torch.Tensor


@dataclass(frozen=True)
class ForwardRope:
    """The ``cos, sin`` of a forward's token positions for each rope flavour its layers use, computed once for the
    forward (:meth:`Rotary.cos_sin`, four launches a flavour) and read by every layer of that flavour and its
    indexer, instead of once in each of them."""

    tables: dict[RopeFlavour, CosSin]

    @staticmethod
    def at(positions: torch.Tensor, rotaries: Iterable[Rotary]) -> ForwardRope:
        """The tables of ``rotaries``' flavours at ``positions [tokens]``."""
        return ForwardRope({rotary.flavour: CosSin(*rotary.cos_sin(positions)) for rotary in rotaries})

    @staticmethod
    def of_model(positions: torch.Tensor, config: DeepseekV4Config) -> ForwardRope:
        """The tables of both of the model's flavours (:func:`model_rotaries`) at ``positions``."""
        return ForwardRope.at(positions, model_rotaries(config))

    def rewrite(self, positions: torch.Tensor, rotaries: Iterable[Rotary]) -> None:
        """The tables of ``rotaries``' flavours recomputed in place at ``positions`` (a CUDA graph's index buffers,
        whose addresses must not change)."""
        for rotary in rotaries:
            table = self.tables[rotary.flavour]
            rotary.write_cos_sin(positions, table.cos, table.sin)

    def cos_sin(self, rotary: Rotary) -> tuple[torch.Tensor, torch.Tensor]:
        """``rotary``'s ``cos, sin`` at the forward's positions, as :meth:`Rotary.cos_sin` computes them."""
        table = self.tables.get(rotary.flavour)
        if table is None:
            raise KeyError(f"no rope table of flavour {rotary.flavour}; this forward has {list(self.tables)}")
        return table.cos, table.sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing ``2 * cos.shape[-1]`` channels of ``x`` in interleaved pairs.

    ``x`` is ``[T, ..., dim]`` and ``cos`` / ``sin`` are ``[T, rope_dim // 2]``; the
    middle dims (heads) broadcast. ``inverse`` rotates by the negative angle.
    """
    rope_dim = 2 * cos.shape[-1]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    cos, sin = cos.view(shape), sin.view(shape)
    if inverse:
        sin = -sin
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat([nope, rotated.to(x.dtype)], dim=-1)
