"""The V4 pool keeps exactly the network's per-request state: load/store round trips."""

from __future__ import annotations

import torch
from conftest import random_ids

from sglang_dsv4.memory_pool.pool import V4KVPool
from sglang_dsv4.model.state import RequestState


def run_through_pool(model, pool: V4KVPool, request: int, ids: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """Logits of ``ids`` fed in ``chunks``, the state living in the pool between chunks."""
    logits, start = [], 0
    for length in chunks:
        end = start + length
        pool.block_tables.alloc_to_lengths(
            req_pool_indices_cpu=torch.tensor([request]), target_seq_lens_cpu=torch.tensor([end])
        )
        layers = [pool.load(layer, request, start, torch.float32) for layer in range(model.config.num_layers)]
        state = RequestState(start, layers)
        logits.append(model(ids[start:end], state))
        for layer, layer_state in enumerate(state.layers):
            pool.store(layer, request, start, end, layer_state)
        start = end
    return torch.cat(logits)


def test_state_resumed_from_the_pool_equals_the_networks_own(tiny_model):
    ids = random_ids(300, tiny_model.config.vocab_size, seed=80)
    pool = V4KVPool(1024, 1, tiny_model.config, torch.float32, max_requests=4, max_context=1024, device="cpu")
    chunks = [130, 1, 1, 97, 71]  # ends inside ratio-4 and ratio-128 blocks
    through_pool = run_through_pool(tiny_model, pool, 3, ids, chunks)
    assert (through_pool - tiny_model(ids, tiny_model.new_state())).abs().max() <= 1e-4


def test_a_reused_request_row_starts_from_an_empty_state(tiny_model):
    pool = V4KVPool(1024, 1, tiny_model.config, torch.float32, max_requests=2, max_context=1024, device="cpu")
    first, second = random_ids(200, 1024, seed=81), random_ids(150, 1024, seed=82)
    run_through_pool(tiny_model, pool, 1, first, [200])
    pool.block_tables.free(1)
    reused = run_through_pool(tiny_model, pool, 1, second, [150])
    assert (reused - tiny_model(second, tiny_model.new_state())).abs().max() <= 1e-4


def test_freeing_a_request_returns_its_entry_rows(tiny_model):
    pool = V4KVPool(1024, 1, tiny_model.config, torch.float32, max_requests=2, max_context=1024, device="cpu")
    before = pool.block_tables.usage()
    run_through_pool(tiny_model, pool, 2, random_ids(300, 1024, seed=83), [300])
    held = pool.block_tables.usage()
    assert held["ratio_4"]["free"] == before["ratio_4"]["free"] - 75
    assert held["ratio_128"]["free"] == before["ratio_128"]["free"] - 2
    pool.block_tables.free(2)
    assert pool.block_tables.usage() == before


def test_bfloat16_pool_stores_bfloat16_and_keeps_the_greedy_choices(tiny_model):
    ids = random_ids(300, tiny_model.config.vocab_size, seed=84)
    pool = V4KVPool(1024, 1, tiny_model.config, torch.bfloat16, max_requests=2, max_context=1024, device="cpu")
    assert pool.window[0].dtype == torch.bfloat16 and all(b.dtype == torch.bfloat16 for b in pool.compressed.values())
    through_pool = run_through_pool(tiny_model, pool, 1, ids, [150, 150])
    exact = tiny_model(ids, tiny_model.new_state())
    assert (through_pool[:150] - exact[:150]).abs().max() <= 1e-4  # the first chunk reads nothing back
    later = slice(150, None)  # reads the window and entries back, rounded to bfloat16
    assert (through_pool[later] - exact[later]).abs().max() > 1e-3
    assert (through_pool[later].argmax(-1) == exact[later].argmax(-1)).float().mean() >= 0.95
