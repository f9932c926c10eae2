"""The queries' norm and rope in one launch (``kernels/query_rope.py``) against the network's torch path it replaces
(:func:`sglang_dsv4.model.norms.rms_normalize`, then :func:`sglang_dsv4.model.rope.apply_rope`), under Triton's
interpreter (in a process of its own: see ``kernel_testing``)."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import interpreted_only, launcher_only, run_under_interpreter

from sglang_dsv4.config import named_config
from sglang_dsv4.model.norms import rms_normalize
from sglang_dsv4.model.rope import Rotary, apply_rope


@launcher_only
def test_query_rope_kernel_under_the_interpreter():
    run_under_interpreter(__file__)


def torch_path(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float | None) -> torch.Tensor:
    return apply_rope(q if eps is None else rms_normalize(q, eps), cos, sin)


def assert_matches_torch(q: torch.Tensor, rotary: Rotary, positions: torch.Tensor, eps: float | None) -> None:
    """Equal to the torch path up to the row's sum of squares taken in another order: float32 to a few ulps, float16
    to one unit of its last place and almost every element bitwise. Bfloat16 to three units: the interpreter
    truncates float32 to bfloat16 (a GPU rounds to nearest), the scale and the product each a unit low at most."""
    from sglang_dsv4.kernels.query_rope import normalize_rope_queries

    cos, sin = rotary.cos_sin(positions)
    actual, expected = normalize_rope_queries(q, cos, sin, eps), torch_path(q, cos, sin, eps)
    assert actual.dtype == q.dtype and actual.shape == q.shape
    if q.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=2e-6, atol=1e-6)
        return
    units = 3 if q.dtype == torch.bfloat16 else 1
    # A unit of the last place of the element, or of the row's root-mean-square where the rope's difference of
    # products cancels to less.
    row_scale = expected.float().square().mean(-1, keepdim=True).sqrt()
    ulp = torch.finfo(q.dtype).eps * torch.maximum(expected.float().abs(), row_scale)
    assert ((actual.float() - expected.float()).abs() <= units * ulp).all()
    if q.dtype == torch.float16:
        assert (actual == expected).float().mean() > 0.99


@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("eps", [1e-6, None], ids=["normalized", "rope-only"])
@pytest.mark.parametrize("head_dim, rope_dim", [(16, 8), (24, 8)], ids=["pow2-dim", "odd-dim"])
def test_small_queries_equal_the_torch_path(dtype, eps, head_dim, rope_dim):
    """Rows of any scale (so the norm matters), heads a view's stride apart, a head dim that is not a power of two."""
    generator = torch.Generator().manual_seed(head_dim)
    wide = torch.randn(3, 2, head_dim + 5, generator=generator) * torch.tensor([0.01, 30.0, 1.0])[:, None, None]
    q = wide[..., :head_dim].to(dtype)
    rotary = Rotary(rope_dim, 160000.0, None)
    assert_matches_torch(q, rotary, torch.tensor([0, 5, 70_001]), eps)


@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("model", ["flash", "pro"])
def test_shipped_queries_equal_the_torch_path(model, dtype):
    """The attention's queries (normalised) and the indexer's (rope only) at the config's heads, dims and rope
    (YaRN, compressed layers' theta), at positions up to 128K."""
    config = named_config(model)
    rotary = Rotary(config.rope_head_dim, config.compress_rope_theta, config.yarn)
    positions = torch.tensor([3, 131_071])
    generator = torch.Generator().manual_seed(1)
    attention_q = torch.randn(2, config.num_heads, config.head_dim, generator=generator).to(dtype)
    assert_matches_torch(attention_q, rotary, positions, config.rms_norm_eps)
    indexer_q = torch.randn(2, config.index_n_heads, config.index_head_dim, generator=generator).to(dtype)
    assert_matches_torch(indexer_q, rotary, positions, None)
