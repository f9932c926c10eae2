"""Shared fixtures: the tiny checkpoint (built once per session) and the HF oracle on it."""

from __future__ import annotations

import contextlib
import copy
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from sglang_dsv4 import load_model
from sglang_dsv4.launch import running_server
from sglang_dsv4.tiny import build_checkpoint, build_quantized_checkpoint, dequantized_twin


@pytest.fixture(autouse=True)
def seeded_torch() -> None:
    """Torch's global generator starts from one seed in every test: its draws repeat, so a failure reproduces."""
    torch.manual_seed(0)


@pytest.fixture
def one_torch_thread():
    """One torch thread for tests that run hundreds of tiny forwards (decoding loops): more only contend on a shared host."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def quantized_tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny checkpoint in the release's quantized format: FP8 dense projections, FP4 routed experts."""
    return build_quantized_checkpoint(tmp_path_factory.mktemp("quantized-tiny"))


@pytest.fixture(scope="session")
def twin_path(quantized_tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The quantized tiny checkpoint with every weight dequantized to float32 (the same values)."""
    return dequantized_twin(quantized_tiny_path, tmp_path_factory.mktemp("dequantized-twin"))


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where servers write their logs (never into a checkpoint directory)."""
    return tmp_path_factory.mktemp("server-logs")


@pytest.fixture(scope="session")
def tiny_server_log(log_dir: Path) -> Path:
    return log_dir / "tiny-server.log"


@pytest.fixture(scope="session")
def tiny_server(tiny_path: Path, tiny_server_log: Path) -> Iterator[str]:
    """One float32 server of the tiny checkpoint with SGLang's cache report, shared by every module that
    needs it as it starts (a server start costs about a minute of CI on two cores). Its prefix cache is
    shared too: a test flushes it where it counts cached tokens, and sets back any mode it changes."""
    with running_server(tiny_path, "--dtype", "float32", "--enable-cache-report", log_path=tiny_server_log) as url:
        yield url


@pytest.fixture(scope="session")
def sglang_with_plugin() -> None:
    """SGLang's plugins loaded in this process, as in a launcher's or a server's, every hook the plugin needs
    applied."""
    from sglang.srt.plugins import load_plugins

    from sglang_dsv4.required_hooks import require_hooks_applied

    load_plugins()
    require_hooks_applied()


@pytest.fixture
def plugin_in_own_registry(monkeypatch) -> None:
    """The plugin registered and its hooks applied in a hook registry of the test's own: the hooks the session
    loaded into this process (:func:`sglang_with_plugin`) stay registered and applied after it."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_dsv4 import plugin

    monkeypatch.setattr(HookRegistry, "_hooks", defaultdict(list))
    monkeypatch.setattr(HookRegistry, "_patched", set())
    plugin.register()
    HookRegistry.apply_hooks()


@pytest.fixture(scope="session")
def tiny_model(tiny_path: Path):
    return load_model(tiny_path)


@pytest.fixture(scope="session")
def float64_tiny_model(tiny_model):
    """The tiny model in float64, for FP8 pools: two forwards of the same tokens chunked differently then differ
    by far less than it takes to flip an FP8 rounding, so both read the same stored rows. In float32 their 1e-7
    differences flip one now and then, and the next layers carry it on (measured: one flipped value in layer 2
    changed 52 of 100 entries of layer 3, logits by 0.6 of 28)."""
    return copy.deepcopy(tiny_model).double()


@pytest.fixture(params=["float32", "fp8"])
def model_and_kv_dtype(request, tiny_model, float64_tiny_model):
    """The float32 model over float32 pools, or the float64 model over FP8 pools (``--kv-cache-dtype fp8_e4m3``)."""
    if request.param == "float32":
        return tiny_model, torch.float32
    return float64_tiny_model, torch.float8_e4m3fn


@pytest.fixture(scope="session")
def hf_tiny(tiny_path: Path):
    return load_hf(tiny_path)


def load_hf(path: Path):
    """Hugging Face transformers' own DeepseekV4ForCausalLM, float32, eager attention."""
    from transformers import DeepseekV4ForCausalLM

    return DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_logits(hf_model, ids: torch.Tensor) -> torch.Tensor:
    """HF's logits, its indexer taking the earliest of keys tied at the k-th place as ours does
    (:func:`~sglang_dsv4.kernels.sparse_torch.top_k_earliest_ties`). Its ``torch.topk`` takes some of the ties,
    which ones depending on the row's width; they occur (keys whose every head's dot is negative score exactly
    0), in the shipped checkpoint on real text."""
    with torch.no_grad(), earliest_ties_in_top_k():
        return hf_model(ids[None]).logits[0].float()


@contextlib.contextmanager
def earliest_ties_in_top_k():
    """``Tensor.topk`` with :func:`~sglang_dsv4.kernels.sparse_torch.top_k_earliest_ties`'s rule, meanwhile
    (rows without ties get ``torch.topk``'s values and slots)."""
    from sglang_dsv4.kernels.sparse_torch import top_k_earliest_ties

    def top_k(scores: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):
        assert largest, "HF's top-k calls take the largest"
        values, slots = top_k_earliest_ties(scores.movedim(dim, -1), k)
        return torch.return_types.topk((values.movedim(-1, dim), slots.movedim(-1, dim)))

    saved = torch.Tensor.topk
    torch.Tensor.topk = top_k
    try:
        yield
    finally:
        torch.Tensor.topk = saved


def random_ids(length: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed))


def assert_close_to_scale(actual: torch.Tensor, expected: torch.Tensor, rel: float) -> None:
    """Max abs difference within ``rel`` of the expected logits' scale (their max magnitude)."""
    scale = expected.abs().max().item()
    diff = (actual - expected).abs().max().item()
    assert diff <= rel * scale, f"max |diff| {diff:.3g} above {rel} x logit scale {scale:.3g}"
