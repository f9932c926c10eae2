"""``--tp 2 --attn-dp-size 2 --ep-size 2`` on the CPU (gloo; attention-TP 1), against one process.

Each DP rank has its own scheduler, requests, pools and prefix tree; the MoE runs over both
ranks' rows (SGLang's DP-attention gather) with the experts split by EP. Requests are pinned to
a rank with ``routed_dp_rank``. The oracle is the session's single-process server
(:func:`conftest.tiny_server`): every figure it gives is recorded up front.
The DP server is short of token slots, as the pool-exhaustion tests' few_tokens server is, so that the
pool-exhaustion, abort and bad-input cases run on it too: after each, every row is back on both ranks.
Random configs are served at DP against their single-process server in ``test_random_configs_server.py``
(which serves them once for HF and DP alike).
"""

from __future__ import annotations

import functools
import itertools
import os
import random
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
import requests
import torch
from conftest import random_ids
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from launch_checks import config_only_checkpoint, refusal_at_resolution
from random_configs import random_v4_config
from serving_checks import assert_healthy, assert_pools_idle, reported_if_down
from test_pool_exhaustion_server import SERVERS, assert_equal_to_cold_runs, cold_run, concurrently, random_round
from test_prefix_cache_server import set_modes
from test_untrusted_requests import CONTAINED_FAILURE, REQUESTS_PER_BATCH, assert_refused, post, probes, send

from sglang_dsv4.config import ConfigError, check_tensor_parallel, parse_config
from sglang_dsv4.launch import running_server

# Prompts inside one window, past two ratio-4 blocks of entries, and past ratio-128 blocks.
PROMPT_LENGTHS = (5, 300, 700)
NEW_TOKENS = 12
LONG_DECODE = 48
VOCAB = 1024
DP_ARGS = ("--tp", "2", "--attn-dp-size", "2", "--ep-size", "2")


def _prompt(length: int, seed: int) -> list[int]:
    return random_ids(length, VOCAB, seed=seed).tolist()


PROMPTS = {length: _prompt(length, 500 + length) for length in PROMPT_LENGTHS}
SESSION_START = _prompt(260, 600)
SESSION_FOLLOW_UP = _prompt(37, 601)
# Unpinned multi-turn sessions sent at once: each turn is the previous prompt, its answer and a follow-up.
ROUTED_SESSIONS, ROUTED_TURNS, ROUTED_ANSWER = 4, 3, 8


def generate_on(url: str, ids: list[int], new_tokens: int, rank: int | None = None, start: int = 0) -> dict:
    """Greedy tokens, and prompt logprobs from position ``start``; pinned to DP rank ``rank``."""
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    payload = {"input_ids": ids, "sampling_params": params, "return_logprob": True, "logprob_start_len": start}
    if rank is not None:
        payload["routed_dp_rank"] = rank
    reply = requests.post(f"{url}/generate", json=payload, timeout=900)
    assert reply.status_code == 200, reply.text
    return reply.json()


def prompt_logprobs(reply: dict) -> torch.Tensor:
    return torch.tensor([entry[0] for entry in reply["meta_info"]["input_token_logprobs"][1:]])


def assert_same(served: dict, expected: dict, what: str) -> None:
    assert served["output_ids"] == expected["output_ids"], what
    difference = (prompt_logprobs(served) - prompt_logprobs(expected)).abs().max().item()
    assert difference <= 1e-4, f"{what}: prompt logprobs differ by {difference:.3g}"


def _flush(url: str) -> None:
    requests.post(f"{url}/flush_cache", timeout=60).raise_for_status()


def _session(url: str, rank: int | None) -> list[dict]:
    """Two turns of one session (pinned to ``rank``): the second resumes the first's prompt and answer."""
    _flush(url)
    first = generate_on(url, SESSION_START, 8, rank)
    history, resumable = _second_turn(first)
    return [first, generate_on(url, history, 8, rank, start=resumable)]


def _second_turn(first: dict) -> tuple[list[int], int]:
    """The session's second prompt, and how much of it the first turn left reusable (its prompt and answer
    but the last token)."""
    history = SESSION_START + first["output_ids"] + SESSION_FOLLOW_UP
    return history, len(SESSION_START) + len(first["output_ids"]) - 1


def _cold_second_turn(url: str, first: dict) -> dict:
    """The session's second turn on a flushed cache."""
    history, resumable = _second_turn(first)
    _flush(url)
    return generate_on(url, history, 8, start=resumable)


def _routed_session(url: str, session: int) -> list[dict]:
    """The turns of one unpinned session, each sent after the previous one's answer."""
    prompt, replies = _prompt(200, 800 + session), []
    for turn in range(ROUTED_TURNS):
        if replies:
            prompt = prompt + replies[-1]["output_ids"] + _prompt(20, 900 + 10 * session + turn)
        # Prompt logprobs from the last token only: SGLang resumes no cached prefix past logprob_start_len.
        replies.append(generate_on(url, prompt, ROUTED_ANSWER, start=len(prompt) - 1))
    return replies


def _routed_sessions(url: str) -> list[list[dict]]:
    _flush(url)
    with ThreadPoolExecutor(ROUTED_SESSIONS) as pool:
        return list(pool.map(lambda session: _routed_session(url, session), range(ROUTED_SESSIONS)))


# Sessions taking their turns one after another; the first turn pinned to a rank, later ones routed.
EVICTED_SESSIONS, EVICTED_RANK = 4, 1


def _turn_prompt(session: int, replies: list[dict]) -> list[int]:
    """Session ``session``'s next prompt after ``replies``: its start, then each answer and a follow-up."""
    prompt = _prompt(200, 1000 + session)
    for turn, reply in enumerate(replies):
        prompt = prompt + reply["output_ids"] + _prompt(20, 1100 + 10 * session + turn)
    return prompt


def _turns(url: str, replies: list[list[dict]], ranks: list[int | None]) -> list[dict]:
    """One more turn of every session, one session after another (session ``s`` pinned to ``ranks[s]``)."""
    for session, rank in enumerate(ranks):
        prompt = _turn_prompt(session, replies[session])
        replies[session].append(generate_on(url, prompt, ROUTED_ANSWER, rank, start=len(prompt) - 1))
    return [session[-1] for session in replies]


def _sessions_turn_by_turn(url: str, sessions: int) -> list[list[dict]]:
    """Three turns of each session, unpinned."""
    _flush(url)
    replies = [[] for _ in range(sessions)]
    for _ in range(3):
        _turns(url, replies, [None] * sessions)
    return replies


def _reusable(reply: dict) -> int:
    """What a turn leaves the next one to resume: its prompt and answer but the answer's last token."""
    return reply["meta_info"]["prompt_tokens"] + len(reply["output_ids"]) - 1


def _internal_states(url: str) -> list[dict]:
    return requests.get(f"{url}/server_info", timeout=60).json()["internal_states"]


def _until_eos(url: str, ids: list[int], new_tokens: int, rank: int | None = None) -> dict:
    payload = {"input_ids": ids, "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0}}
    if rank is not None:
        payload["routed_dp_rank"] = rank
    reply = requests.post(f"{url}/generate", json=payload, timeout=900)
    assert reply.status_code == 200, reply.text
    return reply.json()


# As on the few_tokens server: four 500-token prompts admitted together on one rank (SGLang counts a tenth of
# the outputs of those that may stop at EOS) whose 200-token outputs then do not fit its 2,600 slots.
RETRACTED_PROMPTS = [[random.Random(seed).randrange(VOCAB) for _ in range(500)] for seed in range(23, 27)]
RETRACTED_OUTPUT = 200


def _until_eos_concurrently(url: str, prompts: list[list[int]], rank: int | None = None) -> list[dict]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        replies = list(pool.map(lambda ids: _until_eos(url, ids, RETRACTED_OUTPUT, rank), prompts))
    return replies


@pytest.fixture(scope="module")
def expected(tiny_server) -> dict:
    """The single-process server's answers to every request the tests send."""
    url = tiny_server
    _flush(url)  # the session's shared server: the session tests count cached tokens
    return {
        "prompts": {length: generate_on(url, ids, NEW_TOKENS) for length, ids in PROMPTS.items()},
        "long decode": generate_on(url, PROMPTS[5], LONG_DECODE),
        "session": (session := _session(url, None)),
        "cold second turn": _cold_second_turn(url, session[0]),
        "until eos": _until_eos_concurrently(url, RETRACTED_PROMPTS),
        "routed sessions": _routed_sessions(url),
        "evicted sessions": _sessions_turn_by_turn(url, EVICTED_SESSIONS),
    }


# Token slots per DP rank for about two of the retraction test's requests at once (as the pool-exhaustion
# tests' few_tokens server): SGLang queues, chunks prompts of more than 512 tokens, and retracts.
SCARCE_TOKENS = ("--max-total-tokens", "2600", "--chunked-prefill-size", "512", "--schedule-conservativeness", "0.1")


@pytest.fixture(scope="module")
def dp2(tiny_path, log_dir, expected):
    """The DP server on the batched backend (the random-config case below serves DP on the torch reference)."""
    os.environ.pop("SGLANG_CPU_OMP_THREADS_BIND", None)
    args = ("--dtype", "float32", *DP_ARGS, *SCARCE_TOKENS, "--attention-backend", "dsv4_batched")
    with running_server(tiny_path, *args, log_path=dp2_log(log_dir)) as url:
        yield url


def dp2_log(log_dir: Path) -> Path:
    return log_dir / "dp2-server.log"


def warmup_ranks(log: Path) -> set[str]:
    """The DP ranks of a server log's first two prefills: SGLang's start-up warmup, one identical prompt per
    rank sent together before the server takes requests."""
    prefills = [line for line in log.read_text().splitlines() if "Prefill batch" in line]
    return {re.search(r" (DP\d+) TP\d+", line).group(1) for line in prefills[:2]}


def test_sglangs_start_up_warmups_go_one_to_each_rank(dp2, log_dir):
    # dsv4_cache_aware holds no checkpoint for the first warmup until a rank reports one, so the second goes by
    # load to the other rank (it once followed the first to rank 0).
    assert warmup_ranks(dp2_log(log_dir)) == {"DP0", "DP1"}


def test_both_ranks_at_once_give_the_single_process_tokens_and_logprobs(dp2, expected):
    pinned = [(length, rank) for length in PROMPT_LENGTHS for rank in (0, 1)]
    with ThreadPoolExecutor(len(pinned)) as pool:
        replies = list(pool.map(lambda job: generate_on(dp2, PROMPTS[job[0]], NEW_TOKENS, job[1]), pinned))
    for (length, rank), served in zip(pinned, replies, strict=True):
        assert_same(served, expected["prompts"][length], f"{length} tokens on rank {rank}")


def dp_controller_of(url: str) -> psutil.Process:
    """The DP controller process of the server listening at ``url`` (a child of its launcher)."""
    port = url.rsplit(":", 1)[1]
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if "sglang.launch_server" in cmdline and port in cmdline:
            controllers = [c for c in process.children() if "data_parallel_controller" in " ".join(c.cmdline())]
            assert len(controllers) == 1, controllers
            return controllers[0]
    raise AssertionError(f"no launcher with --port {port}")


def test_an_idle_dp_controller_waits_instead_of_polling_under_sleep_on_idle(dp2):
    # SGLang's own loop polls its socket without waiting: a core busy while nothing is asked.
    controller = dp_controller_of(dp2)
    before = controller.cpu_times()
    time.sleep(3)
    after = controller.cpu_times()
    assert (after.user + after.system) - (before.user + before.system) < 0.3


def test_one_rank_serves_while_the_other_idles(dp2, expected):
    with ThreadPoolExecutor(len(PROMPT_LENGTHS)) as pool:
        replies = list(pool.map(lambda length: generate_on(dp2, PROMPTS[length], NEW_TOKENS, 0), PROMPT_LENGTHS))
    for length, served in zip(PROMPT_LENGTHS, replies, strict=True):
        assert_same(served, expected["prompts"][length], f"{length} tokens on rank 0, rank 1 idle")


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
        decoding = pool.submit(generate_on, dp2, PROMPTS[5], LONG_DECODE, 1)
        _wait_until_running(dp2)
        extending = pool.submit(generate_on, dp2, PROMPTS[700], NEW_TOKENS, 0)
        assert_same(extending.result(), expected["prompts"][700], "700-token prefill on rank 0")
        assert_same(decoding.result(), expected["long decode"], "decode on rank 1")


@pytest.mark.parametrize("rank", [0, 1])
def test_a_session_pinned_to_one_rank_resumes_from_that_ranks_cache(dp2, expected, rank):
    served = _session(dp2, rank)
    for turn, (reply, oracle) in enumerate(zip(served, expected["session"], strict=True)):
        assert_same(reply, oracle, f"turn {turn} on rank {rank}")
        assert reply["meta_info"]["cached_tokens"] == oracle["meta_info"]["cached_tokens"], turn
    assert served[1]["meta_info"]["cached_tokens"] > 0, "the second turn resumed nothing from the cache"
    assert_same(served[1], expected["cold second turn"], f"the warm second turn on rank {rank} against a cold one")
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
def test_an_attention_group_that_does_not_divide_the_output_groups_is_refused_at_start(
    tmp_path, sglang_with_plugin, spelling
):
    checkpoint = config_only_checkpoint(tmp_path / "one-group", o_groups=1)
    assert refusal_at_resolution(checkpoint, "--tp", "4", *spelling).startswith(
        "ConfigError: 'o_groups' (1) is not divisible by attention-TP = tp / attn-dp-size = 4 / 2 = 2"
    )


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


def servable_at_dp2(seed: int) -> bool:
    """Whether the random config of ``seed`` splits over ``--tp 2 --attn-dp-size 2 --ep-size 2``."""
    config = parse_config(random_v4_config(seed))
    try:
        check_tensor_parallel(config, 2, 2)
    except ConfigError:
        return False
    return config.n_routed_experts % 2 == 0


def _leave_mid_stream(url: str, ids: list[int], new_tokens: int, rank: int, events: int) -> None:
    """A streaming client pinned to ``rank`` that closes its connection after ``events`` events (the
    server aborts its request)."""
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    payload = {"input_ids": ids, "sampling_params": params, "stream": True, "routed_dp_rank": rank}
    with requests.post(f"{url}/generate", json=payload, stream=True, timeout=600) as reply:
        assert reply.status_code == 200, reply.text
        for _, _ in zip(range(events), reply.iter_lines(), strict=False):
            pass


def test_aborted_requests_on_both_ranks_return_every_row_and_the_ranks_serve_on_exact(dp2, expected):
    # Each rank: a client gone during a chunked prefill (its first event comes after the prompt), one gone
    # while decoding, and one kept, all at once.
    long_prompt = _prompt(1500, 700)
    with ThreadPoolExecutor(6) as pool:
        left = [pool.submit(_leave_mid_stream, dp2, long_prompt, 64, rank, 0) for rank in (0, 1)]
        left += [pool.submit(_leave_mid_stream, dp2, PROMPTS[300], 200, rank, 3) for rank in (0, 1)]
        kept = [pool.submit(generate_on, dp2, PROMPTS[300], NEW_TOKENS, rank) for rank in (0, 1)]
        for client in left:
            client.result()
        for rank, reply in enumerate(kept):
            assert_same(reply.result(), expected["prompts"][300], f"beside aborted requests on rank {rank}")
    assert_pools_idle(dp2)  # idle: every row free or in the tree; flushed: every row free, on both ranks
    for rank in (0, 1):
        assert_same(generate_on(dp2, PROMPTS[700], NEW_TOKENS, rank), expected["prompts"][700], f"rank {rank} after")


def test_random_load_on_scarce_token_slots_keeps_both_ranks_exact_and_returns_every_row(dp2):
    # The pool-exhaustion tests' rounds (long prompts, forks of earlier ones, n = 2, clients that leave),
    # under both hit modes and window policies, sent unpinned: SGLang's controller spreads them over the ranks.
    rng = random.Random("dp2")
    jobs, outputs = [], []
    _flush(dp2)
    try:
        for prefix_hits, window_policy in (("exact", "all_committed"), ("aligned", "per_request")):
            set_modes(dp2, prefix_hits=prefix_hits, window_policy=window_policy)
            modes = [{name: state["dsv4_prefix_cache"][name] for name in ("prefix_hits", "window_policy")}
                     for state in _internal_states(dp2)]  # fmt: skip
            assert modes == [{"prefix_hits": prefix_hits, "window_policy": window_policy}] * 2
            round_jobs = random_round(rng, [job.ids for job in jobs], SERVERS["few_tokens"])
            outputs += concurrently(dp2, round_jobs)
            jobs += round_jobs
            assert_healthy(dp2)
            for state in _internal_states(dp2):
                assert set(state["dsv4_prefix_cache"]["rows_miscounted"].values()) == {0}
    finally:
        set_modes(dp2, prefix_hits="exact", window_policy="per_request")
    assert_equal_to_cold_runs(jobs, outputs, functools.partial(cold_run, dp2))
    assert_pools_idle(dp2)


def test_a_rank_whose_decode_outgrows_its_token_slots_retracts_and_finishes_exact(dp2, expected):
    _flush(dp2)
    replies = _until_eos_concurrently(dp2, RETRACTED_PROMPTS, rank=1)
    assert sum(reply["meta_info"]["num_retractions"] for reply in replies) > 0, "rank 1 never retracted a request"
    for reply, oracle in zip(replies, expected["until eos"], strict=True):
        assert reply["output_ids"] == oracle["output_ids"], "differs from the single-process server's"
    assert_pools_idle(dp2)


def test_bad_input_on_the_dp_server_is_refused_or_fails_alone(dp2, expected):
    # A rank the server does not have: SGLang's refusal.
    refused = post(dp2, "/generate", {"input_ids": PROMPTS[5], "routed_dp_rank": 2})
    assert_refused(refused, "routed_dp_rank=2 out of range [0, 2)")
    # Ids outside the vocabulary, pinned to a rank (the embedding would raise there and stop every rank).
    refused = post(dp2, "/generate", {"input_ids": [5, VOCAB], "routed_dp_rank": 1})
    assert_refused(refused, f"input_ids must be in [0, {VOCAB})")
    # A sampled request whose grammar leaves no token (complete after one, min_tokens masks EOS) beside
    # greedy neighbours on both ranks: it fails alone.
    dead_end = {"input_ids": PROMPTS[5], "sampling_params": {"max_new_tokens": 4, "regex": "a", "min_new_tokens": 2,
                                                             "top_p": 0.5}}  # fmt: skip
    with ThreadPoolExecutor(4) as pool:
        failing = [pool.submit(post, dp2, "/generate", {**dead_end, "routed_dp_rank": rank}) for rank in (0, 1)]
        neighbours = [pool.submit(generate_on, dp2, PROMPTS[300], NEW_TOKENS, rank) for rank in (0, 1)]
        for reply in failing:
            assert CONTAINED_FAILURE not in reply.result().text, reply.result().text
        for rank, reply in enumerate(neighbours):
            assert_same(reply.result(), expected["prompts"][300], f"beside a dead-end grammar on rank {rank}")
    assert_healthy(dp2)
    assert_pools_idle(dp2)


DP_FUZZ_BATCHES = 4  # the single-process server's fuzz test runs for minutes; here a few batches per backend


@settings(
    max_examples=DP_FUZZ_BATCHES,
    deadline=None,
    phases=[Phase.generate],
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(batch=st.lists(probes(), min_size=REQUESTS_PER_BATCH, max_size=REQUESTS_PER_BATCH))
def test_fuzzed_requests_never_take_the_dp_server_down(dp2, log_dir, expected, batch):
    # The bad-input fuzzer's requests, spread over the ranks by SGLang's controller, with correct ones
    # pinned to each rank among them.
    with reported_if_down(dp2_log(log_dir), batch), ThreadPoolExecutor(16) as pool:
        fuzzed = [pool.submit(send, dp2, probe) for probe in batch]
        correct = [pool.submit(generate_on, dp2, PROMPTS[300], NEW_TOKENS, rank) for rank in (0, 1)]
        for future in fuzzed:
            future.result()
        for rank, reply in enumerate(correct):
            assert_same(reply.result(), expected["prompts"][300], f"among fuzzed requests on rank {rank}")
        assert_healthy(dp2)
        assert_pools_idle(dp2)


def test_unpinned_sessions_reach_the_rank_that_holds_their_cache_and_answer_as_one_process(dp2, expected):
    # dsv4_cache_aware is the default under attention DP: each later turn resumes its previous prompt and
    # answer but the answer's last token, wherever SGLang's controller would have sent it.
    before = _routing_reports(dp2)
    served = _routed_sessions(dp2)
    reusable = cached = 0
    for session, (replies, oracle) in enumerate(zip(served, expected["routed sessions"], strict=True)):
        assert [r["output_ids"] for r in replies] == [r["output_ids"] for r in oracle], f"session {session}"
        for previous, reply in itertools.pairwise(replies):
            reusable += previous["meta_info"]["prompt_tokens"] + len(previous["output_ids"]) - 1
            cached += reply["meta_info"]["cached_tokens"]
    assert cached >= 0.95 * reusable, f"later turns resumed {cached} of {reusable} reusable prompt tokens"
    # /server_info: per rank, the requests the router sent there, and those it predicted a checkpoint for.
    after = _routing_reports(dp2)
    routed = [a["routed"] - b["routed"] for a, b in zip(after, before, strict=True)]
    hits = [_predicted_hits(a) - _predicted_hits(b) for a, b in zip(after, before, strict=True)]
    assert sum(routed) == ROUTED_SESSIONS * ROUTED_TURNS and min(routed) >= ROUTED_TURNS, routed
    assert sum(hits) == ROUTED_SESSIONS * (ROUTED_TURNS - 1), hits
    assert_pools_idle(dp2)


def _routing_reports(url: str) -> list[dict]:
    """Each DP rank's routing figures in /server_info, in rank order."""
    states = sorted(_internal_states(url), key=lambda state: state["attn_dp_rank"])
    return [state["dsv4_routing"] for state in states]


def _predicted_hits(report: dict) -> int:
    return round(report["predicted_hit_share"] * report["routed"])


def test_sessions_on_a_rank_whose_cache_was_evicted_resume_cold_once_then_reuse_again(dp2, expected):
    # Sessions 0 and 1 start on rank 0, sessions 2 and 3 on rank 1; a burst of other prompts pinned to rank 1
    # then evicts what its tree held, and rank 1 reports it: the router predicts nothing there any more.
    _flush(dp2)
    replies = [[] for _ in range(EVICTED_SESSIONS)]
    first_ranks = [0 if session < EVICTED_SESSIONS // 2 else EVICTED_RANK for session in range(EVICTED_SESSIONS)]
    previous = _turns(dp2, replies, first_ranks)
    for seed in range(5):  # 3,500 prompt tokens on a rank of 2,600 token slots
        generate_on(dp2, _prompt(700, 1200 + seed), 1, EVICTED_RANK)
    evicted = [rank == EVICTED_RANK for rank in first_ranks]
    for turn, expect_cold in enumerate((evicted, [False] * EVICTED_SESSIONS), start=1):
        before = _routing_reports(dp2)
        served = _turns(dp2, replies, [None] * EVICTED_SESSIONS)
        after = _routing_reports(dp2)
        for session, (reply, last, cold) in enumerate(zip(served, previous, expect_cold, strict=True)):
            cached = reply["meta_info"]["cached_tokens"]
            assert cached == 0 if cold else cached >= _reusable(last), (turn, session, cached, _reusable(last))
        hits = sum(_predicted_hits(a) - _predicted_hits(b) for a, b in zip(after, before, strict=True))
        assert hits == EVICTED_SESSIONS - sum(expect_cold), f"turn {turn}: the router predicted {hits} hits"
        previous = served
    for session, (served, oracle) in enumerate(zip(replies, expected["evicted sessions"], strict=True)):
        assert [r["output_ids"] for r in served] == [r["output_ids"] for r in oracle], f"session {session}"
    assert_pools_idle(dp2)
