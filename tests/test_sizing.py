"""Pool sizing from a memory budget follows the layout's bytes per token and per request."""

from __future__ import annotations

import pytest
import torch
from test_pool import with_device_twins

from sglang_dsv4 import platform
from sglang_dsv4.config import named_config
from sglang_dsv4.kv_cache import V4KVPool
from sglang_dsv4.memory_pool.layout import PoolLayout
from sglang_dsv4.memory_pool.sizing import (
    DEFAULT_MAX_RUNNING_REQUESTS,
    EAGER_INPUT_BYTES_PER_TOKEN,
    HostSharing,
    V4PoolConfigurator,
)


def test_budget_splits_into_request_rows_and_tokens_that_fit(tiny_model):
    layout = PoolLayout(tiny_model.config, torch.float32)
    budget = 64 * 2**20
    sizing = V4PoolConfigurator(layout, max_running_requests=16, table_context=0)
    tokens = sizing.calculate_pool_sizes(budget, page_size=1).max_total_num_tokens
    config = sizing.finalize_with_max_running_requests(sizing.calculate_pool_sizes_from_max_tokens(tokens, 1))
    assert config.max_running_requests == 16
    pool = V4KVPool(tokens, 1, tiny_model.config, torch.float32, max_requests=16, max_context=4096, device="cpu")
    assert pool.storage.allocated_bytes <= budget
    # The budget is used: one more page of tokens would not fit beside what indexes the rows.
    assert (tokens + 1) * sizing.bytes_per_token + 17 * sizing.bytes_per_row + layout.padding_bytes > budget
    assert sizing.bytes_per_token > layout.bytes_per_token and sizing.bytes_per_row > layout.bytes_per_request


def test_ranks_that_share_the_hosts_memory_each_size_their_pools_from_their_share(tiny_model):
    layout, budget, resident = PoolLayout(tiny_model.config, torch.float32), 64 * 2**20, 8 * 2**20
    whole = V4PoolConfigurator(layout, max_running_requests=16, table_context=0)
    shared = V4PoolConfigurator(layout, 16, table_context=0, sharing=HostSharing(ranks=2, resident_bytes=resident))
    assert shared.calculate_pool_sizes(budget, 1) == whole.calculate_pool_sizes((budget - resident) // 2, 1)


@pytest.mark.parametrize(("nodes", "ranks", "per_node"), [(1, 1, 1), (1, 2, 2), (2, 2, 1), (2, 8, 4), (2, 3, 2)])
def test_on_the_cpu_platform_the_ranks_on_a_numa_node_share_its_memory(monkeypatch, nodes, ranks, per_node):
    # SGLang measured a NUMA node's memory for each rank: ranks beyond one per node share it.
    from sglang.srt.mem_cache.pool_host import base
    from sglang.srt.utils import common

    monkeypatch.setattr(platform, "on_torch_cpu_platform", lambda: True)
    monkeypatch.setattr(common, "get_cpu_ids_by_node", lambda: [str(node) for node in range(nodes)])
    monkeypatch.setattr(base, "ranks_per_host", lambda: ranks)
    sharing = platform.host_sharing()
    assert sharing.ranks == per_node and sharing.resident_bytes > 0


def test_request_rows_default_to_v4s_cap_and_never_exceed_what_was_set_aside():
    sizing = V4PoolConfigurator(
        PoolLayout(named_config("flash"), torch.bfloat16), max_running_requests=None, table_context=0
    )
    assert sizing.request_rows == DEFAULT_MAX_RUNNING_REQUESTS
    config = sizing.calculate_pool_sizes(80 * 2**30, page_size=1)
    config.max_running_requests = 2048  # what SGLang derives from the token count
    assert sizing.finalize_with_max_running_requests(config).max_running_requests == DEFAULT_MAX_RUNNING_REQUESTS


def test_budget_too_small_for_the_request_rows_names_the_fix():
    sizing = V4PoolConfigurator(
        PoolLayout(named_config("flash"), torch.bfloat16), max_running_requests=256, table_context=0
    )
    with pytest.raises(ValueError, match="lower --max-running-requests"):
        sizing.calculate_pool_sizes(2**30, page_size=1)


def test_the_request_tables_are_set_aside_from_the_budget_and_a_gpu_pool_counts_its_device_twins(tiny_model):
    """Each request row's tables at the served context are set aside (the host tables on the CPU, their
    device twins on a GPU); a GPU pool counts the twins in what it allocated, to the byte."""
    layout, context, rows = PoolLayout(tiny_model.config, torch.float32), 4096, 16
    budget = 64 * 2**20
    without = V4PoolConfigurator(layout, max_running_requests=rows, table_context=0)
    with_tables = V4PoolConfigurator(layout, max_running_requests=rows, table_context=context)
    tokens = with_tables.calculate_pool_sizes(budget, page_size=1).max_total_num_tokens
    fewer = without.calculate_pool_sizes(budget, page_size=1).max_total_num_tokens - tokens
    per_token = with_tables.bytes_per_token
    set_aside = (rows + 1) * (layout.request_table_bytes(context) - layout.request_table_bytes(0))
    assert fewer == pytest.approx(set_aside / per_token, abs=1)
    pool = V4KVPool(tokens, 1, tiny_model.config, torch.float32, max_requests=rows, max_context=context, device="cpu")
    rows_only = pool.storage.allocated_bytes
    with_device_twins(pool.storage.tables)  # as on a GPU
    assert pool.storage.allocated_bytes - rows_only == (rows + 1) * layout.request_table_bytes(context)
    assert pool.storage.allocated_bytes <= budget


def test_sglangs_eager_input_buffers_per_token_are_what_the_budget_sets_aside():
    """SGLang sizes each model runner's eager inputs by the pool's token count: what they take per token
    slot, read off SGLang's own registry, is the constant the budget sets aside per runner."""
    from sglang.srt.model_executor.cuda_graph_buffer_registry import build_eager_registry
    from sglang.srt.runtime_context import get_parallel

    def registry_bytes(tokens: int) -> int:
        with get_parallel().override(num_dp_ranks=1):
            registry = build_eager_registry(device="cpu", max_bs=4, max_num_token=tokens, cache_loc_dtype=torch.int64)
        return sum(slot.buffer.nbytes for slot in registry._slots.values())

    assert (registry_bytes(3000) - registry_bytes(1000)) / 2000 == EAGER_INPUT_BYTES_PER_TOKEN


def test_under_speculation_the_draft_workers_eager_inputs_are_set_aside_too(tiny_model):
    plain_layout, speculating_layout = (PoolLayout(tiny_model.config, torch.float32, tokens) for tokens in (0, 4))
    plain, speculating = (V4PoolConfigurator(layout, 16, 0) for layout in (plain_layout, speculating_layout))
    pool_bytes = {
        layout: layout.bytes_per_token + layout.bookkeeping_bytes_per_token
        for layout in (plain_layout, speculating_layout)
    }
    pool_extra = pool_bytes[speculating_layout] - pool_bytes[plain_layout]
    runner_extra = EAGER_INPUT_BYTES_PER_TOKEN
    assert speculating.bytes_per_token - plain.bytes_per_token == pytest.approx(pool_extra + runner_extra)
