"""The cache-aware router's scoring, its checkpoint index and its state, and how SGLang's command line,
resolution and DP controller take the method, without a server."""

from __future__ import annotations

import argparse
import random
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sglang.srt.managers.data_parallel_controller import LoadBalanceMethod
from sglang.srt.server_args import ServerArgs

from sglang_dsv4 import plugin
from sglang_dsv4.routing.checkpoint_index import CheckpointIndex
from sglang_dsv4.routing.controller import METHOD
from sglang_dsv4.routing.rank_reports import Dropped, Flushed, Made, Released
from sglang_dsv4.routing.router import CacheAwareRouter
from sglang_dsv4.routing.scoring import LOAD_WEIGHT, choose_rank, load_spread_bound, rank_costs
from sglang_dsv4.served_config import ARCHITECTURE


def test_cost_is_uncached_prompt_tokens_plus_weighted_load():
    assert rank_costs(100, [60, 0], [40, 0], 0.5) == [40 + 20, 100]
    assert choose_rank(100, [60, 0], [40, 0], 0.5) == 0
    # The same cached prefix outweighed by load.
    assert choose_rank(100, [60, 0], [400, 0], 0.5) == 1


def test_ties_and_an_empty_index_go_to_the_least_loaded_rank():
    assert choose_rank(50, [0, 0, 0], [30, 10, 20]) == 1
    # Equal costs: 10 cached on rank 0 at load 40 against nothing cached on rank 1 at load 0.
    assert rank_costs(50, [10, 0], [40, 0], 0.25) == [50, 50]
    assert choose_rank(50, [10, 0], [40, 0], 0.25) == 1
    assert choose_rank(50, [0, 0], [7, 7]) == 0


def test_the_longest_match_ends_at_a_checkpoint_not_anywhere_along_a_shared_prefix():
    index = CheckpointIndex(max_tokens=1000)
    index.insert(list(range(10)), [4, 10])
    assert index.longest_checkpointed_prefix(list(range(12))) == 10
    assert index.longest_checkpointed_prefix([*range(7), 99]) == 4  # shares 7 tokens, checkpoint at 4
    assert index.longest_checkpointed_prefix([0, 1, 2]) == 0
    assert index.longest_checkpointed_prefix([5, 6]) == 0
    # A second prompt forking inside the first's edge splits it; both keep their checkpoints.
    index.insert([0, 1, 2, 3, 4, 5, 50, 51], [6, 8])
    assert index.longest_checkpointed_prefix([0, 1, 2, 3, 4, 5, 50, 51, 52]) == 8
    assert index.longest_checkpointed_prefix([*range(10), 0]) == 10
    assert index.longest_checkpointed_prefix([0, 1, 2, 3, 4, 5, 7]) == 6
    assert index.tokens == 12


def test_the_index_stays_within_its_tokens_dropping_the_least_recently_used():
    index = CheckpointIndex(max_tokens=25)
    first, second, third = ([seed] * 10 for seed in (1, 2, 3))
    index.insert(first, [10])
    index.insert(second, [10])
    assert index.longest_checkpointed_prefix(first) == 10  # first is now the more recently used
    index.insert(third, [10])
    assert index.tokens <= 25
    assert [index.longest_checkpointed_prefix(ids) for ids in (first, second, third)] == [10, 0, 10]


def serve(router: CacheAwareRouter, rank: int, rid: str, prompt: list[int], output: list[int]) -> None:
    """What rank ``rank`` reports for one request: checkpoints a token before the prompt's end and at it, then
    at the request's end, and the request gone."""
    router.apply(Made(rank, rid, (len(prompt) - 1, len(prompt)), ()))
    router.apply(Made(rank, rid, (len(prompt) + len(output),), tuple(output)))
    router.apply(Released(rank, rid))


def send(router: CacheAwareRouter, rid: str, prompt: list[int], loads: list[int], active=(0, 1)) -> int:
    """Route ``prompt``, note it sent, and grow its rank's load by it (as a fresh load figure would)."""
    rank = router.route(prompt, loads, list(active))
    router.sent(rank, rid, prompt, when=0.0)
    loads[rank] += len(prompt)
    return rank


def test_a_session_stays_on_the_rank_that_reported_its_checkpoints_and_new_sessions_spread_by_load():
    router = CacheAwareRouter(ranks=2)
    loads = [0, 0]
    turns = {}
    for session in range(4):
        prompt = [session] * 100
        rank = send(router, f"{session}/0", prompt, loads)
        serve(router, rank, f"{session}/0", prompt, [7, 8])
        turns[session] = (prompt + [7, 8], rank)
    assert sorted(rank for _, rank in turns.values()) == [0, 0, 1, 1]
    for session, (history, rank) in turns.items():
        assert send(router, f"{session}/1", [*history, 9], loads) == rank, session
    reports = router.report()
    assert [r["routed"] for r in reports] == [4, 4]
    assert [r["predicted_hit_share"] for r in reports] == [0.5, 0.5]
    assert [r["mean_uncached_prompt_tokens"] for r in reports] == [(100 + 100 + 1 + 1) / 4] * 2


def test_back_to_back_identical_prompts_spread_until_a_rank_reports_the_checkpoint():
    # SGLang's start-up warmup: one identical prompt per rank, sent together. Neither rank holds it yet.
    router = CacheAwareRouter(ranks=2)
    loads = [0, 0]
    warmup = [10, 11, 12, 13, 14, 15]
    assert [send(router, f"warmup{i}", warmup, loads) for i in range(2)] == [0, 1]
    # Once a rank reports it, the next one goes there.
    serve(router, 1, "warmup1", warmup, [3])
    assert router.route([*warmup, 3, 4], [0, 0], [0, 1]) == 1


def test_a_ranks_load_counts_the_prompts_sent_since_its_last_figure():
    router = CacheAwareRouter(ranks=2)
    figures, taken_at = [0, 0], [100.0, 100.0]
    first = router.route([1] * 50, router.loads(figures, taken_at), [0, 1])
    router.sent(first, "a", [1] * 50, when=100.5)
    # A figure taken before the send (the rank had not read it yet) still counts it.
    taken_at[first] = 100.4
    assert router.loads(figures, taken_at)[first] == 50
    second = router.route([2] * 50, router.loads(figures, taken_at), [0, 1])
    assert {first, second} == {0, 1}
    # A figure taken after the send counts it itself.
    figures[first], taken_at[first] = 30, 101.0
    assert router.loads(figures, taken_at)[first] == 30


def test_a_dropped_checkpoint_and_a_flushed_rank_are_routed_to_no_more():
    router = CacheAwareRouter(ranks=2)
    prompt = [4] * 60
    router.sent(1, "r", prompt, when=0.0)
    router.apply(Made(1, "r", (30, 59, 60), ()))
    assert router.route([*prompt, 5], [0, 0], [0, 1]) == 1
    router.apply(Dropped(1, "r", 60))
    router.apply(Dropped(1, "r", 59))
    assert router.indexes[1].longest_checkpointed_prefix([*prompt, 5]) == 30
    router.apply(Flushed(1))
    assert router.indexes[1].longest_checkpointed_prefix([*prompt, 5]) == 0
    assert router.route([*prompt, 5], [0, 0], [0, 1]) == 0
    # A request reported gone is forgotten: what arrives for it later is not placed.
    router.apply(Released(1, "r"))
    router.apply(Made(1, "r", (60,), ()))
    assert len(router.indexes[1]) == 0


def test_the_router_keeps_the_prompts_of_requests_on_their_ranks_within_its_bound():
    router = CacheAwareRouter(ranks=1, prompt_tokens_kept=100)
    router.sent(0, "a", [1] * 60, when=0.0)
    router.sent(0, "b", [2] * 60, when=0.0)  # past the bound: "a", the oldest, is forgotten
    router.apply(Made(0, "a", (60,), ()))
    router.apply(Made(0, "b", (60,), ()))
    assert router.indexes[0].longest_checkpointed_prefix([1] * 61) == 0
    assert router.indexes[0].longest_checkpointed_prefix([2] * 61) == 60
    router.apply(Released(0, "b"))
    router.sent(0, "c", [3] * 90, when=0.0)  # fits once "b" is gone
    router.apply(Made(0, "c", (89, 90), ()))
    assert router.indexes[0].longest_checkpointed_prefix([3] * 90 + [5]) == 90


def test_only_active_ranks_are_chosen_and_a_pinned_request_is_placed_on_its_rank():
    router = CacheAwareRouter(ranks=3)
    router.sent(2, "pinned", [5] * 40, when=0.0)
    router.apply(Made(2, "pinned", (39, 40), ()))
    assert router.route([5] * 41, [0, 0, 0], [0, 1]) == 0
    assert router.route([5] * 50, [0, 0, 0], [1, 2]) == 2
    # A prompt seen whole resumes a token before its end (SGLang never matches a prompt's last token).
    assert router.route([5] * 40, [5, 5, 0], [0, 1, 2]) == 2
    router.sent(2, "again", [5] * 40, when=0.0)
    assert router.routing[2].uncached_tokens == 40 + 1


@settings(max_examples=100, deadline=None)
@given(
    ranks=st.integers(2, 4),
    weight=st.sampled_from([LOAD_WEIGHT, 0.05, 1.0, 4.0]),
    long_turn=st.integers(500, 4000),
    shorts=st.integers(1, 40),
    seed=st.integers(0, 2**16),
)
def test_under_skew_no_ranks_load_exceeds_anothers_by_more_than_the_penalty_allows(
    ranks, weight, long_turn, shorts, seed
):
    # One long session (each turn resumes the previous and adds long_turn tokens) among many short sessions
    # of a few turns; nothing finishes, so every prompt stays in its rank's queued tokens.
    rng = random.Random(seed)
    router = CacheAwareRouter(ranks, weight=weight)
    loads = [0] * ranks
    sessions = {"long": [], **{f"short{i}": [] for i in range(shorts)}}
    order = ["long"] * 6 + [name for name in sessions if name != "long" for _ in range(rng.randint(1, 3))]
    rng.shuffle(order)
    longest = 0
    for name in order:
        added = long_turn if name == "long" else rng.randint(5, 200)
        sessions[name] = prompt = sessions[name] + [rng.randrange(1000) for _ in range(added)]
        rid = f"{name}/{len(prompt)}"
        rank = send(router, rid, prompt, loads, active=range(ranks))
        router.apply(Made(rank, rid, (len(prompt) - 1, len(prompt)), ()))
        longest = max(longest, len(prompt))
        assert max(loads) - min(loads) <= load_spread_bound(longest, weight), (loads, name)


def test_the_command_line_and_sglangs_controller_accept_the_method_by_name(plugin_in_own_registry):
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    for method in (METHOD, "round_robin", "total_tokens"):
        parsed = parser.parse_args(["--model-path", "m", "--load-balance-method", method])
        assert parsed.load_balance_method == method
    # Ours keeps SGLang's per-rank token budget (what total_tokens keeps); SGLang's own names are its own.
    assert LoadBalanceMethod.from_str(METHOD) is LoadBalanceMethod.TOTAL_TOKENS
    assert LoadBalanceMethod.from_str("round_robin") is LoadBalanceMethod.ROUND_ROBIN


@pytest.mark.parametrize(
    ("given", "attn_dp", "architecture", "mode", "resolved"),
    [
        ("auto", 2, ARCHITECTURE, "null", METHOD),
        ("auto", 1, ARCHITECTURE, "null", "round_robin"),
        ("auto", 2, "LlamaForCausalLM", "null", "round_robin"),
        ("auto", 2, ARCHITECTURE, "prefill", METHOD),
        ("auto", 2, ARCHITECTURE, "decode", METHOD),
        ("auto", 1, ARCHITECTURE, "prefill", "follow_bootstrap_room"),
        ("auto", 1, ARCHITECTURE, "decode", "round_robin"),
        ("total_tokens", 2, ARCHITECTURE, "null", "total_tokens"),
        (METHOD, 1, ARCHITECTURE, "null", METHOD),
    ],
)  # fmt: skip
def test_auto_is_the_cache_aware_method_for_v4_under_attention_dp_only(
    monkeypatch, given, attn_dp, architecture, mode, resolved
):
    from sglang.srt.arg_groups import model_override_base
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.arg_groups.resolution_hooks import run_hook
    from sglang.srt.arg_groups.serving_hook import handle_load_balance_method

    model = SimpleNamespace(hf_config=SimpleNamespace(architectures=[architecture]))
    monkeypatch.setattr(model_override_base, "model_config_of", lambda server_args: model)
    plugin.register()  # registers the resolution step's wrapper once per process
    server_args = SimpleNamespace(load_balance_method=given, attn_dp_size=attn_dp, disaggregation_mode=mode)
    run_hook(handle_load_balance_method, server_args)
    assert resolving_view(server_args).load_balance_method == resolved
