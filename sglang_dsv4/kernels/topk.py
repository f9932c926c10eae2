"""Exact top-k over rows of float32 scores, in Triton: threshold, keep, verify, refine.

Three launches per call, whatever the rows' lengths (so a call can be captured in a
CUDA graph):

1. a threshold per row that should sit a little below the row's k-th largest score:
   :func:`top_k` takes it from a sample of the row (the maxima of runs of adjacent scores
   spread over it), :func:`temporal_top_k` from the scores the previous step's selection
   has now (their minimum: at least k scores clear it by construction);
2. one pass over the scores in which each block of the row copies the scores that clear
   the threshold, with their slots, into a segment of its own and counts them;
3. per row, a verification and an exact select: when no segment overflowed and at least
   k scores cleared the threshold, a radix select over the kept scores (2-bit digits of
   their order-preserving integer keys, leading digits they all share skipped, stopping at
   the first digit whose keys are all taken) finds the cut under the k largest exactly;
   otherwise, rarely, the same select streams over the whole row.

Either way the result is exactly :func:`torch.topk`'s set, and of equal scores at the k-th place the
earliest slots are taken (:func:`.sparse_torch.top_k_earliest_ties`'s rule): every select below meets its
candidates in slot order where it takes ties. Output: ``[rows, k]`` int32 slots, a row's ``min(k, length)``
chosen slots first in no particular order, then ``-1``. What each step costs on the H200 is in
benchmarks/RESULTS.md.

:func:`whole_row_top_k` (one launch, the row in registers) serves rows up to 16,384 scores, and
:func:`wide_row_top_k` (one launch, a threshold from group maxima, the candidates compacted) wider ones.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SAMPLE_RUNS, RUN_LENGTH = 512, 8  # the sample: 512 runs of 8 adjacent scores (one 32-byte sector each)
SAMPLE_MARGIN = 2  # aim the sampled threshold at about twice k scores ...
SAMPLE_EXTRA = 16  # ... plus this many more sampled ones, so that fewer than k clear it only by a freak
KEEP_BLOCK = 1024  # scores one program of the keeping pass reads
SEGMENT = 256  # scores it may keep (beyond that the row streams)
SELECT_TILE = 8192  # candidate places the select holds in registers at a time


def top_k(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """Slots of the ``k`` largest of ``scores[r, :lengths[r]]`` for each row ``r``, ``[rows, k]`` int32."""
    _check_inputs(scores, lengths, k)
    thresholds = torch.empty(scores.shape[0], dtype=torch.float32, device=scores.device)
    if scores.shape[0]:
        _sampled_threshold_kernel[(scores.shape[0],)](
            scores, scores.stride(0), lengths, thresholds, k,
            RUNS=SAMPLE_RUNS, RUN=RUN_LENGTH, MARGIN=SAMPLE_MARGIN, EXTRA=SAMPLE_EXTRA, num_warps=4,
        )  # fmt: skip
    return _keep_and_select(scores, lengths, k, thresholds)


# The widest rows :func:`whole_row_top_k` holds in registers: the select's digit counts are 16-bit fields.
WHOLE_ROW_MAX_WIDTH = (1 << 16) - 1


def whole_row_top_k(scores: torch.Tensor, lengths: torch.Tensor, k: int, *, num_warps: int | None = None) -> torch.Tensor:
    """:func:`top_k` in one launch, for rows of at most ``WHOLE_ROW_MAX_WIDTH`` scores.

    One program per row holds the whole row in registers and finds its k-th largest score by
    the same radix select (no threshold, no kept segments), then writes the slots above it
    and the first ties. The three-launch :func:`top_k` pays a fixed cost per launch and a
    select over a tile wider than the row; a decode step's rows (context / 4 scores) fit one
    program, so one launch is all the row needs.
    """
    out = torch.empty(scores.shape[0], k, dtype=torch.int32, device=scores.device)
    _launch_whole_row(scores, lengths, k, out, None, None, None, num_warps)
    return out


def whole_row_top_k_rows(
    scores: torch.Tensor,
    lengths: torch.Tensor,
    k: int,
    table: torch.Tensor,
    table_row: torch.Tensor,
    *,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`whole_row_top_k` written as what the slots stand for: row ``r``'s chosen slots ``j`` as
    ``table[table_row[r], j]`` (``[rows, k]`` int32, then ``-1``), and how many it chose (``[rows]`` int32), in the
    same launch. ``table`` ``[table rows, >= width]`` (int32 or int64, contiguous last dim), ``table_row``
    ``[rows]``: for a ratio-4 layer's indexer, the entry rows its attention reads."""
    if table.stride(1) != 1 or table_row.shape != (scores.shape[0],):
        raise ValueError(f"table needs a contiguous last dim and table_row [{scores.shape[0]}]")
    out = torch.empty(scores.shape[0], k, dtype=torch.int32, device=scores.device)
    counts = torch.empty(scores.shape[0], dtype=torch.int32, device=scores.device)
    _launch_whole_row(scores, lengths, k, out, table, table_row, counts, num_warps)
    return out, counts


def _launch_whole_row(scores, lengths, k, out, table, table_row, counts, num_warps) -> None:
    _check_inputs(scores, lengths, k)
    rows, width = scores.shape
    if width > WHOLE_ROW_MAX_WIDTH:
        raise ValueError(f"rows of {width} scores exceed the whole-row select's {WHOLE_ROW_MAX_WIDTH}")
    if rows:
        block = max(16, triton.next_power_of_2(width))
        _whole_row_kernel[(rows,)](
            scores, scores.stride(0), lengths, out, out.stride(0), k,
            out if table is None else table, 0 if table is None else table.stride(0),
            lengths if table_row is None else table_row, lengths if counts is None else counts,
            BLOCK=block, BLOCK_K=triton.next_power_of_2(k), TABLE=table is not None,
            num_warps=num_warps or whole_row_warps(block),
        )  # fmt: skip


def whole_row_warps(block: int) -> int:
    """Warps of the whole-row select for a row of ``block`` places: 8 up to 4,096 places, then 32 (the best
    of 4, 8, 16 and 32 at 2,048 and 16,384 on the H200)."""
    return 8 if block <= 4096 else 32


# The wide-row select: the row read ``WIDE_CHUNK`` scores at a time; a row's candidates held in registers.
WIDE_CHUNK = 4096


def wide_row_top_k(scores: torch.Tensor, lengths: torch.Tensor, k: int, *, num_warps: int = 8) -> torch.Tensor:
    """:func:`top_k` in one launch for rows of any width, one program a row, the row read three times at most:

    1. the maxima of ``G >= k`` strided groups (group ``g``: slots ``g, g + G, ...``); the k-th largest
       maximum ``t`` (the radix select over ``G`` places) has at least ``k`` scores at or above it;
    2. the scores at or above ``t`` compacted, in slot order, into a scratch row of ``C`` places (about 1.4k of
       them on random scores), counting those at and above ``t``;
    3. the radix select over the candidates in registers, which takes the earliest ties (they are in slot
       order). If more than ``C`` cleared ``t`` but fewer than ``k`` exceed it, ``t`` is the k-th largest: the
       scores above it and the earliest ties are written in one more pass (a row of equal scores); otherwise,
       rarely, the select streams over the row.
    """
    out = torch.empty(scores.shape[0], k, dtype=torch.int32, device=scores.device)
    _launch_wide_row(scores, lengths, k, out, None, None, None, num_warps)
    return out


def wide_row_top_k_rows(
    scores: torch.Tensor,
    lengths: torch.Tensor,
    k: int,
    table: torch.Tensor,
    table_row: torch.Tensor,
    *,
    num_warps: int = 8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`wide_row_top_k` written as the table's rows, as :func:`whole_row_top_k_rows` writes them."""
    if table.stride(1) != 1 or table_row.shape != (scores.shape[0],):
        raise ValueError(f"table needs a contiguous last dim and table_row [{scores.shape[0]}]")
    out = torch.empty(scores.shape[0], k, dtype=torch.int32, device=scores.device)
    counts = torch.empty(scores.shape[0], dtype=torch.int32, device=scores.device)
    _launch_wide_row(scores, lengths, k, out, table, table_row, counts, num_warps)
    return out, counts


def wide_row_shape(k: int) -> tuple[int, int]:
    """Groups and candidate places of the wide-row select for ``k``: ``2k`` groups, ``4k`` places (powers of two)."""
    groups = max(16, triton.next_power_of_2(2 * k))
    return groups, max(1024, triton.next_power_of_2(4 * k))


def _launch_wide_row(scores, lengths, k, out, table, table_row, counts, num_warps) -> None:
    _check_inputs(scores, lengths, k)
    rows = scores.shape[0]
    if rows:
        groups, candidates = wide_row_shape(k)
        kept_keys = torch.empty(rows, candidates, dtype=torch.int32, device=scores.device)
        kept_slots = torch.empty(rows, candidates, dtype=torch.int32, device=scores.device)
        _wide_row_kernel[(rows,)](
            scores, scores.stride(0), lengths, out, out.stride(0), k, kept_keys, kept_slots,
            out if table is None else table, 0 if table is None else table.stride(0),
            lengths if table_row is None else table_row, lengths if counts is None else counts,
            GROUPS=groups, GROUP_ROWS=max(1, WIDE_CHUNK // groups), CHUNK=WIDE_CHUNK, CANDIDATES=candidates,
            BLOCK_K=triton.next_power_of_2(k), TABLE=table is not None, num_warps=num_warps,
        )  # fmt: skip


def temporal_top_k(scores: torch.Tensor, lengths: torch.Tensor, k: int, previous: torch.Tensor) -> torch.Tensor:
    """:func:`top_k`, with the threshold taken from ``previous`` (``[rows, >= k]`` int32 slots, ``-1`` for none).

    ``previous`` is typically the last decode step's result for the same rows; any
    content gives the exact result, a poor one only takes longer.
    """
    _check_inputs(scores, lengths, k)
    if previous.dtype != torch.int32 or previous.shape[0] != scores.shape[0] or previous.shape[1] < k:
        raise ValueError(f"previous must be int32 [{scores.shape[0]}, >= {k}], got {previous.dtype} {previous.shape}")
    if previous.stride(1) != 1:
        raise ValueError("previous needs a contiguous last dim")
    thresholds = torch.empty(scores.shape[0], dtype=torch.float32, device=scores.device)
    if scores.shape[0]:
        _previous_threshold_kernel[(scores.shape[0],)](
            scores, scores.stride(0), lengths, previous, previous.stride(0), thresholds, k,
            BLOCK_K=triton.next_power_of_2(k), num_warps=4,
        )  # fmt: skip
    return _keep_and_select(scores, lengths, k, thresholds)


def top_k_reference(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """The same set in torch: ``torch.topk`` of the visible scores (best first; of equal scores at the k-th place
    any), ``-1`` where a row has fewer than ``k``. The baseline the kernels are timed and checked against; no
    served path takes it (:func:`.indexer.exact_top_k`)."""
    width = scores.shape[1]
    visible = torch.arange(width, device=scores.device)[None, :] < lengths[:, None]
    masked = scores.masked_fill(~visible, float("-inf"))
    top = masked.topk(min(k, width), dim=-1).indices.to(torch.int32)
    top = torch.cat([top, top.new_full((top.shape[0], k - top.shape[1]), -1)], dim=1)
    ranks = torch.arange(k, device=scores.device)[None, :]
    return torch.where(ranks < lengths[:, None].clamp(max=k), top, -1)


def _check_inputs(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> None:
    if scores.dim() != 2 or scores.dtype != torch.float32 or scores.stride(1) != 1:
        raise ValueError(f"scores must be float32 [rows, width] with a contiguous last dim, got {scores.dtype}")
    if lengths.shape != (scores.shape[0],) or lengths.dtype != torch.int32:
        raise ValueError(f"lengths must be int32 [{scores.shape[0]}]")
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")


def _keep_and_select(scores: torch.Tensor, lengths: torch.Tensor, k: int, thresholds: torch.Tensor) -> torch.Tensor:
    rows, width = scores.shape
    out = torch.empty(rows, k, dtype=torch.int32, device=scores.device)
    if rows == 0:
        return out
    segments = max(1, triton.cdiv(width, KEEP_BLOCK))
    kept_scores = torch.empty(rows, segments, SEGMENT, dtype=torch.float32, device=scores.device)
    kept_slots = torch.empty(rows, segments, SEGMENT, dtype=torch.int32, device=scores.device)
    kept_counts = torch.empty(rows, segments, dtype=torch.int32, device=scores.device)
    _keep_kernel[(rows, segments)](
        scores, scores.stride(0), width, lengths, thresholds, kept_scores, kept_slots, kept_counts,
        BLOCK=KEEP_BLOCK, SEGMENT=SEGMENT, num_warps=4,
    )  # fmt: skip
    segment_block = triton.next_power_of_2(segments)
    _select_kernel[(rows,)](
        scores, scores.stride(0), lengths, kept_scores, kept_slots, kept_counts, out, out.stride(0), k, segments,
        SEGMENT=SEGMENT, SEGMENT_BLOCK=segment_block, SEGMENT_CHUNK=max(16, SELECT_TILE // segment_block),
        BLOCK_K=triton.next_power_of_2(k), SEGMENTS_PER_CHUNK=max(1, SELECT_TILE // SEGMENT), num_warps=8,
    )  # fmt: skip
    return out


@triton.jit
def _order_key(values):
    """int32 keys ordered like the float32 ``values`` (negative floats have their magnitude bits flipped)."""
    bits = values.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _value_of_key(key):
    bits = tl.where(key < 0, key ^ 0x7FFFFFFF, key)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _digit(keys, prefix, PASS: tl.constexpr):
    """2-bit digit ``PASS`` (0 = most significant) of the keys, and which keys match the digits chosen before it."""
    if PASS == 0:
        digits = ((keys >> 30) + 2) & 3  # the sign's digit, made unsigned-ordered
        match = keys == keys
    else:
        digits = (keys >> (30 - 2 * PASS)) & 3
        match = (keys >> (32 - 2 * PASS)) == (prefix >> (32 - 2 * PASS))
    return digits, match


@triton.jit
def _digit_counts(keys, valid, prefix, PASS: tl.constexpr):
    """How many valid keys matching ``prefix`` have each value (0..3) of digit ``PASS``: four 16-bit fields.

    One packed sum rather than ``tl.histogram``, whose shared-memory atomics serialise
    when most keys share a digit (as the leading digits of a radix select's candidates
    do). A chunk holds at most 65535 keys.
    """
    digits, match = _digit(keys, prefix, PASS)
    one = tl.full(digits.shape, 1, tl.int64)
    return tl.sum(tl.where(valid & match, one << (16 * digits).to(tl.int64), 0), 0)


@triton.jit
def _unpack_counts(packed):
    return (
        (packed & 0xFFFF).to(tl.int32),
        ((packed >> 16) & 0xFFFF).to(tl.int32),
        ((packed >> 32) & 0xFFFF).to(tl.int32),
        ((packed >> 48) & 0xFFFF).to(tl.int32),
    )


@triton.jit
def _choose_digit(c0, c1, c2, c3, rank, prefix, PASS: tl.constexpr):
    """The digit holding the ``rank``-th largest: the extended prefix, the rank within that digit, and how many keys
    hold that digit."""
    at_least_3 = c3
    at_least_2 = c3 + c2
    at_least_1 = at_least_2 + c1
    chosen = tl.where(at_least_3 >= rank, 3, tl.where(at_least_2 >= rank, 2, tl.where(at_least_1 >= rank, 1, 0)))
    above = tl.where(chosen == 3, 0, tl.where(chosen == 2, at_least_3, tl.where(chosen == 1, at_least_2, at_least_1)))
    holding = tl.where(chosen == 3, c3, tl.where(chosen == 2, c2, tl.where(chosen == 1, c1, c0)))
    if PASS == 0:
        prefix = (chosen - 2) << 30
    else:
        prefix = prefix | (chosen << (30 - 2 * PASS))
    return prefix, rank - above, holding


@triton.jit
def _kth_largest_key(keys, valid, rank):
    """A cut through ``keys[valid]`` under its ``rank`` largest (1-based): ``(key, ties)`` such that those are the keys
    above ``key`` and the first ``ties`` keys equal to it.

    Leading digits that every valid key shares (candidates above a threshold usually
    share their sign and high exponent bits) are taken from the least key without a count.
    The select stops at the first digit whose keys are all among the ``rank`` largest: all of them, ties
    included, are taken, as the full select would take them, so the cut is just under the prefix chosen so far
    (its remaining digits zero: the least key holding it), with no ties. On random scores that digit comes after
    about ``log4(valid keys)`` counted digits instead of sixteen. A prefix of the least key there is
    (``-2**31``) does not stop the select: the cut under it would wrap.
    """
    least = tl.min(tl.where(valid, keys, 0x7FFFFFFF), 0)
    most = tl.max(tl.where(valid, keys, -0x7FFFFFFF - 1), 0)
    prefix = tl.zeros((), tl.int32)
    exhausted = tl.zeros((), tl.int32)
    for p in tl.static_range(16):
        if exhausted == 0:
            if (least >> (30 - 2 * p)) == (most >> (30 - 2 * p)):
                prefix = (least >> (30 - 2 * p)) << (30 - 2 * p)
            else:
                c0, c1, c2, c3 = _unpack_counts(_digit_counts(keys, valid, prefix, p))
                prefix, rank, holding = _choose_digit(c0, c1, c2, c3, rank, prefix, p)
                exhausted = ((rank == holding) & (prefix != -0x7FFFFFFF - 1)).to(tl.int32)
    return tl.where(exhausted != 0, prefix - 1, prefix), tl.where(exhausted != 0, 0, rank)


@triton.jit
def _write_chosen(out_row, keys, slots, valid, key, ties, k_eff, written_above, written_ties):
    """Write the slots of keys above ``key`` and of the first ``ties`` keys equal to it; returns the running counts.

    Above-key slots fill ``out_row[0 : k_eff - ties]``, the tied ones the rest of ``[0, k_eff)`` (no scan for
    them where there are none to take).
    """
    above = (valid & (keys > key)).to(tl.int32)
    tl.store(out_row + written_above + tl.cumsum(above, 0) - 1, slots, mask=above != 0)
    written_ties_after = written_ties
    if ties > 0:
        tied = (valid & (keys == key)).to(tl.int32)
        tie_rank = written_ties + tl.cumsum(tied, 0) - 1
        tl.store(out_row + (k_eff - ties) + tie_rank, slots, mask=(tied != 0) & (tie_rank < ties))
        written_ties_after = written_ties + tl.sum(tied, 0)
    return written_above + tl.sum(above, 0), written_ties_after


@triton.jit
def _candidates(
    scores_row, length, kept_scores_row, kept_slots_row, counts, chunk, from_segments,
    SEGMENT: tl.constexpr, SEGMENT_BLOCK: tl.constexpr, SEGMENT_CHUNK: tl.constexpr,
):  # fmt: skip
    """Chunk ``chunk`` of a row's candidates as ``(keys, slots, valid)``, ``SEGMENT_BLOCK * SEGMENT_CHUNK`` wide.

    From the kept segments (columns ``chunk * SEGMENT_CHUNK ..`` of every segment) or, when
    streaming, straight from the row's scores.
    """
    if from_segments:
        column = chunk * SEGMENT_CHUNK + tl.arange(0, SEGMENT_CHUNK)[None, :]
        places = tl.arange(0, SEGMENT_BLOCK)[:, None] * SEGMENT + column
        valid = tl.reshape(column < counts[:, None], (SEGMENT_BLOCK * SEGMENT_CHUNK,))
        places = tl.reshape(places, (SEGMENT_BLOCK * SEGMENT_CHUNK,))
        values = tl.load(kept_scores_row + places, mask=valid, other=0.0)
        slots = tl.load(kept_slots_row + places, mask=valid, other=0)
    else:
        slots = chunk * (SEGMENT_BLOCK * SEGMENT_CHUNK) + tl.arange(0, SEGMENT_BLOCK * SEGMENT_CHUNK)
        valid = slots < length
        values = tl.load(scores_row + slots, mask=valid, other=0.0)
    return _order_key(values), slots, valid


@triton.jit
def _segments_in_slot_order(
    kept_scores_row, kept_slots_row, counts_row, segments, chunk, SEGMENT: tl.constexpr, SEGMENTS: tl.constexpr
):  # fmt: skip
    """Segments ``chunk * SEGMENTS ..`` of a row's kept candidates, whole, as ``(keys, slots, valid)`` in slot
    order."""
    segment = chunk * SEGMENTS + tl.arange(0, SEGMENTS)
    counts = tl.load(counts_row + segment, mask=segment < segments, other=0)
    column = tl.arange(0, SEGMENT)[None, :]
    valid = tl.reshape(column < counts[:, None], (SEGMENTS * SEGMENT,))
    places = tl.reshape(segment[:, None] * SEGMENT + column, (SEGMENTS * SEGMENT,))
    values = tl.load(kept_scores_row + places, mask=valid, other=0.0)
    slots = tl.load(kept_slots_row + places, mask=valid, other=0)
    return _order_key(values), slots, valid


@triton.jit
def _sampled_threshold_kernel(
    scores_ptr, scores_row_stride, lengths_ptr, thresholds_ptr, k,
    RUNS: tl.constexpr, RUN: tl.constexpr, MARGIN: tl.constexpr, EXTRA: tl.constexpr,
):  # fmt: skip
    """A threshold with about ``MARGIN * k + EXTRA * length / (RUNS * RUN)`` scores above it.

    It is a high order statistic of the runs' maxima: for the tail of the distribution a
    run's maximum clears a value about ``RUN`` times as often as one score does, so ranks
    among ``RUNS`` maxima stand for ranks among ``RUNS * RUN`` sampled scores.
    """
    row = tl.program_id(0)
    length = tl.load(lengths_ptr + row)
    k_eff = tl.minimum(k, length)
    SAMPLE: tl.constexpr = RUNS * RUN
    run = tl.arange(0, RUNS).to(tl.int64)
    first = run * length // RUNS
    room = tl.maximum((run + 1) * length // RUNS - first - RUN + 1, 1)
    jitter = ((run * 2654435761 + row * 40503) & 0x7FFFFFFF) % room
    slots = (first + jitter)[:, None] + tl.arange(0, RUN)[None, :]
    values = tl.load(scores_ptr + row * scores_row_stride + slots, mask=slots < length, other=-float("inf"))
    maxima = tl.max(values, 1)
    rank = tl.cdiv(MARGIN * k_eff * SAMPLE, tl.maximum(length, 1)) + EXTRA
    key, _ = _kth_largest_key(_order_key(maxima), run < RUNS, tl.minimum(rank, RUNS))
    # A short row, or one the sample cannot pin down, keeps everything (then selects or streams).
    threshold = tl.where((length <= SAMPLE) | (rank > RUNS), -float("inf"), _value_of_key(key))
    tl.store(thresholds_ptr + row, tl.where(length <= k, float("inf"), threshold))  # all chosen: keep nothing


@triton.jit
def _previous_threshold_kernel(
    scores_ptr, scores_row_stride, lengths_ptr, previous_ptr, previous_row_stride, thresholds_ptr, k,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The least current score of the previous selection: at least k scores are at or above it."""
    row = tl.program_id(0)
    length = tl.load(lengths_ptr + row)
    ranks = tl.arange(0, BLOCK_K)
    slots = tl.load(previous_ptr + row * previous_row_stride + ranks, mask=ranks < k, other=-1)
    valid = (slots >= 0) & (slots < length)
    values = tl.load(scores_ptr + row * scores_row_stride + slots, mask=valid, other=float("inf"))
    # Too few previous slots to vouch for k scores: keep everything (and likely stream).
    vouched = tl.sum(valid.to(tl.int32), 0) >= tl.minimum(k, length)
    threshold = tl.where(vouched, tl.min(values, 0), -float("inf"))
    tl.store(thresholds_ptr + row, tl.where(length <= k, float("inf"), threshold))


@triton.jit
def _keep_kernel(
    scores_ptr, scores_row_stride, width, lengths_ptr, thresholds_ptr, kept_scores_ptr, kept_slots_ptr,
    kept_counts_ptr, BLOCK: tl.constexpr, SEGMENT: tl.constexpr,
):  # fmt: skip
    """Copy the block's scores at or above the row's threshold (and their slots) to its own segment; count them.

    Each block owns its segment, so no atomics (and no round trip to the L2 for an
    offset) stand between the load and the stores.
    """
    row = tl.program_id(0)
    block = tl.program_id(1)
    length = tl.load(lengths_ptr + row)
    # A load mask aligned to 16 slots keeps the loads 16 bytes wide; slots past the length are dropped after.
    readable = tl.minimum(tl.cdiv(length, 16) * 16, width)
    threshold = tl.load(thresholds_ptr + row)
    slots = block * BLOCK + tl.arange(0, BLOCK)
    values = tl.load(scores_ptr + row * scores_row_stride + slots, mask=slots < readable, other=0.0)
    keep = ((slots < length) & (values >= threshold)).to(tl.int32)
    kept = tl.sum(keep, 0)
    segment = (row * tl.num_programs(1) + block).to(tl.int64)
    tl.store(kept_counts_ptr + segment, kept)
    if kept > 0:
        places = tl.cumsum(keep, 0) - 1
        fits = (keep != 0) & (places < SEGMENT)
        tl.store(kept_scores_ptr + segment * SEGMENT + places, values, mask=fits)
        tl.store(kept_slots_ptr + segment * SEGMENT + places, slots, mask=fits)


@triton.jit
def _row_output(lengths_ptr, out_ptr, out_row_stride, row, k, BLOCK_K: tl.constexpr):
    """A row's length, how many slots it chooses (``min(k, length)``) and its output row, whose places past
    those now hold ``-1``."""
    length = tl.load(lengths_ptr + row)
    k_eff = tl.minimum(k, length)
    out_row = out_ptr + row * out_row_stride
    ranks = tl.arange(0, BLOCK_K)
    tl.store(out_row + ranks, -1, mask=(ranks >= k_eff) & (ranks < k))
    return length, k_eff, out_row


@triton.jit
def _select_kernel(
    scores_ptr, scores_row_stride, lengths_ptr, kept_scores_ptr, kept_slots_ptr, kept_counts_ptr,
    out_ptr, out_row_stride, k, segments,
    SEGMENT: tl.constexpr, SEGMENT_BLOCK: tl.constexpr, SEGMENT_CHUNK: tl.constexpr, BLOCK_K: tl.constexpr,
    SEGMENTS_PER_CHUNK: tl.constexpr,
):  # fmt: skip
    """Write the row's top-k slots: from its kept segments when they verify, else by streaming the row.

    In one chunk the candidates are in slot order (segment by segment, each segment's kept scores in order); over
    several chunks the digits are counted chunk by chunk (columns of every segment) and the writes then read whole
    segments in order, so the earliest ties are taken either way."""
    row = tl.program_id(0)
    length, k_eff, out_row = _row_output(lengths_ptr, out_ptr, out_row_stride, row, k, BLOCK_K)
    if length <= k:
        for first in range(0, length, BLOCK_K):
            slots = first + tl.arange(0, BLOCK_K)
            tl.store(out_row + slots, slots, mask=slots < length)
    else:
        segment = tl.arange(0, SEGMENT_BLOCK)
        first_segment = row.to(tl.int64) * segments
        counts = tl.load(kept_counts_ptr + first_segment + segment, mask=segment < segments, other=0)
        # The kept scores verify when none was dropped for room and at least k cleared the threshold.
        from_segments = (tl.max(counts, 0) <= SEGMENT) & (tl.sum(counts, 0) >= k_eff)
        if from_segments:
            chunks = tl.cdiv(tl.max(counts, 0), SEGMENT_CHUNK)
        else:
            chunks = tl.cdiv(length, SEGMENT_BLOCK * SEGMENT_CHUNK)
        scores_row = scores_ptr + row * scores_row_stride
        kept_scores_row = kept_scores_ptr + first_segment * SEGMENT
        kept_slots_row = kept_slots_ptr + first_segment * SEGMENT
        written_above = tl.zeros((), tl.int32)
        written_ties = tl.zeros((), tl.int32)
        if chunks == 1:  # the usual case: every candidate in registers at once
            keys, slots, valid = _candidates(
                scores_row, length, kept_scores_row, kept_slots_row, counts, 0, from_segments,
                SEGMENT, SEGMENT_BLOCK, SEGMENT_CHUNK,
            )  # fmt: skip
            key, ties = _kth_largest_key(keys, valid, k_eff)
            _write_chosen(out_row, keys, slots, valid, key, ties, k_eff, written_above, written_ties)
        else:  # candidates read again for every digit
            key = tl.zeros((), tl.int32)
            ties = k_eff
            for p in tl.static_range(16):
                c0, c1, c2, c3 = (
                    tl.zeros((), tl.int32),
                    tl.zeros((), tl.int32),
                    tl.zeros((), tl.int32),
                    tl.zeros((), tl.int32),
                )
                for chunk in range(chunks):
                    keys, _, valid = _candidates(
                        scores_row, length, kept_scores_row, kept_slots_row, counts, chunk, from_segments,
                        SEGMENT, SEGMENT_BLOCK, SEGMENT_CHUNK,
                    )  # fmt: skip
                    d0, d1, d2, d3 = _unpack_counts(_digit_counts(keys, valid, key, p))
                    c0, c1, c2, c3 = c0 + d0, c1 + d1, c2 + d2, c3 + d3
                key, ties, _holding = _choose_digit(c0, c1, c2, c3, ties, key, p)
            # The writes meet the candidates in slot order (whole segments, in order), so that the earliest ties
            # are taken.
            if from_segments:
                for chunk in range(tl.cdiv(segments, SEGMENTS_PER_CHUNK)):
                    keys, slots, valid = _segments_in_slot_order(
                        kept_scores_row, kept_slots_row, kept_counts_ptr + first_segment, segments, chunk,
                        SEGMENT, SEGMENTS_PER_CHUNK,
                    )  # fmt: skip
                    written_above, written_ties = _write_chosen(
                        out_row, keys, slots, valid, key, ties, k_eff, written_above, written_ties
                    )
            else:
                for chunk in range(chunks):
                    keys, slots, valid = _candidates(
                        scores_row, length, kept_scores_row, kept_slots_row, counts, chunk, from_segments,
                        SEGMENT, SEGMENT_BLOCK, SEGMENT_CHUNK,
                    )  # fmt: skip
                    written_above, written_ties = _write_chosen(
                        out_row, keys, slots, valid, key, ties, k_eff, written_above, written_ties
                    )


@triton.jit
def _whole_row_kernel(
    scores_ptr, scores_row_stride, lengths_ptr, out_ptr, out_row_stride, k, table_ptr, table_stride, table_row_ptr,
    counts_ptr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, TABLE: tl.constexpr,
):  # fmt: skip
    """Write one row's top-k slots, the row held in registers (``BLOCK`` places); with ``TABLE``, the table's
    values at those slots and how many."""
    row = tl.program_id(0)
    length, k_eff, out_row = _row_output(lengths_ptr, out_ptr, out_row_stride, row, k, BLOCK_K)
    slots = tl.arange(0, BLOCK)
    valid = slots < length
    keys = _order_key(tl.load(scores_ptr + row * scores_row_stride + slots, mask=valid, other=0.0))
    written = slots
    if TABLE:
        table_row = tl.load(table_row_ptr + row).to(tl.int64)
        written = tl.load(table_ptr + table_row * table_stride + slots, mask=valid, other=0).to(tl.int32)
        tl.store(counts_ptr + row, k_eff)
    if k_eff > 0:
        key, ties = _kth_largest_key(keys, valid, k_eff)
        _write_chosen(out_row, keys, written, valid, key, ties, k_eff, tl.zeros((), tl.int32), tl.zeros((), tl.int32))


@triton.jit
def _streamed_cut(scores_row, length, rank, CHUNK: tl.constexpr):
    """:func:`_kth_largest_key`'s cut through a row read ``CHUNK`` scores at a time for each of the 16 digits."""
    key = tl.zeros((), tl.int32)
    ties = rank
    for p in tl.static_range(16):
        c0, c1, c2, c3 = tl.zeros((), tl.int32), tl.zeros((), tl.int32), tl.zeros((), tl.int32), tl.zeros((), tl.int32)
        for first in range(0, length, CHUNK):
            slots = first + tl.arange(0, CHUNK)
            valid = slots < length
            keys = _order_key(tl.load(scores_row + slots, mask=valid, other=0.0))
            d0, d1, d2, d3 = _unpack_counts(_digit_counts(keys, valid, key, p))
            c0, c1, c2, c3 = c0 + d0, c1 + d1, c2 + d2, c3 + d3
        key, ties, _holding = _choose_digit(c0, c1, c2, c3, ties, key, p)
    return key, ties


@triton.jit
def _wide_row_kernel(
    scores_ptr, scores_row_stride, lengths_ptr, out_ptr, out_row_stride, k, kept_keys_ptr, kept_slots_ptr,
    table_ptr, table_stride, table_row_ptr, counts_ptr,
    GROUPS: tl.constexpr, GROUP_ROWS: tl.constexpr, CHUNK: tl.constexpr, CANDIDATES: tl.constexpr,
    BLOCK_K: tl.constexpr, TABLE: tl.constexpr,
):  # fmt: skip
    """One row's top-k slots (:func:`wide_row_top_k`); with ``TABLE``, the table's values at those slots and how
    many."""
    row = tl.program_id(0)
    length, k_eff, out_row = _row_output(lengths_ptr, out_ptr, out_row_stride, row, k, BLOCK_K)
    scores_row = scores_ptr + row.to(tl.int64) * scores_row_stride
    table_base = table_ptr
    if TABLE:
        table_base = table_ptr + tl.load(table_row_ptr + row).to(tl.int64) * table_stride
        tl.store(counts_ptr + row, k_eff)
    if length <= k:  # every slot chosen
        for first in range(0, length, BLOCK_K):
            slots = first + tl.arange(0, BLOCK_K)
            taken = slots < length
            written = slots
            if TABLE:
                written = tl.load(table_base + slots, mask=taken, other=0).to(tl.int32)
            tl.store(out_row + slots, written, mask=taken)
    else:
        # 1. The maxima of the strided groups, and the k-th largest of them: at least k scores are at or above it.
        group = tl.arange(0, GROUPS)
        places = tl.arange(0, GROUP_ROWS)[:, None] * GROUPS + group[None, :]
        maxima = tl.full((GROUPS,), -0x7FFFFFFF - 1, tl.int32)
        for first in range(0, length, GROUP_ROWS * GROUPS):
            slots = first + places
            valid = slots < length
            keys = _order_key(tl.load(scores_row + slots, mask=valid, other=0.0))
            maxima = tl.maximum(maxima, tl.max(tl.where(valid, keys, -0x7FFFFFFF - 1), 0))
        cut, cut_ties = _kth_largest_key(maxima, group < length, k_eff)
        threshold = tl.where(cut_ties > 0, cut, cut + 1)
        # 2. The scores at or above it compacted in slot order; how many are at and above it.
        kept_keys_row = kept_keys_ptr + row.to(tl.int64) * CANDIDATES
        kept_slots_row = kept_slots_ptr + row.to(tl.int64) * CANDIDATES
        kept = tl.zeros((), tl.int32)
        above = tl.zeros((), tl.int32)
        for first in range(0, length, CHUNK):
            slots = first + tl.arange(0, CHUNK)
            valid = slots < length
            keys = _order_key(tl.load(scores_row + slots, mask=valid, other=0.0))
            keep = (valid & (keys >= threshold)).to(tl.int32)
            at = kept + tl.cumsum(keep, 0) - 1
            fits = (keep != 0) & (at < CANDIDATES)
            tl.store(kept_keys_row + at, keys, mask=fits)
            tl.store(kept_slots_row + at, slots, mask=fits)
            kept += tl.sum(keep, 0)
            above += tl.sum((valid & (keys > threshold)).to(tl.int32), 0)
        tl.debug_barrier()  # the scratch row written above is read by other threads of the program below
        # 3. The select over the candidates, or (rarely) over the row.
        if kept <= CANDIDATES:
            place = tl.arange(0, CANDIDATES)
            valid = place < kept
            keys = tl.load(kept_keys_row + place, mask=valid, other=0)
            slots = tl.load(kept_slots_row + place, mask=valid, other=0)
            written = slots
            if TABLE:
                written = tl.load(table_base + slots, mask=valid, other=0).to(tl.int32)
            key, ties = _kth_largest_key(keys, valid, k_eff)
            none = tl.zeros((), tl.int32)
            _write_chosen(out_row, keys, written, valid, key, ties, k_eff, none, none)
        else:
            if above < k_eff:  # the threshold is the k-th largest score (a row of ties)
                key = threshold
                ties = k_eff - above
            else:
                key, ties = _streamed_cut(scores_row, length, k_eff, CHUNK)
            written_above = tl.zeros((), tl.int32)
            written_ties = tl.zeros((), tl.int32)
            for first in range(0, length, CHUNK):
                slots = first + tl.arange(0, CHUNK)
                valid = slots < length
                keys = _order_key(tl.load(scores_row + slots, mask=valid, other=0.0))
                written = slots
                if TABLE:
                    written = tl.load(table_base + slots, mask=valid, other=0).to(tl.int32)
                written_above, written_ties = _write_chosen(
                    out_row, keys, written, valid, key, ties, k_eff, written_above, written_ties
                )
