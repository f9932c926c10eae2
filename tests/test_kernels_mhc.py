"""The fused mHC kernels against the torch reference (:mod:`sglang_dsv4.model.mhc`), under Triton's interpreter
(in a process of their own: see ``kernel_testing``).

References run in float64 on the same (possibly bf16-rounded) inputs. Token counts cross
the kernels' 16-token blocks and hidden sizes are not multiples of their 64-channel tiles.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from kernel_testing import (
    TOLERANCE,
    interpreted_only,
    launcher_only,
    poison_allocations,
    relative_error,
    run_under_interpreter,
)

from sglang_dsv4.model.mhc import HyperConnection
from sglang_dsv4.model.norms import RMSNorm

STREAMS = 4
CASES = [(1, 40, torch.float32), (17, 72, torch.float32), (5, 136, torch.bfloat16), (18, 64, torch.bfloat16)]


@launcher_only
def test_mhc_kernels_under_the_interpreter():
    run_under_interpreter(__file__)


@pytest.fixture(scope="module")
def mhc():
    from sglang_dsv4.kernels import mhc

    return mhc


def random_sublayer(hidden: int, dtype: torch.dtype, seed: int) -> tuple[HyperConnection, RMSNorm]:
    """An mHC and the RMSNorm of the sublayer it feeds, with random parameters in ``dtype``."""
    generator = torch.Generator().manual_seed(seed)
    config = SimpleNamespace(hc_mult=STREAMS, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6, hidden_size=hidden)
    hc, norm = HyperConnection(config), RMSNorm(hidden, 1e-6)
    with torch.no_grad():
        hc.fn.copy_(torch.randn(hc.fn.shape, generator=generator) * 0.2)
        hc.base.copy_(torch.randn(hc.base.shape, generator=generator))
        hc.scale.copy_(torch.rand(3, generator=generator) + 0.5)
        norm.weight.copy_(torch.randn(hidden, generator=generator))
    return hc.to(dtype), norm.to(dtype)


def float64_copy(module: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(module).double()


def weights_of(mhc, hc: HyperConnection):
    return mhc.MixingWeights(hc.fn, hc.base, hc.scale, hc.sinkhorn_iters, hc.hc_eps, hc.norm_eps)


def reference_pre(hc: HyperConnection, norm: RMSNorm, streams: torch.Tensor) -> tuple[torch.Tensor, ...]:
    hc64, norm64 = float64_copy(hc), float64_copy(norm)
    x, post, comb = hc64.pre(streams.double())
    return norm64(x), post, comb


def random_mixing(tokens: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A previous pre's ``post [tokens, n]`` and a doubly-stochastic-ish ``comb [tokens, n, n]``."""
    post = 2 * torch.rand(tokens, STREAMS, generator=generator)
    comb = torch.softmax(torch.randn(tokens, STREAMS, STREAMS, generator=generator), dim=-1)
    return post, comb


@interpreted_only
@pytest.mark.parametrize("tokens,hidden,dtype", CASES)
def test_fused_pre_matches_reference(mhc, monkeypatch, tokens, hidden, dtype):
    hc, norm = random_sublayer(hidden, dtype, seed=tokens)
    streams = torch.randn(tokens, STREAMS, hidden).to(dtype)
    poison_allocations(monkeypatch)
    x, post, comb = mhc.fused_pre(streams, weights_of(mhc, hc), norm.weight, norm.eps)
    expected = reference_pre(hc, norm, streams)
    assert x.dtype == dtype and post.dtype == comb.dtype == torch.float32
    assert relative_error(x, expected[0]) < TOLERANCE[dtype]
    assert relative_error(post, expected[1]) < 1e-5  # float32 mixing whatever the streams' dtype
    assert relative_error(comb, expected[2]) < 1e-5


@interpreted_only
@pytest.mark.parametrize("tokens,hidden,dtype", CASES)
def test_fused_post_pre_matches_reference(mhc, monkeypatch, tokens, hidden, dtype):
    generator = torch.Generator().manual_seed(100 + tokens)
    hc, norm = random_sublayer(hidden, dtype, seed=100 + tokens)
    streams = torch.randn(tokens, STREAMS, hidden, generator=generator).to(dtype)
    output = torch.randn(tokens, hidden, generator=generator).to(dtype)
    post, comb = random_mixing(tokens, generator)
    poison_allocations(monkeypatch)
    new_streams, x, next_post, next_comb = mhc.fused_post_pre(
        output, streams, post, comb, weights_of(mhc, hc), norm.weight, norm.eps
    )
    expected_streams = HyperConnection.post(output.double(), streams.double(), post.double(), comb.double())
    assert new_streams.dtype == dtype
    assert relative_error(new_streams, expected_streams) < TOLERANCE[dtype]
    # The next pre reads the new streams as stored (rounded to their dtype), as the reference does.
    expected = reference_pre(hc, norm, new_streams)
    assert relative_error(x, expected[0]) < TOLERANCE[dtype]
    assert relative_error(next_post, expected[1]) < 1e-5
    assert relative_error(next_comb, expected[2]) < 1e-5


@interpreted_only
@pytest.mark.parametrize("tokens,hidden,dtype", CASES[:2])
def test_fused_post_matches_reference(mhc, monkeypatch, tokens, hidden, dtype):
    generator = torch.Generator().manual_seed(200 + tokens)
    streams = torch.randn(tokens, STREAMS, hidden, generator=generator).to(dtype)
    output = torch.randn(tokens, hidden, generator=generator).to(dtype)
    post, comb = random_mixing(tokens, generator)
    poison_allocations(monkeypatch)
    new_streams = mhc.fused_post(output, streams, post, comb)
    expected = HyperConnection.post(output.double(), streams.double(), post.double(), comb.double())
    assert relative_error(new_streams, expected) < TOLERANCE[dtype]


@interpreted_only
def test_other_stream_counts_are_refused(mhc):
    config = SimpleNamespace(hc_mult=2, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6, hidden_size=16)
    hc = HyperConnection(config)
    with pytest.raises(ValueError, match="4 streams"):
        mhc.fused_pre(torch.randn(3, 2, 16), weights_of(mhc, hc), torch.ones(16), 1e-6)
