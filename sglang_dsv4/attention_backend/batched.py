"""The batched attention core: one layer's attention for every request of a forward at once.

It computes what the torch reference backend computes request by request (and the network's
:class:`~sglang_dsv4.model.attention.Attention` defines), over the V4 pool's tensors in place:

* the new tokens' raw KV goes to their window slots; a token attends to the last
  ``sliding_window`` tokens, the ones before its chunk read from the pool, the chunk's own
  from the forward;
* each compressor pools the blocks the forward touches (:class:`CompressorTargets`): a
  block's new tokens, merged with the request's online state where the chunk continues a
  partial block; complete blocks write their entry (and indexer key) rows; the state after
  the forward, and at every checkpoint position inside it, is written to its record;
* ratio-4 layers read the indexer's top-k entries, ratio-128 layers every complete entry;
  one softmax covers window, entries and the sink (:func:`~sglang_dsv4.kernels.sparse_torch.sparse_attention`).

Everything a forward needs to find its rows is built once, before the first layer, as index
tensors (:class:`ForwardIndex`, from plain fields: :class:`BatchPlan`); each layer then runs
one batched call per operation, with no per-request loop and no host synchronisation.
Rows that must write somewhere but have nothing to write (an entry of an incomplete block,
a snapshot a decode row does not take) write the pools' padding row 0, which nothing reads,
so a decode forward has fixed shapes. The number of query heads is that of ``q``: tensor
parallelism passes its local heads (:func:`attend`); entries and indexer keys are replicated.

Imports nothing from SGLang: the pool is read through the attributes :class:`PoolStorage` names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..config import DeepseekV4Config
from ..kernels import sparse_torch
from ..kernels.selection import KVSelection
from ..kernels.sparse_torch import sparse_attention, streamed_top_k
from ..model.attention import Attention
from ..model.compressor import Compressor, SoftmaxPool
from ..model.indexer import Indexer
from ..model.rope import apply_rope


@dataclass(frozen=True)
class Snapshot:
    """A checkpoint the forward fills: the state of batch request ``request`` at ``position``
    goes to checkpoint record ``record`` (0: the padding record, for a decode row taking none)."""

    request: int
    position: int
    record: int


@dataclass(frozen=True)
class BatchPlan:
    """A forward's requests, as plain values: request ``i`` is pool row ``rows[i]`` and runs
    tokens ``starts[i] .. starts[i] + lengths[i] - 1`` (rows of the forward in request order)."""

    rows: list[int]
    starts: list[int]
    lengths: list[int]
    snapshots: list[Snapshot] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not len(self.rows) == len(self.starts) == len(self.lengths):
            raise ValueError(f"rows, starts, lengths differ in length: {self.rows}, {self.starts}, {self.lengths}")
        if any(length < 1 for length in self.lengths) or any(start < 0 for start in self.starts):
            raise ValueError(f"every request needs a start >= 0 and a length >= 1: {self.starts}, {self.lengths}")
        for snapshot in self.snapshots:
            start, length = self.starts[snapshot.request], self.lengths[snapshot.request]
            if not start < snapshot.position <= start + length:
                raise ValueError(f"snapshot at {snapshot.position} outside request {snapshot.request}'s forward")

    @property
    def is_decode(self) -> bool:
        return all(length == 1 for length in self.lengths)


class RequestTableStorage(Protocol):
    """Where a request row's tokens and blocks live (:class:`~sglang_dsv4.memory_pool.request_tables.RequestTables`)."""

    window_table: torch.Tensor  # [request rows, positions]: window slot of each token
    entry_table: dict[int, torch.Tensor]  # per ratio, [request rows, blocks]: entry row of each block


class PoolStorage(Protocol):
    """The V4 pool's tensors (:class:`~sglang_dsv4.memory_pool.pool.V4KVPool`)."""

    window: list[torch.Tensor]
    compressed: dict[tuple[int, str], torch.Tensor]
    state: dict[tuple[int, str], torch.Tensor]
    previous_state: dict[tuple[int, str], torch.Tensor]
    checkpoint_state: dict[tuple[int, str], torch.Tensor]


@dataclass(frozen=True)
class WindowIndex:
    """The sliding window's rows of one forward (the same in every layer).

    A layer stages its keys as ``cat(new kv [tokens], pool rows previous_slots)``: the
    chunk's own tokens, then each request's ``window - 1`` tokens before its chunk.
    """

    write_slots: torch.Tensor  # [tokens]: each new token's window slot (0: the row keeps none)
    previous_slots: torch.Tensor  # [requests * (window - 1)]
    indices: torch.Tensor  # [tokens, window] int32 into the staged keys
    lengths: torch.Tensor  # [tokens] int32


@dataclass(frozen=True)
class CompressorTargets:
    """The pools one compressor ratio computes in a forward, and where they go.

    A target pools positions ``lo .. hi - 1`` of one request (all inside one block),
    merged with the request's partial block from its record where ``merges_record``.
    The first ``touched`` targets are the blocks the forward touches, request by request
    (entries of the complete ones; the last one of a request gives its new state); then one
    per snapshot (the state at the snapshot's position).
    """

    tokens: torch.Tensor  # [targets, width]: forward row of each pooled position
    valid: torch.Tensor  # [targets, width]
    ape_slots: torch.Tensor  # [targets, width]: position % ratio
    request: torch.Tensor  # [targets]: batch index
    merges_record: torch.Tensor  # [targets]
    previous_target: torch.Tensor  # [targets]: target pooling the block before (-1: in the record)
    previous_in_record: torch.Tensor  # [targets]: the record's previous half exists (block > 0)
    touched: int
    entry_rows: torch.Tensor  # [touched]: entry row of a complete block, 0 otherwise
    entry_positions: torch.Tensor  # [touched]: the block's first position (its entry's rope)
    last_target: torch.Tensor  # [requests]: the touched target of each request's last block
    ends_block: torch.Tensor  # [requests]: the forward ends exactly at a block end
    snapshot_records: torch.Tensor  # [snapshots]


@dataclass(frozen=True)
class EntryReads:
    """Which compressed entries of one ratio each token can read: those of complete blocks."""

    table: torch.Tensor  # [requests, blocks]: each request's entry rows
    visible: torch.Tensor  # [tokens] int32: (position + 1) // ratio
    per_token: torch.Tensor | None  # [tokens, blocks] int32: table row of each token, for layers reading all


@dataclass(frozen=True)
class ForwardIndex:
    positions: torch.Tensor  # [tokens]
    token_request: torch.Tensor  # [tokens]: batch index
    rows: torch.Tensor  # [requests]: pool row (state records)
    single_step_rows: torch.Tensor  # [requests]: the row where a forward runs one token, else 0
    window: WindowIndex
    compressors: dict[int, CompressorTargets]
    entries: dict[int, EntryReads]
    tile_owners: list[int]  # host values: per ROW_TILE tokens, the request owning them all, or -1

    @property
    def tokens(self) -> int:
        return self.positions.shape[0]


def build_index(
    plan: BatchPlan, tables: RequestTableStorage, config: DeepseekV4Config, device: torch.device | str
) -> ForwardIndex:
    """The forward's index tensors, on ``device``, from the plan and the request tables.

    A decode plan gets one snapshot target per request (its checkpoint's record or the
    padding record), so that its shapes depend on the batch size only.
    """
    snapshots = plan.snapshots
    if plan.is_decode:
        taken = {s.request: s.record for s in snapshots}
        snapshots = [Snapshot(i, s + 1, taken.get(i, 0)) for i, s in enumerate(plan.starts)]
    rows = torch.tensor(plan.rows, dtype=torch.int64)
    starts = torch.tensor(plan.starts, dtype=torch.int64)
    lengths = torch.tensor(plan.lengths, dtype=torch.int64)
    token_request = torch.repeat_interleave(torch.arange(len(rows)), lengths)
    offsets = torch.cumsum(lengths, 0) - lengths
    positions = starts[token_request] + torch.arange(len(token_request)) - offsets[token_request]
    batch = _Batch(rows, starts, lengths, offsets, token_request, positions, snapshots)
    window, ratios = config.sliding_window, sorted(tables.entry_table)
    tiles = token_request.split(sparse_torch.ROW_TILE)
    index = ForwardIndex(
        positions=positions,
        token_request=token_request,
        rows=rows,
        single_step_rows=torch.where(lengths == 1, rows, 0),
        window=_window_index(batch, tables.window_table, window),
        compressors={r: _compressor_targets(batch, tables.entry_table[r], r) for r in ratios},
        entries={r: _entry_reads(batch, tables.entry_table[r], r, r != config.csa_rate) for r in ratios},
        tile_owners=[int(tile[0]) if tile[0] == tile[-1] else -1 for tile in tiles],
    )
    return _to_device(index, torch.device(device))


@dataclass(frozen=True)
class _Batch:
    rows: torch.Tensor
    starts: torch.Tensor
    lengths: torch.Tensor
    offsets: torch.Tensor
    token_request: torch.Tensor
    positions: torch.Tensor
    snapshots: list[Snapshot]

    @property
    def ends(self) -> torch.Tensor:
        return self.starts + self.lengths

    def token_of(self, request: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """The forward row of ``position`` of batch request ``request`` (inside its chunk)."""
        return self.offsets[request] + position - self.starts[request]


def _window_index(batch: _Batch, window_table: torch.Tensor, window: int) -> WindowIndex:
    tokens, before = len(batch.positions), window - 1
    request, position = batch.token_request, batch.positions
    write_slots = window_table[batch.rows[request], position]
    earlier = batch.starts[:, None] - before + torch.arange(before)  # [requests, window - 1]
    previous = torch.where(earlier >= 0, window_table[batch.rows[:, None], earlier.clamp(min=0)], 0)
    # A token at p reads positions max(0, p - window + 1) .. p.
    lengths = torch.clamp(position + 1, max=window)
    keys = (position - window + 1).clamp(min=0)[:, None] + torch.arange(window)
    in_chunk = keys >= batch.starts[request, None]
    staged = torch.where(
        in_chunk,
        batch.token_of(request[:, None], keys),
        tokens + request[:, None] * before + keys - (batch.starts[request, None] - before),
    )
    staged = torch.where(torch.arange(window) < lengths[:, None], staged, 0)
    return WindowIndex(write_slots, previous.flatten(), staged.to(torch.int32), lengths.to(torch.int32))


def _compressor_targets(batch: _Batch, entry_table: torch.Tensor, ratio: int) -> CompressorTargets:
    starts, ends = batch.starts, batch.ends
    first_block = starts // ratio
    counts = (ends - 1) // ratio - first_block + 1
    touched = int(counts.sum())
    request = torch.repeat_interleave(torch.arange(len(starts)), counts)
    first_target = torch.cumsum(counts, 0) - counts
    block = first_block[request] + torch.arange(touched) - first_target[request]
    lo = torch.maximum(starts[request], block * ratio)
    hi = torch.minimum(ends[request], (block + 1) * ratio)
    complete = hi == (block + 1) * ratio
    previous = torch.where(block > first_block[request], torch.arange(touched) - 1, -1)

    snap_request = torch.tensor([s.request for s in batch.snapshots], dtype=torch.int64)
    snap_position = torch.tensor([s.position for s in batch.snapshots], dtype=torch.int64)
    snap_block = snap_position // ratio
    snap_previous = torch.where(
        snap_block > first_block[snap_request],
        first_target[snap_request] + snap_block - 1 - first_block[snap_request],
        -1,
    )
    all_request = torch.cat([request, snap_request])
    all_block = torch.cat([block, snap_block])
    all_lo = torch.cat([lo, torch.maximum(starts[snap_request], snap_block * ratio)])
    all_hi = torch.cat([hi, snap_position])
    width = max(1, min(ratio, max(batch.lengths.tolist(), default=1)))
    pooled = all_lo[:, None] + torch.arange(width)
    valid = pooled < all_hi[:, None]
    return CompressorTargets(
        tokens=torch.where(valid, batch.token_of(all_request[:, None], pooled), 0),
        valid=valid,
        ape_slots=pooled % ratio,
        request=all_request,
        merges_record=(all_block == first_block[all_request]) & (starts[all_request] % ratio > 0),
        previous_target=torch.cat([previous, snap_previous]),
        previous_in_record=all_block > 0,
        touched=touched,
        entry_rows=torch.where(complete, entry_table[batch.rows[request], block], 0),
        entry_positions=block * ratio,
        last_target=first_target + counts - 1,
        ends_block=ends % ratio == 0,
        snapshot_records=torch.tensor([s.record for s in batch.snapshots], dtype=torch.int64),
    )


def _entry_reads(batch: _Batch, entry_table: torch.Tensor, ratio: int, read_all: bool) -> EntryReads:
    # At least one column, so that the padding entries a selection points at exist.
    table = entry_table[batch.rows, : max(1, max(batch.ends.tolist(), default=0) // ratio)]
    visible = ((batch.positions + 1) // ratio).to(torch.int32)
    return EntryReads(table, visible, table[batch.token_request].to(torch.int32) if read_all else None)


def _to_device(index: ForwardIndex, device: torch.device) -> ForwardIndex:
    def move(value):
        if isinstance(value, torch.Tensor):
            return value.to(device, non_blocking=True)
        if isinstance(value, dict):
            return {key: move(item) for key, item in value.items()}
        if hasattr(value, "__dataclass_fields__"):
            return type(value)(**{name: move(getattr(value, name)) for name in value.__dataclass_fields__})
        return value

    return move(index)


# --- one layer -----------------------------------------------------------------------------------


def attend(
    attention: Attention,
    layer: int,
    x: torch.Tensor,
    index: ForwardIndex,
    pool: PoolStorage,
    heads: slice = slice(None),
) -> torch.Tensor:
    """Attention of the forward's tokens ``x [tokens, hidden]`` before the output projection:
    ``[tokens, local heads, head_dim]`` for query heads ``heads`` (all by default; a tensor-parallel
    rank passes its own). Advances the layer's pools in place."""
    q_residual, q, kv, cos, sin = attention.project(x, index.positions)
    window_rows = pool.window[layer]
    staged = torch.cat([kv, window_rows[index.window.previous_slots].to(kv.dtype)])
    window_rows.index_copy_(0, index.window.write_slots, kv.to(window_rows.dtype))
    window = KVSelection(staged, index.window.indices, index.window.lengths)
    compressed = KVSelection(staged, index.window.indices[:, :0], torch.zeros_like(index.window.lengths))
    if attention.compressor is not None:
        entries = pool.compressed[(layer, "entries")]
        reads = index.entries[attention.compressor.ratio]
        _advance(attention.compressor, x, index, entries, _records(pool, (layer, "compressor")))
        if attention.indexer is None:
            compressed = KVSelection(entries, reads.per_token, reads.visible)
        else:
            keys = pool.compressed[(layer, "indexer_keys")]
            _advance(attention.indexer.compressor, x, index, keys, _records(pool, (layer, "indexer")))
            chosen = select_entries(attention.indexer, x, q_residual, index, keys)
            rows = reads.table[index.token_request[:, None], chosen.clamp(min=0)]
            compressed = KVSelection(entries, rows.to(torch.int32), (chosen >= 0).sum(-1, dtype=torch.int32))
    sink = attention.attn_sink[heads].float()
    return sparse_attention(q[:, heads], window, compressed, sink, cos, sin, scale=attention.head_dim**-0.5)


def select_entries(
    indexer: Indexer, x: torch.Tensor, q_residual: torch.Tensor, index: ForwardIndex, keys: torch.Tensor
) -> torch.Tensor:
    """The indexer's choice for every token: ``[tokens, index_topk]`` block indices, best first, then -1."""
    q, head_weights = indexer.queries(x, q_residual, index.positions)
    reads = index.entries[indexer.compressor.ratio]
    return streamed_top_k(
        q, head_weights, keys, reads.table, index.token_request, reads.visible, indexer.topk,
        scale=indexer.head_dim**-0.5, tile_owners=index.tile_owners,
    )  # fmt: skip


@dataclass(frozen=True)
class _StateRecords:
    state: torch.Tensor
    previous: torch.Tensor
    checkpoint: torch.Tensor


def _records(pool: PoolStorage, key: tuple[int, str]) -> _StateRecords:
    return _StateRecords(pool.state[key], pool.previous_state[key], pool.checkpoint_state[key])


def _advance(
    compressor: Compressor, x: torch.Tensor, index: ForwardIndex, entries: torch.Tensor, records: _StateRecords
) -> None:
    """Run the compressor over the forward: entry rows of complete blocks, new states, snapshots.

    The same pools as :meth:`~sglang_dsv4.model.compressor.Compressor.pool_reference`, for every
    block the forward touches at once (see :class:`CompressorTargets`).
    """
    targets = index.compressors[compressor.ratio]
    dim, touched = compressor.dim, targets.touched
    kv, gate = compressor.wkv(x), compressor.wgate(x)
    logits = (gate[targets.tokens] + compressor.ape[targets.ape_slots]).masked_fill(
        ~targets.valid[..., None], float("-inf")
    )
    pooled = SoftmaxPool.of_slots(kv[targets.tokens], logits)  # [targets, series * dim]
    old = records.state[index.rows]  # [requests, pools, 3, dim]
    record = old[targets.request]
    series = pooled.max.shape[-1]
    later = _channels(pooled, slice(series - dim, series)).merge(_record_pool(record, 0, targets.merges_record))
    if compressor.overlapping:
        earlier = _channels(pooled, slice(0, dim)).merge(_record_pool(record, 1, targets.merges_record))
        in_record = _record_pool(record, 2, targets.previous_in_record)
        previous = _where(targets.previous_target >= 0, earlier[targets.previous_target.clamp(min=0)], in_record)
        entry_pools = previous[:touched].merge(later[:touched])
    else:
        entry_pools = later[:touched]
    new_entries = compressor.norm(entry_pools.value().to(x.dtype))
    cos, sin = compressor.rotary.cos_sin(targets.entry_positions)
    entries.index_copy_(0, targets.entry_rows, apply_rope(new_entries, cos, sin).to(entries.dtype))

    last, ends_block = targets.last_target, targets.ends_block
    empty = SoftmaxPool.empty((len(last), dim), x.device)
    snapshots = slice(touched, None)
    if compressor.overlapping:
        final = [
            _where(ends_block, empty, later[last]),
            _where(ends_block, empty, earlier[last]),
            _where(ends_block, earlier[last], previous[last]),
        ]
        at_snapshots = [later[snapshots], earlier[snapshots], previous[snapshots]]
    else:
        final = [_where(ends_block, empty, later[last])]
        at_snapshots = [later[snapshots]]
    records.previous.index_copy_(0, index.single_step_rows, old)
    records.state.index_copy_(0, index.rows, _as_record(final))
    records.checkpoint.index_copy_(0, targets.snapshot_records, _as_record(at_snapshots))


def _channels(pools: SoftmaxPool, channels: slice) -> SoftmaxPool:
    return SoftmaxPool(pools.max[..., channels], pools.denom[..., channels], pools.weighted[..., channels])


def _record_pool(record: torch.Tensor, pool: int, present: torch.Tensor) -> SoftmaxPool:
    """Pool ``pool`` of state records ``[n, pools, 3, dim]`` where ``present``, an empty pool elsewhere
    (whatever the record holds there: a row's record is never reset)."""
    present = present[:, None]
    return SoftmaxPool(
        torch.where(present, record[:, pool, 0], float("-inf")),
        torch.where(present, record[:, pool, 1], 0.0),
        torch.where(present, record[:, pool, 2], 0.0),
    )


def _where(condition: torch.Tensor, a: SoftmaxPool, b: SoftmaxPool) -> SoftmaxPool:
    condition = condition[:, None]
    return SoftmaxPool(
        torch.where(condition, a.max, b.max),
        torch.where(condition, a.denom, b.denom),
        torch.where(condition, a.weighted, b.weighted),
    )


def _as_record(pools: list[SoftmaxPool]) -> torch.Tensor:
    """State records ``[n, pools, 3, dim]`` (the pool layout: max, denominator, weighted sum)."""
    return torch.stack([torch.stack([p.max, p.denom, p.weighted], dim=1) for p in pools], dim=1)
