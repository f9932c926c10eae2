"""mHC under tensor parallelism: the residual streams sharded by tokens between sublayers.

Under TP a sublayer's output leaves each rank as a partial sum (its heads' share of
``wo_b``, its slice of the expert intermediate). The plain way all-reduces it, and every
rank then runs the same mHC post + next pre + RMSNorm over the whole batch on a full copy
of the ``[tokens, hc_mult, hidden]`` streams. Here instead (:func:`sharded_post_pre`)::

    output_r   = reduce_scatter(partial)[tokens of rank r]          # the sums of my tokens only
    streams_r, x_r, post_r, comb_r = post_pre(output_r, streams_r)  # mHC on my tokens only
    x          = all_gather(x_r)                                    # the next sublayer's input

A reduce-scatter plus an all-gather move what one all-reduce moves (NCCL's ring
all-reduce is those two), while the mHC pass and the four-stream residual shrink to
``1 / tp`` per rank; only the normed ``[tokens, hidden]`` input crosses ranks again. Token
counts that ``tp`` does not divide are padded with zero rows, which the mHC maps to zeros
and the gather drops. :func:`replicated_post_pre` is the all-reduce path, the oracle.

Imports no SGLang: ``group`` is any ``torch.distributed`` process group (SGLang's TP group's
``device_group``, or gloo / NCCL directly in tests and benchmarks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..kernels.dispatch import mhc_post, mhc_post_pre, mhc_pre
from .mhc import HyperConnection
from .norms import RMSNorm


@dataclass(frozen=True)
class TokenShards:
    """Rank ``rank`` of ``ranks`` holds tokens ``[rank * per_rank, (rank + 1) * per_rank)`` of the padded batch."""

    tokens: int
    ranks: int
    rank: int

    @property
    def per_rank(self) -> int:
        return -(-self.tokens // self.ranks)

    @property
    def padded(self) -> int:
        return self.per_rank * self.ranks

    def pad(self, full: torch.Tensor) -> torch.Tensor:
        """``full`` with zero rows appended up to a whole number of shards."""
        missing = self.padded - full.shape[0]
        return full if missing == 0 else torch.cat([full, full.new_zeros(missing, *full.shape[1:])])

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of ``full`` (every token), padding included."""
        start = self.rank * self.per_rank
        return self.pad(full)[start : start + self.per_rank]


def reduce_scatter_tokens(partial: torch.Tensor, shards: TokenShards, group: dist.ProcessGroup) -> torch.Tensor:
    """The sum over ranks of ``partial [tokens, ...]``, this rank's token rows only."""
    out = partial.new_empty(shards.per_rank, *partial.shape[1:])
    dist.reduce_scatter_tensor(out, shards.pad(partial).contiguous(), group=group)
    return out


def all_gather_tokens(shard: torch.Tensor, shards: TokenShards, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's ``shard`` stacked in token order, padding dropped: ``[tokens, ...]``."""
    out = shard.new_empty(shards.padded, *shard.shape[1:])
    dist.all_gather_into_tensor(out, shard.contiguous(), group=group)
    return out[: shards.tokens]


def sharded_post_pre(
    partial: torch.Tensor,
    streams: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    next_hc: HyperConnection,
    next_norm: RMSNorm,
    shards: TokenShards,
    group: dist.ProcessGroup,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A sublayer's post and the next one's pre, on this rank's tokens.

    ``partial [tokens, hidden]``: this rank's partial sum of the sublayer output; ``streams,
    post, comb``: this rank's token shard. Returns ``(streams, post, comb)`` of the shard and
    the next sublayer's normed input ``x [tokens, hidden]`` for every token, as
    ``(streams, x, post, comb)``.
    """
    output = reduce_scatter_tokens(partial, shards, group)
    streams, x, post, comb = mhc_post_pre(output, streams, post, comb, next_hc, next_norm)
    return streams, all_gather_tokens(x, shards, group), post, comb


def replicated_post_pre(
    partial: torch.Tensor,
    streams: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    next_hc: HyperConnection,
    next_norm: RMSNorm,
    group: dist.ProcessGroup,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The all-reduce path: the whole batch's post and next pre on every rank, from full streams."""
    output = partial.clone()
    dist.all_reduce(output, group=group)
    return mhc_post_pre(output, streams, post, comb, next_hc, next_norm)


@dataclass(frozen=True)
class TokenShardedResidual:
    """The served network's residual under TP (:class:`~.network.Residual`): this rank holds its
    token shard of the streams; sublayer outputs arrive by reduce-scatter, the normed input
    leaves by all-gather (:func:`sharded_post_pre`)."""

    shards: TokenShards
    group: dist.ProcessGroup

    def pre(self, hc: HyperConnection, norm: RMSNorm, streams: torch.Tensor) -> tuple[torch.Tensor, ...]:
        shard = self.shards.take(streams)
        x, post, comb = mhc_pre(hc, norm, shard)
        return shard, self.gather(x), post, comb

    def post_pre(
        self,
        partial: torch.Tensor,
        streams: torch.Tensor,
        post: torch.Tensor,
        comb: torch.Tensor,
        next_hc: HyperConnection,
        next_norm: RMSNorm,
    ) -> tuple[torch.Tensor, ...]:
        return sharded_post_pre(partial, streams, post, comb, next_hc, next_norm, self.shards, self.group)

    def post(
        self, partial: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        return mhc_post(reduce_scatter_tokens(partial, self.shards, self.group), streams, post, comb)

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        return all_gather_tokens(rows, self.shards, self.group)
