"""Routed experts as one grouped pass, against every (token, slot) pair computed on its own."""

from __future__ import annotations

import pytest
import torch

from sglang_dsv4.model.experts import clamped_swiglu, grouped_experts

EXPERTS, HIDDEN, INNER, LIMIT = 8, 16, 12, 0.7


def pairwise(x, weights, experts, w1, w2, w3, limit) -> torch.Tensor:
    """Each pair through its own expert's weights, gathered per pair; experts of -1 contribute nothing."""
    on_rank = experts >= 0
    chosen = experts.clamp(min=0)
    gate = torch.einsum("th,tkih->tki", x, w1[chosen])
    up = torch.einsum("th,tkih->tki", x, w3[chosen])
    out = torch.einsum("tki,tkhi->tkh", clamped_swiglu(gate, up, limit), w2[chosen])
    return (out * (weights * on_rank)[..., None]).sum(1)


@pytest.fixture
def expert_weights() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        torch.randn(EXPERTS, INNER, HIDDEN),
        torch.randn(EXPERTS, HIDDEN, INNER) / INNER**0.5,
        torch.randn(EXPERTS, INNER, HIDDEN),
    )


@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_grouped_pass_equals_each_pair_through_its_expert(tokens, expert_weights):
    x = torch.randn(tokens, HIDDEN)
    experts = torch.randint(0, EXPERTS, (tokens, 3))
    experts[0] = torch.tensor([2, 2, 5])  # one token routed twice to the same expert
    weights = torch.rand(tokens, 3)
    expected = pairwise(x, weights, experts, *expert_weights, LIMIT)
    torch.testing.assert_close(grouped_experts(x, weights, experts, *expert_weights, LIMIT), expected)


def test_experts_on_other_ranks_add_nothing_and_empty_experts_are_skipped(expert_weights):
    x = torch.randn(20, HIDDEN)
    experts = torch.randint(0, 3, (20, 2))  # experts 3..7 receive nobody
    experts[::3, 1] = -1  # EP: these slots are another rank's
    experts[7] = -1
    weights = torch.rand(20, 2)
    out = grouped_experts(x, weights, experts, *expert_weights, LIMIT)
    torch.testing.assert_close(out, pairwise(x, weights, experts, *expert_weights, LIMIT))
    assert out[7].eq(0).all()


def test_the_swiglu_limit_clamps_inside_the_grouped_pass(expert_weights):
    x = torch.randn(16, HIDDEN) * 10
    experts, weights = torch.randint(0, EXPERTS, (16, 2)), torch.rand(16, 2)
    clamped = grouped_experts(x, weights, experts, *expert_weights, LIMIT)
    unclamped = grouped_experts(x, weights, experts, *expert_weights, float("inf"))
    torch.testing.assert_close(clamped, pairwise(x, weights, experts, *expert_weights, LIMIT))
    assert not torch.allclose(clamped, unclamped)
