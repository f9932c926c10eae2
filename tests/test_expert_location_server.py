"""SGLang's own loader applies our expert plan to the served model, and routing through it keeps outputs."""

from __future__ import annotations

import json

import pytest
import requests
import torch
from conftest import random_ids

from sglang_dsv4.cli import main as dsv4
from sglang_dsv4.launch import running_server


@pytest.fixture(scope="module")
def plan(tiny_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("plan")
    corpus = folder / "corpus.txt"
    corpus.write_text("def fix_bug(request): return cache.value  # tool call output tests\n" * 20)
    path = folder / "plan.json"
    dsv4(["plan-experts", "--model", str(tiny_path), "--ep-size", "1", "--output", str(path), "--corpus", str(corpus)])
    return path


@pytest.fixture(scope="module")
def planned_server(tiny_path, plan, log_dir):
    args = ("--dtype", "float32", "--init-expert-location", str(plan), "--ep-dispatch-algorithm", "dynamic")
    with running_server(tiny_path, *args, log_path=log_dir / "planned-server.log") as url:
        yield url


def test_plan_moves_hash_layer_experts_off_their_trivial_slots(plan):
    layout = json.loads(plan.read_text())["physical_to_logical_map"]
    assert any(row != sorted(row) for row in layout)


def test_served_model_loads_the_plan_and_greedy_output_is_unchanged(planned_server, hf_tiny, log_dir):
    assert "init_expert_location from init_by_mapping" in (log_dir / "planned-server.log").read_text()
    prompt = random_ids(600, 1024, seed=100).tolist()
    params = {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}
    reply = requests.post(
        f"{planned_server}/generate", json={"input_ids": prompt, "sampling_params": params}, timeout=600
    )
    assert reply.status_code == 200, reply.text
    expected = hf_tiny.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)[0, 600:].tolist()
    assert reply.json()["output_ids"] == expected
