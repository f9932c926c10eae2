"""A prefill and a decode instance behind smg in PD mode serve V4 as one server does (issue 44).

One pair for the module: ``--disaggregation-mode prefill`` with chunked prefill of 128 tokens, ``--disaggregation-mode
decode --disaggregation-decode-enable-radix-cache`` (the decode instance keeps its own V4 tree),
``--disaggregation-transfer-backend mooncake_tcp`` (real bytes over TCP on this host), and ``smg launch
--pd-disaggregation`` in front. The oracle is the session's single-process server (:func:`conftest.tiny_server`):
greedy outputs equal token for token, for ``/generate`` and ``/v1/chat/completions``, on prompts past two ratio-128
blocks with a partial one pending. The bytes the prefill instance submitted to the transfer engine per request are
the ledger's state of the prompt; on a multi-turn session, a later turn's are the ledger's state past the prefix
the decode instance resumed from its own checkpoint (its new tokens' blocks, the window rows past that prefix and one
state record), and the outputs still equal one server's. After requests, after a client that disconnects
mid-request, and after a transfer that fails (the test-only ``fault_plugin`` fails a marked prompt's state send),
every row is back on both instances.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import torch
from conftest import random_ids
from fault_plugin import TRANSFER_FAULT
from serving_checks import assert_pools_idle, generate, greedy
from test_containment import INNOCENT_VOCAB, TESTS, install_fault_plugin

from sglang_dsv4.config import load_config
from sglang_dsv4.disaggregation import mooncake_installed
from sglang_dsv4.launch import free_port, running_pd_router, running_server, smg_command
from sglang_dsv4.memory_pool.layout import PoolLayout

pytestmark = pytest.mark.skipif(
    not (mooncake_installed() and smg_command()), reason="the pd extra (Mooncake's engine and smg) is not installed"
)

TRANSFER = ("--disaggregation-transfer-backend", "mooncake_tcp")
# Past two ratio-128 blocks with a partial block pending, inside one window, and past several chunks of 128.
PROMPT_LENGTHS = (333, 259, 1000)
NEW_TOKENS = 12


def _prompt(length: int) -> list[int]:
    return random_ids(length, INNOCENT_VOCAB, seed=4400 + length).tolist()


PROMPTS = {length: _prompt(length) for length in PROMPT_LENGTHS}


@pytest.fixture(scope="module")
def pair(tiny_path: Path, log_dir: Path, tmp_path_factory) -> Iterator[dict[str, str]]:
    """The prefill and decode instances (with the test-only fault plugin, which fails marked prompts only) and smg
    in front: their URLs."""
    plugin_folder = install_fault_plugin(tmp_path_factory.mktemp("pd-fault-plugin"))
    path = os.pathsep.join(p for p in (str(plugin_folder), str(TESTS), os.environ.get("PYTHONPATH")) if p)
    # SGLang probes a decode session it set aside after a failed send every 30 s by default: 2 s here.
    env = {"PYTHONPATH": path, "SGLANG_FAILED_SESSION_PROBE_INTERVAL_S": "2"}
    bootstrap = free_port()
    prefill_args = ("--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bootstrap))
    decode_args = ("--disaggregation-mode", "decode", "--disaggregation-bootstrap-port", str(free_port()),
                   "--disaggregation-decode-enable-radix-cache")  # fmt: skip
    common = ("--dtype", "float32", *TRANSFER)
    with (
        running_server(tiny_path, *common, *prefill_args, "--chunked-prefill-size", "128",
                       log_path=log_dir / "pd-prefill.log", env=env) as prefill,
        running_server(tiny_path, *common, *decode_args, log_path=log_dir / "pd-decode.log", env=env) as decode,
        running_pd_router(prefill, bootstrap, decode, log_dir / "pd-smg.log") as router,
    ):  # fmt: skip
        yield {"router": router, "prefill": prefill, "decode": decode}


def layout(tiny_path: Path) -> PoolLayout:
    return PoolLayout(load_config(tiny_path), torch.float32)


def transfer_report(url: str) -> dict[str, int]:
    return requests.get(f"{url}/server_info", timeout=30).json()["internal_states"][0]["dsv4_transfer"]


@pytest.mark.parametrize("length", PROMPT_LENGTHS)
def test_the_pair_generates_what_one_server_does_and_moves_the_ledgers_bytes(pair, tiny_server, tiny_path, length):
    before = transfer_report(pair["prefill"])
    assert greedy(pair["router"], PROMPTS[length], NEW_TOKENS) == greedy(tiny_server, PROMPTS[length], NEW_TOKENS)
    after = transfer_report(pair["prefill"])
    assert after["states_sent"] - before["states_sent"] == 1
    assert after["decode_prefix_tokens"] == before["decode_prefix_tokens"]  # a prompt the decode side never saw
    assert after["bytes_sent"] - before["bytes_sent"] == layout(tiny_path).state_bytes_at(length)


def test_a_session_resumes_on_the_decode_side_and_each_turn_moves_only_what_it_lacks(pair, tiny_server, tiny_path):
    """Three turns, each the last one's prompt and output and new tokens (past the 128-token window and a ratio-128
    block): outputs equal one server's; from the second turn the decode instance holds every token up to the last
    turn's end (its checkpoint where the finished request's state ends: after its last output token when SGLang's
    overlap scheduler ran one more step, else before it), and the bytes moved are the ledger's state past that
    prefix."""
    session, sizes = [], (300, 150, 200)
    for turn, new_tokens in enumerate(sizes):
        session += random_ids(new_tokens, INNOCENT_VOCAB, seed=4490 + turn).tolist()
        before = transfer_report(pair["prefill"])
        output = greedy(pair["router"], session, NEW_TOKENS)
        assert output == greedy(tiny_server, session, NEW_TOKENS)
        after = transfer_report(pair["prefill"])
        held = after["decode_prefix_tokens"] - before["decode_prefix_tokens"]
        previous_end = len(session) - new_tokens
        assert held == 0 if turn == 0 else previous_end - 1 <= held <= previous_end
        assert after["bytes_sent"] - before["bytes_sent"] == layout(tiny_path).state_bytes_past(held, len(session))
        session += output


def chat(url: str, messages: list[dict]) -> str:
    model = requests.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "messages": messages, "max_tokens": 24, "temperature": 0}
    reply = requests.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["message"]["content"]


def test_chat_completions_and_a_second_turn_equal_one_servers(pair, tiny_server):
    messages = [{"role": "user", "content": "The test in utils.py fails with a KeyError. Fix it."}]
    first = chat(pair["router"], messages)
    assert first == chat(tiny_server, messages)
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "Now run the tests."}]
    assert chat(pair["router"], messages) == chat(tiny_server, messages)


def test_every_row_comes_back_on_both_sides_after_a_client_disconnects(pair):
    params = {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}
    with pytest.raises(requests.Timeout):
        requests.post(f"{pair['router']}/generate", json={"input_ids": PROMPTS[333], "sampling_params": params},
                      timeout=3)  # fmt: skip
    greedy(pair["router"], PROMPTS[259], 4)
    for side in ("prefill", "decode"):
        assert_pools_idle(pair[side])


def test_a_failed_transfer_fails_its_request_only_and_every_row_comes_back(pair):
    marked = PROMPTS[259][:-1] + [TRANSFER_FAULT]
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    reply = generate(pair["router"], marked, sampling_params=params)
    failed = reply.status_code != 200 or reply.json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert failed, reply.text
    # SGLang sets the decode session aside after a failed send and probes it back: the pair serves again.
    deadline = time.monotonic() + 120
    while generate(pair["router"], PROMPTS[333], sampling_params=params).status_code != 200:
        assert time.monotonic() < deadline, "the pair did not serve again after a failed transfer"
        time.sleep(2)
    for side in ("prefill", "decode"):
        assert_pools_idle(pair[side])
