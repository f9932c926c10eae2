"""The release checkpoint's two block-quantized formats, to and from float32.

* FP8 E4M3 with one float32 scale per 128 x 128 block (the dense projections);
* FP4 e2m1, two values a byte (the even element in the low nibble, OCP MX layout), with one
  power-of-two scale (UE8M0, ``float8_e8m0fnu``) per 32 inputs of a row (the routed experts).

A weight is ``scale * value`` blockwise (DeepSeek's ``.scale``, SGLang's ``weight_scale_inv``).
Both directions take any leading dimensions, so a stack of experts dequantizes in one call.
Quantizing picks power-of-two scales, so a quantized weight's float32 dequantization is exact:
what the tiny checkpoints' dequantized twins hold.
"""

from __future__ import annotations

import torch

FP8_BLOCK = 128
FP4_BLOCK = 32
FP8_MAX = 448.0
FP4_MAX = 6.0
# OCP MX e2m1 code points: sign bit 3, then the magnitude table.
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Float32 ``[..., R, C]`` from FP8 ``weight [..., R, C]`` and ``scale [..., ceil(R/128), ceil(C/128)]``."""
    return weight.float() * _expand(scale.float(), weight.shape[-2:], (FP8_BLOCK, FP8_BLOCK))


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Float32 ``[..., R, C]`` from packed e2m1 ``[..., R, C/2]`` (any 1-byte dtype) and ``scale [..., R, C/32]``."""
    values = unpack_e2m1(packed)
    return values * _expand(scale.float(), values.shape[-2:], (1, FP4_BLOCK))


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Two e2m1 values per byte, the even element in the low nibble."""
    codes = packed.view(torch.uint8)
    pairs = torch.stack([codes & 0x0F, codes >> 4], dim=-1).long()
    return E2M1_VALUES.to(packed.device)[pairs].flatten(-2)


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(float8_e4m3fn weight, float32 power-of-two scales)`` of a 2-D weight whose sides are whole blocks."""
    rows, cols = weight.shape
    blocks = weight.float().reshape(rows // FP8_BLOCK, FP8_BLOCK, cols // FP8_BLOCK, FP8_BLOCK)
    scale = _power_of_two_scale(blocks.abs().amax(dim=(1, 3)), FP8_MAX)
    values = weight.float() / _expand(scale, weight.shape, (FP8_BLOCK, FP8_BLOCK))
    return values.to(torch.float8_e4m3fn), scale


def quantize_fp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(int8 packed e2m1 [R, C/2], float8_e8m0fnu scales [R, C/32])`` of a 2-D weight, rounded to nearest."""
    rows, cols = weight.shape
    scale = _power_of_two_scale(weight.float().reshape(rows, cols // FP4_BLOCK, FP4_BLOCK).abs().amax(-1), FP4_MAX)
    values = weight.float() / _expand(scale, weight.shape, (1, FP4_BLOCK))
    magnitudes = E2M1_VALUES[:8]
    codes = (values.abs()[..., None] - magnitudes).abs().argmin(-1) + 8 * (values < 0)
    pairs = codes.to(torch.uint8).reshape(rows, cols // 2, 2)
    packed = pairs[..., 0] | (pairs[..., 1] << 4)
    return packed.view(torch.int8), scale.to(torch.float8_e8m0fnu)


def _power_of_two_scale(amax: torch.Tensor, largest: float) -> torch.Tensor:
    """The smallest power of two that brings ``amax`` within the format's largest value."""
    return torch.exp2(torch.ceil(torch.log2(amax.clamp(min=1e-30) / largest)))


def _expand(scale: torch.Tensor, shape: torch.Size | tuple[int, ...], block: tuple[int, int]) -> torch.Tensor:
    """Each block's scale repeated over its block, cut to ``shape``'s last two sides (a partial block at the edge)."""
    rows, cols = shape[-2:]
    return scale.repeat_interleave(block[0], -2)[..., :rows, :].repeat_interleave(block[1], -1)[..., :cols]
