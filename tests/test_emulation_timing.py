"""The emulator's timing model (sglang_dsv4/emulation/timing.py): its data, its fit, its parts."""

from __future__ import annotations

from pathlib import Path

import pytest

from sglang_dsv4.cli import main as dsv4
from sglang_dsv4.config import load_config, named_config
from sglang_dsv4.emulation.command import emulated_model_dir
from sglang_dsv4.emulation.timing import (
    Deployment,
    ForwardShape,
    Rooflines,
    TimingModel,
    extract_measurements,
    leave_one_out_errors,
    load_measurements,
)

RESULTS = Path(__file__).parents[1] / "benchmarks" / "results"


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
