"""A checkpoint in the release's quantized format served by the real server on the CPU platform.

The oracle is HF transformers on the checkpoint's dequantized twin (the same values in float32): the quantized
model, dequantized per use, must give its logits to float rounding, holding the quantized bytes the ledger says.
"""

from __future__ import annotations

import pytest
import requests
import torch
from conftest import load_hf, random_ids
from test_v4_server import greedy, hf_logprobs, teacher_forced_logprobs

from sglang_dsv4.config import load_config
from sglang_dsv4.launch import running_server
from sglang_dsv4.memory_pool.ledger import RankLedger
from sglang_dsv4.model.weight_layout import Parallelism


@pytest.fixture(scope="module")
def quantized_server(quantized_tiny_path, log_dir):
    with running_server(quantized_tiny_path, "--dtype", "float32", log_path=log_dir / "quantized-server.log") as url:
        yield url


@pytest.fixture(scope="module")
def hf_twin(twin_path):
    return load_hf(twin_path)


def test_teacher_forced_logprobs_equal_the_dequantized_twins_in_hf(quantized_server, hf_twin):
    ids = random_ids(300, 1024, seed=52).tolist()  # past a 128-token compression block
    served = teacher_forced_logprobs(quantized_server, ids)
    assert (served - hf_logprobs(hf_twin, ids)).abs().max() <= 1e-3


def test_greedy_continuation_equals_the_dequantized_twins_in_hf(quantized_server, hf_twin):
    prompt = random_ids(200, 1024, seed=53).tolist()
    expected = hf_twin.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, 200:].tolist()
    assert greedy(quantized_server, prompt, 24) == expected


def test_resident_bytes_are_the_quantized_ones_the_ledger_says(quantized_server, quantized_tiny_path):
    info = requests.get(f"{quantized_server}/server_info", timeout=30).json()["internal_states"][0]
    config = load_config(quantized_tiny_path).without_mtp()  # the served model holds no MTP layer yet
    quantized = RankLedger(config, Parallelism(), quantized=True, dtype=torch.float32).weight_bytes()
    unquantized = RankLedger(config, Parallelism(), quantized=False, dtype=torch.float32).weight_bytes()
    assert info["dsv4_weights"]["resident_bytes_per_rank"] == [sum(quantized.values())]
    assert sum(quantized.values()) < sum(unquantized.values()) / 2
