"""Rotary position embedding on the trailing rope dims, with interleaved pairs.

Window-only layers use plain rope at ``rope_theta``; compressed layers (their
attention, compressor and indexer) use ``compress_rope_theta`` with YaRN frequency
interpolation and no attention rescaling.
"""

from __future__ import annotations

import math

import torch

from ..config import YarnScaling


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
        self.inv_freq = rope_frequencies(rope_dim, theta, yarn)
        self._inv_freq_copies: dict[torch.device, torch.Tensor] = {}

    def inv_freq_on(self, device: torch.device) -> torch.Tensor:
        """``inv_freq`` on ``device``, copied there once (a copy per call would wait on the device)."""
        if device not in self._inv_freq_copies:
            self._inv_freq_copies[device] = self.inv_freq.to(device)
        return self._inv_freq_copies[device]

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` of shape ``[len(positions), rope_dim // 2]`` in float32."""
        angles = positions.to(torch.float32)[:, None] * self.inv_freq_on(positions.device)[None, :]
        return angles.cos(), angles.sin()


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
