"""The prefix cache through the real server: every agentic turn resumes token-exact.

A cold prefill (the same server after ``/flush_cache``) is the oracle for every cached
path: outputs and logprobs of resumed requests must equal it.
"""

from __future__ import annotations

import concurrent.futures
import json
import random
from pathlib import Path

import pytest
import requests
from conftest import random_ids
from test_v4_server import assert_everything_free, pool_usage

from sglang_dsv4.agentperf.trajectory import SESSION_TOOLS
from sglang_dsv4.prefix_cache import mode_code

# The first turns of one recorded session of ../shared/data/agentic_trajectories.jsonl.gz (messages cut to
# 400 characters), kept with the tests so they need nothing outside the repository.
RECORDED_SESSION = Path(__file__).with_name("data") / "recorded_session_excerpt.json"
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


def generate(url: str, ids: list[int], max_new_tokens: int, logprobs_from: int | None = None) -> dict:
    """Greedy; with ``logprobs_from``, the teacher-forced logprobs of the prompt from there on
    (SGLang then reuses at most that many tokens)."""
    payload = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
    if logprobs_from is not None:
        payload.update(return_logprob=True, logprob_start_len=logprobs_from)
    response = requests.post(f"{url}/generate", json=payload, timeout=300)
    response.raise_for_status()
    return response.json()


def prompt_logprobs(result: dict) -> list[float]:
    return [entry[0] for entry in result["meta_info"]["input_token_logprobs"][1:]]


def updated(response: requests.Response) -> bool:
    assert response.status_code == 200, response.text
    return all(response.json())  # SGLang answers one flag per scheduler


def set_modes(url: str, **modes: str) -> None:
    args = {f"dsv4_{name}": mode_code(f"dsv4_{name}", value) for name, value in modes.items()}
    response = requests.post(f"{url}/set_internal_state", json={"server_args": args}, timeout=30)
    assert updated(response), response.text
    state = requests.get(f"{url}/server_info", timeout=30).json()["internal_states"][0]["dsv4_prefix_cache"]
    assert {name: state[name] for name in modes} == modes


def prefix_cache_state(url: str) -> dict:
    return requests.get(f"{url}/server_info", timeout=30).json()["internal_states"][0]["dsv4_prefix_cache"]


def flush(url: str) -> None:
    assert requests.post(f"{url}/flush_cache", timeout=30).status_code == 200


def conversation(url: str, turns: int, seed: int, first: int = 301) -> list[tuple[list[int], dict, int]]:
    """A conversation whose history grows with the model's own output and tool outputs of odd
    lengths: per turn, the prompt, the reply, and where the reply's prompt logprobs start (what
    the previous turn left reusable: its prompt and output but the last token)."""
    rng = random.Random(seed)
    history, reusable = random_ids(first, 1024, seed=seed).tolist(), 0
    results = []
    for _ in range(turns):
        result = generate(url, history, rng.randrange(3, 24), logprobs_from=reusable)
        results.append((history, result, reusable))
        tool_output = [rng.randrange(1024) for _ in range(rng.randrange(1, 90) | 1)]
        reusable = len(history) + len(result["output_ids"]) - 1
        history = history + result["output_ids"] + tool_output
    return results


def assert_a_cold_prefill_agrees(url: str, prompt: list[int], cached: dict, reusable: int) -> None:
    """The same prompt on the flushed cache gives the cached turn's output, and its prompt's logprobs from
    ``reusable`` on within :data:`TOLERANCE`."""
    flush(url)
    cold = generate(url, prompt, len(cached["output_ids"]), logprobs_from=reusable)
    assert cold["meta_info"]["cached_tokens"] == 0
    assert cold["output_ids"] == cached["output_ids"]
    differences = [abs(a - b) for a, b in zip(prompt_logprobs(cold), prompt_logprobs(cached), strict=True)]
    assert max(differences, default=0.0) <= TOLERANCE


def test_each_agentic_turn_resumes_where_the_last_one_ended_and_matches_a_cold_prefill(server):
    flush(server)
    turns = conversation(server, turns=10, seed=7)
    for prompt, cached, reusable in turns:
        assert cached["meta_info"]["cached_tokens"] == reusable
        assert_a_cold_prefill_agrees(server, prompt, cached, reusable)
    assert set(prefix_cache_state(server)["rows_miscounted"].values()) == {0}


def test_forks_of_one_prompt_all_resume_at_its_end_and_agree(server):
    flush(server)
    prompt = random_ids(517, 1024, seed=11).tolist()
    first = generate(server, prompt, 8)
    assert first["meta_info"]["cached_tokens"] == 0
    suffixes = [random_ids(n, 1024, seed=12 + n).tolist() for n in (1, 3, 40)]
    with concurrent.futures.ThreadPoolExecutor(3) as executor:
        forks = list(executor.map(lambda s: generate(server, prompt + s, 6), suffixes))
    # The prompt's own end is checkpointed (forks, retries), so each fork reuses all of it.
    assert [f["meta_info"]["cached_tokens"] for f in forks] == [len(prompt)] * 3
    retry = generate(server, prompt, 8)  # SGLang never matches a prompt's last token
    assert retry["meta_info"]["cached_tokens"] == len(prompt) - 1
    assert retry["output_ids"] == first["output_ids"]
    flush(server)
    cold = [generate(server, prompt + s, 6) for s in suffixes]
    assert [c["output_ids"] for c in cold] == [f["output_ids"] for f in forks]


def test_sessions_diverging_mid_block_resume_from_the_interval_checkpoint_before_it(server):
    flush(server)
    interval = prefix_cache_state(server)["checkpoint_interval"]
    system = random_ids(interval + 389, 1024, seed=21).tolist()  # diverges inside a ratio-4 and a ratio-128 block
    generate(server, system + random_ids(50, 1024, seed=22).tolist(), 4)
    second_prompt = system + random_ids(61, 1024, seed=23).tolist()
    second = generate(server, second_prompt, 4)
    # No checkpoint lies at the divergence: the second session resumes from the one the
    # first took inside its prefill and prefills the rest.
    assert second["meta_info"]["cached_tokens"] == interval
    flush(server)
    assert generate(server, second_prompt, 4)["output_ids"] == second["output_ids"]


def test_aligned_mode_hits_only_at_whole_pages_and_gives_the_same_outputs(server):
    flush(server)
    set_modes(server, prefix_hits="aligned")
    try:
        turns = conversation(server, turns=4, seed=31, first=600)
        for _, cached, reusable in turns:
            assert cached["meta_info"]["cached_tokens"] == reusable // 256 * 256
        for prompt, cached, _ in turns:
            flush(server)
            assert generate(server, prompt, len(cached["output_ids"]))["output_ids"] == cached["output_ids"]
    finally:
        set_modes(server, prefix_hits="exact")


def test_a_mode_outside_the_allowed_values_is_refused_and_changes_nothing(server):
    for key in ("dsv4_prefix_hits", "dsv4_checkpoint_retention"):
        response = requests.post(f"{server}/set_internal_state", json={"server_args": {key: 2}}, timeout=30)
        assert not updated(response)
    assert prefix_cache_state(server)["prefix_hits"] == "exact"
    assert prefix_cache_state(server)["checkpoint_retention"] == "worth"
    set_modes(server, checkpoint_retention="lru")  # the baseline the retention rule is measured against
    set_modes(server, checkpoint_retention="worth")


def test_per_request_keeps_checkpoint_windows_all_committed_keeps_every_token(server):
    held, by_state, evictions = {}, {}, {}
    for policy in ("per_request", "all_committed"):
        flush(server)
        set_modes(server, window_policy=policy)
        for seed in range(3):
            conversation(server, turns=3, seed=40 + seed, first=700)
        state, usage = prefix_cache_state(server), pool_usage(server)
        held[policy] = (usage["window_slots"]["total"] - usage["window_slots"]["free"], state["checkpoints"])
        by_state[policy], evictions[policy] = state["checkpoints_by_state"], state["checkpoint_evictions"]
        assert sum(kind["count"] for kind in by_state[policy].values()) == state["checkpoints"]
        assert by_state[policy]["locked"] == {"count": 0, "window_bytes": 0}  # no request holds one now
        assert by_state[policy]["live"]["window_bytes"] > 0
    set_modes(server, window_policy="per_request")
    # Issue 29: the checkpoints each turn resumed past are superseded: per_request releases them as it
    # resumes, all_committed keeps them (to go first) and reports them with their window bytes.
    assert by_state["per_request"]["superseded"]["count"] == 0 and evictions["per_request"]["superseded_at_resume"] > 0
    assert by_state["all_committed"]["superseded"]["window_bytes"] > 0
    assert evictions["all_committed"]["superseded_at_resume"] == 0
    per_request_slots, checkpoints = held["per_request"]
    all_committed_slots, _ = held["all_committed"]
    # Nothing but checkpoint windows (128 tokens each, some shared) outlives a request...
    assert per_request_slots <= checkpoints * 128
    # ...while all_committed keeps the window of every token it ran (3 sessions of 700+).
    assert all_committed_slots > 3 * 700
    assert_everything_free(server)


def chat_prompts() -> list[list[dict]]:
    """Each request of the recorded excerpt: every message before an assistant message, tool calls and
    tool results as recorded."""
    messages, prompts = [], []
    for message in json.loads(RECORDED_SESSION.read_text())["messages"]:
        if message["role"] == "assistant":
            prompts.append([dict(m) for m in messages])
        messages.append(message)
    return prompts


def with_parsed_arguments(messages: list[dict]) -> list[dict]:
    """What SGLang's chat serving hands the template: tool-call arguments parsed from their JSON."""
    parsed = []
    for message in messages:
        calls = [
            {**call, "function": {**call["function"], "arguments": json.loads(call["function"]["arguments"])}}
            for call in message.get("tool_calls", [])
        ]
        parsed.append({**message, "tool_calls": calls} if calls else message)
    return parsed


def chat(url: str, messages: list[dict], **payload) -> dict:
    """A greedy chat turn with the recorded session's tools defined."""
    body = {"model": "default", "messages": messages, "tools": list(SESSION_TOOLS), "temperature": 0, **payload}
    response = requests.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def test_chat_turns_from_a_recorded_session_with_its_tools_reuse_their_common_prefix(server, tiny_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_path))
    flush(server)
    prompts = chat_prompts()
    interval = prefix_cache_state(server)["checkpoint_interval"]
    previous_ids = None
    for messages in prompts:
        ids = tokenizer.apply_chat_template(
            with_parsed_arguments(messages), tools=list(SESSION_TOOLS), add_generation_prompt=True, return_dict=False
        )
        usage = chat(server, messages, max_tokens=4)["usage"]
        assert usage["prompt_tokens"] == len(ids)  # the tool definitions, calls and results are all in the prompt
        if previous_ids is not None:
            # Checkpoints on the previous prompt: its end, one token before it, every interval.
            reusable = min(common_prefix(previous_ids, ids), len(ids) - 1)
            ends = [n for n in (len(previous_ids), len(previous_ids) - 1) if n <= reusable]
            expected = max([*ends, reusable // interval * interval])
            assert usage["prompt_tokens_details"]["cached_tokens"] == expected
        previous_ids = ids


def test_a_chat_turn_after_a_tool_result_resumes_from_the_cache_as_a_cold_prefill_would(server):
    flush(server)
    *_, before, after = chat_prompts()
    assert after[-1]["role"] == "tool" and after[: len(before)] == before  # a reply with a tool call, its result
    first = chat(server, before, max_tokens=8)
    resumed = chat(server, after, max_tokens=8, logprobs=True)
    assert resumed["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"]
    flush(server)
    cold = chat(server, after, max_tokens=8, logprobs=True)
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert resumed["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
    resumed_logprobs = [token["logprob"] for token in resumed["choices"][0]["logprobs"]["content"]]
    cold_logprobs = [token["logprob"] for token in cold["choices"][0]["logprobs"]["content"]]
    assert resumed_logprobs == pytest.approx(cold_logprobs, abs=TOLERANCE)


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def test_many_sessions_under_eviction_keep_serving_outputs_equal_to_cold_ones(server):
    flush(server)
    # Eight sessions of ~1,300 tokens each, three at a time, through a 4,096-token pool:
    # the tree evicts cached tokens and checkpoints as they go.
    with concurrent.futures.ThreadPoolExecutor(3) as executor:
        sessions = list(executor.map(lambda seed: conversation(server, turns=3, seed=seed, first=1200), range(60, 68)))
    assert requests.get(f"{server}/health", timeout=30).status_code == 200
    assert set(prefix_cache_state(server)["rows_miscounted"].values()) == {0}
    for prompt, cached, _ in [turn for session in sessions for turn in session][::3]:
        flush(server)
        assert generate(server, prompt, len(cached["output_ids"]))["output_ids"] == cached["output_ids"]
    assert_everything_free(server)
