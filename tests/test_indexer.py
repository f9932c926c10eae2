"""The lightning indexer against HF's indexer module, and that its selection matters."""

from __future__ import annotations

import torch
from conftest import random_ids

from sglang_dsv4.model.rope import ForwardRope


def test_indexer_selects_the_same_entries_as_hf_indexer(tiny_model, hf_tiny):
    layer = next(i for i in range(tiny_model.config.num_layers) if tiny_model.config.layer_kind(i) == "csa")
    ours = tiny_model.layers[layer].attn
    theirs = hf_tiny.model.layers[layer].self_attn.compressor.indexer
    generator = torch.Generator().manual_seed(20)
    length, hidden = 600, tiny_model.config.hidden_size
    x = torch.randn(length, hidden, generator=generator)
    q_residual = torch.randn(length, tiny_model.config.q_lora_rank, generator=generator)
    positions = torch.arange(length)

    state = ours.new_state(torch.float32, "cpu").indexer
    ours.indexer.compressor.advance(x, 0, state)
    visible = torch.arange(state.entries.shape[0])[None, :] < ((positions + 1) // 4)[:, None]
    selected = ours.indexer.select(x, q_residual, ForwardRope.at(positions, (ours.rotary,)), state, visible)

    with torch.no_grad():
        hf_top = theirs(x[None], q_residual[None], positions[None], None, layer)[0]
    hf_selected = torch.zeros_like(selected)
    valid = hf_top >= 0
    rows = torch.arange(length)[:, None].expand_as(hf_top)
    hf_selected[rows[valid], hf_top[valid]] = True

    assert visible.sum(-1).max() > ours.indexer.topk  # late queries see more than top-k
    assert torch.equal(selected, hf_selected)


def test_selection_changes_the_logits(tiny_model):
    ids = random_ids(600, tiny_model.config.vocab_size, seed=21)
    selective = tiny_model(ids, tiny_model.new_state())
    indexers = [b.attn.indexer for b in tiny_model.layers if b.attn.indexer is not None]
    saved = [ix.topk for ix in indexers]
    try:
        for ix in indexers:
            ix.topk = 10**9  # every visible entry
        everything = tiny_model(ids, tiny_model.new_state())
    finally:
        for ix, k in zip(indexers, saved, strict=True):
            ix.topk = k
    late = slice(4 * 4 * saved[0], None)  # positions with more visible entries than top-k
    assert (selective[late] - everything[late]).abs().max() > 1e-2


def test_indexer_takes_the_earliest_of_tied_keys_as_the_served_top_k_does(tiny_model):
    """Keys that tie (here all: zero keys score exactly 0): the network's selection, the oracle of the served
    path, takes the earliest visible ones, as the served top-k (:func:`streamed_top_k`, whole-row Triton) does."""
    from sglang_dsv4.kernels.sparse_torch import streamed_top_k

    layer = next(i for i in range(tiny_model.config.num_layers) if tiny_model.config.layer_kind(i) == "csa")
    indexer = tiny_model.layers[layer].attn.indexer
    generator = torch.Generator().manual_seed(22)
    length, entries = 3, 3 * indexer.topk
    x = torch.randn(length, tiny_model.config.hidden_size, generator=generator)
    q_residual = torch.randn(length, tiny_model.config.q_lora_rank, generator=generator)
    positions = torch.tensor([4 * entries - 9, 4 * entries - 5, 4 * entries - 1])
    keys = torch.zeros(entries, indexer.head_dim)
    visible = torch.arange(entries)[None, :] < ((positions + 1) // 4)[:, None]

    rope = ForwardRope.at(positions, (indexer.rotary,))
    selected = indexer.select_reference(x, q_residual, rope, keys, visible)

    earliest = torch.arange(entries)[None, :] < indexer.topk
    assert torch.equal(selected, earliest.expand(length, -1))
    q, head_weights = indexer.queries(x, q_residual, rope)
    table, lengths = torch.arange(entries)[None], visible.sum(-1, dtype=torch.int32)
    served = streamed_top_k(q, head_weights, keys, table, torch.zeros(length, dtype=torch.long), lengths,
                            indexer.topk, scale=indexer.head_dim**-0.5)  # fmt: skip
    assert all(sorted(row.tolist()) == list(range(indexer.topk)) for row in served)
