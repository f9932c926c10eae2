"""``--tp 2`` and ``--tp 2 --ep-size 2`` on the CPU (gloo, two scheduler processes) against one process.

Nothing is set in the environment for the ranks: the platform deals this host's cores out
to them. Each rank holds its query heads, output groups, vocabulary rows and expert share
(SGLang's parallel layers and ``FusedMoE``), the replicated KV head in its own pools, and
its own prefix tree, which must stay equal to every other rank's.
"""

from __future__ import annotations

import os

import psutil
import pytest
import requests
import torch
from conftest import random_ids
from serving_checks import assert_pools_idle, greedy

from sglang_dsv4.launch import running_server

# Prompts inside one window, past two ratio-4 blocks of entries, and past ratio-128 blocks.
PROMPT_LENGTHS = (5, 300, 700)


def _serve(tiny_path, log_path, *args):
    return running_server(tiny_path, "--dtype", "float32", *args, log_path=log_path)


@pytest.fixture(scope="module")
def single(tiny_server):
    return tiny_server


@pytest.fixture(scope="module")
def tp2(tiny_path, log_dir):
    os.environ.pop("SGLANG_CPU_OMP_THREADS_BIND", None)
    with _serve(tiny_path, log_dir / "tp2-server.log", "--tp", "2") as url:
        yield url


@pytest.fixture(scope="module")
def tp2_ep2(tiny_path, log_dir):
    os.environ.pop("SGLANG_CPU_OMP_THREADS_BIND", None)
    with _serve(tiny_path, log_dir / "tp2-ep2-server.log", "--tp", "2", "--ep-size", "2") as url:
        yield url


@pytest.fixture(params=["tp2", "tp2_ep2"])
def parallel(request) -> tuple[str, int]:
    """A two-rank server and its expert-parallel size."""
    return request.getfixturevalue(request.param), 2 if request.param == "tp2_ep2" else 1


def _logprobs(url: str, ids: list[int], new_tokens: int, start: int = 0) -> dict:
    """Greedy tokens, and prompt logprobs from position ``start`` (SGLang resumes no further than it)."""
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    payload = {"input_ids": ids, "sampling_params": params, "return_logprob": True, "logprob_start_len": start}
    reply = requests.post(f"{url}/generate", json=payload, timeout=600)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _prompt_logprobs(reply: dict) -> torch.Tensor:
    return torch.tensor([entry[0] for entry in reply["meta_info"]["input_token_logprobs"][1:]])


def _internal_state(url: str) -> dict:
    return requests.get(f"{url}/server_info", timeout=60).json()["internal_states"][0]


def test_each_rank_runs_on_its_own_cores(parallel):
    url, _ = parallel
    port = int(url.rsplit(":", 1)[1])
    server = next(p for p in psutil.process_iter(["cmdline"]) if str(port) in " ".join(p.info["cmdline"] or []))
    ranks = [child for child in server.children(recursive=True) if "TP" in child.name()]
    assert len(ranks) == 2, [child.name() for child in server.children(recursive=True)]
    cores = [set(rank.cpu_affinity()) for rank in ranks]
    assert cores[0].isdisjoint(cores[1]) and all(cores), cores


def test_greedy_tokens_and_prompt_logprobs_equal_the_single_process_server(parallel, single, hf_tiny):
    url, _ = parallel
    for seed, length in enumerate(PROMPT_LENGTHS):
        prompt = random_ids(length, 1024, seed=300 + seed).tolist()
        expected, served = _logprobs(single, prompt, 16), _logprobs(url, prompt, 16)
        assert served["output_ids"] == expected["output_ids"], length
        difference = (_prompt_logprobs(served) - _prompt_logprobs(expected)).abs().max().item()
        assert difference <= 1e-4, f"{length} tokens: prompt logprobs differ by {difference:.3g}"
    prompt = random_ids(300, 1024, seed=300 + 1)
    hf_tokens = hf_tiny.generate(prompt[None], max_new_tokens=16, do_sample=False)[0, 300:].tolist()
    assert greedy(url, prompt.tolist(), 16) == hf_tokens


def test_turns_resume_from_the_cache_as_on_one_process_with_every_rank_agreeing(parallel, single):
    url, _ = parallel
    for server in (single, url):
        requests.post(f"{server}/flush_cache", timeout=60).raise_for_status()
    history, resumable = random_ids(260, 1024, seed=400).tolist(), 0
    for turn in range(3):
        expected, served = _logprobs(single, history, 8, resumable), _logprobs(url, history, 8, resumable)
        assert served["output_ids"] == expected["output_ids"], turn
        cached = served["meta_info"]["cached_tokens"]
        assert cached == expected["meta_info"]["cached_tokens"], turn
        if turn:
            assert cached > 0, "a later turn resumed nothing from the cache"
        difference = (_prompt_logprobs(served) - _prompt_logprobs(expected)).abs().max().item()
        assert difference <= 1e-4, f"turn {turn}: prompt logprobs differ by {difference:.3g}"
        resumable = len(history) + len(served["output_ids"]) - 1
        history += served["output_ids"] + random_ids(37, 1024, seed=410 + turn).tolist()
    report = _internal_state(url)["dsv4_prefix_cache"]
    assert report["tp_digest_mismatches"] == 0
    assert set(report["rows_miscounted"].values()) == {0}, report["rows_miscounted"]
    assert_pools_idle(url)
    assert _internal_state(url)["dsv4_prefix_cache"]["tp_digest_mismatches"] == 0


def test_each_rank_holds_the_weight_bytes_the_ledger_says(parallel, tiny_model):
    from sglang_dsv4.memory_pool.ledger import RankLedger
    from sglang_dsv4.model.weight_layout import Parallelism

    url, ep = parallel
    # The served model holds no MTP layer yet (speculative serving is issue 26's).
    config = tiny_model.config.without_mtp()
    ledger = RankLedger(config, Parallelism(tp=2, ep=ep), quantized=False, dtype=torch.float32)
    assert _internal_state(url)["dsv4_weights"]["resident_bytes_per_rank"] == [sum(ledger.weight_bytes().values())] * 2
