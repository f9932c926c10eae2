"""The compressor kernel against the torch reference (:class:`sglang_dsv4.model.compressor.Compressor`),
under Triton's interpreter (in a process of its own: see ``kernel_testing``). The references
pool the kernel's own projections in float64, so a tolerance measures the kernel's arithmetic
(bf16 cases: its bf16 outputs and state), not the projections' rounding.

State rows the position says must be empty are poisoned with NaN (the kernel must not read
them), rows outside the batch must come back untouched, and outputs start as NaN.
"""

from __future__ import annotations

import copy

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

from sglang_dsv4.model.compressor import Compressor, CompressorState
from sglang_dsv4.model.rope import Rotary

HIDDEN, DIM, ROPE_DIM = 24, 16, 8
KINDS = [(4, True), (16, False)]  # overlapping ratio 4 (CSA, indexer); disjoint (HCA; 16 stands in for 128)


@launcher_only
def test_compressor_kernel_under_the_interpreter():
    run_under_interpreter(__file__)


@pytest.fixture(scope="module")
def kernel():
    from sglang_dsv4.kernels import compressor

    return compressor


def random_compressor(ratio: int, overlapping: bool, dtype: torch.dtype, seed: int) -> Compressor:
    generator = torch.Generator().manual_seed(seed)
    compressor = Compressor(HIDDEN, DIM, ratio, overlapping, Rotary(ROPE_DIM, 10000.0, None), 1e-6)
    with torch.no_grad():
        for parameter in compressor.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
    return compressor.to(dtype)


def weights_of(kernel, compressor: Compressor):
    return kernel.CompressorWeights(
        compressor.ape, compressor.norm.weight, compressor.norm.eps, compressor.rotary.inv_freq, compressor.ratio,
        compressor.overlapping,
    )  # fmt: skip


def record_of(state: CompressorState) -> torch.Tensor:
    """The state's pools as the V4 pool stores them: ``[pools, 3, dim]``."""
    pools = [state.current] if state.next_half is None else [state.current, state.next_half, state.previous_half]
    return torch.stack([torch.stack([pool.max, pool.denom, pool.weighted]) for pool in pools])


def assert_same_record(actual: torch.Tensor, expected: torch.Tensor, tolerance: float) -> None:
    assert not torch.isnan(actual).any(), "state has NaN (a field never written, or a poisoned pool read)"
    assert torch.equal(torch.isinf(actual), torch.isinf(expected)), "empty pools differ"
    assert relative_error(actual.nan_to_num(neginf=-1.0), expected.nan_to_num(neginf=-1.0)) < tolerance


class Reference:
    """A float64 copy of a compressor and its state, advanced by the torch reference."""

    def __init__(self, compressor: Compressor):
        self.projected_by = compressor
        self.compressor = copy.deepcopy(compressor).double()
        self.state = self.compressor.new_state(torch.float64, "cpu")

    def advance(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """The entries tokens ``start ..`` complete, pooled from the projections the kernel gets."""
        kv, gate = projections(self.projected_by, x)
        before = self.state.entries.shape[0]
        with torch.no_grad():
            self.compressor.pool_reference(kv.double(), gate.double(), start, self.state)
        return self.state.entries[before:]


def projections(compressor: Compressor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        return compressor.wkv(x), compressor.wgate(x)


@interpreted_only
@pytest.mark.parametrize("ratio,overlapping", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_chunk_by_chunk_matches_reference(kernel, monkeypatch, ratio, overlapping, dtype):
    compressor = random_compressor(ratio, overlapping, dtype, seed=ratio)
    reference = Reference(compressor)
    weights = weights_of(kernel, compressor)
    pools = 3 if overlapping else 1
    state = torch.randn(3, pools, 3, DIM)
    state[1] = float("nan")  # a new request's row: nothing in it may be read
    untouched = state[[0, 2]].clone()
    rows = torch.tensor([1], dtype=torch.int32)
    poison_allocations(monkeypatch)
    start = 0
    for length in (1, 2, 7, 1, 1, 3 * ratio + 1, ratio - 1, 2 * ratio):
        x = torch.randn(length, HIDDEN).to(dtype)
        expected = reference.advance(x, start)
        entries = kernel.compress_extend(*projections(compressor, x), [start], [length], state, rows, weights)
        assert entries.shape == expected.shape and entries.dtype == dtype
        if expected.numel():
            assert relative_error(entries, expected) < TOLERANCE[dtype]
        assert_same_record(state[1], record_of(reference.state), TOLERANCE[dtype])
        start += length
    assert torch.equal(state[[0, 2]], untouched)


@interpreted_only
@pytest.mark.parametrize("ratio,overlapping", KINDS)
def test_extend_of_several_requests_in_one_call(kernel, monkeypatch, ratio, overlapping):
    compressor = random_compressor(ratio, overlapping, torch.float32, seed=10 + ratio)
    weights = weights_of(kernel, compressor)
    starts, lengths, rows = [0, ratio + 1, 3 * ratio - 1], [2 * ratio + 3, 1, ratio + 2], [4, 0, 2]
    references = [Reference(compressor) for _ in starts]
    state = torch.full((5, 3 if overlapping else 1, 3, DIM), float("nan"))
    for reference, start, row in zip(references, starts, rows, strict=True):
        if start:  # the request at position 0 keeps its poisoned row
            reference.advance(torch.randn(start, HIDDEN), 0)
            state[row] = record_of(reference.state)
    xs = [torch.randn(length, HIDDEN) for length in lengths]
    expected = torch.cat([ref.advance(x, start) for ref, x, start in zip(references, xs, starts, strict=True)])
    poison_allocations(monkeypatch)
    kv, gate = projections(compressor, torch.cat(xs))
    entries = kernel.compress_extend(kv, gate, starts, lengths, state, torch.tensor(rows), weights)
    assert relative_error(entries, expected) < TOLERANCE[torch.float32]
    for reference, row in zip(references, rows, strict=True):
        assert_same_record(state[row], record_of(reference.state), TOLERANCE[torch.float32])


@interpreted_only
@pytest.mark.parametrize("ratio,overlapping", KINDS)
def test_decode_of_a_batch_matches_reference(kernel, monkeypatch, ratio, overlapping):
    """One token per request, states updated in place; block ends emit entries, the others zeros."""
    compressor = random_compressor(ratio, overlapping, torch.bfloat16, seed=20 + ratio)
    weights = weights_of(kernel, compressor)
    positions = [0, 1, ratio - 1, ratio, 2 * ratio - 1, 5 * ratio + 3, 7 * ratio - 1]
    rows = [3, 8, 0, 6, 1, 5, 2]
    state = torch.randn(9, 3 if overlapping else 1, 3, DIM)
    references = [Reference(compressor) for _ in positions]
    for reference, position, row in zip(references, positions, rows, strict=True):
        if position:
            reference.advance(torch.randn(position, HIDDEN).to(torch.bfloat16), 0)
            state[row] = record_of(reference.state)
        else:
            state[row] = float("nan")
    untouched = state[[4, 7]].clone()
    x = torch.randn(len(positions), HIDDEN).to(torch.bfloat16)
    poison_allocations(monkeypatch)
    entries = kernel.compress_decode(
        *projections(compressor, x), torch.tensor(positions), state, torch.tensor(rows, dtype=torch.int32), weights
    )
    for i, (reference, position, row) in enumerate(zip(references, positions, rows, strict=True)):
        emitted = reference.advance(x[i : i + 1], position)
        expected = emitted[0] if emitted.numel() else torch.zeros(DIM, dtype=torch.float64)
        if emitted.numel():
            assert relative_error(entries[i], expected) < TOLERANCE[torch.bfloat16]
        else:
            assert torch.equal(entries[i], torch.zeros_like(entries[i]))
        assert_same_record(state[row], record_of(reference.state), TOLERANCE[torch.bfloat16])
    assert torch.equal(state[[4, 7]], untouched)


@interpreted_only
@pytest.mark.parametrize("ratio,overlapping", KINDS)
def test_model_compressor_on_the_kernel_path(kernel, ratio, overlapping):
    """The glue the model uses on CUDA (``model.kernel_calls.compressor_advance_kernel``) keeps the model's state exact."""
    from sglang_dsv4.model.kernel_calls import compressor_advance_kernel

    compressor = random_compressor(ratio, overlapping, torch.float32, seed=30 + ratio)
    reference = Reference(compressor)
    state = compressor.new_state(torch.float32, "cpu")
    start = 0
    for length in (ratio + 3, 1, 1, 2 * ratio):
        x = torch.randn(length, HIDDEN)
        reference.advance(x, start)
        with torch.no_grad():
            compressor_advance_kernel(compressor, x, start, state)
        start += length
    assert relative_error(state.entries, reference.state.entries) < TOLERANCE[torch.float32]
    assert_same_record(record_of(state), record_of(reference.state), TOLERANCE[torch.float32])


@interpreted_only
def test_chunks_without_tokens_are_refused(kernel):
    compressor = random_compressor(4, True, torch.float32, seed=0)
    empty = torch.zeros(0, 2 * DIM)
    with pytest.raises(ValueError, match="at least one new token"):
        kernel.compress_extend(
            empty, empty, [4], [0], torch.zeros(1, 3, 3, DIM), torch.zeros(1), weights_of(kernel, compressor)
        )
