"""A forward that raises fails only its batch's requests (HTTP 500 with the reason); the server keeps serving.

Faults come from ``fault_plugin`` (this folder), registered in the server's process through an
entry point written here: with SGLang's overlap scheduler (the default) and without it.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
from pathlib import Path

import pytest
import requests
from conftest import random_ids
from fault_plugin import DECODE_FAULT, PREFILL_FAULT, SAMPLING_FAULT
from serving_checks import assert_healthy, assert_pools_idle, generate, greedy

from sglang_dsv4.launch import running_server

TESTS = Path(__file__).parent
# Innocent prompts never end with a marker (ids 1019-1021), so none of their prefills fails.
INNOCENT_VOCAB = 1000


def install_fault_plugin(folder: Path) -> Path:
    """An entry point (group ``sglang.srt.plugins``) for ``fault_plugin``, in ``folder``; returns it."""
    dist_info = folder / "dsv4_fault_plugin-0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: dsv4-fault-plugin\nVersion: 0\n")
    (dist_info / "entry_points.txt").write_text("[sglang.srt.plugins]\ndsv4_fault_plugin = fault_plugin:register\n")
    return folder


@pytest.fixture(scope="module", params=["overlap", "no-overlap"])
def server(request, tiny_path, log_dir, tmp_path_factory):
    plugin_folder = install_fault_plugin(tmp_path_factory.mktemp("fault-plugin"))
    path = os.pathsep.join(p for p in (str(plugin_folder), str(TESTS), os.environ.get("PYTHONPATH")) if p)
    args = ["--dtype", "float32", *(["--disable-overlap-schedule"] if request.param == "no-overlap" else [])]
    log = log_dir / f"containment-{request.param}.log"
    with running_server(tiny_path, *args, log_path=log, env={"PYTHONPATH": path}) as url:
        yield url


def innocent_prompts() -> list[list[int]]:
    return [random_ids(n, INNOCENT_VOCAB, seed=200 + n).tolist() for n in (7, 40, 130)]


def marked(marker: int, seed: int) -> list[int]:
    return random_ids(40, INNOCENT_VOCAB, seed=seed).tolist() + [marker]


def assert_failed_by(reply: requests.Response, fault: str) -> None:
    assert reply.status_code == 500, reply.text
    assert f"InjectedFault: injected {fault} fault" in reply.text and "keeps serving" in reply.text


def test_prefill_fault_fails_its_request_with_http_500_and_changes_nothing_else(server):
    prompts = innocent_prompts()
    before = [greedy(server, ids, 16) for ids in prompts]
    params = {"max_new_tokens": 8, "temperature": 0}
    assert_failed_by(generate(server, marked(PREFILL_FAULT, 1), sampling_params=params), "prefill")
    assert_healthy(server)
    assert [greedy(server, ids, 16) for ids in prompts] == before
    assert_pools_idle(server)


def test_decode_fault_among_concurrent_requests_fails_only_its_batch(server):
    prompts = innocent_prompts()
    before = [greedy(server, ids, 24) for ids in prompts]
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(len(prompts) + 1) as pool:
        faulty = pool.submit(generate, server, marked(DECODE_FAULT, 2), sampling_params=params)
        innocent = [pool.submit(generate, server, ids, sampling_params=params) for ids in prompts]
        assert_failed_by(faulty.result(), "decode")
        replies = [future.result() for future in innocent]
    # A request that shared the failing decode batch fails with it, cleanly; the others complete unchanged.
    for reply, expected in zip(replies, before, strict=True):
        if reply.status_code == 200:
            assert reply.json()["output_ids"] == expected
        else:
            assert_failed_by(reply, "decode")
    assert [greedy(server, ids, 24) for ids in prompts] == before
    assert_pools_idle(server)


def test_sampling_fault_of_a_grammar_constrained_request_is_contained(server):
    # With the overlap scheduler, a grammar-constrained batch is sampled after its forward.
    params = {"max_new_tokens": 8, "temperature": 0, "regex": "[0-9 ]+"}
    assert_failed_by(generate(server, marked(SAMPLING_FAULT, 3), sampling_params=params), "sampling")
    reply = generate(server, marked(7, 3), sampling_params=params)
    assert reply.status_code == 200, reply.text
    assert_pools_idle(server)


def test_streaming_client_gets_the_failure_as_its_last_event(server):
    payload = {"input_ids": marked(DECODE_FAULT, 4), "sampling_params": {"max_new_tokens": 32}, "stream": True}
    with requests.post(f"{server}/generate", json=payload, stream=True, timeout=120) as reply:
        events = [line for line in reply.iter_lines() if line and line != b"data: [DONE]"]
    finish = json.loads(events[-1].removeprefix(b"data: "))["meta_info"]["finish_reason"]
    assert finish["type"] == "abort" and finish["status_code"] == 500
    assert "injected decode fault" in finish["message"]
    assert_pools_idle(server)


def test_openai_route_answers_an_openai_error_body(server):
    payload = {"model": "tiny", "prompt": marked(PREFILL_FAULT, 5), "max_tokens": 4}
    reply = requests.post(f"{server}/v1/completions", json=payload, timeout=120)
    assert reply.status_code == 500, reply.text
    assert reply.json()["object"] == "error" and "injected prefill fault" in reply.json()["message"]
    assert_pools_idle(server)
