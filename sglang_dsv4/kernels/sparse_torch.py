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

import math

from collections.abc import Iterable, Iterator

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

    Rows wider than ``2k``: :func:`earliest_top_k_slots`, then the ``k`` ordered; narrower ones, where ordering
    the ``k`` costs about a sort of the whole row, one stable sort.
    """
    if scores.shape[-1] <= 2 * k:
        slots = scores.argsort(dim=-1, descending=True, stable=True)[..., :k]
        return scores.gather(-1, slots), slots
    slots = earliest_top_k_slots(scores, k)
    return _best_first(scores.gather(-1, slots), slots)


def earliest_top_k_slots(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The slots of the ``k`` largest of each row of ``scores``, the earliest of equal scores, in slot order:
    with ``v`` the row's k-th largest score, ``{j : s_j > v}`` and the first ``k - |{j : s_j > v}|`` of
    ``{j : s_j = v}``; ``min(k, width)`` int64 slots a row.

    NaN ranks above every number, as ``torch.sort`` ranks it (never from finite keys): a row's ``m`` NaNs come
    first (the earliest ``k`` if ``m >= k``), then the best ``k - m`` numbers. One ``torch.topk`` over the row with
    NaN read as ``+inf`` finds ``v`` (the ``k - m``-th largest number when ``m < k``); the slots are chosen by
    comparisons and running counts, and written to their places by a scatter: no sort, and nothing read back to the
    host (the CUDA-graph step runs it)."""
    width = scores.shape[-1]
    k = min(k, width)
    if k == 0:
        return torch.empty(*scores.shape[:-1], 0, dtype=torch.int64, device=scores.device)
    nan = scores.isnan()
    # torch.topk, not Tensor.topk: the tests' conftest.earliest_ties_in_top_k makes Tensor.topk this function
    kth = torch.topk(scores.masked_fill(nan, math.inf), k, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)
    above, tied = (scores > kth) & ~nan, (scores == kth) & ~nan
    wanted = k - nan.sum(dim=-1, keepdim=True) - above.sum(dim=-1, keepdim=True)
    taken = (nan & (nan.cumsum(dim=-1) <= k)) | above | (tied & (tied.cumsum(dim=-1) <= wanted))
    places = torch.where(taken, taken.cumsum(dim=-1) - 1, k)  # each taken slot's place; the rest to a spare column
    slots = torch.arange(width, device=scores.device).expand_as(scores)
    chosen = torch.empty(*scores.shape[:-1], k + 1, dtype=torch.int64, device=scores.device)
    return chosen.scatter_(-1, places, slots)[..., :k]


def _best_first(values: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, slots)`` reordered by descending value; ``slots`` ascending, so equal values keep the earliest
    first."""
    order = values.argsort(dim=-1, descending=True, stable=True)
    return values.gather(-1, order), slots.gather(-1, order)


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
    merged into a running top-k held in slot order (:func:`merge_top_k`), so a row's scores are never all held at
    once; of equal scores the earliest slots are taken (:func:`top_k_earliest_ties`), whatever the table's width.
    ``keys_format``: how ``keys`` stores its rows (None: the rows are the keys).
    ``tile_owners`` (host values, one per ``ROW_TILE`` rows) names the table row all rows of a
    tile share, or -1: a shared tile gathers its keys once instead of once per row.
    """
    rows = q.shape[0]
    chosen = torch.full((rows, k), -1, dtype=torch.int64, device=q.device)
    if table.shape[1] == 0:
        return chosen
    for first in range(0, rows, ROW_TILE):
        tile = slice(first, first + ROW_TILE)
        owner = -1 if tile_owners is None else tile_owners[first // ROW_TILE]
        tiles = tile_scores(q[tile], head_weights[tile], keys, table, table_row[tile], lengths[tile],
                            scale=scale, owner=owner, keys_format=keys_format)  # fmt: skip
        found = top_k_of_tiles(tiles, k)
        chosen[tile, : found.shape[1]] = found
    return chosen


def top_k_of_tiles(tiles: Iterable[tuple[torch.Tensor, torch.Tensor]], k: int) -> torch.Tensor:
    """The ``k`` best slots of rows scored a tile at a time (``(slots [tile], scores [rows, tile])``, slots ascending
    from tile to tile; at least one), ``[rows, <= k]`` int64, best first, the earliest of equal scores first, ``-1``
    for a ``-inf`` score: the running top-k of :func:`merge_top_k`, ordered once at the end
    (:func:`top_k_earliest_ties`)."""
    tiles = iter(tiles)
    first = next(tiles, None)
    if first is None:
        raise ValueError("top_k_of_tiles needs at least one tile")
    slots, best = first  # the first tile stands for the running top-k until a second comes
    best_slots = slots.expand(best.shape[0], -1)
    for slots, scores in tiles:
        best, best_slots = merge_top_k(best, best_slots, scores, slots, k)
    best, order = top_k_earliest_ties(best, k)
    return torch.where(best > float("-inf"), best_slots.gather(1, order), -1)


def tile_scores(
    q: torch.Tensor,
    head_weights: torch.Tensor,
    keys: torch.Tensor,
    table: torch.Tensor,
    table_row: torch.Tensor,
    lengths: torch.Tensor,
    *,
    scale: float,
    owner: int = -1,
    keys_format: RowFormat | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """A tile of query rows' scores, ``KEY_TILE`` slots at a time: ``(slots [tile], scores [rows, tile])``,
    ``s_rj = sum_h w_rh * ReLU(q_rh . keys[table[table_row[r], j]]) * scale``, ``-inf`` where ``j >= lengths[r]``.
    ``owner`` >= 0: every row reads table row ``owner`` (its keys gathered once)."""
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, head_weights = q.to(compute), head_weights.to(compute)
    for key_first in range(0, table.shape[1], KEY_TILE):
        slots = torch.arange(key_first, min(key_first + KEY_TILE, table.shape[1]), device=q.device)
        if owner >= 0:
            shared_keys = read_rows(keys, table[owner, slots], keys_format, compute)  # [tile, dim]
            dots = torch.einsum("rhd,kd->rhk", q, shared_keys).relu() * scale
        else:
            tile_keys = read_rows(keys, table[table_row[:, None], slots[None, :]], keys_format, compute)
            dots = torch.einsum("rhd,rkd->rhk", q, tile_keys).relu() * scale
        scores = torch.einsum("rhk,rh->rk", dots, head_weights)
        yield slots, scores.masked_fill(slots[None, :] >= lengths[:, None], float("-inf"))


def merge_top_k(
    best: torch.Tensor, best_slots: torch.Tensor, scores: torch.Tensor, slots: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The running top-k ``(best, best_slots)`` (``[rows, n]``, in slot order, every slot before ``slots``) with a
    new tile's ``scores [rows, tile]`` at ``slots [tile]`` merged in: the ``min(k, n + tile)`` of
    :func:`earliest_top_k_slots` over both, in slot order, so that the earliest of equal scores stay."""
    merged = torch.cat([best, scores], dim=1)
    merged_slots = torch.cat([best_slots, slots.expand(scores.shape[0], -1)], dim=1)
    kept = earliest_top_k_slots(merged, k)
    return merged.gather(1, kept), merged_slots.gather(1, kept)


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


