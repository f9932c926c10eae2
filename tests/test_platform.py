"""The torch-native CPU platform serves a model that is not V4: a tiny Llama, against HF."""

from __future__ import annotations

from pathlib import Path

import pytest
import requests
import torch

from sglang_dsv4 import platform
from sglang_dsv4.launch import running_server
from sglang_dsv4.tiny import shipped_tokenizer


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("llama")
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(40)  # peaked next-token distributions
    model.save_pretrained(path)
    shipped_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llama_server(llama_path: Path):
    with running_server(llama_path, "--dtype", "float32", log_path=llama_path / "server.log") as url:
        yield url


def test_platform_activates_only_without_gpu_and_unless_turned_off(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert platform.activate() == "sglang_dsv4.platform.TorchCpuPlatform"
    monkeypatch.setenv("SGLANG_DSV4_PLUGIN_CPU_PLATFORM", "off")
    assert platform.activate() is None
    monkeypatch.delenv("SGLANG_DSV4_PLUGIN_CPU_PLATFORM")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert platform.activate() is None


def test_tiny_llama_greedy_generation_matches_hf(llama_server, llama_path):
    from transformers import LlamaForCausalLM

    prompt = [0, 17, 400, 33, 900, 5, 61, 200, 12, 77]
    reply = requests.post(
        f"{llama_server}/generate",
        json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}},
        timeout=120,
    )
    assert reply.status_code == 200, reply.text
    hf = LlamaForCausalLM.from_pretrained(llama_path, dtype=torch.float32).eval()
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt) :]
    assert reply.json()["output_ids"] == expected.tolist()


def test_tiny_llama_serves_openai_chat(llama_server):
    reply = requests.post(
        f"{llama_server}/v1/chat/completions",
        json={"model": "llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        timeout=120,
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 4
