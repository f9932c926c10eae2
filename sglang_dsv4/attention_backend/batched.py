"""The batched attention core: one layer's attention for every request of a forward at once.

It computes what the torch reference backend computes request by request (and the network's
:class:`~sglang_dsv4.model.attention.Attention` defines), over the V4 pool's tensors in place:

* the new tokens' raw KV goes to their window slots; a token attends to the last
  ``sliding_window`` tokens, the ones before its chunk read from the pool, the chunk's own
  from the forward (a decode forward's own token from the pool too, written there first);
* each compressor pools the blocks the forward touches (:class:`CompressorTargets`): a
  block's new tokens, merged with the request's online state where the chunk continues a
  partial block; complete blocks write their entry (and indexer key) rows; the state after
  the forward, and at every checkpoint position inside it, is written to its record;
* ratio-4 layers read the indexer's top-k entries, ratio-128 layers every complete entry;
  one softmax covers window, entries and the sink (:func:`~sglang_dsv4.kernels.dispatch.sparse_attention`:
  the Triton kernel on CUDA, tiled torch elsewhere, as for the indexer's top-k).

Everything a forward needs to find its rows, and its tokens' rope tables, is built once, before the first
layer, as index tensors (:class:`ForwardIndex`, from plain fields: :class:`BatchPlan`); each layer then runs
one batched call per operation, with no per-request loop and no host synchronisation.
Rows that must write somewhere but have nothing to write (an entry of an incomplete block,
a snapshot a decode row does not take) write the pools' padding row 0, which nothing reads,
so a decode forward has fixed shapes. The number of query heads is that of ``q``: tensor
parallelism passes its local heads (:func:`attend`); entries and indexer keys are replicated.

Imports nothing from SGLang: the pool is read through the attributes :class:`PoolStorage` names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from ..config import DeepseekV4Config
from ..kernels import sparse_torch
from ..kernels.dispatch import (
    Beside,
    DecodeJob,
    DecodeWrites,
    chosen_entries,
    compress_one_token_each,
    compress_pair_one_token_each,
    decode_rows,
    encode_rows,
    fill_decode_index,
    sparse_attention,
    write_rows,
)
from ..kernels.kv_format import PoolFormats, RowFormat
from ..kernels.selection import KVSelection
from ..model.attention import Attention
from ..model.compressor import BlockTargets, Compressor
from ..model.indexer import Indexer
from ..model.rope import ForwardRope, model_rotaries


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
    """The V4 pool's tensors (:class:`~sglang_dsv4.memory_pool.storage.V4PoolStorage`)."""

    window: list[torch.Tensor]  # window rows, stored as formats.entries
    compressed: dict[tuple[int, str], torch.Tensor]  # entries and indexer keys, stored as formats says
    formats: PoolFormats
    state: dict[tuple[int, str], torch.Tensor]
    previous_state: dict[tuple[int, str], torch.Tensor]
    checkpoint_state: dict[tuple[int, str], torch.Tensor]


@dataclass(frozen=True)
class WindowIndex:
    """The sliding window's rows of one forward (the same in every layer).

    A layer stages its keys as ``cat(new kv [tokens], pool rows previous_slots)``: the
    chunk's own tokens, then each request's ``window - 1`` tokens before its chunk. A decode
    forward (one token a request) stages nothing: its tokens' rows are written to their slots
    first and every key is read from the pool where it lies, ``slots``.
    """

    write_slots: torch.Tensor  # [tokens]: each new token's window slot (0: the row keeps none)
    previous_slots: torch.Tensor  # [requests * (window - 1)]
    indices: torch.Tensor  # [tokens, window] int32 into the staged keys
    lengths: torch.Tensor  # [tokens] int32
    slots: torch.Tensor | None  # [tokens, window] int32: each key's window slot (0 past its length); decode only


@dataclass(frozen=True)
class CompressorTargets:
    """The pools one compressor ratio computes in a forward (:class:`~sglang_dsv4.model.compressor.BlockTargets`),
    and where they go in the pool."""

    blocks: BlockTargets
    entry_rows: torch.Tensor  # [touched]: entry row of a complete block, 0 otherwise
    snapshot_records: torch.Tensor  # [snapshots]: checkpoint record of each snapshot


@dataclass(frozen=True)
class EntryReads:
    """Which compressed entries of one ratio each token can read: those of complete blocks."""

    table: torch.Tensor  # [requests, blocks]: each request's entry rows
    visible: torch.Tensor  # [tokens] int32: (position + 1) // ratio
    per_token: torch.Tensor | None  # [tokens, blocks] int32: table row of each token, for layers reading all
    staged: StagedEntries | None = None  # the same reads of rows decoded once, where the index stages them


# The most compressed rows a forward decodes before its kernels (all ratios; at V4's dims a ratio-4 row is 1 KiB of
# entry and 256 B of key in bf16, so about 1.3 GB): a forward that would stage more (many requests resumed over long
# histories) reads its rows in place instead. A 1M-token history stages 270,336 rows (ratio 4 and 128).
MAX_STAGED_ROWS = 1 << 20


@dataclass(frozen=True)
class StagedEntries:
    """A multi-token forward's compressed rows of one ratio, to be decoded once before its tokens read them.

    In a prefill chunk every token reads rows its neighbours read too (a ratio-128 layer's every entry, a
    ratio-4 layer's keys, all scored by every token, and the top-k it chooses among them): decoding FP8 rows
    where each token reads them decodes each row once a token. Staged row 0 is the pool's padding row; then
    each request's complete blocks in order, ``pool_rows`` naming their rows in the pool, ``reads`` the
    forward's reads of them (:class:`EntryReads` numbered in staged rows)."""

    pool_rows: torch.Tensor  # [staged rows]: the pool row each staged row holds
    reads: EntryReads


@dataclass(frozen=True)
class ForwardIndex:
    positions: torch.Tensor  # [tokens]
    rope: ForwardRope  # both rope flavours' cos, sin at the positions, once for every layer
    token_request: torch.Tensor  # [tokens]: batch index
    rows: torch.Tensor  # [requests]: pool row (state records)
    single_step_rows: torch.Tensor  # [requests]: the row where a forward runs one token, else 0
    window: WindowIndex
    compressors: dict[int, CompressorTargets]
    entries: dict[int, EntryReads]
    tile_owners: list[int]  # host values: per ROW_TILE tokens, the request owning them all, or -1
    one_token_each: bool  # a decode forward: every request runs one token (its compressors' decode kernel applies)
    staged: bool = False  # the rows its tokens read decoded once, before they read them (StagedEntries)

    @property
    def tokens(self) -> int:
        return self.positions.shape[0]


def build_index(
    plan: BatchPlan,
    tables: RequestTableStorage,
    config: DeepseekV4Config,
    device: torch.device | str,
    whole_entry_tiles: bool = False,
    staged: bool = False,
) -> ForwardIndex:
    """The forward's index tensors, built on ``device`` from the plan (one small copy there) and the
    request tables as ``device`` holds them (on a GPU their device twins, flushed).

    With ``staged`` (pools of FP8 rows) a plan of more than one token a request reads its rows decoded once
    (:class:`StagedEntries`; the window's staged rows too), where they are at most ``MAX_STAGED_ROWS``.

    A decode plan gets one snapshot target per request (its checkpoint's record or the
    padding record), so that its shapes depend on the batch size only. With ``whole_entry_tiles``
    (a batch a CUDA graph may also run) the layers that read every entry read the entry tables in
    whole tiles of the attention's (``sparse_torch.ENTRY_TILE`` columns, or the tables' width): the
    graph's index reads the tables' whole width, and both then fold the same tiles, giving the same
    floats (the indexer's scores do not depend on the width).
    """
    snapshots = plan.snapshots
    if plan.is_decode:
        taken = {s.request: s.record for s in snapshots}
        snapshots = [Snapshot(i, s + 1, taken.get(i, 0)) for i, s in enumerate(plan.starts)]
    fields = [plan.rows, plan.starts, plan.lengths, *zip(*((s.request, s.position, s.record) for s in snapshots))]
    fields += [()] * (6 - len(fields))  # no snapshots: three empty fields
    values = torch.tensor([v for field in fields for v in field], dtype=torch.int64).to(device, non_blocking=True)
    rows, starts, lengths, snapshot_request, snapshot_position, snapshot_record = values.split(
        [len(field) for field in fields]
    )
    batch = _Batch.of(
        rows,
        starts,
        lengths,
        tokens=sum(plan.lengths),
        snapshot_request=snapshot_request,
        snapshot_position=snapshot_position,
        snapshot_record=snapshot_record,
    )
    ends = [start + length for start, length in zip(plan.starts, plan.lengths, strict=True)]
    blocks = {
        r: _entry_columns(max(ends, default=0) // r, table.shape[1], whole_entry_tiles and r != config.csa_rate)
        for r, table in tables.entry_table.items()
    }
    staged_rows = {}
    if staged and not plan.is_decode:  # each ratio's padding row and every request's complete blocks
        staged_rows = {r: 1 + sum(min(end // r, blocks[r]) for end in ends) for r in blocks}
        if sum(staged_rows.values()) > MAX_STAGED_ROWS:
            staged_rows = {}
    sizes = {
        r: _Sizes(
            touched=sum((end - 1) // r - start // r + 1 for start, end in zip(plan.starts, ends, strict=True)),
            width=max(1, min(r, max(plan.lengths, default=1))),
            blocks=blocks[r],
            staged_rows=staged_rows.get(r),
        )
        for r in blocks
    }
    owners = _tile_owners([i for i, length in enumerate(plan.lengths) for _ in range(length)])
    staged = len(staged_rows) > 0  # host values: the plan's
    return _index(batch, tables, config, sizes, owners, one_token_each=plan.is_decode, staged=staged)


def _entry_columns(blocks: int, width: int, whole_tiles: bool) -> int:
    """Entry-table columns a forward reads for ``blocks`` complete blocks (at least one, so that the padding
    entries a selection points at exist), in whole tiles where asked."""
    if whole_tiles:
        return min(width, -(-max(1, blocks) // sparse_torch.ENTRY_TILE) * sparse_torch.ENTRY_TILE)
    return max(1, blocks)


def build_decode_index(
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    snapshot_records: torch.Tensor,
    tables: RequestTableStorage,
    config: DeepseekV4Config,
) -> ForwardIndex:
    """A decode forward's index tensors from device tensors, with no host synchronisation.

    Request ``i`` (pool row ``rows[i]``) runs position ``seq_lens[i] - 1`` and takes its
    checkpoint into record ``snapshot_records[i]`` (0: none). Shapes depend on the batch size
    only: entry tables span the tables' whole width, so the same code runs eagerly and inside
    a CUDA graph (:class:`DecodeGraphIndex`).
    """
    requests, device = rows.shape[0], rows.device
    rows, seq_lens = rows.long(), seq_lens.long()
    batch = _Batch.of(
        rows,
        seq_lens - 1,
        torch.ones_like(rows),
        tokens=requests,
        snapshot_request=torch.arange(requests, device=device),
        snapshot_position=seq_lens,
        snapshot_record=snapshot_records.long(),
    )
    sizes = {r: _Sizes(touched=requests, width=1, blocks=table.shape[1]) for r, table in tables.entry_table.items()}
    # Token i is request i: only a tile of one token has an owner.
    return _index(batch, tables, config, sizes, _tile_owners(list(range(requests))), one_token_each=True)


def build_verify_index(
    rows: torch.Tensor,
    starts: torch.Tensor,
    tokens_per_request: int,
    checkpoint_records: torch.Tensor,
    rollback_records: torch.Tensor,
    tables: RequestTableStorage,
    config: DeepseekV4Config,
) -> ForwardIndex:
    """A speculative verify forward's index tensors from device tensors, with no host synchronisation.

    Request ``i`` (pool row ``rows[i]``) runs ``tokens_per_request`` positions from ``starts[i]``, takes
    checkpoints after them into ``checkpoint_records [requests, tokens_per_request]`` (0: none at that
    position) and its rollback records after each of them but the last into ``rollback_records [requests,
    tokens_per_request - 1]``. Shapes depend on the batch size only: every request touches as many blocks
    as the most that ``tokens_per_request`` positions can (:meth:`~sglang_dsv4.model.compressor.BlockTargets.of`),
    entry tables span the tables' whole width, so the same code runs eagerly and inside a CUDA graph
    (:class:`VerifyGraphIndex`).
    """
    requests, device = rows.shape[0], rows.device
    rows, starts = rows.long(), starts.long()
    offsets = torch.arange(1, tokens_per_request + 1, device=device)
    snapshot_positions = torch.cat([starts[:, None] + offsets, starts[:, None] + offsets[:-1]], dim=1)
    batch = _Batch.of(
        rows,
        starts,
        torch.full_like(rows, tokens_per_request),
        tokens=requests * tokens_per_request,
        snapshot_request=torch.arange(requests, device=device)[:, None].expand_as(snapshot_positions).flatten(),
        snapshot_position=snapshot_positions.flatten(),
        snapshot_record=torch.cat([checkpoint_records, rollback_records], dim=1).long().flatten(),
    )
    sizes = {}
    for ratio, table in tables.entry_table.items():
        per_request = -(-(tokens_per_request - 1) // ratio) + 1  # the most blocks the positions can touch
        width = min(ratio, tokens_per_request)
        sizes[ratio] = _Sizes(requests * per_request, width, table.shape[1], per_request)
    owners = _tile_owners([i for i in range(requests) for _ in range(tokens_per_request)])
    return _index(batch, tables, config, sizes, owners, one_token_each=tokens_per_request == 1)


class PendingCheckpoint(Protocol):
    """A checkpoint the pool has planned and not handed on yet (:class:`~sglang_dsv4.memory_pool.checkpoint.Checkpoint`)."""

    position: int
    record: int


# The pending checkpoints of a request row a decode step can fill: its next one and, while SGLang's
# overlapped scheduler has already reserved the step after, that step's.
PENDING_PER_ROW = 2


class DecodeGraphIndex:
    """The decode :class:`ForwardIndex` of a CUDA graph, rebuilt in place before every replay.

    Every tensor of the index lives in a buffer allocated once for ``max_requests``; a batch of
    ``n`` requests reads the first rows of each, so the addresses a captured graph reads never
    change. The host's part (:meth:`stage_checkpoints`, before the graph) writes the pending
    checkpoints of every request row into a device table; the device's part (:meth:`build`,
    recordable in the graph) looks up each row's checkpoint at its new length there and
    builds the index from the batch's device tensors alone. Padded rows (request row 0 at
    length 1) write only padding rows: window slot 0, entry row 0, state and checkpoint record 0.
    """

    def __init__(
        self, max_requests: int, tables: RequestTableStorage, config: DeepseekV4Config, device: torch.device | str
    ):
        self.tables, self.config = tables, config
        request_rows = tables.window_table.shape[0]
        self.pending = torch.full((request_rows, PENDING_PER_ROW, 2), -1, dtype=torch.int64, device=device)
        self._staged = torch.full_like(self.pending, -1, device="cpu")
        rows = torch.zeros(max_requests, dtype=torch.int64, device=device)
        # Cloned: an index may hold its inputs themselves (its rows are the batch's), and no two buffers may share memory.
        self.buffers = _map_tensors(build_decode_index(rows, rows + 1, rows, tables, config), torch.clone)

    def stage_checkpoints(self, pending: Mapping[int, Sequence[PendingCheckpoint]]) -> None:
        """Host side, before a replay: ``(position, record)`` of each row's first pending checkpoints."""
        _stage_checkpoints(pending, self._staged, self.pending)

    def build(self, rows: torch.Tensor, seq_lens: torch.Tensor) -> ForwardIndex:
        """Device side: the index of a decode batch (``rows``, ``seq_lens``: ``[n]`` device tensors)
        in the buffers' first rows, with no host operation (:func:`~sglang_dsv4.kernels.dispatch.fill_decode_index`:
        on CUDA :meth:`build_in_kernels`, elsewhere :meth:`build_in_torch`)."""
        return fill_decode_index(self, rows, seq_lens)

    def build_in_torch(self, rows: torch.Tensor, seq_lens: torch.Tensor) -> ForwardIndex:
        """:meth:`build` by :func:`build_decode_index`, copied into the buffers."""
        pending = self.pending[rows.long()]  # [n, PENDING_PER_ROW, (position, record)]
        due = pending[..., 0] == seq_lens.long()[:, None]
        records = torch.where(due, pending[..., 1], 0).sum(-1)
        return _copy_into(self.buffers, build_decode_index(rows, seq_lens, records, self.tables, self.config))

    def build_in_kernels(self, rows: torch.Tensor, seq_lens: torch.Tensor) -> ForwardIndex:
        """:meth:`build` through the Triton kernels, whatever the device (the CPU runs them interpreted), then the
        rope tables at the new positions (:meth:`~sglang_dsv4.model.rope.ForwardRope.rewrite`)."""
        from ..kernels.decode_index import fill_ratio_index, fill_window_index

        requests, max_requests = rows.shape[0], self.buffers.rows.shape[0]
        index = _map_tensors(self.buffers, lambda buffer: buffer[: buffer.shape[0] // max_requests * requests])
        window = index.window
        fields = {"positions": index.positions, "token_request": index.token_request, "rows": index.rows}
        fields |= {"single_step_rows": index.single_step_rows} | _fields_of(window)
        fill_window_index(rows, seq_lens, self.tables.window_table, fields, window=self.config.sliding_window)
        compressors = {}
        for ratio, targets in index.compressors.items():
            reads = index.entries[ratio]
            fields = _fields_of(targets) | _fields_of(targets.blocks) | _fields_of(reads)
            fill_ratio_index(rows, seq_lens, self.pending, self.tables.entry_table[ratio], fields, ratio=ratio)
            compressors[ratio] = replace(targets, blocks=replace(targets.blocks, touched=requests))
        index.rope.rewrite(index.positions, model_rotaries(self.config))
        owners = _tile_owners(list(range(requests)))
        return replace(index, compressors=compressors, tile_owners=owners)


class VerifyGraphIndex:
    """The speculative verify :class:`ForwardIndex` of a CUDA graph, rebuilt in place before every replay: a
    batch of requests of ``tokens_per_request`` tokens each (:func:`build_verify_index`).

    As :class:`DecodeGraphIndex`: buffers allocated once for ``max_requests``, the host's part
    (:meth:`stage_checkpoints`) before the graph, the device's part (:meth:`build`) recordable in it. A
    row's pending checkpoints can be at any of its verify's positions, and the last verify's not taken yet
    before them: ``PENDING_PER_ROW`` per token. Padded rows (request row 0 at length 1) write only padding
    rows and records.
    """

    def __init__(
        self,
        max_requests: int,
        tokens_per_request: int,
        tables: RequestTableStorage,
        config: DeepseekV4Config,
        device: torch.device | str,
    ):
        if tokens_per_request < 2:
            raise ValueError(f"a verify of {tokens_per_request} tokens per request: a verify runs a draft or more")
        self.tables, self.config, self.tokens_per_request = tables, config, tokens_per_request
        request_rows = tables.window_table.shape[0]
        slots = PENDING_PER_ROW * tokens_per_request
        self.pending = torch.full((request_rows, slots, 2), -1, dtype=torch.int64, device=device)
        self._staged = torch.full_like(self.pending, -1, device="cpu")
        rows = torch.zeros(max_requests, dtype=torch.int64, device=device)
        records = torch.zeros(max_requests, tokens_per_request, dtype=torch.int64, device=device)
        index = build_verify_index(rows, rows + 1, tokens_per_request, records, records[:, 1:], tables, config)
        self.buffers = _map_tensors(index, torch.clone)

    def stage_checkpoints(self, pending: Mapping[int, Sequence[PendingCheckpoint]]) -> None:
        """Host side, before a replay: ``(position, record)`` of each row's first pending checkpoints."""
        _stage_checkpoints(pending, self._staged, self.pending)

    def build(self, rows: torch.Tensor, seq_lens: torch.Tensor, rollback_records: torch.Tensor) -> ForwardIndex:
        """Device side: the index of a verify batch (``rows``, ``seq_lens``: ``[n]`` device tensors, each request
        running positions ``seq_lens[i] ..``; ``rollback_records [n, tokens_per_request]``: each request's rollback
        records, that at offset 0 not filled by the forward) in the buffers' first rows, with no host operation."""
        starts = seq_lens.long()
        positions = starts[:, None] + torch.arange(1, self.tokens_per_request + 1, device=starts.device)
        pending = self.pending[rows.long()]  # [n, slots, (position, record)]
        due = pending[:, None, :, 0] == positions[:, :, None]  # [n, tokens, slots]
        checkpoint_records = torch.where(due, pending[:, None, :, 1], 0).sum(-1)
        index = build_verify_index(
            rows, starts, self.tokens_per_request, checkpoint_records, rollback_records[:, 1:], self.tables, self.config
        )
        return _copy_into(self.buffers, index)


def build_draft_step_index(
    chain_starts: torch.Tensor, step: int, forwards: int, config: DeepseekV4Config
) -> ForwardIndex:
    """Step ``step`` of a chain of ``forwards`` one-token draft forwards of a window-only layer over its scratch
    rows (:class:`DraftChain`), from device tensors with no host synchronisation.

    Batch request ``i`` runs position ``chain_starts[i] + step``; its window rows are scratch rows
    ``1 + i * rows .. (i + 1) * rows`` (``rows = sliding_window - 1 + forwards``), holding positions
    ``chain_starts[i] - sliding_window + 1 ..`` in order: the window before the chain, then the chain's tokens.
    The scratch has no state records: the batch's rows are the scratch rows ``1 .. n``.
    """
    requests, device = chain_starts.shape[0], chain_starts.device
    starts = chain_starts.long() + step
    scratch_rows = torch.arange(1, requests + 1, device=device)
    batch = _Batch.of(
        scratch_rows,
        starts,
        torch.ones_like(starts),
        tokens=requests,
        snapshot_request=scratch_rows - 1,
        snapshot_position=starts + 1,
        snapshot_record=torch.zeros_like(starts),
    )
    rows_per_request = config.sliding_window - 1 + forwards
    first_position = chain_starts.long() - (config.sliding_window - 1)

    def window_slots(request: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        return 1 + request * rows_per_request + position - first_position[request]

    return _index_of(batch, window_slots, {}, config, {}, _tile_owners(list(range(requests))), one_token_each=True)


class DraftChain:
    """A chain of ``forwards`` one-token draft forwards of a window-only layer (the MTP layer's, as the releases
    have it) on scratch rows of fixed shape, for up to ``max_requests`` requests: what a CUDA graph of the draft
    steps runs, writing nothing to the pool.

    :meth:`begin` (recordable in the graph) copies each request's window rows before its chain start from the
    pool into its scratch rows and builds every step's index (:func:`build_draft_step_index`) in buffers allocated
    once; the steps then run the batched core on :attr:`storage`, each writing its token's row into the scratch
    after the window. Row 0 is the padding row, never written.
    """

    def __init__(
        self, max_requests: int, forwards: int, config: DeepseekV4Config, formats: PoolFormats, device: torch.device
    ):
        self.config, self.forwards = config, forwards
        self.rows_per_request = config.sliding_window - 1 + forwards
        window = formats.entries.empty(1 + max_requests * self.rows_per_request, device)
        self.storage = DraftScratch([window], formats)
        starts = torch.zeros(max_requests, dtype=torch.int64, device=device)
        self.buffers = [
            _map_tensors(build_draft_step_index(starts, step, forwards, config), torch.clone)
            for step in range(forwards)
        ]

    def begin(
        self, rows: torch.Tensor, chain_starts: torch.Tensor, pool_window: torch.Tensor, window_table: torch.Tensor
    ) -> list[ForwardIndex]:
        """Device side, with no host operation: batch request ``i`` (pool row ``rows[i]``, its chain from position
        ``chain_starts[i]``) gets its window rows before the chain from ``pool_window`` (the layer's pool rows, slots
        as ``window_table`` gives them); the steps' indexes, in the buffers' first rows."""
        requests, before, device = rows.shape[0], self.config.sliding_window - 1, rows.device
        positions = chain_starts.long()[:, None] - before + torch.arange(before, device=device)
        sources = torch.where(positions >= 0, window_table[rows.long()[:, None], positions.clamp(min=0)], 0)
        targets = 1 + torch.arange(requests, device=device)[:, None] * self.rows_per_request
        targets = targets + torch.arange(before, device=device)
        window = self.storage.window[0]
        window.index_copy_(0, targets.flatten(), pool_window[sources.flatten()])
        return [
            _copy_into(buffers, build_draft_step_index(chain_starts, step, self.forwards, self.config))
            for step, buffers in enumerate(self.buffers)
        ]


@dataclass(frozen=True)
class DraftScratch:
    """A :class:`PoolStorage` of one window-only layer (layer 0): a draft chain's scratch rows."""

    window: list[torch.Tensor]
    formats: PoolFormats
    compressed: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    state: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    previous_state: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    checkpoint_state: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)


def _stage_checkpoints(
    pending: Mapping[int, Sequence[PendingCheckpoint]], staged: torch.Tensor, table: torch.Tensor
) -> None:
    """``(position, record)`` of each row's first pending checkpoints into the device ``table`` (through
    its host twin ``staged``); -1 where a row has no more."""
    staged.fill_(-1)
    slots = staged.shape[1]
    for row, checkpoints in pending.items():
        for slot, checkpoint in enumerate(sorted(checkpoints, key=lambda c: c.position)[:slots]):
            staged[row, slot, 0], staged[row, slot, 1] = checkpoint.position, checkpoint.record
    # Not waited for: a copy from pageable host memory has read it when the call returns.
    table.copy_(staged, non_blocking=True)


def _fields_of(value) -> dict[str, torch.Tensor]:
    """A dataclass's tensor fields by name."""
    return {name: getattr(value, name) for name in value.__dataclass_fields__ if torch.is_tensor(getattr(value, name))}


def _copy_into(buffers, value):
    """``value`` (an index, or any of its parts) copied into the first rows of ``buffers``: the same
    structure, whose tensors are views of the buffers'."""
    if isinstance(value, torch.Tensor):
        view = buffers[: value.shape[0]]
        view.copy_(value)
        return view
    if isinstance(value, dict):
        return {key: _copy_into(buffers[key], item) for key, item in value.items()}
    if hasattr(value, "__dataclass_fields__"):
        fields = value.__dataclass_fields__
        return type(value)(**{name: _copy_into(getattr(buffers, name), getattr(value, name)) for name in fields})
    return value


@dataclass(frozen=True)
class _Sizes:
    """A forward's host-known sizes for one compressor ratio: the blocks it touches, the widest
    pool a target gathers, and the entry-table columns its tokens read."""

    touched: int
    width: int
    blocks: int
    per_request: int | None = None  # touched targets of every request, in a fixed-shape index
    staged_rows: int | None = None  # rows a staging index decodes: the padding row, each request's complete blocks


@dataclass(frozen=True)
class _Batch:
    rows: torch.Tensor
    starts: torch.Tensor
    lengths: torch.Tensor
    offsets: torch.Tensor
    token_request: torch.Tensor
    positions: torch.Tensor
    snapshot_request: torch.Tensor
    snapshot_position: torch.Tensor
    snapshot_record: torch.Tensor

    @classmethod
    def of(cls, rows: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, *, tokens: int, **snapshots) -> _Batch:
        requests = torch.arange(rows.shape[0], device=rows.device)
        token_request = torch.repeat_interleave(requests, lengths, output_size=tokens)
        offsets = torch.cumsum(lengths, 0) - lengths
        positions = starts[token_request] + torch.arange(tokens, device=rows.device) - offsets[token_request]
        return cls(rows, starts, lengths, offsets, token_request, positions, **snapshots)

    @property
    def ends(self) -> torch.Tensor:
        return self.starts + self.lengths

    def token_of(self, request: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """The forward row of ``position`` of batch request ``request`` (inside its chunk)."""
        return self.offsets[request] + position - self.starts[request]


def _index(
    batch: _Batch,
    tables: RequestTableStorage,
    config: DeepseekV4Config,
    sizes: dict[int, _Sizes],
    tile_owners: list[int],
    *,
    one_token_each: bool,
    staged: bool = False,
) -> ForwardIndex:
    window_slots = _table_slots(batch, tables.window_table)
    return _index_of(
        batch, window_slots, tables.entry_table, config, sizes, tile_owners, one_token_each=one_token_each,
        staged=staged,
    )  # fmt: skip


def _index_of(
    batch: _Batch,
    window_slots: WindowSlots,
    entry_tables: dict[int, torch.Tensor],
    config: DeepseekV4Config,
    sizes: dict[int, _Sizes],
    tile_owners: list[int],
    *,
    one_token_each: bool,
    staged: bool = False,
) -> ForwardIndex:
    """The index of ``batch`` whose tokens' window slots ``window_slots`` gives (the request tables', or a
    draft chain's scratch rows) and whose blocks' entry rows ``entry_tables`` per ratio."""
    ratios = sorted(entry_tables)
    return ForwardIndex(
        positions=batch.positions,
        rope=ForwardRope.of_model(batch.positions, config),
        token_request=batch.token_request,
        rows=batch.rows,
        single_step_rows=torch.where(batch.lengths == 1, batch.rows, 0),
        window=_window_index(batch, window_slots, config.sliding_window, one_token_each=one_token_each),
        compressors={r: _compressor_targets(batch, entry_tables[r], r, sizes[r]) for r in ratios},
        entries={r: _entry_reads(batch, entry_tables[r], r, r != config.csa_rate, sizes[r]) for r in ratios},
        tile_owners=tile_owners,
        one_token_each=one_token_each,
        staged=staged,
    )


def _tile_owners(token_request: list[int]) -> list[int]:
    """Per ``ROW_TILE`` tokens, the request owning them all, or -1 (host values, from host values)."""
    tiles = (
        token_request[first : first + sparse_torch.ROW_TILE]
        for first in range(0, len(token_request), sparse_torch.ROW_TILE)
    )
    return [tile[0] if tile[0] == tile[-1] else -1 for tile in tiles]


# The window slot of each position (>= 0) of each batch request: ``(requests, positions) -> slots``, broadcast.
WindowSlots = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _table_slots(batch: _Batch, window_table: torch.Tensor) -> WindowSlots:
    """Window slots as the request tables give them."""
    return lambda request, position: window_table[batch.rows[request], position]


def _window_index(batch: _Batch, window_slots: WindowSlots, window: int, *, one_token_each: bool) -> WindowIndex:
    tokens, before = len(batch.positions), window - 1
    request, position = batch.token_request, batch.positions
    device = position.device
    write_slots = window_slots(request, position)
    earlier = batch.starts[:, None] - before + torch.arange(before, device=device)  # [requests, window - 1]
    requests = torch.arange(batch.rows.shape[0], device=device)
    previous = torch.where(earlier >= 0, window_slots(requests[:, None], earlier.clamp(min=0)), 0)
    # A token at p reads positions max(0, p - window + 1) .. p.
    lengths = torch.clamp(position + 1, max=window)
    keys = (position - window + 1).clamp(min=0)[:, None] + torch.arange(window, device=device)
    in_chunk = keys >= batch.starts[request, None]
    staged = torch.where(
        in_chunk,
        batch.token_of(request[:, None], keys),
        tokens + request[:, None] * before + keys - (batch.starts[request, None] - before),
    )
    read = torch.arange(window, device=device) < lengths[:, None]
    staged = torch.where(read, staged, 0)
    slots = None
    if one_token_each:
        slots = torch.where(read, window_slots(request[:, None], keys.clamp(max=position[:, None])), 0)
        slots = slots.to(torch.int32)
    return WindowIndex(write_slots, previous.flatten(), staged.to(torch.int32), lengths.to(torch.int32), slots)


def _compressor_targets(batch: _Batch, entry_table: torch.Tensor, ratio: int, sizes: _Sizes) -> CompressorTargets:
    snapshots = (batch.snapshot_request, batch.snapshot_position)
    blocks = BlockTargets.of(
        batch.starts, batch.lengths, batch.offsets, snapshots, ratio,
        touched=sizes.touched, width=sizes.width, per_request=sizes.per_request,
    )  # fmt: skip
    request = blocks.request[: blocks.touched]
    # A block repeated past a request's last one (a fixed-shape index's) writes no entry.
    repeated = torch.arange(blocks.touched, device=request.device) > blocks.last_target[request]
    complete = (batch.ends[request] >= blocks.entry_positions + ratio) & ~repeated
    entry_rows = torch.where(complete, entry_table[batch.rows[request], blocks.entry_positions // ratio], 0)
    return CompressorTargets(blocks, entry_rows, batch.snapshot_record)


def _entry_reads(batch: _Batch, entry_table: torch.Tensor, ratio: int, read_all: bool, sizes: _Sizes) -> EntryReads:
    # At least one column, so that the padding entries a selection points at exist.
    table = entry_table[batch.rows, : sizes.blocks]
    visible = ((batch.positions + 1) // ratio).to(torch.int32)
    staged = None if sizes.staged_rows is None else _staged_entries(batch, table, visible, ratio, read_all, sizes)
    return EntryReads(table, visible, table[batch.token_request].to(torch.int32) if read_all else None, staged)


def _staged_entries(
    batch: _Batch, table: torch.Tensor, visible: torch.Tensor, ratio: int, read_all: bool, sizes: _Sizes
) -> StagedEntries:
    """Each request's complete blocks after the forward (``ends // ratio``: every block a token of it can see) as
    staged rows, after the padding row."""
    columns = torch.arange(table.shape[1], device=table.device)
    complete = columns < (batch.ends // ratio)[:, None]  # [requests, blocks]
    counts = complete.sum(dim=1)
    first = 1 + torch.cumsum(counts, 0) - counts  # each request's first staged row
    staged_table = torch.where(complete, first[:, None] + columns, 0)
    pool_rows = table.new_zeros(sizes.staged_rows)
    pool_rows.scatter_(0, staged_table.flatten(), torch.where(complete, table, 0).flatten())  # padding: 0 to row 0
    per_token = staged_table[batch.token_request].to(torch.int32) if read_all else None
    return StagedEntries(pool_rows, EntryReads(staged_table, visible, per_token))


def _map_tensors(value, function):
    """An index (or any of its parts) with ``function`` applied to every tensor in it."""
    if isinstance(value, torch.Tensor):
        return function(value)
    if isinstance(value, dict):
        return {key: _map_tensors(item, function) for key, item in value.items()}
    if hasattr(value, "__dataclass_fields__"):
        return type(value)(
            **{name: _map_tensors(getattr(value, name), function) for name in value.__dataclass_fields__}
        )
    return value


# --- one layer -----------------------------------------------------------------------------------


def attend(
    attention: Attention,
    layer: int,
    x: torch.Tensor,
    index: ForwardIndex,
    storage: PoolStorage,
    heads: slice = slice(None),
) -> torch.Tensor:
    """Attention of the forward's tokens ``x [tokens, hidden]`` before the output projection:
    ``[tokens, local heads, head_dim]`` for query heads ``heads`` (all by default; a tensor-parallel
    rank passes its own). Advances the layer's pools in place.

    The compressors and the indexer's choice read only ``x`` and the low-rank query: on CUDA they run beside
    the query and KV projections and the window's write (:class:`~sglang_dsv4.kernels.dispatch.Beside`), which
    touch none of what they write; the attention reads both after the join."""
    cos, sin = index.rope.cos_sin(attention.rotary)
    q_residual = attention.low_rank_query(x)
    beside = Beside(x)
    with beside:
        compressed = _compressed_selection(attention, layer, x, q_residual, index, storage)
    q, kv = attention.project_heads(x, q_residual, cos, sin)
    window = _window_selection(layer, kv, index, storage)
    beside.join()
    sink = attention.attn_sink[heads]  # the kernel reads it as float32: no cast launched
    return sparse_attention(q[:, heads], window, compressed, sink, cos, sin, scale=attention.head_dim**-0.5)


def _window_selection(layer: int, kv: torch.Tensor, index: ForwardIndex, storage: PoolStorage) -> KVSelection:
    """Write the forward's KV rows into the layer's window pool; what each token reads of the window."""
    window_rows, entries_format = storage.window[layer], storage.formats.entries
    if index.window.slots is None:
        # The chunk's own tokens are read as stored, as the forwards after it read them from the pool: staged as
        # stored rows, which the attention decodes where it reads them, or decoded once where the index stages.
        stored = encode_rows(entries_format, kv)
        staged = _Rows(torch.cat([stored, window_rows[index.window.previous_slots]]), entries_format)
        window_rows.index_copy_(0, index.window.write_slots, stored)
        if index.staged:
            staged = _decoded(staged, torch.arange(staged.rows.shape[0], device=kv.device), kv.dtype)
        return KVSelection(staged.rows, index.window.indices, index.window.lengths, staged.row_format)
    # A decode forward reads every key where it lies, its own after it is written.
    write_rows(entries_format, kv, window_rows, index.window.write_slots)
    return KVSelection(window_rows, index.window.slots, index.window.lengths, entries_format)


def _compressed_selection(
    attention: Attention, layer: int, x: torch.Tensor, q_residual: torch.Tensor, index: ForwardIndex,
    storage: PoolStorage,
) -> KVSelection:  # fmt: skip
    """Advance the layer's compressors (and its indexer's); what each token reads of the compressed entries:
    every complete one (ratio 128), the indexer's choice (ratio 4), none (a window-only layer)."""
    formats = storage.formats
    if attention.compressor is None:
        no_entries = index.window.indices[:, :0], torch.zeros_like(index.window.lengths)
        return KVSelection(storage.window[layer], *no_entries, formats.entries)
    entries = _Rows(storage.compressed[(layer, "entries")], formats.entries)
    reads = index.entries[attention.compressor.ratio]
    entry_records = _records(storage, (layer, "compressor"))
    if attention.indexer is None:
        _advance(attention.compressor, x, index, entries, entry_records)
        entries, reads = _read_as_staged(entries, reads, x.dtype)
        return KVSelection(entries.rows, reads.per_token, reads.visible, entries.row_format)
    keys = _Rows(storage.compressed[(layer, "indexer_keys")], formats.indexer_keys)
    key_records = _records(storage, (layer, "indexer"))
    jobs = (attention.compressor, entries, entry_records), (attention.indexer.compressor, keys, key_records)
    _advance_pair(*jobs, x, index)
    keys, key_reads = _read_as_staged(keys, reads, x.dtype)
    rows, selected = select_entries(attention.indexer, x, q_residual, index, keys.rows, keys.row_format, key_reads)
    entries, _ = _read_as_staged(entries, reads, x.dtype)
    return KVSelection(entries.rows, rows, selected, entries.row_format)


def _read_as_staged(rows: _Rows, reads: EntryReads, dtype: torch.dtype) -> tuple[_Rows, EntryReads]:
    """The rows the forward's tokens read, and their reads: the staged rows decoded (:class:`StagedEntries`) where
    the index stages them, else the pool's rows as they are."""
    if reads.staged is None:
        return rows, reads
    return _decoded(rows, reads.staged.pool_rows, dtype), reads.staged.reads


def _decoded(stored: _Rows, rows: torch.Tensor, dtype: torch.dtype) -> _Rows:
    """Rows ``rows`` of ``stored`` as values in ``dtype``."""
    return _Rows(decode_rows(stored.row_format, stored.rows, rows, dtype), None)


def select_entries(
    indexer: Indexer,
    x: torch.Tensor,
    q_residual: torch.Tensor,
    index: ForwardIndex,
    keys: torch.Tensor,
    keys_format: RowFormat | None = None,
    reads: EntryReads | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer's choice for every token as its attention reads it: the entry rows of its ``index_topk`` best
    blocks ``[tokens, index_topk]`` int32 (past the choice never read) and how many it chose ``[tokens]`` int32
    (``keys``: the indexer key pool, its rows stored in ``keys_format``; ``reads``: the index's reads of them, or
    of their staged rows)."""
    q, head_weights = indexer.queries(x, q_residual, index.rope)
    reads = index.entries[indexer.compressor.ratio] if reads is None else reads
    return chosen_entries(
        q, head_weights, keys, reads.table, index.token_request, reads.visible, indexer.topk,
        scale=indexer.head_dim**-0.5, tile_owners=index.tile_owners, keys_format=keys_format,
    )  # fmt: skip


@dataclass(frozen=True)
class _Rows:
    """A layer's compressed entries or indexer keys: the pool's rows, and how they are stored."""

    rows: torch.Tensor
    row_format: RowFormat | None  # None: the rows are values


@dataclass(frozen=True)
class _StateRecords:
    state: torch.Tensor
    previous: torch.Tensor
    checkpoint: torch.Tensor


def _records(storage: PoolStorage, key: tuple[int, str]) -> _StateRecords:
    return _StateRecords(storage.state[key], storage.previous_state[key], storage.checkpoint_state[key])


def _advance(compressor: Compressor, x: torch.Tensor, index: ForwardIndex, out: _Rows, records: _StateRecords) -> None:
    """Run the compressor over the forward: the entry rows of complete blocks (in ``out``: the layer's
    compressed entries, or its indexer keys for the indexer's compressor), new states, snapshots.

    The record one step back is saved first. A decode forward advances each request by its one token
    (:func:`_advance_one_token_each`: the Triton decode kernel on CUDA, which saves it too); every other
    forward pools its blocks in torch (:func:`_advance_pooled`).
    """
    if index.one_token_each:
        _advance_one_token_each(compressor, x, index, out, records)
    else:
        records.previous.index_copy_(0, index.single_step_rows, records.state[index.rows])
        _advance_pooled(compressor, x, index, out, records)


# A compressor, where it writes its entries, its state records.
_CompressorJob = tuple[Compressor, _Rows, _StateRecords]


def _advance_pair(first: _CompressorJob, second: _CompressorJob, x: torch.Tensor, index: ForwardIndex) -> None:
    """:func:`_advance` of a ratio-4 layer's two compressors (its own and its indexer's): in a decode forward both
    in one step (:func:`~sglang_dsv4.kernels.dispatch.compress_pair_one_token_each`: on CUDA one launch)."""
    if not index.one_token_each:
        for compressor, out, records in (first, second):
            _advance(compressor, x, index, out, records)
        return
    first_job, second_job = (_decode_job(*job, x, index) for job in (first, second))
    targets = index.compressors[first[0].ratio]
    compress_pair_one_token_each(first_job, second_job, index.positions, targets.blocks)


def _decode_job(
    compressor: Compressor, out: _Rows, records: _StateRecords, x: torch.Tensor, index: ForwardIndex
) -> DecodeJob:
    """A compressor's decode step over the forward: its projections, and where it writes (:class:`DecodeWrites`)."""
    targets = index.compressors[compressor.ratio]
    writes = DecodeWrites(
        records.state, index.rows, records.previous, records.checkpoint, targets.snapshot_records,
        out.rows, out.row_format, targets.entry_rows,
    )  # fmt: skip
    return DecodeJob(compressor, compressor.wkv(x), compressor.wgate(x), writes)


def _advance_one_token_each(
    compressor: Compressor, x: torch.Tensor, index: ForwardIndex, out: _Rows, records: _StateRecords
) -> None:
    """:func:`_advance` of a decode forward (:func:`~sglang_dsv4.kernels.dispatch.compress_one_token_each`: on CUDA
    one launch, the records and the entry rows written in it), where every row is a single step and the only
    snapshot a row can take is the state after its token."""
    job = _decode_job(compressor, out, records, x, index)
    targets = index.compressors[compressor.ratio]
    compress_one_token_each(compressor, job.kv, job.gate, index.positions, job.writes, targets.blocks)


def _advance_pooled(
    compressor: Compressor, x: torch.Tensor, index: ForwardIndex, out: _Rows, records: _StateRecords
) -> None:
    """:func:`_advance` of any forward in torch (:meth:`~sglang_dsv4.model.compressor.Compressor.pool_blocks`,
    every block the forward touches at once)."""
    targets = index.compressors[compressor.ratio]
    pooled = compressor.pool_blocks(compressor.wkv(x), compressor.wgate(x), targets.blocks, records.state[index.rows])
    out.rows.index_copy_(0, targets.entry_rows, encode_rows(out.row_format, pooled.entries))
    records.state.index_copy_(0, index.rows, pooled.state)
    records.checkpoint.index_copy_(0, targets.snapshot_records, pooled.snapshots)
