"""The KV compressor: one entry per block of ``ratio`` tokens, as a gated softmax pool.

Each token ``j`` contributes a value ``kv_j`` and a gate logit ``g_j + ape[j % ratio]``
per channel; a block's entry is ``sum_j softmax(g)_j * kv_j`` per channel, then
RMSNorm and rope at the block's first position.

* Disjoint (ratio 128, HCA): an entry pools its own block.
* Overlapping (ratio 4, CSA and the indexer): the projections are two series ``Ca``
  and ``Cb``; entry ``w`` pools ``Ca`` of block ``w - 1`` together with ``Cb`` of
  block ``w`` (a softmax over ``2 * ratio`` slots).

A partial block is never kept as raw tokens: the softmax pool is accumulated online
(:class:`SoftmaxPool`: per channel the running max, denominator and weighted sum),
so the state behind a partial block costs O(dim) whatever its length, and prefill of
any length, chunked prefill and decode all go through the same :meth:`Compressor.advance`.

One implementation pools the blocks of any number of requests at once
(:meth:`Compressor.pool_blocks`, over the :class:`BlockTargets` of a forward): the network's
:meth:`Compressor.advance` runs it for one request, the batched attention core for a whole
batch over the V4 pool's state records. A state record is one codec for both
(:func:`as_record`, :func:`record_pools`): ``[pools, 3, dim]`` float32, per pool its max,
denominator and weighted sum; the pools are ``current``, then ``next_half`` and
``previous_half`` when overlapping.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..kernels.dispatch import compress_chunk
from .norms import RMSNorm
from .rope import Rotary, apply_rope


@dataclass
class SoftmaxPool:
    """Online softmax-weighted sum per channel: ``value = weighted / denom``.

    Leading dims are blocks (or none); an empty pool has ``max = -inf`` and zeros.
    Always float32.
    """

    max: torch.Tensor
    denom: torch.Tensor
    weighted: torch.Tensor

    @staticmethod
    def empty(shape: tuple[int, ...], device: torch.device | str = "cpu") -> SoftmaxPool:
        return SoftmaxPool(
            max=torch.full(shape, float("-inf"), device=device),
            denom=torch.zeros(shape, device=device),
            weighted=torch.zeros(shape, device=device),
        )

    @staticmethod
    def of_slots(kv: torch.Tensor, logits: torch.Tensor) -> SoftmaxPool:
        """Pool over dim -2 of ``[..., slots, dim]``; slots with ``-inf`` logits are absent."""
        kv, logits = kv.float(), logits.float()
        peak = logits.max(dim=-2).values
        weights = torch.exp(logits - _finite(peak).unsqueeze(-2))
        return SoftmaxPool(peak, weights.sum(-2), (weights * kv).sum(-2))

    def merge(self, other: SoftmaxPool) -> SoftmaxPool:
        peak = torch.maximum(self.max, other.max)
        mine, theirs = _rescale(self.max, peak), _rescale(other.max, peak)
        return SoftmaxPool(
            peak, self.denom * mine + other.denom * theirs, self.weighted * mine + other.weighted * theirs
        )

    def value(self) -> torch.Tensor:
        return self.weighted / self.denom

    def __getitem__(self, index: int | slice | torch.Tensor) -> SoftmaxPool:
        return SoftmaxPool(self.max[index], self.denom[index], self.weighted[index])

    def channels(self, channels: slice) -> SoftmaxPool:
        return SoftmaxPool(self.max[..., channels], self.denom[..., channels], self.weighted[..., channels])

    def clone(self) -> SoftmaxPool:
        return SoftmaxPool(self.max.clone(), self.denom.clone(), self.weighted.clone())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.max, self.denom, self.weighted))


def _finite(peak: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))


def _rescale(old_max: torch.Tensor, new_max: torch.Tensor) -> torch.Tensor:
    """``exp(old_max - new_max)``, with 0 for an empty pool."""
    return torch.where(torch.isfinite(old_max), torch.exp(old_max - _finite(new_max)), torch.zeros_like(old_max))


def as_record(pools: Sequence[SoftmaxPool]) -> torch.Tensor:
    """State records ``[..., pools, 3, dim]``: per pool its max, denominator and weighted sum."""
    return torch.stack([torch.stack([p.max, p.denom, p.weighted], dim=-2) for p in pools], dim=-3)


def record_pools(record: torch.Tensor) -> list[SoftmaxPool]:
    """The pools of state records ``[..., pools, 3, dim]`` (views of them)."""
    return [
        SoftmaxPool(record[..., i, 0, :], record[..., i, 1, :], record[..., i, 2, :]) for i in range(record.shape[-3])
    ]


@dataclass
class CompressorState:
    """A compressor's state at a token position.

    ``entries`` are the compressed entries of every complete block (persistent).
    ``current`` pools the partial block (the ``Cb`` series when overlapping);
    ``next_half`` pools the partial block's ``Ca`` (overlapping only) and
    ``previous_half`` the last complete block's ``Ca``, which the next entry still needs.
    """

    entries: torch.Tensor
    current: SoftmaxPool
    next_half: SoftmaxPool | None
    previous_half: SoftmaxPool | None

    @staticmethod
    def of_record(entries: torch.Tensor, record: torch.Tensor) -> CompressorState:
        """The state with ``entries`` whose pools are state record ``record [pools, 3, dim]`` (views of it)."""
        pools = record_pools(record)
        if len(pools) == 1:
            return CompressorState(entries, pools[0], None, None)
        current, next_half, previous_half = pools
        return CompressorState(entries, current, next_half, previous_half)

    def record(self) -> torch.Tensor:
        """The state record of the pools, ``[pools, 3, dim]``."""
        pools = (self.current,) if self.next_half is None else (self.current, self.next_half, self.previous_half)
        return as_record(pools)

    def append(self, entries: torch.Tensor, record: torch.Tensor) -> int:
        """Take a forward's new ``entries`` and the pools of its state record ``record``; returns how many entries."""
        advanced = CompressorState.of_record(entries, record)
        self.entries = torch.cat([self.entries, entries])
        self.current, self.next_half, self.previous_half = advanced.current, advanced.next_half, advanced.previous_half
        return entries.shape[0]

    def clone(self) -> CompressorState:
        return CompressorState(
            self.entries.clone(),
            self.current.clone(),
            self.next_half.clone() if self.next_half is not None else None,
            self.previous_half.clone() if self.previous_half is not None else None,
        )

    @property
    def online_nbytes(self) -> int:
        """Bytes of the partial-block state (everything but the entries)."""
        pools = (self.current, self.next_half, self.previous_half)
        return sum(p.nbytes for p in pools if p is not None)


@dataclass(frozen=True)
class BlockTargets:
    """The pools one compressor computes over a forward of one or more requests (batch indices).

    A target pools positions ``lo .. hi - 1`` of one request (all inside one block), merged with
    the request's partial block from its state record where ``merges_record``. The first
    ``touched`` targets are the blocks the forward touches, request by request (the entries of
    the complete ones; the last one of a request gives its new state); then one per snapshot
    (the state at the snapshot's position).
    """

    tokens: torch.Tensor  # [targets, width]: forward row of each pooled position
    valid: torch.Tensor  # [targets, width]
    ape_slots: torch.Tensor  # [targets, width]: position % ratio
    request: torch.Tensor  # [targets]: batch index
    merges_record: torch.Tensor  # [targets]
    previous_target: torch.Tensor  # [targets]: target pooling the block before (-1: in the record)
    previous_in_record: torch.Tensor  # [targets]: the record's previous half exists (block > 0)
    touched: int
    entry_positions: torch.Tensor  # [touched]: the block's first position (its entry's rope)
    last_target: torch.Tensor  # [requests]: the touched target of each request's last block
    ends_block: torch.Tensor  # [requests]: the forward ends exactly at a block end

    @staticmethod
    def of(
        starts: torch.Tensor,
        lengths: torch.Tensor,
        offsets: torch.Tensor,
        snapshots: tuple[torch.Tensor, torch.Tensor],
        ratio: int,
        *,
        touched: int,
        width: int,
        per_request: int | None = None,
    ) -> BlockTargets:
        """The targets of requests running positions ``starts[i] .. starts[i] + lengths[i] - 1`` from forward
        row ``offsets[i]``, with snapshots ``(batch index, position)`` (``touched``: the blocks they touch,
        ``width``: the most positions a target pools, host values).

        With ``per_request`` every request has that many touched targets, whatever its positions (shapes that
        depend on the batch size only, for a CUDA graph): those past a request's last block repeat it, and
        are not its last target (so nothing takes their pool as an entry or a state)."""
        ends = starts + lengths
        device = starts.device
        first_block = starts // ratio
        counts = (ends - 1) // ratio - first_block + 1
        requests = torch.arange(len(starts), device=device)
        if per_request is None:
            request = torch.repeat_interleave(requests, counts, output_size=touched)
            first_target = torch.cumsum(counts, 0) - counts
        else:
            request = torch.repeat_interleave(requests, per_request, output_size=touched)
            first_target = requests * per_request
        in_request = torch.arange(touched, device=device) - first_target[request]
        block = first_block[request] + torch.minimum(in_request, counts[request] - 1)
        lo = torch.maximum(starts[request], block * ratio)
        hi = torch.minimum(ends[request], (block + 1) * ratio)
        previous = torch.where(
            block > first_block[request], first_target[request] + block - 1 - first_block[request], -1
        )

        snap_request, snap_position = snapshots
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
        pooled = all_lo[:, None] + torch.arange(width, device=device)
        valid = pooled < all_hi[:, None]
        rows = offsets[all_request, None] + pooled - starts[all_request, None]
        return BlockTargets(
            tokens=torch.where(valid, rows, 0),
            valid=valid,
            ape_slots=pooled % ratio,
            request=all_request,
            merges_record=(all_block == first_block[all_request]) & (starts[all_request] % ratio > 0),
            previous_target=torch.cat([previous, snap_previous]),
            previous_in_record=all_block > 0,
            touched=touched,
            entry_positions=block * ratio,
            last_target=first_target + counts - 1,
            ends_block=ends % ratio == 0,
        )

    @staticmethod
    def of_chunk(start: int, length: int, ratio: int, device: torch.device) -> BlockTargets:
        """The targets of one request running positions ``start .. start + length - 1``, no snapshot."""
        starts, lengths, offsets = torch.tensor([[start], [length], [0]], device=device)
        none = torch.zeros(0, dtype=torch.int64, device=device)
        touched = (start + length - 1) // ratio - start // ratio + 1
        return BlockTargets.of(starts, lengths, offsets, (none, none), ratio, touched=touched, width=min(ratio, length))


@dataclass(frozen=True)
class PooledBlocks:
    """What :meth:`Compressor.pool_blocks` computes: the touched blocks' entries (normed and roped; those of
    incomplete blocks unused), and the state records after the forward and at each snapshot."""

    entries: torch.Tensor  # [touched, dim]
    state: torch.Tensor  # [requests, pools, 3, dim]
    snapshots: torch.Tensor  # [snapshots, pools, 3, dim]


class Compressor(nn.Module):
    """Compresses blocks of ``ratio`` tokens into entries of ``dim`` channels (release names)."""

    def __init__(self, hidden_size: int, dim: int, ratio: int, overlapping: bool, rotary: Rotary, eps: float):
        super().__init__()
        self.dim = dim
        self.ratio = ratio
        self.overlapping = overlapping
        self.rotary = rotary
        series = 2 if overlapping else 1
        self.wkv = nn.Linear(hidden_size, series * dim, bias=False)
        self.wgate = nn.Linear(hidden_size, series * dim, bias=False)
        self.ape = nn.Parameter(torch.zeros(ratio, series * dim))
        self.norm = RMSNorm(dim, eps)

    def new_state(self, dtype: torch.dtype, device: torch.device | str) -> CompressorState:
        half = SoftmaxPool.empty((self.dim,), device) if self.overlapping else None
        return CompressorState(
            entries=torch.zeros(0, self.dim, dtype=dtype, device=device),
            current=SoftmaxPool.empty((self.dim,), device),
            next_half=half,
            previous_half=half.clone() if half is not None else None,
        )

    def advance(self, x: torch.Tensor, start: int, state: CompressorState) -> int:
        """Feed tokens ``start .. start + len(x) - 1`` (``x`` is ``[L, hidden]``).

        Appends the entries of the blocks this completes to ``state.entries`` and
        returns how many were appended. On CUDA a Triton kernel pools the blocks
        (:func:`sglang_dsv4.kernels.dispatch.compress_chunk`), elsewhere :meth:`pool_chunk`.
        """
        record = state.record()[None]
        return state.append(compress_chunk(self, self.wkv(x), self.wgate(x), start, record), record[0])

    def pool_reference(self, kv: torch.Tensor, gate: torch.Tensor, start: int, state: CompressorState) -> int:
        """:meth:`advance` in torch, from the projections ``kv = wkv(x)`` and ``gate = wgate(x)``."""
        record = state.record()[None]
        return state.append(self.pool_chunk(kv, gate, start, record), record[0])

    def pool_chunk(self, kv: torch.Tensor, gate: torch.Tensor, start: int, record: torch.Tensor) -> torch.Tensor:
        """One request's tokens ``start .. start + len(kv) - 1`` from their projections, its state record
        ``record [1, pools, 3, dim]`` advanced in place: the entries of the blocks they complete."""
        targets = BlockTargets.of_chunk(start, kv.shape[0], self.ratio, kv.device)
        pooled = self.pool_blocks(kv, gate, targets, record)
        record.copy_(pooled.state)
        return pooled.entries[: (start + kv.shape[0]) // self.ratio - start // self.ratio]

    def pool_one_token_each(
        self, kv: torch.Tensor, gate: torch.Tensor, targets: BlockTargets, records: torch.Tensor, rows: torch.Tensor
    ) -> torch.Tensor:
        """One token per request (its projections ``kv``, ``gate`` ``[requests, series * dim]``), the requests'
        state records ``records[rows]`` advanced in place: each request's entry (unused where its block is
        incomplete)."""
        pooled = self.pool_blocks(kv, gate, targets, records[rows])
        records.index_copy_(0, rows, pooled.state)
        return pooled.entries

    def pool_blocks(
        self, kv: torch.Tensor, gate: torch.Tensor, targets: BlockTargets, records: torch.Tensor
    ) -> PooledBlocks:
        """Every target's pool from the forward's projections ``kv``, ``gate`` ``[tokens, series * dim]`` and the
        requests' state records ``records [requests, pools, 3, dim]`` (a pool the targets say is absent is not
        read: a record is never reset)."""
        dim, touched = self.dim, targets.touched
        logits = (gate[targets.tokens] + self.ape[targets.ape_slots]).masked_fill(
            ~targets.valid[..., None], float("-inf")
        )
        pooled = SoftmaxPool.of_slots(kv[targets.tokens], logits)  # [targets, series * dim]
        record = records[targets.request]
        series = pooled.max.shape[-1]
        later = pooled.channels(slice(series - dim, series)).merge(_record_pool(record, 0, targets.merges_record))
        if self.overlapping:
            earlier = pooled.channels(slice(0, dim)).merge(_record_pool(record, 1, targets.merges_record))
            in_record = _record_pool(record, 2, targets.previous_in_record)
            previous = _where(targets.previous_target >= 0, earlier[targets.previous_target.clamp(min=0)], in_record)
            entry_pools = previous[:touched].merge(later[:touched])
        else:
            entry_pools = later[:touched]
        entries = self.norm(entry_pools.value().to(kv.dtype))
        cos, sin = self.rotary.cos_sin(targets.entry_positions)

        last, ends_block = targets.last_target, targets.ends_block
        empty = SoftmaxPool.empty((len(last), dim), kv.device)
        snapshots = slice(touched, None)
        if self.overlapping:
            final = [
                _where(ends_block, empty, later[last]),
                _where(ends_block, empty, earlier[last]),
                _where(ends_block, earlier[last], previous[last]),
            ]
            at_snapshots = [later[snapshots], earlier[snapshots], previous[snapshots]]
        else:
            final = [_where(ends_block, empty, later[last])]
            at_snapshots = [later[snapshots]]
        return PooledBlocks(apply_rope(entries, cos, sin), as_record(final), as_record(at_snapshots))


def _record_pool(record: torch.Tensor, pool: int, present: torch.Tensor) -> SoftmaxPool:
    """Pool ``pool`` of state records ``[n, pools, 3, dim]`` where ``present``, an empty pool elsewhere
    (whatever the record holds there: a row's record is never reset)."""
    stored, present = record_pools(record)[pool], present[:, None]
    return SoftmaxPool(
        torch.where(present, stored.max, float("-inf")),
        torch.where(present, stored.denom, 0.0),
        torch.where(present, stored.weighted, 0.0),
    )


def _where(condition: torch.Tensor, a: SoftmaxPool, b: SoftmaxPool) -> SoftmaxPool:
    condition = condition[:, None]
    return SoftmaxPool(
        torch.where(condition, a.max, b.max),
        torch.where(condition, a.denom, b.denom),
        torch.where(condition, a.weighted, b.weighted),
    )
