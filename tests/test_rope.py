"""A forward's rope tables (``model/rope.py`` :class:`ForwardRope`): each flavour's ``cos, sin`` once a forward,
bitwise what each layer computed for itself before (:meth:`Rotary.cos_sin`), and the batched core's layers reading
them from the forward's index instead of computing their own."""

from __future__ import annotations

import pytest
import torch

from sglang_dsv4.attention_backend import batched
from sglang_dsv4.config import named_config
from sglang_dsv4.model.compressor import Compressor
from sglang_dsv4.model.rope import ForwardRope, Rotary, model_rotaries


@pytest.mark.parametrize("model", ["flash", "pro"])
def test_a_forwards_tables_equal_each_flavours_own_bitwise(model):
    """At the shipped configs' flavours (plain rope; YaRN at the compressed layers' theta), positions to 1M."""
    config = named_config(model)
    positions = torch.tensor([0, 1, 127, 4_095, 131_071, 1_048_575])
    rope = ForwardRope.of_model(positions, config)
    plain, compressed = model_rotaries(config)
    assert plain.flavour != compressed.flavour
    for rotary in (plain, compressed):
        expected = rotary.cos_sin(positions)
        for table, value in zip(rope.cos_sin(rotary), expected, strict=True):
            assert torch.equal(table, value)


def test_layers_of_equal_rope_parameters_share_one_table_and_others_have_none():
    """Tables are keyed by the rope's parameters, not by the object: a layer's own ``Rotary`` of the model's
    parameters reads the model's table; a rope the forward did not compute is an error, not a silent recompute."""
    config = named_config("flash")
    positions = torch.arange(5, 9)
    rope = ForwardRope.of_model(positions, config)
    same = Rotary(config.rope_head_dim, config.compress_rope_theta, config.yarn)
    assert rope.cos_sin(same)[0] is rope.cos_sin(model_rotaries(config)[1])[0]
    with pytest.raises(KeyError, match="no rope table"):
        rope.cos_sin(Rotary(config.rope_head_dim, 5000.0, None))


def test_rewritten_tables_keep_their_tensors_and_hold_the_new_positions():
    """What a CUDA graph's decode index does each replay: the same tensors, the tables of the new positions."""
    config = named_config("pro")
    rope = ForwardRope.of_model(torch.tensor([3, 40]), config)
    before = {flavour: (table.cos.data_ptr(), table.sin.data_ptr()) for flavour, table in rope.tables.items()}
    positions = torch.tensor([70_000, 9])
    rope.rewrite(positions, model_rotaries(config))
    for rotary in model_rotaries(config):
        table = rope.tables[rotary.flavour]
        assert (table.cos.data_ptr(), table.sin.data_ptr()) == before[rotary.flavour]
        assert all(torch.equal(a, b) for a, b in zip(rope.cos_sin(rotary), rotary.cos_sin(positions), strict=True))


def test_a_batched_forward_computes_each_flavour_once_and_no_layer_computes_its_own(tiny_model, monkeypatch):
    """The index build computes the model's two flavours at the tokens' positions; every layer (window, ratio 4 with
    its indexer, ratio 128) reads them, prefill and decode alike: no layer computes a table but its compressors'
    torch path, which ropes each entry at its block's first position."""
    from test_batched_backend import TwoBackends

    tables, pooled = [], []
    cos_sin, pool_blocks = Rotary.cos_sin, Compressor.pool_blocks
    monkeypatch.setattr(Rotary, "cos_sin", lambda self, at: tables.append(self.flavour) or cos_sin(self, at))
    monkeypatch.setattr(Compressor, "pool_blocks", lambda self, *a: pooled.append(self) or pool_blocks(self, *a))
    config = tiny_model.config
    assert {config.layer_kind(i) for i in range(config.num_layers)} == {"window", "csa", "hca"}
    pool = TwoBackends(tiny_model).pools[1]
    for row in (1, 2):
        pool.storage.tables.bind(row)
    for starts, lengths in (([0, 0], [9, 300]), ([9, 300], [1, 1])):  # a prefill, then a decode step
        for row, start, length in zip([1, 2], starts, lengths, strict=True):
            pool.manager.reserve(row, start + length)
        index = batched.build_index(batched.BatchPlan([1, 2], starts, lengths), pool.storage.tables, config, "cpu")
        assert sorted(map(str, tables)) == sorted(str(r.flavour) for r in model_rotaries(config))
        tables.clear()
        x = torch.randn(sum(lengths), config.hidden_size)
        with torch.no_grad():
            for layer, block in enumerate(tiny_model.layers):
                batched.attend(block.attn, layer, x, index, pool.storage)
        assert pooled and len(tables) == len(pooled)
        tables.clear()
        pooled.clear()
