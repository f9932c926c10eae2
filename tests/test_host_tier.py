"""The host tier's rows: the device pool's cached kinds of row copied to CPU memory and back, as stored."""

from __future__ import annotations

import random
from array import array

import pytest
import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InitLoadBackParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey
from test_prefix_tree import TOKENS, Scheduler, check, run_turn

from sglang_dsv4.kv_cache import V4KVPool
from sglang_dsv4.memory_pool.host_pools import HostPools, consecutive, device_kinds, host_rows_for_bytes


def device_pool(config, kv_dtype: torch.dtype) -> V4KVPool:
    return V4KVPool(1024, 1, config, kv_dtype, max_requests=4, max_context=1024, device="cpu")


def fill_with_random_bytes(buffers: list[torch.Tensor], generator: torch.Generator) -> None:
    for buffer in buffers:
        raw = buffer.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn])
def test_every_kind_of_row_comes_back_from_the_host_bit_for_bit(tiny_model, kv_dtype):
    """Random bytes in the device rows of every kind (FP8-packed rows under FP8) are saved to the host, the
    device rows are overwritten, and restored into other device rows: equal to what was saved, byte for byte."""
    storage = device_pool(tiny_model.config, kv_dtype).storage
    host = HostPools(storage, {name: 20 for name in device_kinds(storage)})
    generator = torch.Generator().manual_seed(0)
    for name, (rows, buffers) in device_kinds(storage).items():
        fill_with_random_bytes(buffers, generator)
        kind = host.kinds()[name]
        source, target = rows.alloc(4), rows.alloc(4)
        saved = [b[source].clone() for b in buffers]
        held = kind.save(source)
        fill_with_random_bytes(buffers, generator)
        kind.restore(held, target)
        for before, buffer in zip(saved, buffers, strict=True):
            assert torch.equal(before.view(torch.uint8), buffer[target].view(torch.uint8)), name


@pytest.mark.parametrize(
    ("host_rows", "one_run"),
    [([9, 8, 7, 6], True), ([3, 4, 5], True), ([5], True), ([], True), ([9, 7, 8], False), ([2, 3, 5], False)],
    ids=["counting-down", "counting-up", "one", "none", "shuffled", "gap"],
)
def test_a_run_of_consecutive_host_rows_is_read_in_place_paired_with_its_device_rows(host_rows, one_run):
    """What a load on CUDA copies without gathering: the host slice it reads, row for row, lands where a
    gather would put it; rows that are not one run answer None (they are gathered)."""
    host = torch.arange(10 * 3).view(10, 3)
    rows = torch.tensor(host_rows, dtype=torch.int64)
    device_rows = torch.arange(len(rows)) * 2
    gathered = torch.zeros(2 * len(rows), 3, dtype=host.dtype).index_copy_(0, device_rows, host[rows])
    run = consecutive(rows, device_rows)
    assert (run is not None) == one_run
    if run is not None:
        in_host, ordered = run
        assert torch.equal(torch.zeros_like(gathered).index_copy_(0, ordered, host[in_host]), gathered)


def test_a_short_host_reports_the_shortage_and_takes_nothing(tiny_model):
    storage = device_pool(tiny_model.config, torch.float32).storage
    host = HostPools(storage, {name: 3 for name in device_kinds(storage)})
    window = host.window
    assert window.save(storage.window_slots.alloc(4)) is None
    assert window.rows.free == 3
    assert window.save(storage.window_slots.alloc(3)) is not None and window.rows.free == 0


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn])
def test_a_host_sized_by_bytes_fits_them_in_the_device_pools_proportions(tiny_model, kv_dtype):
    storage = device_pool(tiny_model.config, kv_dtype).storage
    device_bytes = sum(b.numel() * b.element_size() for _, buffers in device_kinds(storage).values() for b in buffers)
    capacity = 3 * device_bytes
    rows = host_rows_for_bytes(storage, capacity)
    assert 0.98 * capacity <= HostPools(storage, rows).allocated_bytes <= capacity
    window_share = rows["window_slots"] / storage.window_slots.capacity
    for name, (device_rows, _) in device_kinds(storage).items():
        assert rows[name] == pytest.approx(device_rows.capacity * window_share, abs=1), name


# --- the tree over two tiers, driven as SGLang's scheduler drives it ---------------------------------------


def session_on_host(tiny_model, host_share: float = 2.0, seed: int = 41) -> tuple[Scheduler, list[int]]:
    """One finished turn whose whole prefix SGLang's eviction then moved to the host."""
    scheduler = Scheduler(tiny_model.config, random.Random(seed), host_share=host_share)
    _, history = run_turn(scheduler, [scheduler.rng.randrange(1024) for _ in range(200)], new_tokens=3)
    scheduler.tree.evict(EvictParams(num_tokens=TOKENS))
    check(scheduler)
    return scheduler, history


def match(tree, tokens: list[int]):
    return tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens))))


def test_an_evicted_sessions_next_turn_resumes_from_the_host_at_its_last_end(tiny_model):
    """The evicted turn's nodes stay in the tree, host-only, with its checkpoints; the next turn's match
    reports all of it as a host hit, the load brings it back, and the resumed row reads every byte its
    checkpoint was made with (run_turn checks); the host gives back the rows of what it loaded."""
    scheduler, history = session_on_host(tiny_model)
    tree, host = scheduler.tree, scheduler.tree.host
    assert tree.evictable_size() == 0 and len(tree.checkpoints) == 0 and len(host.checkpoints) > 0
    hit = match(tree, history + [1])
    assert (hit.device_prefix_len, hit.host_hit_length) == (0, len(history))
    window = len(host.checkpoints[hit.best_match_node].window)
    written = tree.checkpoint_report()["host_tier"]
    assert written["host_bytes_held"] == written["bytes_to_host"] > 0  # all it wrote, nothing dropped since
    resumed, _ = run_turn(scheduler, history + [5, 6, 7], new_tokens=2)
    assert resumed == len(history)
    report = tree.checkpoint_report()["host_tier"]
    assert report["checkpoints_loaded_back"] == 1 and report["tokens_loaded_back"] == len(history)
    # What came back, in the pool's own row sizes: the checkpoint's window and record, every block's entries.
    layout = scheduler.pool.storage.layout
    entries = sum(len(history) // b.ratio * layout.row_bytes(b) for b in layout.compressed_buffers())
    assert report["bytes_to_device"] == window * layout.window_slot_bytes + layout.record_bytes + entries
    assert len(host.checkpoints) == 0 and not host.entries  # a request resumes below the dropped ones
    assert all(kind["free"] == kind["total"] for kind in host.pools.usage().values())
    assert report["host_bytes_held"] == 0
    check(scheduler)


def test_under_write_through_a_cached_turn_is_on_the_host_before_eviction_which_copies_only_its_checkpoints(
    tiny_model,
):
    """Under SGLang's default policy the turn's entries are copied when the tree caches it (nodes backed up,
    still on the device); evicting it copies only its checkpoints' windows and records; the next turn resumes
    from the host reading every byte its checkpoint was made with (run_turn checks), and the loaded nodes keep
    their host copy."""
    scheduler = Scheduler(tiny_model.config, random.Random(41), host_share=2.0, write_policy="write_through")
    tree, host = scheduler.tree, scheduler.tree.host
    _, history = run_turn(scheduler, [scheduler.rng.randrange(1024) for _ in range(200)], new_tokens=3)
    layout = scheduler.pool.storage.layout
    entries = sum(len(history) // b.ratio * layout.row_bytes(b) for b in layout.compressed_buffers())
    cached = host.report()
    assert cached["backed_up_nodes"] > 0 and cached["host_nodes"] == 0
    assert cached["bytes_to_host"] == entries  # every block's entries, no checkpoint yet
    tree.evict(EvictParams(num_tokens=TOKENS))
    check(scheduler)
    evicted = host.report()
    windows = sum(len(c.window) * layout.window_slot_bytes + layout.record_bytes for c in host.checkpoints.values())
    assert evicted["backed_up_nodes"] == 0 and evicted["host_nodes"] == cached["backed_up_nodes"]
    assert evicted["bytes_to_host"] - cached["bytes_to_host"] == windows > 0
    resumed, _ = run_turn(scheduler, history + [5, 6, 7], new_tokens=2)
    assert resumed == len(history)
    assert host.report()["backed_up_nodes"] >= cached["backed_up_nodes"] and host.report()["host_nodes"] == 0
    check(scheduler)


def test_a_load_back_that_cannot_have_its_token_slots_changes_nothing(tiny_model):
    """All or nothing: with every token slot held by running requests (nothing left to evict), the load
    answers None and the tree, both tiers' rows and every reference count are as they were."""
    scheduler, history = session_on_host(tiny_model)
    tree = scheduler.tree
    hit = match(tree, history + [1])
    held = scheduler.slots.alloc(scheduler.slots.available_size())
    before, usage = tree.digest(), tree.host.pools.usage()
    assert tree.init_load_back(InitLoadBackParams(hit.best_match_node, hit.host_hit_length)) is None
    assert tree.digest() == before and tree.host.pools.usage() == usage
    assert set(tree.audit().values()) == {0}
    scheduler.slots.free(held)
    assert tree.init_load_back(InitLoadBackParams(hit.best_match_node, hit.host_hit_length)) == (
        len(history),
        hit.best_match_node,
    )


def test_a_load_back_of_a_prefix_dropped_since_its_match_answers_none(tiny_model):
    scheduler, history = session_on_host(tiny_model)
    tree = scheduler.tree
    hit = match(tree, history + [1])
    tree.reset()
    assert tree.init_load_back(InitLoadBackParams(hit.best_match_node, hit.host_hit_length)) is None


def test_a_request_computing_host_tokens_again_loads_them_back_and_the_host_checkpoint_below_still_resumes(
    tiny_model,
):
    """A request whose match stops above host-only tokens (no checkpoint on its part of them) computes them
    again; its insert loads the host's copies back, so the tree keeps the entries the checkpoint below was
    made with: a later turn resuming there from the host reads exactly those (run_turn checks)."""
    scheduler, history = session_on_host(tiny_model)
    tree, rng = scheduler.tree, scheduler.rng
    resumed, _ = run_turn(scheduler, history[:50] + [rng.randrange(1024) for _ in range(20)], new_tokens=1)
    assert resumed == 0
    hit = match(tree, history + [1])
    assert (hit.device_prefix_len, hit.host_hit_length) == (50, len(history) - 50)
    resumed, _ = run_turn(scheduler, history + [1, 2], new_tokens=1)
    assert resumed == len(history)


def test_a_full_host_drops_its_least_recently_used_sessions_first(tiny_model):
    """A host with 0.6 of the device's rows holds two of these sessions' windows: of six evicted one after the
    other, the latest stays and the one looked up before every turn; the others were dropped, least recently
    used first."""
    scheduler = Scheduler(tiny_model.config, random.Random(43), host_share=0.6)
    tree, histories = scheduler.tree, []
    for _ in range(6):
        if histories:
            match(tree, histories[0] + [1])  # the first session is looked up every turn
        _, history = run_turn(scheduler, [scheduler.rng.randrange(1024) for _ in range(200)], new_tokens=3)
        histories.append(history)
        tree.evict(EvictParams(num_tokens=TOKENS))
        check(scheduler)
    on_host = [match(tree, h + [1]).host_hit_length == len(h) for h in histories]
    assert on_host == [True, False, False, False, False, True]
    assert tree.host.moves["checkpoints_dropped"] > 0


def test_audit_counts_a_host_row_nothing_holds(tiny_model):
    scheduler, _ = session_on_host(tiny_model)
    tree = scheduler.tree
    tree.host.pools.window.rows.try_alloc(1)
    audit = tree.audit()
    assert audit == {**dict.fromkeys(audit, 0), "host_window_slots": 1}


def test_the_scheduler_finds_nothing_in_flight_between_the_tiers(tiny_model):
    """What SGLang's scheduler asks of a hierarchical cache: nothing pending for it to track (copies to the host
    are synchronous, loads ordered by the streams), no controller runs them, no storage tier lies below, and the
    loaded slots are the tree's."""
    tree = session_on_host(tiny_model)[0].tree
    assert tree.ready_to_load_host_cache() == -1 and tree.check_hicache_events() is None
    assert len(tree.ongoing_write_through) == 0 and len(tree.ongoing_load_back) == 0
    assert tree.cache_controller is None and not tree.enable_storage and tree.load_back_is_cache_owned()


def test_sglangs_hicache_gauges_read_the_host_tier_in_tokens(tiny_model):
    """``--enable-metrics`` logs the host pool's tokens each step: SGLang's reporter reads the tier as a host pool."""
    from types import SimpleNamespace

    from sglang.srt.managers.scheduler_components.metrics_reporter import SchedulerMetricsReporter

    scheduler, _ = session_on_host(tiny_model)
    entries = scheduler.tree.host.pools.entries[min(scheduler.tree.host.pools.entries)].rows
    reporter = SimpleNamespace(
        scheduler=SimpleNamespace(enable_hierarchical_cache=True, tree_cache=scheduler.tree), stats=SimpleNamespace()
    )
    SchedulerMetricsReporter._log_hicache_stats(reporter)
    ratio = min(scheduler.tree.host.pools.entries)
    assert reporter.stats.hicache_host_total_tokens == ratio * entries.capacity
    assert reporter.stats.hicache_host_used_tokens == ratio * (entries.capacity - entries.free) > 0
