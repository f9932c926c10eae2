"""The V4 pool keeps exactly the network's per-request state: load/store round trips."""

from __future__ import annotations

import torch
from conftest import random_ids

from sglang_dsv4.memory_pool.pool import V4KVPool
from sglang_dsv4.model.state import RequestState


def run_through_pool(model, pool: V4KVPool, request: int, ids: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """Logits of ``ids`` fed in ``chunks``, the state living in the pool between chunks."""
    logits, start = [], pool.tables.position[request]
    if not pool.tables.bound[request]:
        pool.start(request)
    for length in chunks:
        end = start + length
        pool.tables.reserve(request, end)
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
    pool.tables.free(1)
    reused = run_through_pool(tiny_model, pool, 1, second, [150])
    assert (reused - tiny_model(second, tiny_model.new_state())).abs().max() <= 1e-4


def test_freeing_a_request_returns_its_entry_rows(tiny_model):
    pool = V4KVPool(1024, 1, tiny_model.config, torch.float32, max_requests=2, max_context=1024, device="cpu")
    before = pool.usage()
    run_through_pool(tiny_model, pool, 2, random_ids(300, 1024, seed=83), [300])
    held = pool.usage()
    assert held["ratio_4_entries"]["free"] == before["ratio_4_entries"]["free"] - 75
    assert held["ratio_128_entries"]["free"] == before["ratio_128_entries"]["free"] - 2
    window = tiny_model.config.sliding_window
    assert held["window_slots"]["free"] == before["window_slots"]["free"] - (window + 1)
    pool.tables.free(2)
    assert pool.usage() == before


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


def test_a_checkpoint_resumes_exactly_on_another_row(tiny_model):
    ids = random_ids(400, tiny_model.config.vocab_size, seed=85)
    pool = V4KVPool(2048, 1, tiny_model.config, torch.float32, max_requests=4, max_context=1024, device="cpu")
    run_through_pool(tiny_model, pool, 1, ids, [130, 67])  # 197: inside a ratio-4 and a ratio-128 block
    slots = torch.arange(1, 198)  # the token slots a prefix cache would hold for them
    pool.commit_entries(1, slots, 0, 197)
    checkpoint = pool.checkpoint(1, 197)
    pool.tables.free(1)  # the checkpoint and the slots keep what they point at
    pool.resume(2, checkpoint, slots)
    resumed = run_through_pool(tiny_model, pool, 2, ids[:400], [203])
    cold = tiny_model(ids, tiny_model.new_state())
    assert (resumed - cold[197:]).abs().max() <= 1e-4


def test_a_checkpoint_one_decode_step_late_uses_the_state_before_it(tiny_model):
    # SGLang's overlap scheduler runs the next decode step before it checkpoints this one.
    ids = random_ids(300, tiny_model.config.vocab_size, seed=86)
    pool = V4KVPool(2048, 1, tiny_model.config, torch.float32, max_requests=4, max_context=1024, device="cpu")
    run_through_pool(tiny_model, pool, 1, ids, [259, 1])
    slots = torch.arange(1, 260)
    pool.commit_entries(1, slots, 0, 259)
    checkpoint = pool.checkpoint(1, 259)
    pool.resume(3, checkpoint, slots)
    resumed = run_through_pool(tiny_model, pool, 3, ids, [41])
    assert (resumed - tiny_model(ids, tiny_model.new_state())[259:]).abs().max() <= 1e-4


def test_checkpoints_and_requests_return_every_row_they_shared(tiny_model):
    pool = V4KVPool(2048, 1, tiny_model.config, torch.float32, max_requests=4, max_context=1024, device="cpu")
    before = pool.usage()
    ids = random_ids(300, tiny_model.config.vocab_size, seed=87)
    run_through_pool(tiny_model, pool, 1, ids, [200])
    slots = torch.arange(1, 201)
    pool.commit_entries(1, slots, 0, 200)
    checkpoint = pool.checkpoint(1, 200)
    pool.resume(2, checkpoint, slots)
    run_through_pool(tiny_model, pool, 2, ids, [100])
    pool.tables.free(1)
    pool.release(checkpoint)
    pool.release_slots(slots)
    assert pool.usage() != before  # row 2 still holds the shared entries
    pool.tables.free(2)
    assert pool.usage() == before
