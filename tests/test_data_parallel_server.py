"""``--tp 2 --attn-dp-size 2 --ep-size 2`` on the CPU (gloo; attention-TP 1), on both attention backends,
against one process.

Each DP rank has its own scheduler, requests, pools and prefix tree; the MoE runs over both
ranks' rows (SGLang's DP-attention gather) with the experts split by EP. Requests are pinned to
a rank with ``routed_dp_rank``. The oracle is the single-process server, run first and stopped
before the DP server starts (one server at a time): every figure it gives is recorded up front.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch
from conftest import random_ids
from serving_checks import assert_pools_idle

from sglang_dsv4.launch import running_server

# Prompts inside one window, past two ratio-4 blocks of entries, and past ratio-128 blocks.
PROMPT_LENGTHS = (5, 300, 700)
NEW_TOKENS = 12
LONG_DECODE = 48
VOCAB = 1024


def _prompt(length: int, seed: int) -> list[int]:
    return random_ids(length, VOCAB, seed=seed).tolist()


PROMPTS = {length: _prompt(length, 500 + length) for length in PROMPT_LENGTHS}
SESSION_START = _prompt(260, 600)
SESSION_FOLLOW_UP = _prompt(37, 601)


def _generate(url: str, ids: list[int], new_tokens: int, rank: int | None = None, start: int = 0) -> dict:
    """Greedy tokens, and prompt logprobs from position ``start``; pinned to DP rank ``rank``."""
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    payload = {"input_ids": ids, "sampling_params": params, "return_logprob": True, "logprob_start_len": start}
    if rank is not None:
        payload["routed_dp_rank"] = rank
    reply = requests.post(f"{url}/generate", json=payload, timeout=900)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _prompt_logprobs(reply: dict) -> torch.Tensor:
    return torch.tensor([entry[0] for entry in reply["meta_info"]["input_token_logprobs"][1:]])


def _assert_same(served: dict, expected: dict, what: str) -> None:
    assert served["output_ids"] == expected["output_ids"], what
    difference = (_prompt_logprobs(served) - _prompt_logprobs(expected)).abs().max().item()
    assert difference <= 1e-4, f"{what}: prompt logprobs differ by {difference:.3g}"


def _session(url: str, rank: int | None) -> list[dict]:
    """Two turns of one session (pinned to ``rank``): the second resumes the first's prompt and answer."""
    requests.post(f"{url}/flush_cache", timeout=60).raise_for_status()
    first = _generate(url, SESSION_START, 8, rank)
    history = SESSION_START + first["output_ids"] + SESSION_FOLLOW_UP
    resumable = len(SESSION_START) + len(first["output_ids"]) - 1
    return [first, _generate(url, history, 8, rank, start=resumable)]


def _internal_states(url: str) -> list[dict]:
    return requests.get(f"{url}/server_info", timeout=60).json()["internal_states"]


@pytest.fixture(scope="module")
def expected(tiny_path, log_dir) -> dict:
    """The single-process server's answers to every request the tests send."""
    with running_server(tiny_path, "--dtype", "float32", log_path=log_dir / "dp-oracle-server.log") as url:
        return {
            "prompts": {length: _generate(url, ids, NEW_TOKENS) for length, ids in PROMPTS.items()},
            "long decode": _generate(url, PROMPTS[5], LONG_DECODE),
            "session": _session(url, None),
        }


@pytest.fixture(scope="module", params=["dsv4_batched", "dsv4_torch"])
def dp2(request, tiny_path, log_dir, expected):
    """The DP server on each attention backend in turn (idle ranks and padded rows go through both)."""
    os.environ.pop("SGLANG_CPU_OMP_THREADS_BIND", None)
    args = ("--dtype", "float32", "--tp", "2", "--attn-dp-size", "2", "--ep-size", "2")
    log_path = log_dir / f"dp2-{request.param}-server.log"
    with running_server(tiny_path, *args, "--attention-backend", request.param, log_path=log_path) as url:
        yield url


def test_both_ranks_at_once_give_the_single_process_tokens_and_logprobs(dp2, expected):
    pinned = [(length, rank) for length in PROMPT_LENGTHS for rank in (0, 1)]
    with ThreadPoolExecutor(len(pinned)) as pool:
        replies = list(pool.map(lambda job: _generate(dp2, PROMPTS[job[0]], NEW_TOKENS, job[1]), pinned))
    for (length, rank), served in zip(pinned, replies, strict=True):
        _assert_same(served, expected["prompts"][length], f"{length} tokens on rank {rank}")


def test_one_rank_serves_while_the_other_idles(dp2, expected):
    with ThreadPoolExecutor(len(PROMPT_LENGTHS)) as pool:
        replies = list(pool.map(lambda length: _generate(dp2, PROMPTS[length], NEW_TOKENS, 0), PROMPT_LENGTHS))
    for length, served in zip(PROMPT_LENGTHS, replies, strict=True):
        _assert_same(served, expected["prompts"][length], f"{length} tokens on rank 0, rank 1 idle")


def _wait_until_running(url: str) -> None:
    """Until a request of the server is in its running batch (prefilled, so decoding next)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        loads = requests.get(f"{url}/v1/loads", timeout=30).json()["loads"]
        if sum(load["num_running_reqs"] for load in loads):
            return
        time.sleep(0.05)
    raise AssertionError("the request never started running")


def test_one_rank_extends_while_the_other_decodes(dp2, expected):
    with ThreadPoolExecutor(2) as pool:
        decoding = pool.submit(_generate, dp2, PROMPTS[5], LONG_DECODE, 1)
        _wait_until_running(dp2)
        extending = pool.submit(_generate, dp2, PROMPTS[700], NEW_TOKENS, 0)
        _assert_same(extending.result(), expected["prompts"][700], "700-token prefill on rank 0")
        _assert_same(decoding.result(), expected["long decode"], "decode on rank 1")


@pytest.mark.parametrize("rank", [0, 1])
def test_a_session_pinned_to_one_rank_resumes_from_that_ranks_cache(dp2, expected, rank):
    served = _session(dp2, rank)
    for turn, (reply, oracle) in enumerate(zip(served, expected["session"], strict=True)):
        _assert_same(reply, oracle, f"turn {turn} on rank {rank}")
        assert reply["meta_info"]["cached_tokens"] == oracle["meta_info"]["cached_tokens"], turn
    assert served[1]["meta_info"]["cached_tokens"] > 0, "the second turn resumed nothing from the cache"
    assert_pools_idle(dp2)


def test_each_dp_rank_reports_its_own_pools_cache_and_weights(dp2, tiny_model):
    from sglang_dsv4.memory_pool.ledger import RankLedger
    from sglang_dsv4.model.weight_layout import Parallelism

    states = _internal_states(dp2)
    assert sorted(state["attn_dp_rank"] for state in states) == [0, 1]  # in the order the ranks answer
    layout = Parallelism(tp=2, ep=2, attn_dp=2)
    # The served model holds no MTP layer yet (speculative serving is issue 26's).
    ledger = RankLedger(tiny_model.config.without_mtp(), layout, quantized=False, dtype=torch.float32)
    for state in states:
        # Attention-TP 1: each DP rank is its own attention group.
        assert state["dsv4_weights"]["resident_bytes_per_rank"] == [sum(ledger.weight_bytes().values())]
        assert state["dsv4_prefix_cache"]["tp_digest_mismatches"] == 0
        assert {"token_slots", "request_rows"} <= set(state["dsv4_pools"])


@pytest.mark.parametrize(
    "spelling", [("--attn-dp-size", "2"), ("--dp-size", "2", "--enable-dp-attention")], ids=["attn-dp-size", "older"]
)
def test_an_attention_group_that_does_not_divide_the_output_groups_stops_the_launcher(tmp_path, spelling):
    from test_random_configs_server import config_only_checkpoint, launch_until_exit

    checkpoint = config_only_checkpoint(tmp_path / "one-group", o_groups=1)
    launched = launch_until_exit(checkpoint, "--tp", "4", *spelling)
    assert launched.returncode != 0
    output = launched.stdout + launched.stderr
    assert "ConfigError: 'o_groups' (1) is not divisible by attention-TP = tp / attn-dp-size = 4 / 2 = 2" in output


@pytest.mark.parametrize(
    ("flag", "setting"), [("--attn-cp-size", {"attn_cp_size": 2}), ("--moe-dp-size", {"moe_dp_size": 2}),
                          ("--moe-a2a-backend", {"moe_a2a_backend": "deepep"})],
)  # fmt: skip
def test_attention_dp_with_what_the_model_does_not_serve_is_refused_naming_the_flag(flag, setting):
    from types import SimpleNamespace

    from sglang_dsv4.config import ConfigError
    from sglang_dsv4.data_parallel import check_attention_data_parallel

    served = {"attn_dp_size": 2, "attn_cp_size": 1, "moe_dp_size": 1, "moe_a2a_backend": "none"}
    check_attention_data_parallel(SimpleNamespace(**served))
    with pytest.raises(ConfigError, match=rf"^{flag} with --attn-dp-size 2: .* leave {flag} at its default"):
        check_attention_data_parallel(SimpleNamespace(**{**served, **setting}))
