"""What a prefill instance sends a decode instance for one request (issue 44), without servers: the transfer groups
moved byte for byte as the transfer engine moves them (address + row x row length), a decode pool continuing
from them exactly as the prefill pool does, the bytes equal to the ledger's, and the launch refusals.

The servers behind a router are in ``test_pd_server.py``.
"""

from __future__ import annotations

import ctypes
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import random_ids
from test_pool import run_through_pool

from sglang_dsv4.config import ConfigError
from sglang_dsv4.disaggregation import (
    LEGACY_TCP_FRAMING,
    _resolve_rows,
    check_disaggregation,
    mooncake_installed,
    use_legacy_tcp_framing,
)
from sglang_dsv4.kv_cache import RequestStateRows, V4KVPool
from sglang_dsv4.memory_pool.transfer import STATE, WINDOW, ratio_group


def new_pool(config, kv_dtype: torch.dtype) -> V4KVPool:
    return V4KVPool(2048, 1, config, kv_dtype, max_requests=4, max_context=2048, device="cpu")


def move_request_state(
    source: V4KVPool, source_row: int, target: V4KVPool, target_row: int, length: int, prefix: int = 0
) -> int:
    """Each group's rows of the request past the ``prefix`` the target holds, copied as the transfer engine copies
    them, from each buffer's address plus row x row length, on both sides' indices (the target's row bound by
    asking for them); the bytes moved."""
    sent = source.request_state_transfer_indices(source_row, length)
    received = target.request_state_transfer_indices(target_row, length)
    moved = 0
    for source_group, target_group in zip(source.transfer.groups, target.transfer.groups, strict=True):
        source_rows, target_rows = sent.rows(source_group.name, prefix), received.rows(target_group.name, prefix)
        assert len(source_rows) == len(target_rows)
        for (src, _, item), (dst, _, dst_item) in zip(
            zip(*source_group.buffer_infos(), strict=True), zip(*target_group.buffer_infos(), strict=True), strict=True
        ):
            assert item == dst_item
            for a, b in zip(source_rows.tolist(), target_rows.tolist(), strict=True):
                ctypes.memmove(dst + b * item, src + a * item, item)
                moved += item
    return moved


def continue_decoding(model, pool: V4KVPool, row: int, ids: torch.Tensor, start: int) -> torch.Tensor:
    """Logits of ``ids[start:]`` one token at a time from the row's state at ``start``."""
    return run_through_pool(model, pool, row, ids, [1] * (len(ids) - start))


@pytest.mark.parametrize("length", [5, 259, 333, 1000])
def test_a_decode_pool_continues_from_the_moved_state_exactly(tiny_model, length):
    ids = random_ids(length + 6, tiny_model.config.vocab_size, seed=440 + length)
    prefill, decode = new_pool(tiny_model.config, torch.float32), new_pool(tiny_model.config, torch.float32)
    chunks = [128] * (length // 128) + ([length % 128] if length % 128 else [])
    run_through_pool(tiny_model, prefill, 2, ids[:length], chunks)
    move_request_state(prefill, 2, decode, 3, length)
    on_decode = continue_decoding(tiny_model, decode, 3, ids, length)
    on_prefill = continue_decoding(tiny_model, prefill, 2, ids, length)
    assert torch.equal(on_decode, on_prefill)
    cold = tiny_model(ids, tiny_model.new_state())[length:]
    assert (on_decode - cold).abs().max() <= 1e-4


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("length", [1, 127, 128, 300, 1000])
def test_the_bytes_moved_are_the_ledgers_state_of_the_request(tiny_model, kv_dtype, length):
    prefill, decode = new_pool(tiny_model.config, kv_dtype), new_pool(tiny_model.config, kv_dtype)
    prefill.manager.start(1, length)
    assert move_request_state(prefill, 1, decode, 1, length) == prefill.storage.layout.state_bytes_at(length)


def test_the_window_group_moves_only_the_last_window(tiny_model):
    pool = new_pool(tiny_model.config, torch.float32)
    pool.manager.start(1, 1000)
    rows = pool.request_state_transfer_indices(1, 1000)
    window = tiny_model.config.sliding_window
    assert len(rows.rows(WINDOW, 0)) == window
    assert len(rows.rows(ratio_group(4), 0)) == 250 and len(rows.rows(ratio_group(128), 0)) == 7
    assert rows.rows(STATE, 0).tolist() == [1]


@pytest.mark.parametrize(("prefix", "length"), [(900, 1000), (990, 1000), (129, 1000), (255, 300), (0, 300)])
def test_past_the_decode_prefix_only_new_blocks_the_windows_new_rows_and_one_record_move(tiny_model, prefix, length):
    prefill, decode = new_pool(tiny_model.config, torch.float32), new_pool(tiny_model.config, torch.float32)
    prefill.manager.start(1, length)
    rows = prefill.request_state_transfer_indices(1, length)
    window = tiny_model.config.sliding_window
    assert len(rows.rows(WINDOW, prefix)) == length - max(prefix, length - window)
    assert len(rows.rows(ratio_group(4), prefix)) == length // 4 - prefix // 4
    assert len(rows.rows(ratio_group(128), prefix)) == length // 128 - prefix // 128
    assert rows.rows(STATE, prefix).tolist() == [1]
    assert move_request_state(prefill, 1, decode, 2, length, prefix) == prefill.storage.layout.state_bytes_past(
        prefix, length
    )


def test_a_decode_row_is_bound_and_reserved_once_and_returned_when_freed(tiny_model):
    pool = new_pool(tiny_model.config, torch.float32)
    free = pool.storage.usage()
    pool.request_state_transfer_indices(2, 333)
    again = pool.request_state_transfer_indices(2, 333)
    held = pool.storage.usage()
    assert held["ratio_4_entries"]["free"] == free["ratio_4_entries"]["free"] - 333 // 4
    assert again.rows(WINDOW, 0).tolist() == pool.storage.tables.window_rows(2, 333 - 128, 333).tolist()
    pool.manager.free(2)
    assert pool.storage.usage() == free


def test_each_component_resolves_to_its_own_group_whatever_order_sglang_asks_in(tiny_model):
    pool = new_pool(tiny_model.config, torch.float32)
    pool.manager.start(1, 300)
    names = [group.name for group in pool.transfer.groups]
    order = list(reversed(names))
    manager = SimpleNamespace(kv_args=SimpleNamespace(dsv4_groups={i + 1: name for i, name in enumerate(order)}))
    other = np.array([7, 8], dtype=np.int32)  # another pool's component before ours: left as it is
    asked = RequestStateRows(pool.transfer, 1, 300)
    resolved = _resolve_rows(manager, [other, *[asked] * len(order)], 0)
    assert resolved[0] is other
    for position, name in enumerate(order, start=1):
        assert resolved[position].tolist() == pool.transfer.rows(name, 1, 300).tolist()


PD_VIEW = dict(
    disaggregation_mode="prefill",
    disaggregation_transfer_backend="mooncake",
    disaggregation_decode_enable_radix_cache=False,
    disaggregation_enable_kv_checksum=False,
    enable_hierarchical_cache=False,
    speculative_algorithm=None,
    attn_dp_size=1,
)


@pytest.mark.skipif(not mooncake_installed(), reason="the pd extra (Mooncake) is not installed")
@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"disaggregation_transfer_backend": "nixl"}, "--disaggregation-transfer-backend nixl"),
        ({"disaggregation_transfer_backend": "fake"}, "fake moves no bytes"),
        (
            {"disaggregation_decode_enable_radix_cache": True, "enable_hierarchical_cache": True},
            "--disaggregation-decode-enable-radix-cache with --enable-hierarchical-cache",
        ),
        ({"disaggregation_enable_kv_checksum": True}, "--disaggregation-enable-kv-checksum"),
        ({"speculative_algorithm": "EAGLE"}, "--speculative-algorithm EAGLE"),
    ],
)
def test_what_is_not_built_is_refused_at_launch_naming_the_flag(change, named):
    check_disaggregation(SimpleNamespace(**PD_VIEW))  # the plain pair is accepted
    with pytest.raises(ConfigError, match="--disaggregation-mode prefill") as refusal:
        check_disaggregation(SimpleNamespace(**{**PD_VIEW, **change}))
    assert named in str(refusal.value)


@pytest.mark.skipif(not mooncake_installed(), reason="the pd extra (Mooncake) is not installed")
@pytest.mark.parametrize("change", [{"disaggregation_decode_enable_radix_cache": True}, {"attn_dp_size": 2}])
def test_the_decode_radix_cache_and_attention_dp_are_accepted(change):
    check_disaggregation(SimpleNamespace(**{**PD_VIEW, **change}))


def test_without_disaggregation_nothing_is_checked():
    check_disaggregation(SimpleNamespace(**{**PD_VIEW, "disaggregation_mode": "null", "attn_dp_size": 2}))


@pytest.mark.parametrize(
    ("change", "environment", "framing"),
    [
        ({"disaggregation_transfer_backend": "mooncake_tcp"}, {}, "1"),  # the TCP transport: the legacy framing
        ({"disaggregation_transfer_backend": "mooncake"}, {"MC_FORCE_TCP": "1"}, "1"),  # SGLang's rewrite of it
        ({"disaggregation_transfer_backend": "mooncake_tcp"}, {LEGACY_TCP_FRAMING: "2"}, "2"),  # the environment's
        ({"disaggregation_transfer_backend": "mooncake"}, {}, None),  # RDMA
        ({"disaggregation_mode": "null", "disaggregation_transfer_backend": "mooncake_tcp"}, {}, None),  # no pair
    ],
)
def test_the_tcp_transport_gets_the_legacy_framing_unless_the_environment_chooses(
    monkeypatch, change, environment, framing
):
    monkeypatch.delenv(LEGACY_TCP_FRAMING, raising=False)
    monkeypatch.delenv("MC_FORCE_TCP", raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    use_legacy_tcp_framing(SimpleNamespace(**{**PD_VIEW, **change}))
    assert os.environ.get(LEGACY_TCP_FRAMING) == framing


def test_a_decode_forward_reads_only_what_moved(tiny_model):
    """The layer state a decode pool loads at the prompt's end is the prefill pool's, layer by layer."""
    length = 700
    ids = random_ids(length, tiny_model.config.vocab_size, seed=447)
    prefill, decode = new_pool(tiny_model.config, torch.float32), new_pool(tiny_model.config, torch.float32)
    run_through_pool(tiny_model, prefill, 1, ids, [300, 400])
    move_request_state(prefill, 1, decode, 2, length)
    for layer in range(tiny_model.config.num_layers):
        sent, received = (p.storage.load(layer, r, length, torch.float32) for p, r in ((prefill, 1), (decode, 2)))
        assert torch.equal(received.window, sent.window)
        for kind in ("compressor", "indexer"):
            a, b = getattr(sent, kind), getattr(received, kind)
            assert (a is None) == (b is None)
            if a is not None:
                assert torch.equal(a.entries, b.entries) and torch.equal(a.record(), b.record())


def test_an_fp8_pool_moves_its_rows_as_stored(float64_tiny_model):
    """FP8-packed rows move as they are: the decode pool continues exactly as the prefill pool does."""
    model, length = float64_tiny_model, 333
    ids = random_ids(length + 4, model.config.vocab_size, seed=448)
    prefill, decode = new_pool(model.config, torch.float8_e4m3fn), new_pool(model.config, torch.float8_e4m3fn)
    run_through_pool(model, prefill, 1, ids[:length], [128, 128, 77])
    move_request_state(prefill, 1, decode, 2, length)
    on_decode = continue_decoding(model, decode, 2, ids, length)
    assert torch.equal(on_decode, continue_decoding(model, prefill, 1, ids, length))
