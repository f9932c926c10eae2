"""No request can take the tiny V4 server down: what would fail inside the scheduler is refused with an
HTTP 400 that names the field and the limit."""

from __future__ import annotations

import pytest
import requests
from serving_checks import assert_healthy
from sglang_dsv4.launch import running_server
from sglang_dsv4.serving.validation import MAX_SAMPLES_PER_REQUEST, MAX_TOP_LOGPROBS

VOCAB = 1024


@pytest.fixture(scope="module")
def server(tiny_path, log_dir):
    with running_server(tiny_path, "--dtype", "float32", log_path=log_dir / "untrusted-server.log") as url:
        yield url


def post(url: str, route: str, payload: dict) -> requests.Response:
    return requests.post(f"{url}{route}", json=payload, timeout=120)


def assert_refused(reply: requests.Response, *phrases: str) -> None:
    assert reply.status_code == 400, reply.text
    assert all(phrase in reply.text for phrase in phrases), reply.text


# Refusals. Each of these took the whole server down, or tied it up, before the checks.

PROMPT = [5, 6, 7, 8, 9]


@pytest.mark.parametrize("count", [-1, MAX_TOP_LOGPROBS + 1, VOCAB + 1, 2**40])
def test_top_logprobs_num_out_of_range_is_refused(server, count):
    payload = {"input_ids": PROMPT, "return_logprob": True, "top_logprobs_num": count}
    assert_refused(post(server, "/generate", payload), "top_logprobs_num", f"[0, {MAX_TOP_LOGPROBS}]", str(count))


def test_top_logprobs_num_at_the_bound_is_served(server):
    payload = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}, "return_logprob": True}
    reply = post(server, "/generate", {**payload, "top_logprobs_num": MAX_TOP_LOGPROBS})
    assert reply.status_code == 200, reply.text
    assert len(reply.json()["meta_info"]["output_top_logprobs"][0]) == MAX_TOP_LOGPROBS


def test_openai_logprob_counts_out_of_range_are_refused_with_openai_names(server):
    completion = {"model": "tiny", "prompt": "fix the test", "max_tokens": 2, "logprobs": MAX_TOP_LOGPROBS + 1}
    assert_refused(post(server, "/v1/completions", completion), "logprobs must be in", '"object":"error"')
    messages = [{"role": "user", "content": "fix the test"}]
    chat = {"model": "tiny", "messages": messages, "max_tokens": 2, "logprobs": True, "top_logprobs": -1}
    assert_refused(post(server, "/v1/chat/completions", chat), "top_logprobs must be in", '"object":"error"')


@pytest.mark.parametrize("n", [0, MAX_SAMPLES_PER_REQUEST + 1, 10**9])
def test_sample_count_out_of_range_is_refused_on_every_route(server, n):
    limit = f"[1, {MAX_SAMPLES_PER_REQUEST}]"
    assert_refused(post(server, "/generate", {"input_ids": PROMPT, "sampling_params": {"n": n}}), "n must be in", limit)
    completion = {"model": "tiny", "prompt": "fix", "max_tokens": 2, "n": n}
    assert_refused(post(server, "/v1/completions", completion), "n must be in", limit)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "fix"}], "max_tokens": 2, "n": n}
    assert_refused(post(server, "/v1/chat/completions", chat), "n must be in", limit)


@pytest.mark.parametrize("prompt", [{"text": ""}, {"text": ["fix", ""]}, {"input_ids": [[]]}])
def test_prompt_that_tokenizes_to_nothing_is_refused(server, prompt):
    assert_refused(post(server, "/generate", {**prompt, "sampling_params": {"max_new_tokens": 2}}), "prompt is empty")


def test_top_k_beyond_int32_is_refused(server):
    payload = {"input_ids": PROMPT, "sampling_params": {"top_k": 2**31}}
    assert_refused(post(server, "/generate", payload), "top_k", str(2**31 - 1))


def test_logprob_start_below_minus_one_is_refused(server):
    payload = {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": -2}
    assert_refused(post(server, "/generate", payload), "logprob_start_len must be -1")


def test_upstream_refusals_are_kept(server):
    # SGLang's own answers: a logprob start beyond the prompt, logprob token ids outside the vocabulary.
    payload = {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": 6}
    assert_refused(post(server, "/generate", payload), "logprob_start_len")
    payload = {"input_ids": PROMPT, "return_logprob": True, "token_ids_logprob": [VOCAB]}
    assert_refused(post(server, "/generate", payload), f"[0, {VOCAB})")
    assert_healthy(server)
