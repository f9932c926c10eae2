"""The queries' and the KV row's norm and rope in one launch (``kernels/norm_rope.py``) against the network's torch
path it replaces (:func:`sglang_dsv4.model.norms.rms_normalize` or :class:`~sglang_dsv4.model.norms.RMSNorm`, then
:func:`sglang_dsv4.model.rope.apply_rope`), under Triton's interpreter (in a process of its own: see
``kernel_testing``)."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import interpreted_only, launcher_only, run_under_interpreter

from sglang_dsv4.config import named_config
from sglang_dsv4.model.norms import RMSNorm, rms_normalize
from sglang_dsv4.model.rope import Rotary, apply_rope

EPS = 1e-6


@launcher_only
def test_norm_rope_kernel_under_the_interpreter():
    run_under_interpreter(__file__)


def torch_path(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norm: str, weight: torch.Tensor | None):
    if norm == "unit":
        x = rms_normalize(x, EPS)
    elif norm == "weighted":
        module = RMSNorm(x.shape[-1], EPS).to(x.dtype)
        with torch.no_grad():
            module.weight.copy_(weight)
            x = module(x)
    return apply_rope(x, cos, sin)


def assert_matches_torch(x: torch.Tensor, rotary: Rotary, positions: torch.Tensor, norm: str) -> None:
    """Equal to the torch path up to the row's sum of squares taken in another order: float32 to a few ulps, float16
    to a unit of the last place and almost every element bitwise. Bfloat16 to four units: the interpreter truncates
    float32 to bfloat16 (a GPU rounds to nearest), each rounding of the norm and the rope a unit low at most."""
    from sglang_dsv4.kernels.norm_rope import normalize_rope

    generator = torch.Generator().manual_seed(5)
    weight = (torch.rand(x.shape[-1], generator=generator) + 0.5).to(x.dtype) if norm == "weighted" else None
    cos, sin = rotary.cos_sin(positions)
    actual = normalize_rope(x, cos, sin, None if norm == "none" else EPS, weight)
    expected = torch_path(x, cos, sin, norm, weight)
    assert actual.dtype == x.dtype and actual.shape == x.shape
    if x.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=2e-6, atol=1e-6)
        return
    # A unit of the last place of the element, or of the row's root-mean-square where the rope's difference of
    # products cancels to less.
    row_scale = expected.float().square().mean(-1, keepdim=True).sqrt()
    ulp = torch.finfo(x.dtype).eps * torch.maximum(expected.float().abs(), row_scale)
    units = 4 if x.dtype == torch.bfloat16 else 1
    assert ((actual.float() - expected.float()).abs() <= units * ulp).all()
    if x.dtype == torch.float16:
        assert (actual == expected).float().mean() > 0.99


@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("norm", ["unit", "weighted", "none"])
@pytest.mark.parametrize("head_dim, rope_dim", [(16, 8), (24, 8)], ids=["pow2-dim", "odd-dim"])
def test_small_rows_equal_the_torch_path(dtype, norm, head_dim, rope_dim):
    """Rows of any scale (so the norm matters), heads a view's stride apart, a head dim that is not a power of two."""
    generator = torch.Generator().manual_seed(head_dim)
    wide = torch.randn(3, 2, head_dim + 5, generator=generator) * torch.tensor([0.01, 30.0, 1.0])[:, None, None]
    x = wide[..., :head_dim].to(dtype)
    rotary = Rotary(rope_dim, 160000.0, None)
    assert_matches_torch(x, rotary, torch.tensor([0, 5, 70_001]), norm)


@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("model", ["flash", "pro"])
def test_shipped_rows_equal_the_torch_path(model, dtype):
    """The attention's queries (normalised), its KV row (normalised with the weight) and the indexer's queries (rope
    only) at the config's heads, dims and rope (YaRN, compressed layers' theta), at positions up to 128K."""
    config = named_config(model)
    rotary = Rotary(config.rope_head_dim, config.compress_rope_theta, config.yarn)
    positions = torch.tensor([3, 131_071])
    generator = torch.Generator().manual_seed(1)
    queries = torch.randn(2, config.num_heads, config.head_dim, generator=generator).to(dtype)
    assert_matches_torch(queries, rotary, positions, "unit")
    assert_matches_torch(queries[:, :1], rotary, positions, "weighted")
    indexer_queries = torch.randn(2, config.index_n_heads, config.index_head_dim, generator=generator).to(dtype)
    assert_matches_torch(indexer_queries, rotary, positions, "none")


def assert_norm_matches_torch(x: torch.Tensor) -> None:
    """:func:`~sglang_dsv4.kernels.norm_rope.rms_norm` against :class:`RMSNorm`, to :func:`assert_matches_torch`'s
    tolerances (the sum of squares in another order; bfloat16 truncated by the interpreter)."""
    from sglang_dsv4.kernels.norm_rope import rms_norm

    generator = torch.Generator().manual_seed(7)
    module = RMSNorm(x.shape[-1], EPS).to(x.dtype)
    with torch.no_grad():
        module.weight.copy_(torch.rand(x.shape[-1], generator=generator) + 0.5)
        expected = module(x)
    actual = rms_norm(x, EPS, module.weight.detach())
    assert actual.dtype == x.dtype and actual.shape == x.shape
    if x.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=2e-6, atol=1e-6)
        return
    ulp = torch.finfo(x.dtype).eps * expected.float().abs()
    units = 4 if x.dtype == torch.bfloat16 else 1
    assert ((actual.float() - expected.float()).abs() <= units * ulp).all()
    if x.dtype == torch.float16:
        assert (actual == expected).float().mean() > 0.99


@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("dim", [16, 24])
def test_small_rows_normalised_alone_equal_the_torch_norm(dtype, dim):
    """Rows of any scale, a row's stride wider than its dim, a dim that is not a power of two."""
    generator = torch.Generator().manual_seed(dim)
    wide = torch.randn(3, dim + 5, generator=generator) * torch.tensor([0.01, 30.0, 1.0])[:, None]
    assert_norm_matches_torch(wide[:, :dim].to(dtype))


@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("model", ["flash", "pro"])
def test_shipped_low_rank_queries_normalised_equal_the_torch_norm(model, dtype):
    """The attention's ``q_norm`` at the config's ``q_lora_rank`` (V4-Pro's 1,536 is no power of two)."""
    config = named_config(model)
    generator = torch.Generator().manual_seed(2)
    assert_norm_matches_torch(torch.randn(3, config.q_lora_rank, generator=generator).to(dtype))
