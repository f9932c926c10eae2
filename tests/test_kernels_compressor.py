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

from sglang_dsv4.kernels.kv_format import Fp8EntryRows, Fp8KeyRows, PlainRows
from sglang_dsv4.model.compressor import Compressor
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
        assert_same_record(state[1], reference.state.record(), TOLERANCE[dtype])
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
            state[row] = reference.state.record()
    xs = [torch.randn(length, HIDDEN) for length in lengths]
    expected = torch.cat([ref.advance(x, start) for ref, x, start in zip(references, xs, starts, strict=True)])
    poison_allocations(monkeypatch)
    kv, gate = projections(compressor, torch.cat(xs))
    entries = kernel.compress_extend(kv, gate, starts, lengths, state, torch.tensor(rows), weights)
    assert relative_error(entries, expected) < TOLERANCE[torch.float32]
    for reference, row in zip(references, rows, strict=True):
        assert_same_record(state[row], reference.state.record(), TOLERANCE[torch.float32])


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
            state[row] = reference.state.record()
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
        assert_same_record(state[row], reference.state.record(), TOLERANCE[torch.bfloat16])
    assert torch.equal(state[[4, 7]], untouched)


@interpreted_only
@pytest.mark.parametrize("ratio,overlapping", KINDS)
def test_model_compressor_on_the_kernel_path(kernel, monkeypatch, ratio, overlapping):
    """The model's compressor where dispatch chooses the kernel (on CUDA; here, told so) keeps its state exact."""
    from sglang_dsv4.kernels import dispatch

    monkeypatch.setattr(dispatch, "uses_triton", lambda tensor: True)
    compressor = random_compressor(ratio, overlapping, torch.float32, seed=30 + ratio)
    reference = Reference(compressor)
    state = compressor.new_state(torch.float32, "cpu")
    start = 0
    for length in (ratio + 3, 1, 1, 2 * ratio):
        x = torch.randn(length, HIDDEN)
        reference.advance(x, start)
        with torch.no_grad():
            compressor.advance(x, start, state)
        start += length
    assert relative_error(state.entries, reference.state.entries) < TOLERANCE[torch.float32]
    assert_same_record(state.record(), reference.state.record(), TOLERANCE[torch.float32])


@interpreted_only
def test_chunks_without_tokens_are_refused(kernel):
    compressor = random_compressor(4, True, torch.float32, seed=0)
    empty = torch.zeros(0, 2 * DIM)
    with pytest.raises(ValueError, match="at least one new token"):
        kernel.compress_extend(
            empty, empty, [4], [0], torch.zeros(1, 3, 3, DIM), torch.zeros(1), weights_of(kernel, compressor)
        )


@interpreted_only
@pytest.mark.parametrize(
    "stored_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn], ids=["in_kernel", "encoded_after", "fp8"]
)
@pytest.mark.parametrize("ratio,overlapping", KINDS)
def test_batched_decode_on_the_kernel_equals_the_batched_torch_pools(
    kernel, monkeypatch, ratio, overlapping, stored_dtype
):
    """The batched core's decode step on CUDA (``batched._advance`` where dispatch chooses the decode kernel)
    writes what its torch pools of any forward (``batched._advance_pooled``) write: entry rows, states, the
    records one step back, snapshots. Entries stored in the projections' dtype, or as DeepSeek's FP8 rows, are
    written by the kernel itself (``in_kernel``, ``fp8``: one launch); stored in another dtype, they are encoded
    and copied after it (``encoded_after``).

    Requests sit at every kind of position (the first token, inside a block, a block's last token, the
    first after one), two padded rows decode position 0 of row 0, some rows take a snapshot; the
    state's pools their position says are empty are NaN, and the kernel's outputs start as NaN.
    """
    import dataclasses
    import types

    from sglang_dsv4.attention_backend import batched
    from sglang_dsv4.kernels import dispatch

    compressor = random_compressor(ratio, overlapping, torch.float32, seed=40 + ratio)
    request_rows, blocks, pools = 9, 8, 3 if overlapping else 1
    rows = torch.tensor([3, 8, 7, 6, 1, 5, 2, 0, 0])
    positions = torch.tensor([1, ratio - 1, 0, ratio, 2 * ratio - 1, 5 * ratio + 3, 7 * ratio - 1, 0, 0])
    snapshot_records = torch.tensor([2, 0, 0, 1, 3, 0, 4, 0, 0])
    tables = types.SimpleNamespace(
        window_table=torch.arange(request_rows * 8 * ratio).view(request_rows, 8 * ratio),
        entry_table={ratio: 1 + torch.arange(request_rows * blocks).view(request_rows, blocks)},
    )
    config = types.SimpleNamespace(
        sliding_window=8, csa_rate=4, rope_head_dim=ROPE_DIM, rope_theta=10000.0, compress_rope_theta=10000.0, yarn=None
    )
    index = batched.build_decode_index(rows, positions + 1, snapshot_records, tables, config)
    state = torch.randn(request_rows, pools, 3, DIM)
    for row, position in zip(rows.tolist(), positions.tolist(), strict=True):
        if position % ratio == 0:
            state[row, :2] = float("nan")  # the partial block (both halves)
        if overlapping and position < ratio:
            state[row, 2] = float("nan")  # the block before
    fresh = {"state": state, "previous": torch.randn_like(state), "checkpoint": torch.randn(5, pools, 3, DIM)}
    torch_side = {name: tensor.clone() for name, tensor in fresh.items()}
    fp8 = stored_dtype == torch.float8_e4m3fn
    stored_as = Fp8EntryRows(DIM, ROPE_DIM) if fp8 else PlainRows(DIM, stored_dtype)
    entries = stored_as.encode(torch.randn(1 + request_rows * blocks, DIM))
    torch_entries = entries.clone()
    x = torch.randn(len(rows), HIDDEN)
    with torch.no_grad():
        pooled = dataclasses.replace(index, one_token_each=False)
        batched._advance(
            compressor, x, pooled, batched._Rows(torch_entries, stored_as), batched._StateRecords(**torch_side)
        )
        poison_allocations(monkeypatch)
        monkeypatch.setattr(dispatch, "uses_triton", lambda tensor: True)
        batched._advance(compressor, x, index, batched._Rows(entries, stored_as), batched._StateRecords(**fresh))

    def same(actual: torch.Tensor, expected: torch.Tensor, what: str, equal_nan: bool = False, tol=1e-5) -> None:
        assert equal_nan or not torch.isnan(actual).any(), f"{what}: NaN (a poisoned pool read, or unwritten)"
        torch.testing.assert_close(actual, expected, rtol=tol, atol=tol, equal_nan=equal_nan, msg=what)

    # Row 0: the padding entry. bf16 rows: one step of rounding either way; FP8 rows: each within one FP8 step.
    if fp8:
        kernel_rows, torch_rows = (stored_as.decode(rows[1:], torch.float32) for rows in (entries, torch_entries))
        assert ((kernel_rows - torch_rows).norm(dim=1) <= 0.125 * torch_rows.norm(dim=1)).all(), "entry rows"
    else:
        rounding = 1e-5 if stored_dtype == torch.float32 else 1e-2
        same(entries[1:], torch_entries[1:], "entry rows", tol=rounding)
    same(fresh["state"][1:], torch_side["state"][1:], "states")
    real = rows[rows > 0]
    same(fresh["previous"][real], torch_side["previous"][real], "records one step back", equal_nan=True)
    same(fresh["checkpoint"][1:], torch_side["checkpoint"][1:], "snapshots")


def decode_step(kernel, compressor: Compressor, x: torch.Tensor, positions: list[int], seed: int):
    """A decode step's inputs for ``compressor`` (its projections of ``x``, at ``positions``, request ``i`` at state
    row ``rows[i]``): states and records at random, the pools the position says are empty NaN, entries NaN."""
    generator = torch.Generator().manual_seed(seed)
    dim, pools, ratio = compressor.dim, 3 if compressor.overlapping else 1, compressor.ratio
    state = torch.randn(9, pools, 3, dim, generator=generator)
    rows = torch.tensor([3, 8, 0, 6, 1, 5, 2][: len(positions)], dtype=torch.int32)
    for row, position in zip(rows.tolist(), positions, strict=True):
        if position % ratio == 0:
            state[row, :2] = float("nan")
        if compressor.overlapping and position < ratio:
            state[row, 2] = float("nan")
    records = kernel.DecodeRecords(
        torch.randn(9, pools, 3, dim, generator=generator), torch.randn(5, pools, 3, dim, generator=generator),
        torch.tensor([2, 0, 0, 1, 3, 4, 0][: len(positions)]),
    )  # fmt: skip
    entries = torch.full((20, dim), float("nan"), dtype=x.dtype)
    entry_rows = torch.tensor([5, 0, 7, 0, 9, 11, 13][: len(positions)])
    kv, gate = projections(compressor, x)
    weights = weights_of(kernel, compressor)
    return kernel.DecodeInto(kv, gate, state, rows, weights, records, entries, entry_rows)


def written(step) -> list[torch.Tensor]:
    return [step.state, step.records.previous, step.records.checkpoint, step.entries]


def cloned(kernel, step):
    records = step.records
    return kernel.DecodeInto(
        step.kv, step.gate, step.state.clone(), step.state_rows, step.weights,
        kernel.DecodeRecords(records.previous.clone(), records.checkpoint.clone(), records.checkpoint_rows),
        step.entries.clone(), step.entry_rows,
    )  # fmt: skip


@interpreted_only
@pytest.mark.parametrize("second_kind", [(4, True, 32), (16, False, 8)], ids=["indexer-like", "disjoint"])
def test_two_compressors_in_one_launch_write_what_each_writes_alone(kernel, second_kind):
    """A ratio-4 layer's compressor and a second one of another width (its indexer's, wider here; or a disjoint one
    of another ratio) decoded by the pair launch: every state, record and entry row bitwise what
    :func:`compress_decode_into` writes for each alone, at every kind of position, bf16 projections."""
    ratio, overlapping, dim = second_kind
    first = random_compressor(4, True, torch.bfloat16, seed=60)
    generator = torch.Generator().manual_seed(61)
    second = Compressor(HIDDEN, dim, ratio, overlapping, Rotary(ROPE_DIM, 160000.0, None), 1e-6)
    with torch.no_grad():
        for parameter in second.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
    second = second.to(torch.bfloat16)
    positions = [1, 3, 0, 4, 7, 23, 15]
    x = torch.randn(len(positions), HIDDEN, generator=generator).to(torch.bfloat16)
    at = torch.tensor(positions)
    steps = [decode_step(kernel, compressor, x, positions, seed) for compressor, seed in ((first, 1), (second, 2))]
    alone = [cloned(kernel, step) for step in steps]
    for step in alone:
        kernel.compress_decode_into(
            step.kv, step.gate, at, step.state, step.state_rows, step.weights, step.records, step.entries,
            step.entry_rows,
        )  # fmt: skip
    kernel.compress_decode_pair_into(at, *steps)
    for step, expected in zip(steps, alone, strict=True):
        for actual, wanted in zip(written(step), written(expected), strict=True):
            assert torch.equal(actual.isnan(), wanted.isnan()) and torch.equal(actual.nan_to_num(), wanted.nan_to_num())
        assert not step.entries[step.entry_rows].isnan().any(), "an entry row left unwritten"


@interpreted_only
@pytest.mark.parametrize("stored_dtype", [torch.float32, torch.float8_e4m3fn], ids=["in_kernel", "fp8"])
def test_a_ratio4_layers_pair_decode_equals_the_batched_torch_pools(kernel, monkeypatch, stored_dtype):
    """``batched._advance_pair`` (a ratio-4 layer's compressor and its indexer's) in a decode forward where dispatch
    chooses the kernels (the pair launch, its entries stored as computed, ``in_kernel``, or as FP8 rows, ``fp8``)
    writes what the batched torch pools write: entry and key rows, states, records one step back,
    snapshots. Requests at every kind of position, padded rows, NaN in the pools the positions say are empty."""
    import dataclasses
    import types

    from sglang_dsv4.attention_backend import batched
    from sglang_dsv4.kernels import dispatch

    entry_compressor = random_compressor(4, True, torch.float32, seed=70)
    key_compressor = Compressor(HIDDEN, 2 * DIM, 4, True, Rotary(ROPE_DIM, 10000.0, None), 1e-6)
    generator = torch.Generator().manual_seed(71)
    with torch.no_grad():
        for parameter in key_compressor.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
    request_rows, blocks = 9, 8
    rows = torch.tensor([3, 8, 7, 6, 1, 5, 2, 0, 0])
    positions = torch.tensor([1, 3, 0, 4, 7, 23, 27, 0, 0])
    tables = types.SimpleNamespace(
        window_table=torch.arange(request_rows * 32).view(request_rows, 32),
        entry_table={4: 1 + torch.arange(request_rows * blocks).view(request_rows, blocks)},
    )
    config = types.SimpleNamespace(
        sliding_window=8, csa_rate=4, rope_head_dim=ROPE_DIM, rope_theta=10000.0, compress_rope_theta=10000.0, yarn=None
    )
    index = batched.build_decode_index(rows, positions + 1, torch.tensor([2, 0, 0, 1, 3, 0, 4, 0, 0]), tables, config)
    sides = {"torch": [], "kernel": []}
    for compressor in (entry_compressor, key_compressor):
        dim = compressor.dim
        state = torch.randn(request_rows, 3, 3, dim, generator=generator)
        for row, position in zip(rows.tolist(), positions.tolist(), strict=True):
            if position % 4 == 0:
                state[row, :2] = float("nan")
            if position < 4:
                state[row, 2] = float("nan")
        records = {"state": state, "previous": torch.randn_like(state), "checkpoint": torch.randn(5, 3, 3, dim)}
        stored_as = Fp8EntryRows(dim, ROPE_DIM) if stored_dtype == torch.float8_e4m3fn else PlainRows(dim, stored_dtype)
        entries = stored_as.encode(torch.randn(1 + request_rows * blocks, dim, generator=generator))
        for side in sides.values():
            copies = batched._StateRecords(**{name: tensor.clone() for name, tensor in records.items()})
            side.append((compressor, batched._Rows(entries.clone(), stored_as), copies))
    x = torch.randn(len(rows), HIDDEN, generator=generator)
    with torch.no_grad():
        batched._advance_pair(*sides["torch"], x, dataclasses.replace(index, one_token_each=False))
        poison_allocations(monkeypatch)
        monkeypatch.setattr(dispatch, "uses_triton", lambda tensor: True)
        pair_launches, pair_into = [], kernel.compress_decode_pair_into
        monkeypatch.setattr(kernel, "compress_decode_pair_into", lambda *a: pair_launches.append(a) or pair_into(*a))
        batched._advance_pair(*sides["kernel"], x, index)
    assert len(pair_launches) == 1

    real = rows[rows > 0]
    for (_, kernel_rows, kernel_records), (_, torch_rows, torch_records) in zip(sides["kernel"], sides["torch"]):
        if stored_dtype == torch.float8_e4m3fn:
            decoded = [r.row_format.decode(r.rows[1:], torch.float32) for r in (kernel_rows, torch_rows)]
            assert ((decoded[0] - decoded[1]).norm(dim=1) <= 0.125 * decoded[1].norm(dim=1)).all(), "entry rows"
        else:
            torch.testing.assert_close(kernel_rows.rows[1:], torch_rows.rows[1:], rtol=1e-5, atol=1e-5)
        for name, chosen in (("state", slice(1, None)), ("previous", real), ("checkpoint", slice(1, None))):
            actual, expected = getattr(kernel_records, name)[chosen], getattr(torch_records, name)[chosen]
            torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5, equal_nan=name == "previous", msg=name)


@interpreted_only
@pytest.mark.parametrize("pair", [False, True], ids=["alone", "pair"])
def test_fp8_rows_the_decode_kernel_stores_are_its_entries_encoded_byte_for_byte(kernel, pair):
    """The decode kernel storing DeepSeek's FP8 rows itself (entry rows, UE8M0 scales and bf16 rope; indexer-key
    rows, float32 scales and padding) writes at each entry row the bytes the Triton encode gives for the entries it
    returns in the projections' dtype, and leaves every other row as it was; alone, and in the pair launch (a
    ratio-4 layer's compressor and its indexer's)."""
    import dataclasses

    from sglang_dsv4.kernels.fp8_encode import encode_fp8_rows

    compressors = [random_compressor(4, True, torch.bfloat16, seed=80), random_compressor(4, True, torch.bfloat16, 81)]
    formats = [Fp8EntryRows(DIM, ROPE_DIM), Fp8KeyRows(DIM)]
    positions = [1, 3, 0, 4, 7, 23, 15]
    x = torch.randn(len(positions), HIDDEN, generator=torch.Generator().manual_seed(82)).to(torch.bfloat16)
    at = torch.tensor(positions)
    steps, expected = [], []
    for seed, (compressor, stored_as) in enumerate(zip(compressors, formats, strict=True)):
        step = decode_step(kernel, compressor, x, positions, seed)
        plain = cloned(kernel, step)
        entries = kernel.compress_decode(step.kv, step.gate, at, plain.state, plain.state_rows, step.weights)
        pool = torch.randint(0, 256, (20, stored_as.row_bytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(83))
        wanted = pool.clone()
        wanted[step.entry_rows] = encode_fp8_rows(entries, stored_as)  # row 0 twice: both zeros encoded
        steps.append(dataclasses.replace(step, entries=pool, stored_as=stored_as))
        expected.append(wanted)
    if pair:
        kernel.compress_decode_pair_into(at, *steps)
    else:
        for step in steps:
            kernel.compress_decode_into(
                step.kv, step.gate, at, step.state, step.state_rows, step.weights, step.records, step.entries,
                step.entry_rows, step.stored_as,
            )  # fmt: skip
    for step, wanted in zip(steps, expected, strict=True):
        assert torch.equal(step.entries, wanted), type(step.stored_as).__name__
