"""Sparse attention and the indexer's top-k in batched torch: the CPU implementations, and the oracles.

:func:`sparse_attention` is :func:`sparse_decode_attention_reference`'s attention (one
softmax over a row's window rows, its compressed rows and the per-head sink, inverse rope
on the output) computed in fixed tiles: rows ``ROW_TILE`` at a time, compressed rows
``ENTRY_TILE`` at a time folded into an online softmax, so that memory stays
O(``ROW_TILE`` x heads x tile) whatever the context. :func:`streamed_top_k` scores a row's
indexer keys tile by tile and keeps a running top-k, never holding a row's whole score
list. Both take tensors and return tensors; nothing here imports Triton or the model.
Of keys with equal scores the top-k takes the earliest (:func:`top_k_earliest_ties`).
"""

from __future__ import annotations

import torch

from .kv_format import RowFormat
from .selection import KVSelection, read_rows

ROW_TILE = 64  # query rows per step
ENTRY_TILE = 512  # compressed rows folded into the online softmax per step
KEY_TILE = 1024  # indexer keys scored per step


def sparse_attention(
    q: torch.Tensor,
    window: KVSelection,
    compressed: KVSelection,
    sink: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    scale: float,
) -> torch.Tensor:
    """:func:`sparse_decode_attention_reference` in tiles; ``[rows, heads, head_dim]`` in ``q``'s dtype.

    Any number of heads: each row's query heads share its selected rows (multi-query).
    """
    out = torch.empty_like(q)
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    for first in range(0, q.shape[0], ROW_TILE):
        rows = slice(first, first + ROW_TILE)
        tile_q = q[rows].to(compute)
        peak = sink.to(compute)[None, :].expand(tile_q.shape[0], -1)  # the sink starts the softmax ...
        total = torch.ones_like(peak)  # ... with weight exp(0) and a zero value
        acc = torch.zeros_like(tile_q)
        state = (peak, total, acc)
        state = _fold(state, tile_q, _rows_of(window, rows, slice(None), compute), scale)
        for entry in range(0, compressed.indices.shape[1], ENTRY_TILE):
            state = _fold(state, tile_q, _rows_of(compressed, rows, slice(entry, entry + ENTRY_TILE), compute), scale)
        peak, total, acc = state
        out[rows] = _inverse_rope((acc / total[..., None]).to(q.dtype), cos[rows], sin[rows])
    return out


def _rows_of(
    part: KVSelection, rows: slice, columns: slice, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pool rows ``[rows, width, head_dim]`` in ``dtype`` a tile of query rows reads, and which of them are real."""
    indices = part.indices[rows, columns]
    first = columns.start or 0
    slots = torch.arange(first, first + indices.shape[1], device=indices.device)
    visible = slots[None, :] < part.lengths[rows, None]
    keys = read_rows(part.pool, indices.long().clamp(0, part.pool.shape[0] - 1), part.row_format, dtype)
    return keys, visible


def _fold(
    state: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    q: torch.Tensor,
    keys_visible: tuple[torch.Tensor, torch.Tensor],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold some keys (which double as values) into the online softmax ``(peak, total, acc)`` of ``q``."""
    keys, visible = keys_visible
    if keys.shape[1] == 0:
        return state
    peak, total, acc = state
    keys = keys.to(q.dtype)
    logits = torch.einsum("rhd,rkd->rhk", q, keys) * scale
    logits = logits.masked_fill(~visible[:, None, :], float("-inf"))
    new_peak = torch.maximum(peak, logits.amax(-1))  # finite: the sink is in every row
    correction = torch.exp(peak - new_peak)
    probs = torch.exp(logits - new_peak[..., None])
    total = total * correction + probs.sum(-1)
    acc = acc * correction[..., None] + torch.einsum("rhk,rkd->rhd", probs, keys)
    return new_peak, total, acc


def chosen_entry_rows(
    table: torch.Tensor, table_row: torch.Tensor, chosen: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The entry rows of each token's chosen blocks, ``table[table_row[t], chosen[t, j]]`` int32 (``chosen`` best
    first, then -1; past the choice ``table[table_row[t], 0]``, never read), and how many it chose, int32."""
    rows = table[table_row[:, None], chosen.clamp(min=0)].to(torch.int32)
    return rows, (chosen >= 0).sum(-1, dtype=torch.int32)


def top_k_earliest_ties(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest of each row of ``scores`` and their slots ``(values, slots)``, best first: ``torch.topk``'s,
    except that of equal scores the earliest slots are taken, first, as the Triton whole-row select
    (:func:`.topk.whole_row_top_k`) takes them.

    ``torch.topk`` takes some of the equal scores at the k-th place, which ones depending on the row's width:
    the indexer's scores tie exactly wherever ReLU zeroes every head's dot, and a request's choice would then
    depend on the longest request in its batch (the width of the block table).
    """
    slots = scores.argsort(dim=-1, descending=True, stable=True)[..., :k]
    return scores.gather(-1, slots), slots


def streamed_top_k(
    q: torch.Tensor,
    head_weights: torch.Tensor,
    keys: torch.Tensor,
    table: torch.Tensor,
    table_row: torch.Tensor,
    lengths: torch.Tensor,
    k: int,
    *,
    scale: float,
    tile_owners: list[int] | None = None,
    keys_format: RowFormat | None = None,
) -> torch.Tensor:
    """The ``k`` best-scoring key slots of each query row, ``[rows, k]`` int64, best first, then ``-1``.

    Row ``r`` scores keys ``keys[table[table_row[r], j]]`` for ``j < lengths[r]`` as
    :func:`.indexer.index_scores_reference` does (``sum_h w_h * ReLU(q_h . k) * scale``);
    queries of one request share one table row. Keys are scored ``KEY_TILE`` at a time and
    merged into a running top-k, so a row's scores are never all held at once; of equal scores the
    earliest slots are taken (:func:`top_k_earliest_ties`; the running top-k holds earlier slots than
    each new tile), whatever the table's width. ``keys_format``: how ``keys`` stores its rows (None:
    the rows are the keys).
    ``tile_owners`` (host values, one per ``ROW_TILE`` rows) names the table row all rows of a
    tile share, or -1: a shared tile gathers its keys once instead of once per row.
    """
    rows = q.shape[0]
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    chosen = torch.full((rows, k), -1, dtype=torch.int64, device=q.device)
    for first in range(0, rows, ROW_TILE):
        tile = slice(first, first + ROW_TILE)
        tile_q, tile_weights = q[tile].to(compute), head_weights[tile].to(compute)
        best = torch.empty(tile_q.shape[0], 0, dtype=compute, device=q.device)
        best_slots = torch.empty(tile_q.shape[0], 0, dtype=torch.int64, device=q.device)
        for key_first in range(0, table.shape[1], KEY_TILE):
            slots = torch.arange(key_first, min(key_first + KEY_TILE, table.shape[1]), device=q.device)
            owner = -1 if tile_owners is None else tile_owners[first // ROW_TILE]
            if owner >= 0:
                shared_keys = read_rows(keys, table[owner, slots], keys_format, compute)  # [tile, dim]
                dots = torch.einsum("rhd,kd->rhk", tile_q, shared_keys).relu() * scale
            else:
                tile_keys = read_rows(keys, table[table_row[tile, None], slots[None, :]], keys_format, compute)
                dots = torch.einsum("rhd,rkd->rhk", tile_q, tile_keys).relu() * scale
            scores = torch.einsum("rhk,rh->rk", dots, tile_weights)
            scores = scores.masked_fill(slots[None, :] >= lengths[tile, None], float("-inf"))
            best = torch.cat([best, scores], dim=1)
            best_slots = torch.cat([best_slots, slots.expand(best.shape[0], -1)], dim=1)
            best, order = top_k_earliest_ties(best, k)
            best_slots = best_slots.gather(1, order)
        found = best_slots.shape[1]
        chosen[tile, :found] = torch.where(best > float("-inf"), best_slots, -1)
    return chosen


def sparse_decode_attention_reference(
    q: torch.Tensor,
    window: KVSelection,
    compressed: KVSelection,
    sink: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    scale: float,
) -> torch.Tensor:
    """The same attention in torch (gather, then the model's softmax with the sink), in ``q``'s dtype."""
    keys = torch.cat([_gather(window, q.dtype), _gather(compressed, q.dtype)], dim=1)  # [rows, width, head_dim]
    visible = torch.cat([_visible(window), _visible(compressed)], dim=1)
    logits = torch.einsum("rhd,rkd->rhk", q, keys) * scale
    logits = logits.masked_fill(~visible[:, None, :], float("-inf"))
    sinks = sink.view(1, -1, 1).expand(q.shape[0], -1, 1).to(logits.dtype)
    probs = torch.softmax(torch.cat([logits, sinks], dim=-1), dim=-1)[..., :-1]
    out = torch.einsum("rhk,rkd->rhd", probs.to(keys.dtype), keys)
    return _inverse_rope(out, cos, sin)


def _gather(part: KVSelection, dtype: torch.dtype) -> torch.Tensor:
    return read_rows(part.pool, part.indices.long().clamp(0, part.pool.shape[0] - 1), part.row_format, dtype)


def _visible(part: KVSelection) -> torch.Tensor:
    width = part.indices.shape[1]
    return torch.arange(width, device=part.indices.device)[None, :] < part.lengths[:, None]


def _inverse_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rope_dim = 2 * cos.shape[-1]
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    cos, sin = cos[:, None, :].to(compute), sin[:, None, :].to(compute)
    rope = x[..., -rope_dim:].to(compute)
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((even * cos + odd * sin, odd * cos - even * sin), dim=-1).flatten(-2)
    return torch.cat([x[..., :-rope_dim], rotated.to(x.dtype)], dim=-1)


