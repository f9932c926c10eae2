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

Faults (issue 44), each ending its request in an error (at once, or when the SGLang timeout covering it runs out),
every row back on both sides, and the pair (or the surviving instance) then serving as one server does: an abort
sent to the prefill instance (while it prefills, and while it sends) or to the decode instance; a transfer that does
not progress (``fault_plugin`` holds a marked prompt's state send), ended by the decode instance's
``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``; a decode instance killed while the prefill instance sends to it, then
started again; a prefill instance killed while it sends, found dead by the decode instance's heartbeat. The requests
with faults are sent to the two instances as a PD router sends them (SGLang's bootstrap fields), so that each goes
once (smg retries a failed request). Every SGLang timeout involved is set short by environment for these instances
(:data:`FAULT_TIMEOUTS`).
"""

from __future__ import annotations

import os
import random
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import requests
import torch
from conftest import random_ids
from fault_plugin import SIGNALS, TRANSFER_FAULT, TRANSFER_HOLD
from serving_checks import assert_pools_idle, greedy
from test_containment import INNOCENT_VOCAB, TESTS, install_fault_plugin

from sglang_dsv4.config import load_config
from sglang_dsv4.disaggregation import mooncake_installed
from sglang_dsv4.launch import (
    free_port,
    free_server_port,
    running_pd_router,
    running_server,
    server_command,
    smg_command,
    stop_process_group,
)
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
# SGLang's timeouts for a pair, short here (defaults in parentheses): the decode instance fails a request whose state
# has not arrived this long after it asked (300 s); the prefill instance one whose decode instance never asked
# (300 s); the decode instance checks each prefill instance's bootstrap server this often (5 s) and gives it up
# after this many misses (2); it holds a failed request's rows for the prefill instance's word that nothing more
# will be written, at most this long (30 s); the prefill instance probes a decode session it set aside after a failed
# send this often (30 s).
FAULT_TIMEOUTS = {
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "20",
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "20",
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2",
    "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "2",
    "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": "2",
    "SGLANG_FAILED_SESSION_PROBE_INTERVAL_S": "2",
}
PREFILL_ARGS = ("--dtype", "float32", *TRANSFER, "--disaggregation-mode", "prefill", "--chunked-prefill-size", "128")
DECODE_ARGS = ("--dtype", "float32", *TRANSFER, "--disaggregation-mode", "decode",
               "--disaggregation-decode-enable-radix-cache")  # fmt: skip


def decode_args() -> tuple[str, ...]:
    return (*DECODE_ARGS, "--disaggregation-bootstrap-port", str(free_port()))


@pytest.fixture(scope="module")
def fault_env(tmp_path_factory) -> dict[str, str]:
    """The instances' environment: the test-only fault plugin on the path (it fails marked prompts only) and
    :data:`FAULT_TIMEOUTS`."""
    plugin_folder = install_fault_plugin(tmp_path_factory.mktemp("pd-fault-plugin"))
    path = os.pathsep.join(p for p in (str(plugin_folder), str(TESTS), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path, **FAULT_TIMEOUTS}


@pytest.fixture(scope="module")
def pair(tiny_path: Path, log_dir: Path, tmp_path_factory, fault_env) -> Iterator[dict[str, str]]:
    """The prefill and decode instances and smg in front: their URLs, the prefill instance's bootstrap port and the
    folder of its fault plugin's signals."""
    signals = tmp_path_factory.mktemp("pd-signals")
    bootstrap = free_port()
    with (
        running_server(tiny_path, *PREFILL_ARGS, "--disaggregation-bootstrap-port", str(bootstrap),
                       log_path=log_dir / "pd-prefill.log", env={**fault_env, SIGNALS: str(signals)}) as prefill,
        running_server(tiny_path, *decode_args(), log_path=log_dir / "pd-decode.log", env=fault_env) as decode,
        running_pd_router(prefill, bootstrap, decode, log_dir / "pd-smg.log") as router,
    ):  # fmt: skip
        yield {"router": router, "prefill": prefill, "decode": decode, "bootstrap": bootstrap, "signals": signals}


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


class PDRequest:
    """One request sent to a prefill and a decode instance at once, as a PD router sends it: the same body to both,
    with the prefill instance's bootstrap address and a new bootstrap room."""

    def __init__(self, prefill: str, decode: str, bootstrap: int, ids: list[int], rid: str, new_tokens: int = 8):
        params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
        self.body = {"input_ids": ids, "sampling_params": params, "rid": rid, "bootstrap_host": "127.0.0.1",
                     "bootstrap_port": bootstrap, "bootstrap_room": random.getrandbits(63)}  # fmt: skip
        self.replies: dict[str, requests.Response | Exception] = {}
        self.threads = [threading.Thread(target=self._post, args=(side, url)) for side, url in
                        (("prefill", prefill), ("decode", decode))]  # fmt: skip
        for thread in self.threads:
            thread.start()

    def _post(self, side: str, url: str) -> None:
        try:
            self.replies[side] = requests.post(f"{url}/generate", json=self.body, timeout=300)
        except requests.RequestException as error:  # an instance killed mid-request
            self.replies[side] = error

    def wait(self, within_s: float = 60) -> dict[str, requests.Response | Exception]:
        deadline = time.monotonic() + within_s
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        assert not any(thread.is_alive() for thread in self.threads), f"no reply within {within_s} s"
        return self.replies


def pd_request(pair: dict, ids: list[int], rid: str, **kwargs) -> PDRequest:
    return PDRequest(pair["prefill"], pair["decode"], pair["bootstrap"], ids, rid, **kwargs)


def failed(reply: requests.Response | Exception, naming: str = "") -> bool:
    """An error reply (naming ``naming``), or an aborted request's."""
    if isinstance(reply, Exception):
        return True
    if reply.status_code != 200:
        return naming in reply.text
    return reply.json()["meta_info"]["finish_reason"]["type"] == "abort"


def timed_out(reply: requests.Response) -> bool:
    return "timed out" in reply.text


def held(signals: Path, within_s: float = 120) -> None:
    """Wait until the fault plugin holds a marked prompt's state send (the request is mid-transfer)."""
    deadline = time.monotonic() + within_s
    while not (signals / "held").exists():
        assert time.monotonic() < deadline, "the marked prompt's send was not held"
        time.sleep(0.1)


def marked(length: int, marker: int) -> list[int]:
    return PROMPTS[length][:-1] + [marker]


def assert_served_as_one_server(url: str, tiny_server: str) -> None:
    assert greedy(url, PROMPTS[333], NEW_TOKENS) == greedy(tiny_server, PROMPTS[333], NEW_TOKENS)


def test_a_failed_transfer_fails_its_request_only_and_every_row_comes_back(pair, tiny_server):
    replies = pd_request(pair, marked(259, TRANSFER_FAULT), "failed-transfer").wait()
    assert failed(replies["prefill"], "Failed to send state components") and failed(replies["decode"])
    # SGLang sets the decode session aside after a failed send and probes it back: the pair serves again.
    deadline = time.monotonic() + 60
    while failed(pd_request(pair, PROMPTS[333], f"retry-{time.monotonic()}").wait()["decode"]):
        assert time.monotonic() < deadline, "the pair did not serve again after a failed transfer"
        time.sleep(1)
    for side in ("prefill", "decode"):
        assert_pools_idle(pair[side])
    assert_served_as_one_server(pair["router"], tiny_server)


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_an_abort_sent_to_one_instance_mid_transfer_ends_the_request_on_both(pair, tiny_server, side):
    """While the prefill instance sends the request's state (held by the fault plugin), ``/abort_request`` with its
    rid to one instance: both reply at once (the decode instance an error; the prefill instance told it), every row
    comes back on both, and the pair serves a request sent meanwhile and later ones as one server does."""
    rid = f"abort-on-{side}"
    request = pd_request(pair, marked(333, TRANSFER_HOLD), rid)
    held(pair["signals"])
    meanwhile_output: list = []
    meanwhile = threading.Thread(target=lambda: meanwhile_output.append(greedy(pair["router"], PROMPTS[259], 8)))
    meanwhile.start()
    assert requests.post(f"{pair[side]}/abort_request", json={"rid": rid}, timeout=30).status_code == 200
    replies = request.wait(within_s=30)
    assert failed(replies["prefill"]) and failed(replies["decode"]), replies
    assert not timed_out(replies["decode"])  # told, not left to its waiting timeout
    meanwhile.join(120)
    assert meanwhile_output == [greedy(tiny_server, PROMPTS[259], 8)]
    for instance in ("prefill", "decode"):
        assert_pools_idle(pair[instance])
    assert_served_as_one_server(pair["router"], tiny_server)


def test_an_abort_sent_to_the_prefill_instance_while_it_prefills_ends_the_request_on_both(pair, tiny_server):
    rid = "abort-while-prefilling"
    long_prompt = random_ids(3000, INNOCENT_VOCAB, seed=4430).tolist()  # 24 chunks of 128
    abort_at_the_prefill_while_it_prefills(pair, pd_request(pair, long_prompt, rid), rid, ended_within_s=30)
    assert_served_as_one_server(pair["router"], tiny_server)


def abort_at_the_prefill_while_it_prefills(pair: dict, request: PDRequest, rid: str, ended_within_s: float) -> None:
    """Abort ``request`` (``rid``) at the prefill instance once it prefills it: both instances end it with an
    error (the decode side told, not left to its waiting timeout), and every row comes back on both."""
    deadline = time.monotonic() + 120
    while not prefilling(pair["prefill"]):
        assert time.monotonic() < deadline, "the prefill instance did not start the prompt"
        time.sleep(0.05)
    assert requests.post(f"{pair['prefill']}/abort_request", json={"rid": rid}, timeout=30).status_code == 200
    replies = request.wait(within_s=ended_within_s)
    assert failed(replies["prefill"]) and failed(replies["decode"]), replies
    assert not timed_out(replies["decode"])
    for instance in ("prefill", "decode"):
        assert_pools_idle(pair[instance])


def prefilling(url: str) -> bool:
    """Whether any rank of the instance at ``url`` holds tokens (a prompt being prefilled)."""
    return any(load["num_used_tokens"] > 0 for load in requests.get(f"{url}/v1/loads", timeout=10).json()["loads"])


def test_a_transfer_that_does_not_progress_times_out_on_both_sides(pair, tiny_server):
    """The marked prompt's state send is held until its room fails: the decode instance gives it up after
    ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` (20 s here), naming the timeout, and tells the prefill instance,
    whose send then ends; every row comes back on both."""
    start = time.monotonic()
    replies = pd_request(pair, marked(333, TRANSFER_HOLD), "stalled").wait(within_s=120)
    assert failed(replies["decode"], "timed out") and failed(replies["prefill"]), replies
    assert time.monotonic() - start >= float(FAULT_TIMEOUTS["SGLANG_DISAGGREGATION_WAITING_TIMEOUT"])
    for instance in ("prefill", "decode"):
        assert_pools_idle(pair[instance])
    assert_served_as_one_server(pair["router"], tiny_server)


@contextmanager
def killable_server(tiny_path: Path, *args: str, log_path: Path, env: dict) -> Iterator[tuple[str, subprocess.Popen]]:
    """A server as :func:`running_server` starts it, with its process (whose group a test kills)."""
    port = free_server_port()
    with open(log_path, "w") as log:
        process = subprocess.Popen(server_command(tiny_path, port, *args), stdout=log, stderr=subprocess.STDOUT,
                                   cwd=log_path.parent, env={**os.environ, **env}, start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while not healthy(url):
            assert process.poll() is None and time.monotonic() < deadline, log_path.read_text()[-4000:]
            time.sleep(1)
        yield url, process
    finally:
        if process.poll() is None:
            stop_process_group(process)


def healthy(url: str) -> bool:
    try:
        return requests.get(f"{url}/health", timeout=5).status_code == 200
    except requests.RequestException:
        return False


def test_a_decode_instance_killed_mid_transfer_then_restarted(pair, tiny_server, tiny_path, log_dir, fault_env):
    """A second decode instance is killed while the prefill instance sends it a request's state: the prefill
    instance's send fails (its request ends in an error) and every row comes back there; started again, the decode
    instance and the prefill instance serve as one server does."""
    signals = pair["signals"]
    with killable_server(tiny_path, *decode_args(), log_path=log_dir / "pd-decode-killed.log", env=fault_env) as (
        decode, process,
    ):  # fmt: skip
        request = PDRequest(pair["prefill"], decode, pair["bootstrap"], marked(333, TRANSFER_HOLD), "decode-killed")
        held(signals)
        stop_process_group(process)
        (signals / "release").touch()  # the send goes on, to a decode instance that is gone
        try:
            replies = request.wait(within_s=60)
        finally:
            (signals / "release").unlink()
    assert failed(replies["prefill"]) and isinstance(replies["decode"], Exception), replies
    assert_pools_idle(pair["prefill"])
    with killable_server(tiny_path, *decode_args(), log_path=log_dir / "pd-decode-restarted.log", env=fault_env) as (
        decode, _,
    ):  # fmt: skip
        replies = PDRequest(pair["prefill"], decode, pair["bootstrap"], PROMPTS[333], "after-restart",
                            new_tokens=NEW_TOKENS).wait()  # fmt: skip
        assert replies["decode"].json()["output_ids"] == greedy(tiny_server, PROMPTS[333], NEW_TOKENS)
        assert_pools_idle(decode)
    assert_pools_idle(pair["prefill"])
    assert_served_as_one_server(pair["router"], tiny_server)


def test_a_prefill_instance_killed_mid_transfer(pair, tiny_server, tiny_path, log_dir, fault_env, tmp_path):
    """A second prefill instance is killed while it sends a request's state to the decode instance: the decode
    instance's heartbeat finds it gone and ends the request in an error naming it, every row comes back on the
    decode instance, and the pair serves as one server does."""
    bootstrap = free_port()
    args = (*PREFILL_ARGS, "--disaggregation-bootstrap-port", str(bootstrap))
    env = {**fault_env, SIGNALS: str(tmp_path)}
    with killable_server(tiny_path, *args, log_path=log_dir / "pd-prefill-killed.log", env=env) as (prefill, process):
        request = PDRequest(prefill, pair["decode"], bootstrap, marked(333, TRANSFER_HOLD), "prefill-killed")
        held(tmp_path)
        stop_process_group(process)
        replies = request.wait(within_s=60)
    assert failed(replies["decode"], "Lost connection with prefill instance"), replies
    assert isinstance(replies["prefill"], Exception)
    assert_pools_idle(pair["decode"])
    assert_served_as_one_server(pair["router"], tiny_server)
