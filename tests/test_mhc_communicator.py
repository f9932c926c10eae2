"""mHC with the residual sharded by tokens under TP equals the all-reduce path (two gloo ranks on the CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sglang_dsv4.config import parse_config
from sglang_dsv4.launch import free_port
from sglang_dsv4.model.mhc import HyperConnection
from sglang_dsv4.model.mhc_communicator import (
    TokenShards,
    all_gather_tokens,
    replicated_post_pre,
    sharded_post_pre,
)
from sglang_dsv4.model.norms import RMSNorm
from sglang_dsv4.tiny import TINY_CONFIG

RANKS = 2
SUBLAYERS = 3


def random_sublayer(config, seed: int) -> tuple[HyperConnection, RMSNorm]:
    generator = torch.Generator().manual_seed(seed)
    hc, norm = HyperConnection(config), RMSNorm(config.hidden_size, config.rms_norm_eps)
    with torch.no_grad():
        for param in [*hc.parameters(), norm.weight]:
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5 + (1 if param is norm.weight else 0))
    return hc, norm


@torch.no_grad()
def compare_on_ranks(rank: int, port: int, tokens: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS)
    try:
        config = parse_config(TINY_CONFIG)
        sublayers = [random_sublayer(config, seed) for seed in range(SUBLAYERS + 1)]
        generator = torch.Generator().manual_seed(100)
        streams = torch.randn(tokens, config.hc_mult, config.hidden_size, generator=generator)
        _, post, comb = sublayers[0][0].pre(streams)
        shards = TokenShards(tokens, RANKS, rank)
        full = (streams, post, comb)
        shard = tuple(shards.take(t) for t in full)
        for layer in range(1, SUBLAYERS + 1):
            # Each rank's own partial sum of the sublayer output (its heads' share).
            partial = torch.randn(
                tokens, config.hidden_size, generator=torch.Generator().manual_seed(10 * layer + rank)
            )
            hc, norm = sublayers[layer]
            streams, x_all, post, comb = replicated_post_pre(partial, *full, hc, norm, dist.group.WORLD)
            full = (streams, post, comb)
            streams_r, x_sharded, post_r, comb_r = sharded_post_pre(partial, *shard, hc, norm, shards, dist.group.WORLD)
            shard = (streams_r, post_r, comb_r)
            torch.testing.assert_close(x_sharded, x_all, rtol=1e-5, atol=1e-6)
            for gathered, expected in zip((all_gather_tokens(t, shards, dist.group.WORLD) for t in shard), full):
                torch.testing.assert_close(gathered, expected, rtol=1e-5, atol=1e-6)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tokens", [1, 3, 8], ids=["fewer-than-ranks", "not-divisible", "divisible"])
def test_token_sharded_mhc_equals_all_reduce_then_full_mhc(tokens):
    mp.spawn(compare_on_ranks, args=(free_port(), tokens), nprocs=RANKS)


def test_shards_pad_to_whole_rows_and_cover_every_token_once():
    rows = torch.arange(5.0)[:, None]
    shards = [TokenShards(5, 4, rank) for rank in range(4)]
    assert [s.per_rank for s in shards] == [2] * 4 and shards[0].padded == 8
    assert torch.cat([s.take(rows) for s in shards])[:5].equal(rows)
    assert torch.cat([s.take(rows) for s in shards])[5:].eq(0).all()
