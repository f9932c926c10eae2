"""No request can take the tiny V4 server down: refusals that name the field and the limit, then fuzzing.

The fuzz test sends batches of generated requests (random JSON shapes, wrong types, huge and
negative numbers, unicode, ids at the vocabulary edge, clients that disconnect while streaming
or waiting) to ``/generate``, ``/v1/completions`` and ``/v1/chat/completions``, with correct
requests among them. After each batch the server answers ``/health``, the correct requests gave
the greedy outputs they gave before any fuzzing, and once idle the pools are whole. Batches are
sent for ``DSV4_FUZZ_SECONDS`` (default 40; the long mode for the benchmark directory sets, say, 3600).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import time
from dataclasses import dataclass

import pytest
import requests
from conftest import random_ids
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from serving_checks import assert_healthy, assert_pools_idle, greedy, reported_if_down

from sglang_dsv4.serving.validation import (
    MAX_LOGIT_BIAS,
    MAX_SAMPLES_PER_REQUEST,
    MAX_TOP_LOGPROBS,
    MIN_REPETITION_PENALTY,
)

VOCAB = 1024
FUZZ_SECONDS = float(os.environ.get("DSV4_FUZZ_SECONDS", "40"))
REQUESTS_PER_BATCH = 32  # hypothesis overruns its example buffer on much larger batches
CLIENTS = 16  # concurrent connections: the served requests of a batch decode together
CLIENT_TIMEOUT_S = 10  # a request still running then is dropped by its client (the server aborts it)
CONTAINED_FAILURE = "keeps serving"  # in the 500 of a request whose forward raised (serving.containment)


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


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


def test_empty_sampling_params_list_is_refused(server):
    assert_refused(post(server, "/generate", {"input_ids": PROMPT, "sampling_params": []}), "sampling_params must be")


def test_top_k_beyond_int32_is_refused(server):
    payload = {"input_ids": PROMPT, "sampling_params": {"top_k": 2**31}}
    assert_refused(post(server, "/generate", payload), "top_k", str(2**31 - 1))


# The request the fuzzer found (with top_p and min_p set, the batch's sampling raised on NaN probabilities).
NAN_LOGITS = {"repetition_penalty": 1.8e-201, "top_p": 0.49, "min_p": 0.15, "temperature": 0.95}


@pytest.mark.parametrize(
    "sampling,refusal",
    [
        (NAN_LOGITS, f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, 2]"),
        ({"repetition_penalty": 0.0}, f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, 2]"),
        ({"logit_bias": {"5": 1e308}}, f"logit_bias values must be in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}]"),
        ({"logit_bias": {"5": -101}}, f"logit_bias values must be in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}]"),
    ],
)
def test_sampling_values_that_make_the_logits_non_finite_are_refused_on_every_route(server, sampling, refusal):
    payload = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, **sampling}}
    assert_refused(post(server, "/generate", payload), refusal)
    completion = {"model": "tiny", "prompt": "fix", "max_tokens": 2, **sampling}
    assert_refused(post(server, "/v1/completions", completion), refusal, '"object":"error"')
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "fix"}], "max_tokens": 2, **sampling}
    assert_refused(post(server, "/v1/chat/completions", chat), refusal, '"object":"error"')


def test_strongest_repetition_penalty_and_logit_bias_are_served(server):
    strongest = {
        "repetition_penalty": MIN_REPETITION_PENALTY,
        "logit_bias": {"5": MAX_LOGIT_BIAS, "6": -MAX_LOGIT_BIAS},
    }
    sampling = {"max_new_tokens": 3, "top_p": 0.49, "min_p": 0.15, **strongest}
    reply = post(server, "/generate", {"input_ids": PROMPT, "sampling_params": sampling})
    assert reply.status_code == 200, reply.text
    output = reply.json()["output_ids"]
    assert len(output) == 3 and output[0] == 5  # the bias forces the first token


def test_a_sampled_request_whose_grammar_leaves_no_token_fails_alone(server, references):
    # The regex is complete after one token, and min_tokens then masks EOS too: no token is left.
    # Found by the fuzzer: sampled (top_p below 1), the row's NaN probabilities failed the whole batch.
    dead_end = {"model": "tiny", "prompt": "fix", "max_tokens": 4, "regex": "a", "min_tokens": 2, "top_p": 0.5}
    reference = references[0]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        refused = pool.submit(post, server, "/v1/completions", dead_end)
        neighbour = pool.submit(greedy, server, reference.ids, 8)
        assert CONTAINED_FAILURE not in refused.result().text, refused.result().text
        assert neighbour.result() == reference.output


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


# Fuzzing.


@dataclass(frozen=True)
class Probe:
    """One generated request and how its client behaves."""

    route: str
    body: object  # a JSON value, or raw bytes that are not valid JSON
    stream_lines_before_disconnect: int | None = None  # streaming: close the connection after this many lines
    client_timeout_s: float = CLIENT_TIMEOUT_S


EDGE_INTS = [-(2**63), -(2**31) - 1, -(2**31), -2, -1, 0, 1, 2, VOCAB - 1, VOCAB, VOCAB + 1]
EDGE_INTS += [2**31 - 1, 2**31, 2**53, 2**63 - 1, 2**64]
edge_ints = st.sampled_from(EDGE_INTS) | st.integers(-3, 40)
numbers = edge_ints | st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from([0.0, -0.0, 1e-30, 1e308])


def weighted(common: st.SearchStrategy, rare: st.SearchStrategy, common_share: int) -> st.SearchStrategy:
    """``common`` ``common_share`` times out of ``common_share + 1`` (``one_of`` alone favours no branch)."""
    return st.sampled_from([True] * common_share + [False]).flatmap(lambda common_now: common if common_now else rare)


def mostly(served: st.SearchStrategy, edges: st.SearchStrategy) -> st.SearchStrategy:
    """Values the server serves four times in five (so that requests reach the scheduler), edge values otherwise."""
    return weighted(served, edges, 4)


token_ids = mostly(st.integers(0, VOCAB - 1), edge_ints)
texts = st.text(max_size=40) | st.sampled_from(["", " ", "\u0000", "🙂" * 50, "<|im_start|>", "a" * 3000])
json_values = st.recursive(
    st.none() | st.booleans() | numbers | texts,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=10,
)
small_counts = mostly(st.integers(0, 4), edge_ints)
sample_counts = mostly(st.integers(1, 2), edge_ints)
top_ks = mostly(st.sampled_from([-1, 1, 2, 50, VOCAB, 10**6]), edge_ints)
seeds = mostly(st.integers(0, 2**31), edge_ints)
fractions = mostly(st.floats(0, 1), numbers)
biases = st.dictionaries(token_ids.map(str), mostly(st.floats(-100, 100), numbers), max_size=3)
# Lengths that are served stay short (a batch takes seconds); the others are refused (negative, beyond the context).
new_token_counts = mostly(st.integers(1, 4), st.sampled_from([-1, 0, 65536, 2**31, 2**63 - 1]))


def fields(required: dict, optional: dict) -> st.SearchStrategy[dict]:
    """Plausible requests: the required fields, some optional ones; a value is junk one time in 25."""

    def junk_or(strategy):
        return weighted(strategy, json_values, 24)

    return st.fixed_dictionaries(
        {name: junk_or(value) for name, value in required.items()},
        optional={name: junk_or(value) for name, value in optional.items()},
    )


def merged(*parts: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    return st.tuples(*parts).map(lambda dicts: {key: value for part in dicts for key, value in part.items()})


sampling_params = fields(
    {"max_new_tokens": new_token_counts},
    {
        "temperature": fractions, "top_p": fractions, "top_k": top_ks, "min_p": fractions,
        "frequency_penalty": fractions, "presence_penalty": fractions, "repetition_penalty": fractions,
        "min_new_tokens": small_counts, "n": sample_counts, "ignore_eos": st.booleans(),
        "stop": texts | st.lists(texts, max_size=3), "stop_token_ids": st.lists(token_ids, max_size=3),
        "logit_bias": biases, "sampling_seed": seeds,
        "regex": st.sampled_from(["[0-9]+", "((", "a{0,100000}", ".*"]),
        "json_schema": st.sampled_from(['{"type": "object"}', "{not json", '{"type": "nonsense"}']),
        "skip_special_tokens": st.booleans(), "no_stop_trim": st.booleans(),
    },
)  # fmt: skip
prompt_ids = mostly(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40), st.lists(token_ids, max_size=40))
prompts = fields({"input_ids": prompt_ids | st.lists(prompt_ids, max_size=3)}, {}) | fields(
    {"text": texts | st.lists(texts, max_size=3)}, {}
)
generate_options = fields(
    {"sampling_params": sampling_params | st.lists(sampling_params, max_size=2)},
    {
        "return_logprob": st.booleans(), "logprob_start_len": small_counts, "top_logprobs_num": small_counts,
        "token_ids_logprob": st.lists(token_ids, max_size=4), "stream": st.booleans(),
        "return_text_in_logprobs": st.booleans(),
    },
)  # fmt: skip
# Fields this server refuses or rarely serves (embeddings on V4, LoRA, sessions, caller-chosen ids).
exotic_options = fields(
    {},
    {
        "rid": texts, "input_embeds": st.lists(st.lists(numbers, max_size=3), max_size=2),
        "session_params": json_values, "lora_path": texts, "text": texts,
    },
)  # fmt: skip
generate_bodies = merged(prompts, generate_options) | merged(prompts, generate_options, exotic_options)
openai_sampling = {
    "temperature": fractions, "top_p": fractions, "top_k": top_ks, "n": sample_counts, "stream": st.booleans(),
    "stop": texts | st.lists(texts, max_size=3), "seed": seeds, "presence_penalty": fractions,
    "frequency_penalty": fractions, "logit_bias": biases,
    "min_tokens": small_counts, "ignore_eos": st.booleans(), "regex": st.sampled_from(["[a-z ]+", "(("]),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
}  # fmt: skip
completion_bodies = fields(
    {"model": st.just("tiny"), "prompt": texts | st.lists(texts, max_size=3) | prompt_ids,
     "max_tokens": new_token_counts},
    {"logprobs": small_counts, "echo": st.booleans(),
     "best_of": small_counts, "suffix": texts, **openai_sampling},
)  # fmt: skip
roles = mostly(st.sampled_from(["system", "user", "assistant"]), st.sampled_from(["tool", "developer"]) | texts)
content_parts = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": texts})
messages = st.lists(
    fields({"role": roles, "content": mostly(texts, st.lists(content_parts, max_size=2))}, {"name": texts}),
    min_size=1,
    max_size=4,
)
chat_bodies = fields(
    {"model": st.just("tiny"), "messages": messages, "max_tokens": new_token_counts},
    {"max_completion_tokens": new_token_counts,
     "logprobs": st.booleans(), "top_logprobs": small_counts,
     "response_format": st.sampled_from([{"type": "json_object"}, {"type": "text"}, {"type": "bogus"}]),
     "tools": json_values, "tool_choice": st.sampled_from(["auto", "none", "required"]) | json_values,
     "continue_final_message": st.booleans(), **openai_sampling},
)  # fmt: skip
ROUTE_BODIES = {"/generate": generate_bodies, "/v1/completions": completion_bodies, "/v1/chat/completions": chat_bodies}
raw_bodies = st.sampled_from([b"", b"{", b"[]", b"null", b'{"input_ids": [1, 2, NaN]}', b"[" * 5000 + b"]" * 5000])
raw_bodies |= st.sampled_from([b'{"text": "\\ud800", "sampling_params": {"max_new_tokens": 2}}'])  # a lone surrogate
raw_bodies |= st.binary(max_size=64)


@st.composite
def probes(draw) -> Probe:
    route = draw(st.sampled_from(sorted(ROUTE_BODIES)))
    body = draw(weighted(ROUTE_BODIES[route], json_values | raw_bodies, 3))
    if isinstance(body, dict) and body.get("stream") is True:
        return Probe(route, body, stream_lines_before_disconnect=draw(st.sampled_from([0, 1, 2, 5, 10**6])))
    timeout = draw(st.sampled_from([CLIENT_TIMEOUT_S] * 4 + [0.05, 0.5]))  # some clients give up early
    return Probe(route, body, client_timeout_s=timeout)


def send(url: str, probe: Probe) -> None:
    """Send the probe and read its answer as its client would; a forward that failed on it is a finding."""
    data = probe.body if isinstance(probe.body, bytes) else json.dumps(probe.body).encode()
    headers = {"Content-Type": "application/json"}
    streaming = probe.stream_lines_before_disconnect is not None
    try:
        with requests.post(
            f"{url}{probe.route}", data=data, headers=headers, stream=streaming, timeout=probe.client_timeout_s
        ) as reply:
            if streaming:
                read = []
                for line in reply.iter_lines():
                    read.append(line.decode(errors="replace"))
                    if len(read) > probe.stream_lines_before_disconnect:
                        break  # leaving the block closes the connection mid-stream
                answer = "\n".join(read)
            else:
                answer = reply.text
    except requests.RequestException:
        return  # the client gave up (timeout) or the server closed a stream it refused
    # Validation let through something that failed inside the scheduler (contained by serving.containment).
    assert CONTAINED_FAILURE not in answer, f"a forward failed on {probe}: {answer}"


@dataclass(frozen=True)
class Reference:
    """A correct request, its greedy output measured before any fuzzing."""

    ids: list[int]
    output: list[int]


@pytest.fixture(scope="module")
def references(server) -> list[Reference]:
    prompts = [random_ids(n, VOCAB, seed=300 + n).tolist() for n in (9, 150)]
    return [Reference(ids, greedy(server, ids, 8)) for ids in prompts]


@pytest.fixture(scope="module")
def fuzz_deadline(server) -> float:
    return time.monotonic() + FUZZ_SECONDS


@settings(
    # An upper bound (a batch takes two seconds or more); the batches drawn after the deadline are not sent.
    max_examples=int(FUZZ_SECONDS / 2),
    deadline=None,
    phases=[Phase.generate],  # a failing batch is reported as sent; shrinking would replay it on a changed server
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(batch=st.lists(probes(), min_size=REQUESTS_PER_BATCH, max_size=REQUESTS_PER_BATCH))
def test_fuzzed_requests_never_take_the_server_down(server, tiny_server_log, references, fuzz_deadline, batch):
    if time.monotonic() > fuzz_deadline:
        return
    with reported_if_down(tiny_server_log, batch), concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
        fuzzed = [pool.submit(send, server, probe) for probe in batch]
        correct = [pool.submit(greedy, server, ref.ids, 8) for ref in references]
        for future in fuzzed:
            future.result()
        assert [future.result() for future in correct] == [ref.output for ref in references]
        assert_healthy(server)
        assert_pools_idle(server)
