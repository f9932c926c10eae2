"""The one place that chooses between this package's Triton kernels and their torch implementations.

:func:`uses_triton` is the choice: the Triton kernels (and torch's CUDA grouped GEMM) for tensors
on a CUDA device, the torch implementations everywhere else; every operation that has both is a
function here, and no other file checks a device. The tensor-level operations' torch paths live in
``kernels/``; the network's modules (mHC, the compressor, attention, the indexer) come in as the
protocols below, which name what their kernels read and their own torch path, so that nothing here
imports the network. The kernel modules (and Triton) are imported only on the CUDA path, so CPU
hosts never need them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from . import sparse_torch
from .kv_format import Fp8EntryRows, Fp8KeyRows, PlainRows, RowFormat
from .selection import KVSelection, read_rows


def uses_triton(tensor: torch.Tensor) -> bool:
    """Whether operations on ``tensor`` run the Triton kernels: on a CUDA device."""
    return tensor.device.type == "cuda"


class Beside:
    """Work run beside the current stream. On CUDA (``like``'s device), what is enqueued inside ``with beside:``
    goes to a side stream of the device that first waits for everything enqueued on the current stream so far,
    and the current stream waits for it at :meth:`join`: what the current stream enqueues in between runs
    alongside (in a CUDA graph's capture the two become parallel branches). Elsewhere the work runs in order and
    :meth:`join` does nothing.

    No ``record_stream`` is needed where tensors cross only at the fork (the side reads what the current stream made
    before it) and at the join (the current stream reads what the side made), and are dropped after the join: a
    block freed then is reused by either stream only after work that waits for the join (the current stream's in
    its order, the side stream's behind its next fork)."""

    def __init__(self, like: torch.Tensor) -> None:
        self._streams = None
        if uses_triton(like):
            current, side = torch.cuda.current_stream(like.device), _side_stream(like.device.index)
            side.wait_stream(current)
            self._streams = current, side
            self._context = torch.cuda.stream(side)

    def __enter__(self) -> Beside:
        if self._streams is not None:
            self._context.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._streams is not None:
            self._context.__exit__(*exc)

    def join(self) -> None:
        if self._streams is not None:
            current, side = self._streams
            current.wait_stream(side)


@functools.cache
def _side_stream(device: int | None) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


# --- the network's modules ----------------------------------------------------------------------


class Norm(Protocol):
    """An RMSNorm (:class:`~sglang_dsv4.model.norms.RMSNorm`)."""

    weight: torch.Tensor
    eps: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class Mixing(Protocol):
    """The mHC around one sublayer (:class:`~sglang_dsv4.model.mhc.HyperConnection`)."""

    fn: torch.Tensor
    base: torch.Tensor
    scale: torch.Tensor
    sinkhorn_iters: int
    hc_eps: float
    norm_eps: float

    def pre(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


def mhc_pre(hc: Mixing, norm: Norm, streams: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A sublayer's input ``norm(collapse(streams))`` and its mixing weights ``(x, post, comb)``."""
    if uses_triton(streams):
        from . import mhc

        return mhc.fused_pre(streams, _mixing_weights(hc), norm.weight, norm.eps)
    x, post, comb = hc.pre(streams)
    return norm(x), post, comb


def mhc_post_pre(
    output: torch.Tensor,
    streams: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    next_hc: Mixing,
    next_norm: Norm,
) -> tuple[torch.Tensor, ...]:
    """A sublayer's post and the next sublayer's pre: ``(new streams, next x, next post, next comb)``."""
    if uses_triton(streams):
        from . import mhc

        return mhc.fused_post_pre(
            output, streams, post, comb, _mixing_weights(next_hc), next_norm.weight, next_norm.eps
        )
    new_streams = mix_post(output, streams, post, comb)
    return (new_streams, *mhc_pre(next_hc, next_norm, new_streams))


def mhc_post(output: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """A sublayer's post alone: the new streams (:func:`mix_post`)."""
    if uses_triton(streams):
        from . import mhc

        return mhc.fused_post(output, streams, post, comb)
    return mix_post(output, streams, post, comb)


def mix_post(output: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams in torch: ``post[k] * output + sum_j comb[j, k] * streams[j]`` (it reads no parameter)."""
    dtype = streams.dtype
    mixed = torch.einsum("ljk,ljd->lkd", comb.to(dtype), streams)
    return post.to(dtype).unsqueeze(-1) * output.unsqueeze(1) + mixed


def _mixing_weights(hc: Mixing):
    from .mhc import MixingWeights

    return MixingWeights(hc.fn, hc.base, hc.scale, hc.sinkhorn_iters, hc.hc_eps, hc.norm_eps)


class Rotary(Protocol):
    def inv_freq_on(self, device: torch.device) -> torch.Tensor: ...


class Compressor(Protocol):
    """A KV compressor (:class:`~sglang_dsv4.model.compressor.Compressor`) and its torch paths."""

    ape: torch.Tensor
    norm: Norm
    rotary: Rotary
    ratio: int
    overlapping: bool

    def pool_chunk(self, kv: torch.Tensor, gate: torch.Tensor, start: int, record: torch.Tensor) -> torch.Tensor: ...

    def pool_one_token_each(
        self, kv: torch.Tensor, gate: torch.Tensor, targets: Any, records: torch.Tensor, rows: torch.Tensor
    ) -> torch.Tensor: ...


def compress_chunk(
    compressor: Compressor, kv: torch.Tensor, gate: torch.Tensor, start: int, record: torch.Tensor
) -> torch.Tensor:
    """One request's tokens ``start .. start + len(kv) - 1`` from their projections (``kv``, ``gate``
    ``[tokens, series * dim]``), its state record ``record [1, pools, 3, dim]`` advanced in place: the
    entries of the blocks they complete (the Triton extend kernel, or :meth:`Compressor.pool_chunk`)."""
    if uses_triton(kv):
        from .compressor import compress_extend

        rows = torch.zeros(1, dtype=torch.int32, device=kv.device)
        return compress_extend(kv, gate, [start], [kv.shape[0]], record, rows, _compressor_weights(compressor, kv))
    return compressor.pool_chunk(kv, gate, start, record)


@dataclass(frozen=True)
class DecodeWrites:
    """Where a decode step of one compressor writes: its state records ``state[rows]``, advanced in place, the
    records one step back ``previous[rows]`` (the state before the token), the snapshots
    ``checkpoint[checkpoint_records]`` (the state after it; record 0 is the padding record) and each request's
    entry, ``entries[entry_rows]`` stored as ``entry_format`` (row 0, the padding row, where its token ends no
    block)."""

    state: torch.Tensor
    rows: torch.Tensor
    previous: torch.Tensor
    checkpoint: torch.Tensor
    checkpoint_records: torch.Tensor
    entries: torch.Tensor
    entry_format: RowFormat
    entry_rows: torch.Tensor


def compress_one_token_each(
    compressor: Compressor,
    kv: torch.Tensor,
    gate: torch.Tensor,
    positions: torch.Tensor,
    writes: DecodeWrites,
    targets: Any,
) -> None:
    """One token per request at ``positions`` (projections ``[requests, series * dim]``): everything ``writes``
    names. The Triton decode kernel (graph-capturable; one launch where it stores the entries itself: in the
    projections' dtype or as FP8 rows, else their encode and copy after it), or
    :meth:`Compressor.pool_one_token_each` over the forward's ``targets`` and the copies in torch."""
    if uses_triton(kv):
        from .compressor import DecodeRecords, compress_decode, compress_decode_into

        weights = _compressor_weights(compressor, kv)
        records = DecodeRecords(writes.previous, writes.checkpoint, writes.checkpoint_records)
        stored_in_kernel = _stored_in_kernel(writes.entry_format, kv)
        if stored_in_kernel is not None:
            compress_decode_into(
                kv, gate, positions, writes.state, writes.rows, weights, records, writes.entries, writes.entry_rows,
                stored_in_kernel.stored_as,
            )  # fmt: skip
            return
        new_entries = compress_decode(kv, gate, positions, writes.state, writes.rows, weights, records)
    else:
        writes.previous.index_copy_(0, writes.rows, writes.state[writes.rows])
        new_entries = compressor.pool_one_token_each(kv, gate, targets, writes.state, writes.rows)
        writes.checkpoint.index_copy_(0, writes.checkpoint_records, writes.state[writes.rows])
    write_rows(writes.entry_format, new_entries, writes.entries, writes.entry_rows)


@dataclass(frozen=True)
class DecodeJob:
    """One compressor's decode step: its projections ``kv``, ``gate`` ``[requests, series * dim]`` and where it
    writes."""

    compressor: Compressor
    kv: torch.Tensor
    gate: torch.Tensor
    writes: DecodeWrites


def compress_pair_one_token_each(first: DecodeJob, second: DecodeJob, positions: torch.Tensor, targets: Any) -> None:
    """:func:`compress_one_token_each` of two compressors over the same tokens (a ratio-4 layer's and its indexer's,
    ``targets`` the forward's blocks of their ratio): one Triton launch for both where the kernel stores both's
    entries itself, else each on its own."""
    jobs = (first, second)
    stored = [_stored_in_kernel(job.writes.entry_format, job.kv) for job in jobs]
    if uses_triton(first.kv) and None not in stored:
        from .compressor import DecodeInto, DecodeRecords, compress_decode_pair_into

        steps = [
            DecodeInto(
                job.kv, job.gate, job.writes.state, job.writes.rows, _compressor_weights(job.compressor, job.kv),
                DecodeRecords(job.writes.previous, job.writes.checkpoint, job.writes.checkpoint_records),
                job.writes.entries, job.writes.entry_rows, stored_in_kernel.stored_as,
            )
            for job, stored_in_kernel in zip(jobs, stored, strict=True)
        ]  # fmt: skip
        compress_decode_pair_into(positions, *steps)
        return
    for job in jobs:
        compress_one_token_each(job.compressor, job.kv, job.gate, positions, job.writes, targets)


@dataclass(frozen=True)
class StoredInKernel:
    """Entries the decode kernel stores itself: ``stored_as`` FP8 rows, or (``None``) values in the projections'
    dtype."""

    stored_as: Fp8EntryRows | Fp8KeyRows | None


def _stored_in_kernel(entry_format: RowFormat, kv: torch.Tensor) -> StoredInKernel | None:
    """How the decode kernel stores entries of ``entry_format`` itself (values in the projections' dtype, or FP8 rows
    of power-of-two dims, as :func:`encode_rows` encodes them), or ``None`` where it cannot."""
    if isinstance(entry_format, PlainRows) and entry_format.dtype == kv.dtype:
        return StoredInKernel(None)
    if _fp8_in_one_launch(entry_format, kv):
        return StoredInKernel(entry_format)
    return None


def _compressor_weights(compressor: Compressor, x: torch.Tensor):
    from .compressor import CompressorWeights

    return CompressorWeights(
        ape=compressor.ape,
        norm_weight=compressor.norm.weight,
        norm_eps=compressor.norm.eps,
        inv_freq=compressor.rotary.inv_freq_on(x.device),
        ratio=compressor.ratio,
        overlapping=compressor.overlapping,
    )


class Attention(Protocol):
    """A V4 attention (:class:`~sglang_dsv4.model.attention.Attention`) and its torch path."""

    head_dim: int
    attn_sink: torch.Tensor

    def attend_reference(
        self, q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor: ...


def attend_visible(
    attention: Attention,
    q: torch.Tensor,
    keys: torch.Tensor,
    raw_count: int,
    visible: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """The attention's softmax over ``keys`` (the window's ``raw_count`` rows, then the entries) where
    ``visible [L, len(keys)]``, and the sink; inverse rope on the output, ``[L, heads, head_dim]``.

    The Triton kernel does all of it in one pass; the torch path is :meth:`Attention.attend_reference`."""
    if uses_triton(q):
        from .attention import attend_visible as kernel

        scale = attention.head_dim**-0.5
        return kernel(q, keys, raw_count, visible, attention.attn_sink, cos, sin, scale=scale)
    return attention.attend_reference(q, keys, visible, cos, sin)


def normalize_rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    in_torch: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    eps: float | None = None,
    weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows ``x [L, heads, head_dim]`` scaled to unit root-mean-square (where ``eps`` is given; times ``weight
    [head_dim]`` where given), then roped at ``cos, sin [L, rope_dim // 2]``: one Triton launch
    (``kernels/norm_rope.py``) where the weight, if any, is in ``x``'s dtype, else ``in_torch(x, cos, sin)``, the
    network's own norm and rope."""
    if uses_triton(x) and (weight is None or weight.dtype == x.dtype):
        from .norm_rope import normalize_rope as kernel

        return kernel(x, cos, sin, eps, weight)
    return in_torch(x, cos, sin)


def rms_norm(norm: Norm, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)`` over rows ``x [L, dim]``: one Triton launch (``kernels/norm_rope.py``, the weighted norm with no
    rope) where the norm's weight is in ``x``'s dtype, else the module itself (9 launches on CUDA)."""
    if uses_triton(x) and norm.weight.dtype == x.dtype:
        from .norm_rope import rms_norm as kernel

        return kernel(x, norm.eps, norm.weight)
    return norm(x)


class Indexer(Protocol):
    """A lightning indexer (:class:`~sglang_dsv4.model.indexer.Indexer`) and its torch path."""

    head_dim: int
    topk: int

    def queries(self, x: torch.Tensor, q_residual: torch.Tensor, rope: Any) -> tuple[torch.Tensor, torch.Tensor]: ...

    def select_reference(
        self, x: torch.Tensor, q_residual: torch.Tensor, rope: Any, keys: torch.Tensor, visible: torch.Tensor,
    ) -> torch.Tensor: ...  # fmt: skip


def select_visible(
    indexer: Indexer,
    x: torch.Tensor,
    q_residual: torch.Tensor,
    rope: Any,
    keys: torch.Tensor,
    visible: torch.Tensor,
) -> torch.Tensor:
    """Boolean ``[L, len(keys)]``: the indexer's top-k of each query's visible keys, its queries roped at the
    forward's tables ``rope`` (:class:`~sglang_dsv4.model.rope.ForwardRope`; scoring, then an exact top-k, in
    Triton; :meth:`Indexer.select_reference` in torch)."""
    if uses_triton(x):
        from .indexer import select_visible as kernel

        q, head_weights = indexer.queries(x, q_residual, rope)
        return kernel(q, head_weights, keys, visible, indexer.topk, scale=indexer.head_dim**-0.5)
    return indexer.select_reference(x, q_residual, rope, keys, visible)


class DecodeIndex(Protocol):
    """A CUDA graph's decode index, built in place two ways
    (:class:`~sglang_dsv4.attention_backend.batched.DecodeGraphIndex`)."""

    def build_in_kernels(self, rows: torch.Tensor, seq_lens: torch.Tensor) -> Any: ...

    def build_in_torch(self, rows: torch.Tensor, seq_lens: torch.Tensor) -> Any: ...


def fill_decode_index(index: DecodeIndex, rows: torch.Tensor, seq_lens: torch.Tensor) -> Any:
    """A decode batch's index in the graph's buffers: the Triton kernels of :mod:`.decode_index` (three
    launches, then the rope tables' four a flavour), or the torch build."""
    if uses_triton(rows):
        return index.build_in_kernels(rows, seq_lens)
    return index.build_in_torch(rows, seq_lens)


# --- tensors ---------------------------------------------------------------------------------------


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
    """One softmax over each row's window rows, compressed rows and the sink, inverse rope on the
    output: ``[rows, heads, head_dim]`` (:func:`.sparse_torch.sparse_decode_attention_reference`)."""
    if uses_triton(q):
        from .attention import sparse_decode_attention

        return sparse_decode_attention(q, window, compressed, sink.contiguous(), cos, sin, scale=scale)
    return sparse_torch.sparse_attention(q, window, compressed, sink, cos, sin, scale=scale)


def encode_rows(row_format: RowFormat, values: torch.Tensor) -> torch.Tensor:
    """``row_format.encode(values)``: DeepSeek's FP8 rows in one Triton launch (:mod:`.fp8_encode`, byte for byte
    the torch codec's) where ``dim`` is a power of two, anything else by the codec itself."""
    if _fp8_in_one_launch(row_format, values):
        from .fp8_encode import encode_fp8_rows

        return encode_fp8_rows(values, row_format)
    return row_format.encode(values)


def write_rows(row_format: RowFormat, values: torch.Tensor, pool: torch.Tensor, rows: torch.Tensor) -> None:
    """``pool[rows] = row_format.encode(values)``: FP8 rows encoded straight into the pool in the launch that
    :func:`encode_rows` makes, anything else encoded, then copied."""
    if _fp8_in_one_launch(row_format, values) and pool.is_contiguous():
        from .fp8_encode import encode_fp8_rows_into

        encode_fp8_rows_into(values, row_format, pool, rows)
        return
    pool.index_copy_(0, rows, encode_rows(row_format, values))


def decode_rows(row_format: RowFormat, pool: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values ``[len(rows), dim]`` in ``dtype`` of ``pool[rows]`` stored as ``row_format``: FP8 rows gathered and
    decoded in one Triton launch (:func:`.fp8_rows.decode_fp8_rows`, bitwise the codec's) where ``dim`` is a power of
    two, anything else by :func:`.selection.read_rows`."""
    if _fp8_in_one_launch(row_format, pool) and pool.is_contiguous():
        from .fp8_rows import decode_fp8_rows

        return decode_fp8_rows(pool, rows, row_format, dtype)
    return read_rows(pool, rows, row_format, dtype)


def _fp8_in_one_launch(row_format: RowFormat, tensor: torch.Tensor) -> bool:
    """Whether FP8 rows of ``row_format`` beside ``tensor`` are encoded and decoded by one Triton launch."""
    fp8 = isinstance(row_format, Fp8EntryRows | Fp8KeyRows)
    return fp8 and uses_triton(tensor) and row_format.dim & (row_format.dim - 1) == 0


# Query rows scored at once on the Triton path: its scores are [rows, context / 4] float32 (256 MiB at 1M).
INDEX_ROW_TILE = 256


def chosen_entries(
    q: torch.Tensor,
    head_weights: torch.Tensor,
    keys: torch.Tensor,
    table: torch.Tensor,
    table_row: torch.Tensor,
    lengths: torch.Tensor,
    k: int,
    *,
    scale: float,
    tile_owners: list[int],
    keys_format: RowFormat | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer's choice as its attention reads it: each query row's ``k`` best key slots ``j`` (the arguments of
    :func:`.sparse_torch.streamed_top_k`) written as ``table[table_row[r], j]``, ``[rows, k]`` int32 (past the
    choice never read), and how many it chose, ``[rows]`` int32. On CUDA the scoring kernel and the whole-row
    select writing the table's rows (:func:`chosen_entries_triton`); elsewhere the streamed torch top-k, best first,
    and :func:`.sparse_torch.chosen_entry_rows`."""
    if uses_triton(q):
        return chosen_entries_triton(
            q, head_weights, keys, table, table_row, lengths, k, scale=scale, keys_format=keys_format
        )
    chosen = sparse_torch.streamed_top_k(
        q, head_weights, keys, table, table_row, lengths, k, scale=scale, tile_owners=tile_owners,
        keys_format=keys_format,
    )  # fmt: skip
    return sparse_torch.chosen_entry_rows(table, table_row, chosen)


def chosen_entries_triton(
    q: torch.Tensor,
    head_weights: torch.Tensor,
    keys: torch.Tensor,
    table: torch.Tensor,
    table_row: torch.Tensor,
    lengths: torch.Tensor,
    k: int,
    *,
    scale: float,
    keys_format: RowFormat | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`chosen_entries` through the Triton scoring kernel (reading each row's table row where it lies),
    ``INDEX_ROW_TILE`` rows at a time, then the exact top-k of each tile's scores written as entry rows
    (:func:`.indexer.top_k_entry_rows`: at a decode step's widths one launch, the counts in it). Two launches a tile,
    whatever the table's dtype."""
    from .indexer import index_scores, top_k_entry_rows

    weights, tiles = head_weights.float().contiguous(), []
    for first in range(0, q.shape[0], INDEX_ROW_TILE):
        tile = slice(first, first + INDEX_ROW_TILE)
        scores = index_scores(
            q[tile], weights[tile], keys, lengths[tile], scale=scale, table=table, table_row=table_row[tile],
            keys_format=keys_format,
        )  # fmt: skip
        tiles.append(top_k_entry_rows(scores, lengths[tile], k, table, table_row[tile]))
    if len(tiles) == 1:
        return tiles[0]  # one tile: no copy
    if not tiles:
        return torch.empty(0, k, dtype=torch.int32, device=q.device), torch.empty(0, dtype=torch.int32, device=q.device)
    return torch.cat([rows for rows, _ in tiles]), torch.cat([counts for _, counts in tiles])


def grouped_gated_mlp(
    x: torch.Tensor,
    group_sizes: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    activation: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Rows of ``x`` grouped by expert (the first ``group_sizes[0]`` rows expert 0's, and so on)
    through their expert's gated MLP ``w2[e] activation(w1[e] x, w3[e] x)``; rows past the last
    group are left unwritten.

    On CUDA in bf16, torch's grouped GEMM over the groups (no host sync); elsewhere one GEMM
    per non-empty group, after one read of the group sizes.
    """
    if uses_triton(x) and x.dtype == torch.bfloat16:
        offsets = torch.cumsum(group_sizes, 0).to(torch.int32)
        gate = torch._grouped_mm(x, w1.transpose(1, 2), offs=offsets)
        up = torch._grouped_mm(x, w3.transpose(1, 2), offs=offsets)
        return torch._grouped_mm(activation(gate, up), w2.transpose(1, 2), offs=offsets)
    out = x.new_zeros(x.shape[0], w2.shape[1])
    start = 0
    for expert, size in enumerate(group_sizes.tolist()):
        if size:
            rows = x[start : start + size]
            out[start : start + size] = activation(rows @ w1[expert].T, rows @ w3[expert].T) @ w2[expert].T
            start += size
    return out
