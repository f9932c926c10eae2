"""A decode forward's index tensors in two Triton kernels, written into a CUDA graph's buffers.

What :func:`sglang_dsv4.attention_backend.batched.build_decode_index` builds in torch (its oracle, some
250 small launches), for a batch where request ``i`` (request-table row ``rows[i]``) runs one token at
position ``p = seq_lens[i] - 1`` and checkpoints into the record its pending table holds for position
``s = seq_lens[i]`` (0: none):

* :func:`fill_window_index` (one program per request): the token's row fields (``positions``, ``token_request``,
  ``rows``, ``single_step_rows``) and the sliding window's: the slot it writes, ``window_table[row, p]``; the
  ``window - 1`` slots before it, ``window_table[row, p - window + 1 + j]`` (0 before position 0), staged after
  the batch's own tokens; the staged index of each of its ``min(p + 1, window)`` keys (its own token is staged
  row ``i``, earlier ones ``n + i (window - 1) + j``), and its window slot ``window_table[row, p - length + 1 + j]``
  (0 past the length), by which a decode forward reads it from the pool.
* :func:`fill_ratio_index` (one program per request, per compressor ratio ``r``): its two compressor targets,
  the block it touches (position ``p``, entry row ``entry_table[row, p // r]`` when ``p + 1`` ends the block) and
  its snapshot at ``s`` (the pooled position ``max(p, r (s // r))``, empty when ``s`` starts a block), and the
  entries it reads: its entry-table row, ``s // r`` of them visible.

Each writes the first ``n`` rows of buffers laid out as ``build_decode_index`` lays them out.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def fill_window_index(
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    window_table: torch.Tensor,
    out: dict[str, torch.Tensor],
    *,
    window: int,
) -> None:
    """Write the token fields and the window's (``out``: ``positions``, ``token_request``, ``rows``,
    ``single_step_rows``, ``write_slots``, ``previous_slots``, ``indices``, ``lengths``, ``slots``)."""
    requests = rows.shape[0]
    if requests == 0:
        return
    _window_kernel[(requests,)](
        rows, seq_lens, window_table, window_table.stride(0), requests,
        out["positions"], out["token_request"], out["rows"], out["single_step_rows"],
        out["write_slots"], out["previous_slots"], out["indices"], out["indices"].stride(0), out["lengths"],
        out["slots"], out["slots"].stride(0),
        WINDOW=window, BLOCK=triton.next_power_of_2(window), num_warps=1,
    )  # fmt: skip


def fill_ratio_index(
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    pending: torch.Tensor,
    entry_table: torch.Tensor,
    out: dict[str, torch.Tensor],
    *,
    ratio: int,
) -> None:
    """Write one ratio's compressor targets and entry reads (``out``: the tensor fields of the batched core's
    ``CompressorTargets``, of the ``BlockTargets`` inside it and of ``EntryReads``, by name, ``per_token`` absent for a ratio whose layers select their entries).

    ``pending`` is ``[request rows, k, 2]``: each row's next ``(position, record)`` checkpoints, -1 for none.
    """
    requests = rows.shape[0]
    if requests == 0:
        return
    per_token = out.get("per_token")
    blocks = entry_table.shape[1]
    _ratio_kernel[(requests,)](
        rows, seq_lens, pending, pending.stride(0), entry_table, entry_table.stride(0), requests, blocks,
        out["tokens"], out["valid"], out["ape_slots"], out["request"], out["merges_record"], out["previous_target"],
        out["previous_in_record"], out["entry_rows"], out["entry_positions"], out["last_target"], out["ends_block"],
        out["snapshot_records"], out["table"], out["table"].stride(0), out["visible"],
        out["table"] if per_token is None else per_token, 0 if per_token is None else per_token.stride(0),
        RATIO=ratio, PENDING=pending.shape[1], HAS_PER_TOKEN=per_token is not None, BLOCK=1024, num_warps=4,
    )  # fmt: skip


@triton.jit
def _window_kernel(
    rows_ptr, seq_lens_ptr, window_table_ptr, window_table_stride, requests,
    positions_ptr, token_request_ptr, rows_out_ptr, single_step_rows_ptr,
    write_slots_ptr, previous_slots_ptr, indices_ptr, indices_stride, lengths_ptr, slots_ptr, slots_stride,
    WINDOW: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    position = tl.load(seq_lens_ptr + i).to(tl.int64) - 1
    table_row = window_table_ptr + row * window_table_stride
    tl.store(positions_ptr + i, position)
    tl.store(token_request_ptr + i, i.to(tl.int64))
    tl.store(rows_out_ptr + i, row)
    tl.store(single_step_rows_ptr + i, row)
    tl.store(write_slots_ptr + i, tl.load(table_row + position))
    j = tl.arange(0, BLOCK)
    before = j < WINDOW - 1
    earlier = position - (WINDOW - 1) + j
    slots = tl.load(table_row + tl.maximum(earlier, 0), mask=before & (earlier >= 0), other=0)
    tl.store(previous_slots_ptr + i * (WINDOW - 1) + j, slots, mask=before)
    length = tl.minimum(position + 1, WINDOW)
    keys = tl.maximum(position - WINDOW + 1, 0) + j
    staged = tl.where(keys >= position, i, requests + i * (WINDOW - 1) + keys - (position - (WINDOW - 1)))
    staged = tl.where(j < length, staged, 0)
    tl.store(indices_ptr + i * indices_stride + j, staged.to(tl.int32), mask=j < WINDOW)
    key_slots = tl.load(table_row + tl.minimum(keys, position), mask=j < length, other=0)
    tl.store(slots_ptr + i * slots_stride + j, key_slots.to(tl.int32), mask=j < WINDOW)
    tl.store(lengths_ptr + i, length.to(tl.int32))


@triton.jit
def _ratio_kernel(
    rows_ptr, seq_lens_ptr, pending_ptr, pending_stride, entry_table_ptr, entry_table_stride, requests, blocks,
    tokens_ptr, valid_ptr, ape_slots_ptr, request_ptr, merges_record_ptr, previous_target_ptr,
    previous_in_record_ptr, entry_rows_ptr, entry_positions_ptr, last_target_ptr, ends_block_ptr,
    snapshot_records_ptr, table_ptr, table_stride, visible_ptr, per_token_ptr, per_token_stride,
    RATIO: tl.constexpr, PENDING: tl.constexpr, HAS_PER_TOKEN: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    end = tl.load(seq_lens_ptr + i).to(tl.int64)  # s: the snapshot's position
    position = end - 1
    block = position // RATIO
    snapshot_block = end // RATIO
    table_row = entry_table_ptr + row * entry_table_stride
    continues = position % RATIO > 0
    # Target i: the block the token touches.
    tl.store(tokens_ptr + i, i.to(tl.int64))
    tl.store(valid_ptr + i, 1)
    tl.store(ape_slots_ptr + i, position % RATIO)
    tl.store(request_ptr + i, i.to(tl.int64))
    tl.store(merges_record_ptr + i, continues.to(tl.int1))
    tl.store(previous_target_ptr + i, -1)
    tl.store(previous_in_record_ptr + i, (block > 0).to(tl.int1))
    complete = end % RATIO == 0
    entry_row = tl.load(table_row + block)
    tl.store(entry_rows_ptr + i, tl.where(complete, entry_row, 0))
    tl.store(entry_positions_ptr + i, block * RATIO)
    tl.store(last_target_ptr + i, i.to(tl.int64))
    tl.store(ends_block_ptr + i, complete.to(tl.int1))
    # Target requests + i: the state at position s, pooled from max(p, r * (s // r)) (nothing when s starts a block).
    pooled = tl.maximum(position, snapshot_block * RATIO)
    pooled_valid = pooled < end
    snapshot = requests + i
    tl.store(tokens_ptr + snapshot, tl.where(pooled_valid, i.to(tl.int64), 0))
    tl.store(valid_ptr + snapshot, pooled_valid.to(tl.int1))
    tl.store(ape_slots_ptr + snapshot, pooled % RATIO)
    tl.store(request_ptr + snapshot, i.to(tl.int64))
    tl.store(merges_record_ptr + snapshot, ((snapshot_block == block) & continues).to(tl.int1))
    tl.store(previous_target_ptr + snapshot, tl.where(snapshot_block > block, i.to(tl.int64), -1))
    tl.store(previous_in_record_ptr + snapshot, (snapshot_block > 0).to(tl.int1))
    # The record the checkpoint pending at s takes (0: none).
    slot = tl.arange(0, PENDING)
    due_position = tl.load(pending_ptr + row * pending_stride + 2 * slot)
    due_record = tl.load(pending_ptr + row * pending_stride + 2 * slot + 1)
    tl.store(snapshot_records_ptr + i, tl.sum(tl.where(due_position == end, due_record, 0), 0))
    # The entries it reads: its entry-table row, s // r visible.
    tl.store(visible_ptr + i, snapshot_block.to(tl.int32))
    for first in range(0, blocks, BLOCK):
        columns = first + tl.arange(0, BLOCK)
        inside = columns < blocks
        entries = tl.load(table_row + columns, mask=inside)
        tl.store(table_ptr + i * table_stride + columns, entries, mask=inside)
        if HAS_PER_TOKEN:
            tl.store(per_token_ptr + i * per_token_stride + columns, entries.to(tl.int32), mask=inside)
