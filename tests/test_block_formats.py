"""The release's FP8 and FP4 block formats: byte layout, power-of-two scales, rounding bounds, stacked dequantization."""

from __future__ import annotations

import torch

from sglang_dsv4.model.block_formats import (
    FP4_BLOCK,
    FP8_BLOCK,
    dequantize_fp4,
    dequantize_fp8,
    quantize_fp4,
    quantize_fp8,
)


def test_fp4_packs_the_even_element_in_the_low_nibble_with_the_sign_in_bit_3():
    row = torch.zeros(1, FP4_BLOCK)
    row[0, :4] = torch.tensor([0.5, -6.0, 3.0, -0.0])  # amax 6: scale 1
    packed, scale = quantize_fp4(row)
    assert scale.float().item() == 1.0 and packed.dtype == torch.int8 and packed.shape == (1, FP4_BLOCK // 2)
    assert packed.view(torch.uint8)[0, :2].tolist() == [0xF1, 0x05]  # (0.5 -> 1, -6 -> 15), (3 -> 5, 0 -> 0)
    assert dequantize_fp4(packed, scale)[0, :4].tolist() == [0.5, -6.0, 3.0, 0.0]


def test_fp4_rounds_each_value_to_the_nearest_e2m1_point_under_a_power_of_two_scale():
    weight = torch.randn(64, 4 * FP4_BLOCK)
    packed, scale = quantize_fp4(weight)
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (64, 4)
    scale = scale.float()
    assert torch.equal(torch.exp2(torch.log2(scale).round()), scale)
    blocks = weight.view(64, 4, FP4_BLOCK).abs().amax(-1)
    assert (blocks <= 6 * scale).all() and (blocks > 3 * scale).all()  # the smallest power that fits
    # The e2m1 grid's widest gap below 6 is 2 (4 -> 6): no value is off by more than one scale.
    error = (dequantize_fp4(packed, scale) - weight).abs()
    assert (error <= scale.repeat_interleave(FP4_BLOCK, 1) + 1e-6).all()


def test_fp8_blocks_have_power_of_two_scales_and_e4m3_rounding():
    weight = torch.randn(2 * FP8_BLOCK, FP8_BLOCK) * torch.tensor([1e-3, 10.0]).repeat_interleave(FP8_BLOCK)[:, None]
    quantized, scale = quantize_fp8(weight)
    assert quantized.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (2, 1)
    assert torch.equal(torch.exp2(torch.log2(scale).round()), scale)
    restored = dequantize_fp8(quantized, scale)
    smallest_step = scale.repeat_interleave(FP8_BLOCK, 0) * 2.0**-9
    assert ((restored - weight).abs() <= weight.abs() * 2.0**-4 + smallest_step / 2).all()


def test_a_stack_dequantizes_as_each_of_its_members():
    experts = torch.randn(3, 256, 2 * FP8_BLOCK)
    fp4 = [quantize_fp4(expert) for expert in experts]
    stacked = dequantize_fp4(torch.stack([p for p, _ in fp4]), torch.stack([s for _, s in fp4]))
    assert torch.equal(stacked, torch.stack([dequantize_fp4(p, s) for p, s in fp4]))
    fp8 = [quantize_fp8(expert) for expert in experts]
    stacked = dequantize_fp8(torch.stack([q for q, _ in fp8]), torch.stack([s for _, s in fp8]))
    assert torch.equal(stacked, torch.stack([dequantize_fp8(q, s) for q, s in fp8]))
