"""The KV compressor on the GPU: online softmax pools, entries with RMSNorm and rope fused.

The math is :mod:`sglang_dsv4.model.compressor`'s: per channel, a block's entry is the
softmax-weighted sum of its tokens' values (gate logit plus ``ape[position % ratio]``),
ratio-4 entries pool the previous block's ``Ca`` half with their own block's ``Cb`` half,
and a partial block lives on as an online pool (running max, denominator, weighted sum).

One kernel, :func:`_compress_blocks`, does both phases. Its grid is (request, block of the
request's new tokens): every block the chunk touches is pooled in parallel, the ones it
completes emit their entry (RMSNorm over the entry, rope at the block's first position),
and the program of the last block writes the request's online state. Decode is the case
of one token per request (one block), with the state updated in place; prefill and
extend split the chunk's blocks over programs. A ratio-4 layer's two compressors (its own and
its indexer's, of other widths) decode in one launch, :func:`_compress_decode_pair`: a program
per request and compressor, each running what the single launch runs.

State rows are ``[pools, 3, dim]`` float32, the V4 pool's layout (:mod:`sglang_dsv4.memory_pool.layout`):
pool 0 is the partial block (its ``Cb`` half when overlapping), pool 1 its ``Ca`` half and
pool 2 the last complete block's ``Ca`` half; fields are max, denominator, weighted sum.
A pool the position says must be empty (the partial block at a block start, the previous
half before the first block) is never read, so a request's row needs no reset.

Channels are held as ``[dim / 2, 2]`` tiles (pair, even/odd) so that rope, which rotates
interleaved pairs, needs no gather.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .fp8_encode import store_fp8_rows
from .kv_format import ENTRY_SCALE_BLOCK, KEY_SCALE_BLOCK, Fp8EntryRows, Fp8KeyRows

MAX_POOLED_TOKENS = 16  # tokens pooled per step of a program


@dataclass(frozen=True)
class CompressorWeights:
    """What the kernel needs of a compressor besides its projections."""

    ape: torch.Tensor  # [ratio, series * dim]
    norm_weight: torch.Tensor  # [dim]
    norm_eps: float
    inv_freq: torch.Tensor  # [rope_dim / 2] float32, on the device
    ratio: int
    overlapping: bool

    @property
    def dim(self) -> int:
        return self.norm_weight.shape[0]


@triton.jit
def _merge(a, b):
    """Two online pools ``(max, denom, weighted)`` as one; an empty pool (max -inf) adds nothing."""
    max_a, denom_a, weighted_a = a
    max_b, denom_b, weighted_b = b
    peak = tl.maximum(max_a, max_b)
    safe_peak = tl.where(peak == float("-inf"), 0.0, peak)
    scale_a = tl.where(max_a == float("-inf"), 0.0, tl.exp(max_a - safe_peak))
    scale_b = tl.where(max_b == float("-inf"), 0.0, tl.exp(max_b - safe_peak))
    return peak, denom_a * scale_a + denom_b * scale_b, weighted_a * scale_a + weighted_b * scale_b


@triton.jit
def _pairs(HALF: tl.constexpr):
    """Channel indices ``[HALF, 2]``: pair, then even/odd."""
    return tl.arange(0, HALF)[:, None] * 2 + tl.arange(0, 2)[None, :]


@triton.jit
def _pool_tokens(
    kv_ptr, gate_ptr, ape_ptr, row_at_zero, block_start, first, end, width, HALF: tl.constexpr, BLOCK_TOK: tl.constexpr
):
    """Online pool of positions ``first .. end - 1``, all in the block at ``block_start``.

    Position ``p`` is projection row ``row_at_zero + p``; the pointers are at the series' first channel.
    """
    channel = _pairs(HALF)[None, :, :]
    peak = tl.full([HALF, 2], float("-inf"), tl.float32)
    denom = tl.zeros([HALF, 2], tl.float32)
    weighted = tl.zeros([HALF, 2], tl.float32)
    for step_start in range(first, end, BLOCK_TOK):
        position = step_start + tl.arange(0, BLOCK_TOK)
        ok = (position < end)[:, None, None]
        at = (row_at_zero + position).to(tl.int64)[:, None, None] * width + channel
        ape_at = (position - block_start)[:, None, None] * width + channel
        logits = tl.load(gate_ptr + at, mask=ok, other=0.0).to(tl.float32)
        logits += tl.load(ape_ptr + ape_at, mask=ok, other=0.0).to(tl.float32)
        logits = tl.where(ok, logits, float("-inf"))
        values = tl.load(kv_ptr + at, mask=ok, other=0.0).to(tl.float32)
        new_peak = tl.maximum(peak, tl.max(logits, axis=0))  # finite: every step holds a token
        rescale = tl.exp(peak - new_peak)
        weights = tl.exp(logits - new_peak[None, :, :])
        denom = denom * rescale + tl.sum(weights, axis=0)
        weighted = weighted * rescale + tl.sum(weights * values, axis=0)
        peak = new_peak
    return peak, denom, weighted


@triton.jit
def _load_pool(state_ptr, row, pool, present, DIM: tl.constexpr, POOLS: tl.constexpr):
    """Pool ``pool`` of state row ``row``, or an empty pool where ``present`` is false."""
    at = state_ptr + (row.to(tl.int64) * POOLS + pool) * 3 * DIM + _pairs(DIM // 2)
    return (
        tl.load(at, mask=present, other=float("-inf")),
        tl.load(at + DIM, mask=present, other=0.0),
        tl.load(at + 2 * DIM, mask=present, other=0.0),
    )


@triton.jit
def _store_pool(state_ptr, row, pool, value, DIM: tl.constexpr, POOLS: tl.constexpr):
    peak, denom, weighted = value
    at = state_ptr + (row.to(tl.int64) * POOLS + pool) * 3 * DIM + _pairs(DIM // 2)
    tl.store(at, peak)
    tl.store(at + DIM, denom)
    tl.store(at + 2 * DIM, weighted)


@triton.jit
def _compress_blocks(
    kv_ptr, gate_ptr, ape_ptr, starts_ptr, chunk_rows_ptr, entry_slots_ptr, state_in_ptr, in_rows_ptr, state_out_ptr,
    out_rows_ptr, norm_weight_ptr, inv_freq_ptr, entries_ptr, previous_ptr, checkpoint_ptr, checkpoint_rows_ptr, eps,
    DIM: tl.constexpr, ROPE_DIM: tl.constexpr, RATIO: tl.constexpr, OVERLAPPING: tl.constexpr, BLOCK_TOK: tl.constexpr,
    DECODE: tl.constexpr, ENTRY_ROWS: tl.constexpr, RECORDS: tl.constexpr,
    ROW_BYTES: tl.constexpr, NOPE_DIM: tl.constexpr, SCALE_WIDTH: tl.constexpr, SCALES: tl.constexpr,
    SCALE_OFFSET: tl.constexpr, FLOAT32_SCALES: tl.constexpr,
):  # fmt: skip
    """Program (request, block of its chunk): :func:`_compress_block`."""
    _compress_block(
        tl.program_id(0), tl.program_id(1), kv_ptr, gate_ptr, ape_ptr, starts_ptr, chunk_rows_ptr, entry_slots_ptr,
        state_in_ptr, in_rows_ptr, state_out_ptr, out_rows_ptr, norm_weight_ptr, inv_freq_ptr, entries_ptr,
        previous_ptr, checkpoint_ptr, checkpoint_rows_ptr, eps,
        DIM, ROPE_DIM, RATIO, OVERLAPPING, BLOCK_TOK, DECODE, ENTRY_ROWS, RECORDS,
        ROW_BYTES, NOPE_DIM, SCALE_WIDTH, SCALES, SCALE_OFFSET, FLOAT32_SCALES,
    )  # fmt: skip


@triton.jit
def _compress_decode_pair(
    positions_ptr,
    kv_a, gate_a, ape_a, entry_rows_a, state_a, rows_a, norm_weight_a, inv_freq_a, entries_a, previous_a,
    checkpoint_a, checkpoint_rows_a, eps_a,
    kv_b, gate_b, ape_b, entry_rows_b, state_b, rows_b, norm_weight_b, inv_freq_b, entries_b, previous_b,
    checkpoint_b, checkpoint_rows_b, eps_b,
    DIM_A: tl.constexpr, ROPE_DIM_A: tl.constexpr, RATIO_A: tl.constexpr, OVERLAPPING_A: tl.constexpr,
    ROW_BYTES_A: tl.constexpr, NOPE_DIM_A: tl.constexpr, SCALE_WIDTH_A: tl.constexpr, SCALES_A: tl.constexpr,
    SCALE_OFFSET_A: tl.constexpr, FLOAT32_SCALES_A: tl.constexpr,
    DIM_B: tl.constexpr, ROPE_DIM_B: tl.constexpr, RATIO_B: tl.constexpr, OVERLAPPING_B: tl.constexpr,
    ROW_BYTES_B: tl.constexpr, NOPE_DIM_B: tl.constexpr, SCALE_WIDTH_B: tl.constexpr, SCALES_B: tl.constexpr,
    SCALE_OFFSET_B: tl.constexpr, FLOAT32_SCALES_B: tl.constexpr,
):  # fmt: skip
    """Program (request, compressor): the decode step of compressor A (``which`` 0) or B (1) for one request, as
    :func:`_compress_blocks` runs it alone (one token, entry rows, records kept)."""
    request, which = tl.program_id(0), tl.program_id(1)
    block = which * 0  # a decode request's only block
    if which == 0:
        _compress_block(
            request, block, kv_a, gate_a, ape_a, positions_ptr, positions_ptr, entry_rows_a, state_a, rows_a, state_a,
            rows_a, norm_weight_a, inv_freq_a, entries_a, previous_a, checkpoint_a, checkpoint_rows_a, eps_a,
            DIM_A, ROPE_DIM_A, RATIO_A, OVERLAPPING_A, 1, True, True, True,
            ROW_BYTES_A, NOPE_DIM_A, SCALE_WIDTH_A, SCALES_A, SCALE_OFFSET_A, FLOAT32_SCALES_A,
        )  # fmt: skip
    else:
        _compress_block(
            request, block, kv_b, gate_b, ape_b, positions_ptr, positions_ptr, entry_rows_b, state_b, rows_b, state_b,
            rows_b, norm_weight_b, inv_freq_b, entries_b, previous_b, checkpoint_b, checkpoint_rows_b, eps_b,
            DIM_B, ROPE_DIM_B, RATIO_B, OVERLAPPING_B, 1, True, True, True,
            ROW_BYTES_B, NOPE_DIM_B, SCALE_WIDTH_B, SCALES_B, SCALE_OFFSET_B, FLOAT32_SCALES_B,
        )  # fmt: skip


@triton.jit
def _compress_block(
    request,
    block,
    kv_ptr,
    gate_ptr,
    ape_ptr,
    starts_ptr,
    chunk_rows_ptr,
    entry_slots_ptr,
    state_in_ptr,
    in_rows_ptr,
    state_out_ptr,
    out_rows_ptr,
    norm_weight_ptr,
    inv_freq_ptr,
    entries_ptr,
    previous_ptr,
    checkpoint_ptr,
    checkpoint_rows_ptr,
    eps,
    DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    RATIO: tl.constexpr,
    OVERLAPPING: tl.constexpr,
    BLOCK_TOK: tl.constexpr,
    DECODE: tl.constexpr,
    ENTRY_ROWS: tl.constexpr,
    RECORDS: tl.constexpr,
    ROW_BYTES: tl.constexpr,
    NOPE_DIM: tl.constexpr,
    SCALE_WIDTH: tl.constexpr,
    SCALES: tl.constexpr,
    SCALE_OFFSET: tl.constexpr,
    FLOAT32_SCALES: tl.constexpr,
):
    """Block ``block`` of request ``request``'s chunk: pool the block's new tokens, emit its entry if
    the chunk completes it, and, for the request's last block, write the online state.

    ``later`` pools the block's own series (Cb when overlapping), ``earlier`` its Ca half and
    ``previous`` the Ca half of the block before, which this block's entry pools too.
    ``DECODE``: request ``r`` has one token, projection row ``r`` and entry row ``r`` (``ENTRY_ROWS``: entry
    row ``entry_slots[r]``; zeros when its block is not complete), and its state is updated in place;
    ``RECORDS``: its state row is also copied whole to ``previous`` (the same row) before the update, and the
    updated one to checkpoint record ``checkpoint_rows[r]``. ``ROW_BYTES`` and what follows it: how an entry is
    stored (:func:`_store_entry`).
    """
    HALF: tl.constexpr = DIM // 2
    POOLS: tl.constexpr = 3 if OVERLAPPING else 1
    width = (2 if OVERLAPPING else 1) * DIM
    start = tl.load(starts_ptr + request)
    if DECODE:
        first_row = request
        end = start + 1
    else:
        first_row = tl.load(chunk_rows_ptr + request)
        end = start + tl.load(chunk_rows_ptr + request + 1) - first_row
    row_at_zero = first_row - start
    first_block = start // RATIO
    offset = start - first_block * RATIO
    blocks = (end - first_block * RATIO + RATIO - 1) // RATIO
    complete = (end - first_block * RATIO) // RATIO
    if block < blocks:
        block_start = (first_block + block) * RATIO
        first = tl.maximum(start, block_start)
        block_end = tl.minimum(end, block_start + RATIO)
        in_row = tl.load(in_rows_ptr + request)
        if RECORDS:
            _copy_row(state_in_ptr, previous_ptr, in_row, in_row, DIM, POOLS)
        continues_partial = (block == 0) & (offset > 0)  # the state's partial block is this one
        later_ptr, later_gate_ptr = kv_ptr + width - DIM, gate_ptr + width - DIM
        later = _pool_tokens(
            later_ptr,
            later_gate_ptr,
            ape_ptr + width - DIM,
            row_at_zero,
            block_start,
            first,
            block_end,
            width,
            HALF,
            BLOCK_TOK,
        )
        later = _merge(later, _load_pool(state_in_ptr, in_row, 0, continues_partial, DIM, POOLS))
        entry_pool = later
        earlier = later  # the disjoint compressor has one series: no Ca half, no block before
        previous = later
        if OVERLAPPING:
            earlier = _pool_tokens(
                kv_ptr, gate_ptr, ape_ptr, row_at_zero, block_start, first, block_end, width, HALF, BLOCK_TOK
            )
            earlier = _merge(earlier, _load_pool(state_in_ptr, in_row, 1, continues_partial, DIM, POOLS))
            # The block before: in the state (block 0), else in the chunk (plus the state's Ca
            # half when that block is the state's partial one).
            previous_start = block_start - RATIO
            previous = _pool_tokens(
                kv_ptr,
                gate_ptr,
                ape_ptr,
                row_at_zero,
                previous_start,
                tl.maximum(start, previous_start),
                tl.where(block > 0, block_start, 0),
                width,
                HALF,
                BLOCK_TOK,
            )
            previous = _merge(
                previous, _load_pool(state_in_ptr, in_row, 2, (block == 0) & (first_block > 0), DIM, POOLS)
            )
            previous = _merge(previous, _load_pool(state_in_ptr, in_row, 1, (block == 1) & (offset > 0), DIM, POOLS))
            entry_pool = _merge(previous, later)
        if DECODE and not ENTRY_ROWS:
            slot = request.to(tl.int64)
        else:
            slot = (tl.load(entry_slots_ptr + request) + block).to(tl.int64)
        if block < complete:
            entry = _norm_and_rope(entry_pool, norm_weight_ptr, inv_freq_ptr, block_start, eps, DIM, ROPE_DIM)
            _store_entry(
                entries_ptr, slot, entry, kv_ptr.dtype.element_ty,
                DIM, ROW_BYTES, NOPE_DIM, SCALE_WIDTH, SCALES, SCALE_OFFSET, FLOAT32_SCALES,
            )  # fmt: skip
        elif DECODE:
            _store_entry(
                entries_ptr, slot, tl.zeros([HALF, 2], tl.float32), kv_ptr.dtype.element_ty,
                DIM, ROW_BYTES, NOPE_DIM, SCALE_WIDTH, SCALES, SCALE_OFFSET, FLOAT32_SCALES,
            )  # fmt: skip
        if block == blocks - 1:
            if DECODE:
                tl.debug_barrier()  # every thread has read the state before any overwrites it
            out_row = tl.load(out_rows_ptr + request)
            block_done = block < complete
            _store_state(state_out_ptr, out_row, block_done, later, earlier, previous, HALF, OVERLAPPING)
            if RECORDS:
                checkpoint_row = tl.load(checkpoint_rows_ptr + request)
                _store_state(checkpoint_ptr, checkpoint_row, block_done, later, earlier, previous, HALF, OVERLAPPING)


@triton.jit
def _store_state(state_ptr, row, block_done, later, earlier, previous, HALF: tl.constexpr, OVERLAPPING: tl.constexpr):
    """State row ``row`` after the pooled tokens: the partial block's pools (empty once the block is done) and,
    overlapping, the last complete block's ``Ca`` half."""
    DIM: tl.constexpr = 2 * HALF
    POOLS: tl.constexpr = 3 if OVERLAPPING else 1
    empty = _empty_pool(HALF)
    _store_pool(state_ptr, row, 0, _select(block_done, empty, later), DIM, POOLS)
    if OVERLAPPING:
        _store_pool(state_ptr, row, 1, _select(block_done, empty, earlier), DIM, POOLS)
        _store_pool(state_ptr, row, 2, _select(block_done, earlier, previous), DIM, POOLS)


@triton.jit
def _store_entry(
    entries_ptr, slot, entry, computed_dtype,
    DIM: tl.constexpr, ROW_BYTES: tl.constexpr, NOPE_DIM: tl.constexpr, SCALE_WIDTH: tl.constexpr,
    SCALES: tl.constexpr, SCALE_OFFSET: tl.constexpr, FLOAT32_SCALES: tl.constexpr,
):  # fmt: skip
    """Entry row ``slot`` of ``entries``: the entry (float32 ``[DIM / 2, 2]``) in the pool's dtype (``ROW_BYTES``
    0), or encoded as DeepSeek's FP8 rows of ``ROW_BYTES`` bytes (:func:`.fp8_encode.store_fp8_rows`: the first
    ``NOPE_DIM`` channels as E4M3 with a scale per ``SCALE_WIDTH``, a float32 with ``FLOAT32_SCALES`` (indexer
    keys) else a UE8M0 byte with the rest, the rope, in bf16) from the entry as the projections' dtype
    (``computed_dtype``) holds it: the bytes of the entry stored in that dtype, then encoded."""
    if ROW_BYTES == 0:
        tl.store(entries_ptr + slot * DIM + _pairs(DIM // 2), entry.to(entries_ptr.dtype.element_ty))
    else:
        BLOCKS: tl.constexpr = DIM // SCALE_WIDTH if DIM >= SCALE_WIDTH else 1
        values = tl.reshape(entry.to(computed_dtype).to(tl.float32), (1, BLOCKS, DIM // BLOCKS))
        row_starts = entries_ptr + slot * ROW_BYTES + tl.zeros([1], tl.int64)
        store_fp8_rows(
            row_starts, values, tl.full([1, 1, 1], 1, tl.int1),
            NOPE_DIM, DIM // BLOCKS, SCALES, SCALE_OFFSET, ROW_BYTES, FLOAT32_SCALES, 16,
        )  # fmt: skip


@triton.jit
def _copy_row(source_ptr, target_ptr, source_row, target_row, DIM: tl.constexpr, POOLS: tl.constexpr):
    """State row ``source_row`` copied whole, every pool and field as stored (read or not), to ``target_row``."""
    channel = tl.arange(0, DIM)
    for part in tl.static_range(POOLS * 3):
        value = tl.load(source_ptr + (source_row.to(tl.int64) * POOLS * 3 + part) * DIM + channel)
        tl.store(target_ptr + (target_row.to(tl.int64) * POOLS * 3 + part) * DIM + channel, value)


@triton.jit
def _empty_pool(HALF: tl.constexpr):
    zeros = tl.zeros([HALF, 2], tl.float32)
    return zeros + float("-inf"), zeros, zeros


@triton.jit
def _select(condition, a, b):
    """Pool ``a`` where ``condition`` holds, else pool ``b``."""
    max_a, denom_a, weighted_a = a
    max_b, denom_b, weighted_b = b
    return (
        tl.where(condition, max_a, max_b),
        tl.where(condition, denom_a, denom_b),
        tl.where(condition, weighted_a, weighted_b),
    )


@triton.jit
def _norm_and_rope(pool, norm_weight_ptr, inv_freq_ptr, position, eps, DIM: tl.constexpr, ROPE_DIM: tl.constexpr):
    """The pool's value, RMS-normalised with the norm's weight, rope at ``position`` on the
    trailing ``ROPE_DIM`` channels (interleaved pairs); float32 ``[DIM / 2, 2]``."""
    HALF: tl.constexpr = DIM // 2
    _, denom, weighted = pool
    value = weighted / denom
    value = value * tl.rsqrt(tl.sum(tl.sum(value * value, axis=1), axis=0) / DIM + eps)
    pair = tl.arange(0, HALF)
    parity = tl.arange(0, 2)[None, :]
    value = value * tl.load(norm_weight_ptr + pair[:, None] * 2 + parity).to(tl.float32)
    rope_pair = pair - (HALF - ROPE_DIM // 2)
    roped = rope_pair >= 0
    angle = position.to(tl.float32) * tl.load(inv_freq_ptr + rope_pair, mask=roped, other=0.0)
    cos = tl.where(roped, tl.cos(angle), 1.0)[:, None]
    sin = tl.where(roped, tl.sin(angle), 0.0)[:, None]
    even = tl.sum(tl.where(parity == 0, value, 0.0), axis=1)[:, None]
    odd = tl.sum(tl.where(parity == 1, value, 0.0), axis=1)[:, None]
    return tl.where(parity == 0, even * cos - odd * sin, odd * cos + even * sin)


@dataclass(frozen=True)
class DecodeRecords:
    """The records a decode step keeps beside the state it advances: ``previous`` holds each request's state
    before its token (at the request's state row), ``checkpoint`` the state after it (at record
    ``checkpoint_rows[i]``; 0, the padding record, for a request taking no snapshot)."""

    previous: torch.Tensor
    checkpoint: torch.Tensor
    checkpoint_rows: torch.Tensor


def compress_decode(
    kv: torch.Tensor,
    gate: torch.Tensor,
    positions: torch.Tensor,
    state: torch.Tensor,
    state_rows: torch.Tensor,
    weights: CompressorWeights,
    records: DecodeRecords | None = None,
) -> torch.Tensor:
    """One new token per request: advance each request's online state in place (and write ``records``).

    ``kv``, ``gate`` ``[requests, series * dim]`` (the projections, ``gate`` without ``ape``);
    ``positions`` the tokens' positions; ``state`` ``[rows, pools, 3, dim]`` float32 and
    ``state_rows`` each request's row in it. Returns ``[requests, dim]``: the entry of a
    request whose token ends a block, zeros for the others. No host synchronisation.
    """
    entries = kv.new_empty((kv.shape[0], weights.dim))
    unused = positions  # decode reads no chunk offsets; its entry row is the request's
    _launch_decode(kv, gate, positions, state, state_rows, weights, records, entries, unused, entry_rows=False)
    return entries


StoredAs = Fp8EntryRows | Fp8KeyRows | None
"""How a pool stores the entries the kernel computes: DeepSeek's FP8 rows, or (``None``) values in its dtype."""


def compress_decode_into(
    kv: torch.Tensor,
    gate: torch.Tensor,
    positions: torch.Tensor,
    state: torch.Tensor,
    state_rows: torch.Tensor,
    weights: CompressorWeights,
    records: DecodeRecords,
    entries: torch.Tensor,
    entry_rows: torch.Tensor,
    stored_as: StoredAs = None,
) -> None:
    """:func:`compress_decode` with each request's entry written to ``entries[entry_rows[i]]`` (the pool's rows:
    values in their dtype, or ``stored_as``'s FP8 rows, byte for byte what encoding the entries as the projections'
    dtype holds them gives; zeros where the token ends no block, so ``entry_rows[i]`` is then the padding row 0):
    the whole decode step of a compressor in one launch."""
    _launch_decode(
        kv, gate, positions, state, state_rows, weights, records, entries, entry_rows, entry_rows=True,
        stored_as=stored_as,
    )  # fmt: skip


@dataclass(frozen=True)
class DecodeInto:
    """One compressor's decode step as :func:`compress_decode_into` takes it: its projections ``kv``, ``gate``, its
    state ``state[state_rows]`` advanced in place, its ``records``, its entries written to ``entries[entry_rows]``."""

    kv: torch.Tensor
    gate: torch.Tensor
    state: torch.Tensor
    state_rows: torch.Tensor
    weights: CompressorWeights
    records: DecodeRecords
    entries: torch.Tensor
    entry_rows: torch.Tensor
    stored_as: StoredAs = None


def compress_decode_pair_into(positions: torch.Tensor, first: DecodeInto, second: DecodeInto) -> None:
    """:func:`compress_decode_into` of two compressors over the same tokens at ``positions`` (a ratio-4 layer's and
    its indexer's) in one launch: a program per request and compressor, each what the single launch runs."""
    if first.kv.shape[0] != second.kv.shape[0]:
        raise ValueError(f"a pair of compressors decodes the same requests: {first.kv.shape[0]}, {second.kv.shape[0]}")
    if first.kv.shape[0] == 0:
        return
    for step in (first, second):
        _check_launch(step.kv, step.gate, step.state, step.weights)
        _check_records(step.state, step.records)

    def arguments(step: DecodeInto) -> list:
        records = step.records
        return [
            step.kv.contiguous(), step.gate.contiguous(), step.weights.ape.contiguous(), step.entry_rows, step.state,
            step.state_rows, step.weights.norm_weight.contiguous(), step.weights.inv_freq, step.entries,
            records.previous, records.checkpoint, records.checkpoint_rows, step.weights.norm_eps,
        ]  # fmt: skip

    def shape(step: DecodeInto) -> list:
        weights = step.weights
        stored = _stored_entries(step.stored_as).values()
        return [weights.dim, 2 * weights.inv_freq.shape[0], weights.ratio, weights.overlapping, *stored]

    grid = (first.kv.shape[0], 2)
    _compress_decode_pair[grid](positions, *arguments(first), *arguments(second), *shape(first), *shape(second))


def _launch_decode(
    kv: torch.Tensor,
    gate: torch.Tensor,
    positions: torch.Tensor,
    state: torch.Tensor,
    state_rows: torch.Tensor,
    weights: CompressorWeights,
    records: DecodeRecords | None,
    entries: torch.Tensor,
    entry_slots: torch.Tensor,
    *,
    entry_rows: bool,
    stored_as: StoredAs = None,
) -> None:
    if kv.shape[0] == 0:
        return
    if records is not None:
        _check_records(state, records)
    kept = records or DecodeRecords(state, state, state_rows)  # not written without records
    _launch(
        kv, gate, positions, positions, entry_slots, state, state_rows, state, state_rows, weights, entries, 1, True,
        kept, entry_rows=entry_rows, keep_records=records is not None, stored_as=stored_as,
    )  # fmt: skip


def compress_extend(
    kv: torch.Tensor,
    gate: torch.Tensor,
    starts: list[int],
    lengths: list[int],
    state: torch.Tensor,
    state_rows: torch.Tensor,
    weights: CompressorWeights,
) -> torch.Tensor:
    """Chunks of new tokens, request after request (``kv``, ``gate`` ``[sum(lengths), series * dim]``).

    Request ``i`` feeds positions ``starts[i] .. starts[i] + lengths[i] - 1``. Every block
    a chunk touches is pooled in parallel; returns the entries of the blocks the chunks
    complete, request after request, and leaves each partial block in the state.
    """
    if any(length < 1 for length in lengths):
        raise ValueError(f"every request needs at least one new token, got lengths {lengths}")
    ratio = weights.ratio
    completes = [(start + length) // ratio - start // ratio for start, length in zip(starts, lengths, strict=True)]
    blocks = [-(-(start % ratio + length) // ratio) for start, length in zip(starts, lengths, strict=True)]
    entries = kv.new_empty((sum(completes), weights.dim))
    if not lengths:
        return entries
    requests = len(lengths)
    chunk_rows = [0, *itertools.accumulate(lengths)]
    entry_slots = [0, *itertools.accumulate(completes)][:-1]
    # One copy to the device for all the offsets: starts, chunk rows, entry slots, snapshot rows.
    offsets = torch.tensor([*starts, *chunk_rows, *entry_slots, *range(requests)], dtype=torch.int32)
    offsets = offsets.to(kv.device, non_blocking=True)
    starts_at, rows_at, slots_at, snapshot_rows = offsets.split([requests, requests + 1, requests, requests])
    snapshot = state[state_rows]  # blocks of one request read the state while its last block rewrites it
    unkept = DecodeRecords(state, state, state_rows)  # extend keeps its records in torch
    _launch(
        kv, gate, starts_at, rows_at, slots_at, snapshot, snapshot_rows, state, state_rows, weights, entries,
        max(blocks), False, unkept, entry_rows=True, keep_records=False,
    )  # fmt: skip
    return entries


def _launch(
    kv: torch.Tensor,
    gate: torch.Tensor,
    starts: torch.Tensor,
    chunk_rows: torch.Tensor,
    entry_slots: torch.Tensor,
    state_in: torch.Tensor,
    in_rows: torch.Tensor,
    state_out: torch.Tensor,
    out_rows: torch.Tensor,
    weights: CompressorWeights,
    entries: torch.Tensor,
    max_blocks: int,
    decode: bool,
    records: DecodeRecords,
    *,
    entry_rows: bool,
    keep_records: bool,
    stored_as: StoredAs = None,
) -> None:
    _check_launch(kv, gate, state_out, weights)
    _compress_blocks[(starts.shape[0], max_blocks)](
        kv.contiguous(),
        gate.contiguous(),
        weights.ape.contiguous(),
        starts,
        chunk_rows,
        entry_slots,
        state_in,
        in_rows,
        state_out,
        out_rows,
        weights.norm_weight.contiguous(),
        weights.inv_freq,
        entries,
        records.previous,
        records.checkpoint,
        records.checkpoint_rows,
        weights.norm_eps,
        DIM=weights.dim,
        ROPE_DIM=2 * weights.inv_freq.shape[0],
        RATIO=weights.ratio,
        OVERLAPPING=weights.overlapping,
        BLOCK_TOK=1 if decode else min(weights.ratio, MAX_POOLED_TOKENS),
        DECODE=decode,
        ENTRY_ROWS=entry_rows,
        RECORDS=keep_records,
        **_stored_entries(stored_as),
    )


def _stored_entries(stored_as: StoredAs) -> dict[str, int | bool]:
    """:func:`_store_entry`'s constants for entries stored as ``stored_as``."""
    if stored_as is None:
        return dict(ROW_BYTES=0, NOPE_DIM=0, SCALE_WIDTH=1, SCALES=0, SCALE_OFFSET=0, FLOAT32_SCALES=False)
    keys = isinstance(stored_as, Fp8KeyRows)
    stored = {
        "ROW_BYTES": stored_as.row_bytes,
        "NOPE_DIM": stored_as.dim if keys else stored_as.nope_dim,
        "SCALE_WIDTH": KEY_SCALE_BLOCK if keys else ENTRY_SCALE_BLOCK,
        "SCALES": stored_as.scales,
        "SCALE_OFFSET": stored_as.scale_offset,
        "FLOAT32_SCALES": keys,
    }
    if stored["ROW_BYTES"] - stored["SCALE_OFFSET"] - stored["SCALES"] * (4 if keys else 1) > 16:
        raise ValueError(f"{stored_as}: more than 16 padding bytes a row")
    return stored


def _check_launch(kv: torch.Tensor, gate: torch.Tensor, state: torch.Tensor, weights: CompressorWeights) -> None:
    dim, series = weights.dim, 2 if weights.overlapping else 1
    if kv.shape[-1] != series * dim or gate.shape != kv.shape:
        raise ValueError(f"compressor projections are {tuple(kv.shape)}, {tuple(gate.shape)}; need [*, {series * dim}]")
    if state.dtype != torch.float32 or tuple(state.shape[1:]) != (3 if weights.overlapping else 1, 3, dim):
        need = f"float32 [rows, pools, 3, {dim}]"
        raise ValueError(f"compressor state is {state.dtype} {tuple(state.shape)}; need {need}")


def _check_records(state: torch.Tensor, records: DecodeRecords) -> None:
    kept = (records.previous, records.checkpoint)
    if not all(r.dtype == state.dtype and r.shape[1:] == state.shape[1:] for r in kept):
        raise ValueError(f"compressor records need the state's rows: {state.dtype} [*, {tuple(state.shape[1:])}]")
