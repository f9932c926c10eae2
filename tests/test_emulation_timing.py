"""The emulator's timing model (sglang_dsv4/emulation/timing.py): its data, its fit, its parts."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from sglang_dsv4.cli import main as dsv4
from sglang_dsv4.config import load_config, named_config
from sglang_dsv4.emulation.command import emulated_model_dir
from sglang_dsv4.emulation.device import EmulatedDevice, RankClock, runqueue_wait_s
from sglang_dsv4.emulation.timing import (
    REFERENCE_ENTRY_BYTES,
    REFERENCE_INDEXER_KEY_BYTES,
    Deployment,
    ForwardShape,
    Rooflines,
    TimingModel,
    extract_measurements,
    leave_one_out_errors,
    load_measurements,
)

RESULTS = Path(__file__).parents[1] / "benchmarks" / "results"
FP8_NODE = Deployment(gpus=4, kv_dtype="fp8", experts="fp8")


def test_package_data_is_the_benchmarks_measurements():
    assert load_measurements() == extract_measurements(RESULTS)


@pytest.mark.parametrize("model", ["flash", "pro"])
def test_decode_attention_is_the_measured_step_at_grid_points(model):
    timing = TimingModel(named_config(model), model)
    grid = load_measurements()[model]["decode_layer_us"]["bf16"]
    for batch, context in [(1, 8192), (64, 8192), (256, 131072)]:
        time = timing.forward(ForwardShape((1,) * batch, (context,) * batch))
        expected = sum(
            count * grid[kind if kind in grid else "hca"][f"{batch},{context}"]
            for kind, count in timing.layer_counts.items()
        )
        assert time.parts["attention"] == pytest.approx(expected * 1e-6)


@pytest.mark.parametrize("model", ["flash", "pro"])
def test_decode_interpolation_within_eleven_percent_of_a_left_out_batch(model):
    errors = leave_one_out_errors(model)
    assert errors and max(abs(e) for e in errors.values()) < 0.11


def test_a_forward_is_the_sum_of_its_parts_and_grows_with_the_batch():
    timing = TimingModel(named_config("flash"), "flash")
    small = timing.forward(ForwardShape((1,) * 8, (16384,) * 8))
    large = timing.forward(ForwardShape((1,) * 128, (16384,) * 128))
    assert small.total_s == pytest.approx(sum(small.parts.values()))
    assert set(small.parts) == {"attention", "mhc_gate_shared", "routed_experts", "all_to_all", "head", "sampling"}
    assert 0.005 < small.total_s < large.total_s < 0.1  # a V4-Flash rank's decode step: milliseconds


def test_routed_experts_read_bound_in_decode_and_compute_bound_in_prefill():
    config, roof = named_config("flash"), Rooflines()
    timing = TimingModel(config, "flash", Deployment(gpus=8))
    weights = 3 * config.hidden_size * config.moe_intermediate_size
    experts_here = config.n_routed_experts / 8
    all_read_s = experts_here * weights * (0.5 + 1 / 32) / (roof.hbm_bytes_per_s * roof.expert_bandwidth_efficiency)
    decode = timing.forward(ForwardShape((1,) * 64, (8192,) * 64))
    assert decode.parts["routed_experts"] / config.num_layers == pytest.approx(all_read_s, rel=1e-4)  # all touched
    prefill = timing.forward(ForwardShape((8192,), (8192,)))
    flops = 2 * weights * 8192 * config.num_experts_per_tok
    expected = flops / (roof.fp8_flops_per_s * roof.expert_compute_efficiency)
    assert prefill.parts["routed_experts"] / config.num_layers == pytest.approx(expected)


def test_one_gpu_has_no_all_to_all():
    timing = TimingModel(named_config("flash"), "flash", Deployment(gpus=1))
    assert timing.forward(ForwardShape((1,) * 4, (4096,) * 4)).parts["all_to_all"] == 0.0


def test_the_emulated_model_folder_is_the_config_and_a_tokenizer(tmp_path):
    folder = emulated_model_dir("pro", tmp_path / "pro")
    assert load_config(folder) == named_config("pro")
    assert (folder / "tokenizer.json").is_file() and not list(folder.glob("*.safetensors"))


def test_dsv4_emulate_refuses_an_untimed_config():
    with pytest.raises(SystemExit) as stopped:
        dsv4(["emulate", "--config", "tiny", "--context-length", "4096"])
    assert stopped.value.code == 2


def test_flashmla_attention_reads_the_reference_layouts_fp8_kv():
    from sglang_dsv4.memory_pool.ledger import ReferenceLayout

    reference = ReferenceLayout(named_config("flash"))
    assert (REFERENCE_ENTRY_BYTES, REFERENCE_INDEXER_KEY_BYTES) == (reference.entry_bytes, reference.indexer_key_bytes)


def test_flashmla_decode_is_its_bytes_floor_plus_launches_and_tp_splits_weights_not_kv():
    config, roof = named_config("flash"), Rooflines()
    dp = TimingModel(config, "flash", FP8_NODE, attention="flashmla").attention
    tp = TimingModel(config, "flash", Deployment(4, "fp8", 4, "fp8"), attention="flashmla").attention
    one = ForwardShape((1,), (8192,))
    kv = (config.sliding_window + config.index_topk) * REFERENCE_ENTRY_BYTES + 2048 * REFERENCE_INDEXER_KEY_BYTES
    expected = roof.attention_layer_latency_s + (dp.weight_bytes["csa"] + kv) / (
        roof.hbm_bytes_per_s * roof.attention_bandwidth_efficiency
    )
    assert dp.layer_us("csa", one) == pytest.approx(1e6 * expected)
    assert tp.weight_bytes["window"] < dp.weight_bytes["window"] / 2  # the heads' projections split over 4
    assert tp.layer_us("csa", one) < dp.layer_us("csa", one)
    prefill = ForwardShape((8192,), (8192,))
    assert dp.layer_us("csa", prefill) > 50 * dp.layer_us("csa", one)  # compute-bound: FLOPs, not bytes


def test_tensor_parallel_reads_a_quarter_of_the_touched_experts_and_measured_attention_refuses_it():
    config, roof = named_config("flash"), Rooflines()
    tp = TimingModel(config, "flash", Deployment(4, "fp8", 4, "fp8"), attention="flashmla")
    weights = 3 * config.hidden_size * config.moe_intermediate_size
    touched = config.n_routed_experts * (1 - (1 - 1 / config.n_routed_experts) ** config.num_experts_per_tok)
    expected = touched * weights * (1 + 4 / 128**2) / 4 / (roof.hbm_bytes_per_s * roof.expert_bandwidth_efficiency)
    step = tp.forward(ForwardShape((1,), (8192,)))
    assert step.parts["routed_experts"] / config.num_layers == pytest.approx(expected)
    with pytest.raises(ValueError, match="attention DP only"):
        TimingModel(config, "flash", Deployment(4, "fp8", 4, "fp8"))


def test_the_rank_clock_passes_blocked_time_at_the_walls_rate_and_scales_cpu_time():
    clock, start = RankClock(host_speed=0.5), time.monotonic()
    began = clock.now()
    time.sleep(0.1)
    slept = clock.now() - began
    assert slept == pytest.approx(time.monotonic() - start, abs=0.02)
    cpu, began = time.thread_time(), clock.now()
    while time.thread_time() - cpu < 0.2:
        pass
    assert clock.now() - began == pytest.approx(0.5 * (time.thread_time() - cpu), abs=0.03)  # contention left out


def test_a_slower_emulated_host_sleeps_off_its_work_so_the_wall_keeps_pace_with_the_rank_clock():
    clock = RankClock(host_speed=2.0)
    began, start, cpu, queued = clock.now(), time.monotonic(), time.thread_time(), runqueue_wait_s()
    while time.thread_time() - cpu < 0.1:
        pass
    clock.settle()
    ran, wall, contention = clock.now() - began, time.monotonic() - start, runqueue_wait_s() - queued
    assert ran == pytest.approx(2 * (time.thread_time() - cpu), abs=0.01)
    assert ran - 0.01 <= wall <= ran + contention + 0.02  # behind the rank clock only by this host's contention
    assert clock.spent()["settled_s"] == pytest.approx(wall - (time.thread_time() - cpu) - contention, abs=0.02)


def test_cpu_time_left_out_as_device_work_moves_neither_the_rank_clock_nor_the_debt():
    clock = RankClock(host_speed=2.0)
    began, cpu = clock.now(), time.thread_time()
    while time.thread_time() - cpu < 0.1:
        pass
    clock.leave_out(time.thread_time() - cpu)
    clock.settle()
    assert clock.now() - began == pytest.approx(0.0, abs=0.01)
    assert clock.spent()["settled_s"] == pytest.approx(0.0, abs=0.005)  # the wall is already ahead


def test_a_load_runs_beside_the_forward_in_flight_and_holds_back_the_next_one():
    device = EmulatedDevice()
    started = device.now()
    first = device.issue(0.2)
    device.load(0.1)  # on the copy engine while the first forward runs: it ends before the first does
    assert device.issue(0.05) == pytest.approx(first + 0.05, abs=0.01)
    device.load(0.3)  # behind the first copy on the copy engine, it ends after the forwards queued (at 0.25)
    assert device.issue(0.05) == pytest.approx(started + 0.1 + 0.3 + 0.05, abs=0.01)  # the next forward waits
    assert device.busy_s == pytest.approx(0.3) and device.loaded_s == pytest.approx(0.4)
    assert device.now() - started < 0.05  # nothing above held the host


def test_host_work_of_the_host_tiers_copies_holds_the_host_and_not_the_device():
    device = EmulatedDevice()
    started, finish = device.now(), device.issue(0.3)
    device.hold_host(0.1)
    assert device.now() - started == pytest.approx(0.1, abs=0.02)
    assert device.busy_until == finish and device.held_host_s == pytest.approx(0.1)


def test_lockstep_charges_each_extend_for_every_rank_and_leaves_decode_alone():
    config, shape = named_config("flash"), ForwardShape((4096,), (4096,))
    alone = TimingModel(config, "flash", FP8_NODE).forward(shape)
    lockstep = TimingModel(config, "flash", Deployment(4, "fp8", 1, "fp8", lockstep=True))
    assert lockstep.forward(shape).total_s == pytest.approx(4 * alone.total_s)
    decode = ForwardShape((1,) * 8, (8192,) * 8)
    assert lockstep.forward(decode).total_s == TimingModel(config, "flash", FP8_NODE).forward(decode).total_s
