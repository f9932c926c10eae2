"""The per-request state: snapshot/restore and the size of the online compressor state."""

from __future__ import annotations

import pytest
import torch
from conftest import random_ids

from sglang_dsv4.model.state import online_state_floats, state_nbytes


def test_restored_snapshot_continues_exactly(tiny_model):
    ids = random_ids(460, tiny_model.config.vocab_size, seed=10)
    position = 301  # neither a multiple of 4 nor of 128
    state = tiny_model.new_state()
    tiny_model(ids[:position], state)
    snapshot = state.snapshot()
    uninterrupted = torch.cat(
        [tiny_model(ids[position:450], state)] + [tiny_model(ids[i : i + 1], state) for i in range(450, 460)]
    )

    fresh = tiny_model.restore(snapshot)
    resumed = torch.cat(
        [tiny_model(ids[position:450], fresh)] + [tiny_model(ids[i : i + 1], fresh) for i in range(450, 460)]
    )
    assert (resumed - uninterrupted).abs().max().item() <= 1e-5
    # The snapshot itself was not advanced: it can be restored again.
    assert snapshot.position == position


def test_snapshot_is_detached_from_the_running_state(tiny_model):
    state = tiny_model.new_state()
    tiny_model(random_ids(10, tiny_model.config.vocab_size, seed=11), state)
    snapshot = state.snapshot()
    before = snapshot.layers[1].window.clone()
    tiny_model(random_ids(5, tiny_model.config.vocab_size, seed=12), state)
    assert snapshot.position == 10 and torch.equal(snapshot.layers[1].window, before)


def test_compressor_state_bytes_match_online_formula_at_every_partial_length(tiny_model):
    config = tiny_model.config
    expected = 4 * online_state_floats(config)
    # 3 floats per channel for a ratio-128 layer; 3 pools x 3 floats for each ratio-4 compressor.
    assert online_state_floats(config) == sum(
        3 * config.head_dim if kind == "hca" else 9 * (config.head_dim + config.index_head_dim) if kind == "csa" else 0
        for kind in map(config.layer_kind, range(config.num_layers))
    )
    state = tiny_model.new_state()
    ids = random_ids(config.hca_rate + 6, config.vocab_size, seed=13)
    assert state.compressor_state_nbytes == expected
    for i in range(len(ids)):  # every partial length of a ratio-128 block, and past it
        tiny_model(ids[i : i + 1], state)
        assert state.compressor_state_nbytes == expected, f"at position {state.position}"


def test_state_bytes_follow_the_position_formula(tiny_model):
    config = tiny_model.config
    state = tiny_model.new_state()
    tiny_model(random_ids(1000, config.vocab_size, seed=14), state)
    assert state.nbytes == state_nbytes(config, 1000, kv_bytes=4)


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        (torch.tensor([], dtype=torch.long), "non-empty"),
        (torch.zeros(2, 3, dtype=torch.long), "1-D"),
        (torch.tensor([5, 1024]), "token ids must be in [0, 1024); got min 5, max 1024"),
        (torch.tensor([-1, 3]), "got min -1"),
    ],
)
def test_bad_input_ids_are_refused_and_leave_the_state_alone(tiny_model, ids, message):
    state = tiny_model.new_state()
    with pytest.raises(ValueError) as error:
        tiny_model(ids, state)
    assert message in str(error.value) and state.position == 0


def test_bfloat16_model_runs_with_float32_compressor_state(tiny_path):
    from sglang_dsv4 import load_model

    model = load_model(tiny_path, dtype=torch.bfloat16)
    state = model.new_state()
    logits = model(random_ids(140, model.config.vocab_size, seed=15), state)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    assert state.layers[2].compressor.entries.dtype == torch.bfloat16
    assert state.layers[2].compressor.current.max.dtype == torch.float32
