"""Hash-routing-aware EP planning: load prediction, the placement planner, plan files for SGLang."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from conftest import random_ids

from sglang_dsv4 import load_config
from sglang_dsv4.cli import main as dsv4
from sglang_dsv4.config import named_config
from sglang_dsv4.moe import (
    ExpertPlanError,
    HashLoadPredictor,
    Placement,
    expected_hash_loads,
    plan_placement,
    token_histogram,
)
from sglang_dsv4.moe.load import random_hash_tables, traffic_windows
from sglang_dsv4.moe.placement import LayerLoads, plan_layer, trivial_layer
from sglang_dsv4.moe.plan_files import read_hash_tables, read_recorded_loads, write_plan

FLASH = named_config("flash")


def zipf_histogram(vocab_size: int, used: int = 32000, exponent: float = 1.1, seed: int = 0) -> torch.Tensor:
    """Token frequencies of Zipf-distributed text over ``used`` token ids scattered in the vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    histogram = torch.zeros(vocab_size, dtype=torch.float64)
    histogram[torch.randperm(vocab_size, generator=gen)[:used]] = 1e6 / torch.arange(1, used + 1).double() ** exponent
    return histogram


def imbalance(placement: Placement, expert_loads: torch.Tensor) -> torch.Tensor:
    """Per layer, max over mean rank load."""
    ranks = placement.rank_loads(expert_loads)
    return ranks.max(-1).values / ranks.mean(-1)


def layers(expected: torch.Tensor) -> list[LayerLoads]:
    return [LayerLoads(row) for row in expected]


@pytest.fixture(scope="module")
def flash_hash_loads() -> torch.Tensor:
    return expected_hash_loads(FLASH, random_hash_tables(FLASH), zipf_histogram(FLASH.vocab_size))


def test_predicted_counts_equal_what_the_forward_routes(tiny_path, tiny_model):
    config = tiny_model.config
    routed: dict[int, torch.Tensor] = {}
    hooks = [
        tiny_model.layers[layer].ffn.gate.register_forward_hook(
            lambda _module, _inputs, output, layer=layer: routed.__setitem__(layer, output[1])
        )
        for layer in range(config.num_layers)
    ]
    ids = random_ids(200, config.vocab_size, seed=3)
    try:
        tiny_model(ids, tiny_model.new_state())
    finally:
        for hook in hooks:
            hook.remove()
    predictor = HashLoadPredictor(config, read_hash_tables(tiny_path, config))
    forward_counts = torch.stack(
        [torch.bincount(routed[layer].flatten(), minlength=config.n_routed_experts) for layer in range(2)]
    )
    assert predictor.num_layers == config.num_hash_layers == 2
    assert torch.equal(predictor.expert_counts(ids), forward_counts)
    assert int(forward_counts.sum()) == 2 * ids.numel() * config.num_experts_per_tok


def test_rank_counts_match_sglang_dynamic_dispatch():
    from sglang.srt.eplb.expert_location import _compute_logical_to_all_physical_map
    from sglang.srt.eplb.expert_location_dispatch import (
        ExpertLocationDispatchInfo,
        _topk_ids_logical_to_physical_dynamic,
    )

    config = replace(FLASH, vocab_size=5000)
    tables = random_hash_tables(config, seed=1)
    placement = plan_placement(layers(expected_hash_loads(config, tables, zipf_histogram(5000, 3000))), 256, 8, 8)
    ids = random_ids(3000, config.vocab_size, seed=4)
    predictor = HashLoadPredictor(config, tables)
    slots = predictor.slot_counts(ids, placement)
    all_physical = _compute_logical_to_all_physical_map(placement.physical_to_logical, 256, 8, moe_ep_rank=None)
    for layer in range(config.num_hash_layers):
        info = ExpertLocationDispatchInfo(
            ep_dispatch_algorithm="dynamic",
            partial_logical_to_rank_dispatch_physical_map=None,
            partial_logical_to_all_physical_map=all_physical[layer],
            partial_logical_to_all_physical_map_num_valid=(all_physical[layer] != -1).sum(-1),
            num_physical_experts=placement.num_slots,
            rank_invariant=True,
        )
        physical = _topk_ids_logical_to_physical_dynamic(tables[layer][ids], info)
        assert torch.equal(slots[layer], torch.bincount(physical.flatten(), minlength=placement.num_slots))
    ranks = predictor.rank_counts(ids, placement)
    assert torch.equal(ranks.sum(-1), predictor.expert_counts(ids).sum(-1))


def test_expected_loads_of_a_batch_histogram_are_its_counts():
    config = replace(FLASH, vocab_size=2000)
    tables = random_hash_tables(config)
    ids = random_ids(500, config.vocab_size, seed=5)
    expected = expected_hash_loads(config, tables, token_histogram(ids, config.vocab_size))
    assert torch.equal(expected.long(), HashLoadPredictor(config, tables).expert_counts(ids))


@pytest.mark.parametrize(("ep_size", "redundant"), [(8, 0), (16, 16), (64, 0), (64, 64), (32, 96)])
def test_every_expert_is_placed_and_rank_capacity_holds(flash_hash_loads, ep_size, redundant):
    placement = plan_placement(layers(flash_hash_loads), 256, ep_size, redundant)
    replicas = placement.replica_counts()
    assert placement.physical_to_logical.shape == (3, 256 + redundant)
    assert int(replicas.min()) >= 1 and int(replicas.sum(-1).max()) == 256 + redundant
    by_rank = placement.physical_to_logical.view(3, ep_size, placement.slots_per_rank)
    assert all(len(set(rank.tolist())) == placement.slots_per_rank for rank in by_rank.flatten(0, 1))


@pytest.mark.parametrize(("ep_size", "redundant"), [(8, 0), (16, 0), (32, 0), (32, 32), (64, 0), (64, 64)])
def test_plan_beats_no_planning_and_matches_sglang_deepseek_on_skewed_loads(flash_hash_loads, ep_size, redundant):
    from sglang.srt.eplb import eplb_algorithms

    num_slots = 256 + redundant
    ours = plan_placement(layers(flash_hash_loads), 256, ep_size, redundant)
    deepseek_map, _, _ = eplb_algorithms.rebalance_experts(
        tokens_per_expert=flash_hash_loads[None].float(),
        num_physical_experts=num_slots,
        num_local_physical_experts=num_slots // ep_size,
        num_groups=None,
        num_nodes=1,
        algorithm=eplb_algorithms.EplbAlgorithm.deepseek,
    )
    deepseek = Placement(deepseek_map.long(), ep_size, 256)
    unplanned = Placement(trivial_layer(256, num_slots).repeat(3, 1), ep_size, 256)
    busiest = flash_hash_loads.max(-1).values / flash_hash_loads.mean(-1)
    assert float(busiest.min()) > 5  # the skew is real: hot tokens always land on the same experts
    assert bool((imbalance(ours, flash_hash_loads) < imbalance(unplanned, flash_hash_loads)).all())
    assert bool((imbalance(ours, flash_hash_loads) <= imbalance(deepseek, flash_hash_loads) + 1e-9).all())


@pytest.mark.parametrize("suffix", [".pt", ".json"])
def test_plan_file_is_what_sglang_init_expert_location_reads(tmp_path, monkeypatch, flash_hash_loads, suffix):
    from sglang.srt.eplb import expert_location
    from sglang.srt.runtime_context import get_context

    placement = plan_placement([*layers(flash_hash_loads), None, None], 256, 8, 8)
    path = write_plan(placement, tmp_path / f"plan{suffix}")
    # The model class's get_model_config_for_expert_location is the serving model's part; stand in for it.
    monkeypatch.setattr(
        expert_location.ModelConfigForExpertLocation,
        "from_model_config",
        staticmethod(lambda _: expert_location.ModelConfigForExpertLocation(num_layers=5, num_logical_experts=256)),
    )
    with get_context().override_server_args(
        init_expert_location=str(path), ep_size=8, tp_size=8, ep_num_redundant_experts=8, device="cpu"
    ):
        metadata = expert_location.compute_initial_expert_location_metadata(None, moe_ep_rank=0)
    assert torch.equal(metadata.physical_to_logical_map_cpu, placement.physical_to_logical)
    assert torch.equal(metadata.logical_to_all_physical_map_num_valid.cpu(), placement.replica_counts())


def test_plan_experts_command_plans_hash_layers_from_text_and_learned_layers_from_records(tmp_path, tiny_path):
    config = load_config(tiny_path)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def fix_bug(request):\n    return request.user\n" * 50 + "the the the a a of\n" * 200)
    recorded = torch.zeros(7, config.num_layers, config.n_routed_experts, dtype=torch.int32)
    recorded[:, 2, 5] = 100  # layer 2's gate sends everything to expert 5
    recorded[:, 2] += 1
    dump = tmp_path / "expert_distribution_recorder_1.pt"
    torch.save({"rank": 0, "logical_count": recorded, "average_utilization_rate_over_window": None}, dump)
    plan = tmp_path / "plan.json"
    argv = [
        "plan-experts",
        "--model",
        str(tiny_path),
        "--ep-size",
        "4",
        "--redundant-experts",
        "4",
        "--window-tokens",
        "256",
    ]
    dsv4([*argv, "--output", str(plan), "--corpus", str(corpus), "--expert-distribution", str(dump)])

    placement = Placement(torch.tensor(json.loads(plan.read_text())["physical_to_logical_map"]), 4, 8)
    assert placement.physical_to_logical.shape == (config.num_layers, 12)
    assert int(placement.replica_counts()[2, 5]) == 4  # the hot learned expert is on every rank
    assert torch.equal(placement.physical_to_logical[3], trivial_layer(8, 12))  # no statistics there
    assert torch.equal(read_recorded_loads(dump, config), recorded.double())


def test_plan_experts_command_balances_hash_layers_from_a_token_histogram(tmp_path, tiny_path):
    config = load_config(tiny_path)
    histogram = zipf_histogram(config.vocab_size, used=config.vocab_size // 2)
    (tmp_path / "histogram.json").write_text(json.dumps(histogram.tolist()))
    plan = tmp_path / "plan.pt"
    dsv4(
        ["plan-experts", "--model", str(tiny_path), "--ep-size", "4", "--output", str(plan)]
        + ["--token-histogram", str(tmp_path / "histogram.json")]
    )

    planned = torch.load(plan)["physical_to_logical_map"]
    hashed = config.num_hash_layers
    loads = expected_hash_loads(config, read_hash_tables(tiny_path, config), histogram)
    unplanned = Placement(trivial_layer(8, 8).repeat(hashed, 1), 4, 8)
    assert bool((imbalance(Placement(planned[:hashed], 4, 8), loads) < imbalance(unplanned, loads)).all())
    assert torch.equal(planned[hashed:], trivial_layer(8, 8).repeat(config.num_layers - hashed, 1))


def test_windows_keep_experts_that_get_busy_together_on_different_ranks():
    expected = torch.tensor([1.03, 1.02, 1.01, 1.00])  # packing alone pairs experts 0 and 3
    windows = torch.tensor([[3.0, 1.0, 1.0, 3.0], [1.0, 3.0, 3.0, 1.0]])  # 0 and 3 are busy together

    def pairs(slots: torch.Tensor) -> set[frozenset[int]]:
        return {frozenset(rank.tolist()) for rank in slots.view(2, 2)}

    assert frozenset({0, 3}) in pairs(plan_layer(LayerLoads(expected), ep_size=2, slots_per_rank=2))
    planned = pairs(plan_layer(LayerLoads(expected, windows), ep_size=2, slots_per_rank=2))
    assert frozenset({0, 3}) not in planned and frozenset({1, 2}) not in planned


def test_traffic_windows_mix_spans_of_documents():
    documents = [torch.full((1000,), doc) for doc in range(8)]
    windows = traffic_windows(documents, window_tokens=512, span_tokens=64)
    assert len(windows) == (8 * (1000 // 64)) // 8 and all(w.numel() == 512 for w in windows)
    assert all(len(w.unique()) > 2 for w in windows)  # several requests per batch
    assert sorted(torch.cat(windows).tolist()) == sorted(torch.cat([d[: 15 * 64] for d in documents]).tolist())


def test_tid2eid_whose_shape_does_not_match_the_config_is_refused():
    tables = random_hash_tables(replace(FLASH, vocab_size=1000))
    with pytest.raises(ExpertPlanError, match=r"shape \(3, 1000, 6\); the config needs \[3, 129280, 6\]"):
        HashLoadPredictor(FLASH, tables)
    with pytest.raises(ExpertPlanError, match=r"shape \(2, 1000, 6\)"):
        HashLoadPredictor(replace(FLASH, vocab_size=1000), tables[:2])


def test_tid2eid_with_expert_ids_out_of_range_is_refused():
    config = replace(FLASH, vocab_size=100)
    tables = random_hash_tables(config)
    tables[1, 7, 2] = 256
    with pytest.raises(ExpertPlanError, match=r"expert ids in \[0, 256\]; allowed \[0, 256\)"):
        HashLoadPredictor(config, tables)


def test_histogram_over_another_vocabulary_is_refused():
    config = replace(FLASH, vocab_size=100)
    with pytest.raises(ExpertPlanError, match="histogram has 32000 entries; the config's vocabulary has 100"):
        expected_hash_loads(config, random_hash_tables(config), torch.ones(32000))


def test_token_ids_out_of_range_are_refused():
    config = replace(FLASH, vocab_size=100)
    predictor = HashLoadPredictor(config, random_hash_tables(config))
    with pytest.raises(ExpertPlanError, match=r"token ids must be in \[0, 100\); got min 0, max 100"):
        predictor.expert_counts(torch.tensor([0, 5, 100]))
    with pytest.raises(ExpertPlanError, match=r"got min -1"):
        token_histogram(torch.tensor([-1, 3]), 100)


def test_slots_that_do_not_divide_over_ranks_are_refused(flash_hash_loads):
    with pytest.raises(
        ExpertPlanError, match="256 experts \\+ 4 redundant slots = 260 slots, not divisible by ep_size 64"
    ):
        plan_placement(layers(flash_hash_loads), 256, 64, 4)
