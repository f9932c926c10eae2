"""A prefill and a decode instance, each under attention DP (``--tp 2 --attn-dp-size 2 --ep-size 2``), behind smg
in PD mode (issue 44).

Both DP controllers route by ``dsv4_cache_aware`` (``auto`` resolves to it on either instance of a pair): the
prefill side to the rank holding the session's checkpoints, the decode side (``--disaggregation-decode-enable-radix-
cache``) to the rank whose tree resumed its last turn. SGLang pairs the ranks: the prefill rank posts itself to its
bootstrap server for the request's room, and the decode rank asks for it there. The oracle is the session's
single-process server (:func:`conftest.tiny_server`): greedy outputs equal token for token on multi-turn sessions
whose prompts span ratio-128 blocks, chunked prefill of 128 on the prefill side. Which rank served a turn is read
from each side: the decode rank from the reply's ``meta_info["dp_rank"]``, the prefill rank from the per-rank
``dsv4_transfer`` report (the rank that sent a state), and each side's router report (``dsv4_routing``: requests
routed, those it predicted a cached prefix for). The bytes each prefill rank submitted to the transfer engine are the
ledger's state past the prefix the decode rank held. After the sessions and after aborts, every row is back on
every rank of both instances. DP on one instance only: a plain decode instance paired with the DP prefill instance,
and a plain prefill instance with the DP decode instance, each started for its test, serve a two-turn session as one
server does.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
from conftest import random_ids
from serving_checks import assert_pools_idle, greedy
from test_containment import INNOCENT_VOCAB
from test_pd_server import DECODE_ARGS as PLAIN_DECODE_ARGS
from test_pd_server import PREFILL_ARGS as PLAIN_PREFILL_ARGS
from test_pd_server import PDRequest, abort_at_the_prefill_while_it_prefills, layout

from sglang_dsv4.disaggregation import mooncake_installed
from sglang_dsv4.launch import free_port, running_pd_router, running_server, smg_command

pytestmark = pytest.mark.skipif(
    not (mooncake_installed() and smg_command()), reason="the pd extra (Mooncake's engine and smg) is not installed"
)

DP_ARGS = ("--tp", "2", "--attn-dp-size", "2", "--ep-size", "2")
# The plain pair's instances (chunked prefill of 128 on the prefill side, the decode radix cache), each at DP 2.
PREFILL_ARGS, DECODE_ARGS = (*PLAIN_PREFILL_ARGS, *DP_ARGS), (*PLAIN_DECODE_ARGS, *DP_ARGS)
# A DP-2 instance starts its DP controller, two schedulers joined by gloo and a tokenizer: a minute or more here.
STARTUP_S = 600
SESSIONS, TURN_TOKENS, NEW_TOKENS = 2, (300, 150, 150), 12


@pytest.fixture(scope="module")
def pair(tiny_path: Path, log_dir: Path) -> Iterator[dict[str, str]]:
    """The two instances started one after the other, and smg in front (Mooncake's TCP transport with its legacy
    framing, which the plugin sets: docs/serving.md, "Mooncake's TCP framing")."""
    os.environ.pop("SGLANG_CPU_OMP_THREADS_BIND", None)
    bootstrap = free_port()
    with (
        running_server(tiny_path, *PREFILL_ARGS, "--disaggregation-bootstrap-port", str(bootstrap),
                       log_path=log_dir / "pd-dp-prefill.log", startup_timeout_s=STARTUP_S) as prefill,
        running_server(tiny_path, *DECODE_ARGS, "--disaggregation-bootstrap-port", str(free_port()),
                       log_path=log_dir / "pd-dp-decode.log", startup_timeout_s=STARTUP_S) as decode,
        running_pd_router(prefill, bootstrap, decode, log_dir / "pd-dp-smg.log") as router,
    ):  # fmt: skip
        yield {"router": router, "prefill": prefill, "decode": decode, "bootstrap": bootstrap}


def rank_states(url: str) -> dict[int, dict]:
    """Each DP rank's ``/server_info`` internal state, by its rank (SGLang lists them as they answer)."""
    states = requests.get(f"{url}/server_info", timeout=30).json()["internal_states"]
    return {state["attn_dp_rank"]: state for state in states}


def snapshot(pair: dict) -> dict[str, dict[int, dict]]:
    """Per rank: the prefill side's transfer report, each side's router report."""
    prefill, decode = rank_states(pair["prefill"]), rank_states(pair["decode"])
    return {
        "sent": {rank: state["dsv4_transfer"] for rank, state in prefill.items()},
        "prefill_routing": {rank: state["dsv4_routing"] for rank, state in prefill.items()},
        "decode_routing": {rank: state["dsv4_routing"] for rank, state in decode.items()},
    }


def change(before: dict[int, dict], after: dict[int, dict], key: str) -> dict[int, float]:
    return {rank: count(after[rank], key) - count(before[rank], key) for rank in after}


def count(report: dict, key: str) -> float:
    """A report's figure; ``predicted_hits``: the router's requests predicted a cached prefix (its share of those
    routed)."""
    if key == "predicted_hits":
        return round(report["predicted_hit_share"] * report["routed"])
    return report[key]


def generate(url: str, ids: list[int]) -> dict:
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    reply = requests.post(f"{url}/generate", json={"input_ids": ids, "sampling_params": params}, timeout=600)
    assert reply.status_code == 200, reply.text
    return reply.json()


def new_tokens(session: int, turn: int) -> list[int]:
    return random_ids(TURN_TOKENS[turn], INNOCENT_VOCAB, seed=4600 + 10 * session + turn).tolist()


@pytest.fixture(scope="module")
def sessions(pair, tiny_server, tiny_path) -> list[list[dict]]:
    """Two sessions of three turns, each turn the last one's prompt and output and new tokens: the first turns sent
    at once (the routers spread them by load), the later ones one at a time. Per turn: its prompt, the reply, the
    expected output (the single server's) and the change in the per-rank reports."""
    prompts = [new_tokens(session, 0) for session in range(SESSIONS)]
    turns: list[list[dict]] = [[] for _ in range(SESSIONS)]
    before = snapshot(pair)
    with ThreadPoolExecutor(SESSIONS) as pool:
        replies = list(pool.map(lambda ids: generate(pair["router"], ids), prompts))
    after = snapshot(pair)
    for session, reply in enumerate(replies):
        turns[session].append({"prompt": prompts[session], "reply": reply, "reports": (before, after)})
    for turn in range(1, len(TURN_TOKENS)):
        for session in range(SESSIONS):
            last = turns[session][-1]
            prompt = last["prompt"] + last["reply"]["output_ids"] + new_tokens(session, turn)
            before = snapshot(pair)
            reply = generate(pair["router"], prompt)
            turns[session].append({"prompt": prompt, "reply": reply, "reports": (before, snapshot(pair))})
    for session_turns in turns:
        for entry in session_turns:
            entry["expected"] = greedy(tiny_server, entry["prompt"], NEW_TOKENS)
    return turns


def test_multi_turn_sessions_generate_what_one_server_does(sessions):
    for session, session_turns in enumerate(sessions):
        for turn, entry in enumerate(session_turns):
            assert entry["reply"]["output_ids"] == entry["expected"], (session, turn)


def test_the_first_turns_are_spread_over_both_ranks_of_each_side(sessions):
    decode_ranks = {session_turns[0]["reply"]["meta_info"]["dp_rank"] for session_turns in sessions}
    assert decode_ranks == {0, 1}
    before, after = sessions[0][0]["reports"]
    assert change(before["sent"], after["sent"], "states_sent") == {0: 1, 1: 1}
    assert change(before["prefill_routing"], after["prefill_routing"], "routed") == {0: 1, 1: 1}


def serving_prefill_rank(entry: dict) -> int:
    """The one prefill rank that sent a state during this (lone) turn."""
    before, after = entry["reports"]
    sent = change(before["sent"], after["sent"], "states_sent")
    ranks = [rank for rank, count in sent.items() if count]
    assert len(ranks) == 1 and sent[ranks[0]] == 1, sent
    return ranks[0]


def test_every_turn_of_a_session_lands_on_the_rank_holding_its_cache_on_each_side(sessions):
    """Later turns: on the decode side the rank of the session's first turn, predicted (and found) to hold its
    cache; on the prefill side one rank per session, the two sessions on different ranks, each routed there for the
    session's checkpoints (a predicted hit)."""
    prefill_ranks = []
    for session_turns in sessions:
        decode_rank = session_turns[0]["reply"]["meta_info"]["dp_rank"]
        ranks = set()
        for entry in session_turns[1:]:
            assert entry["reply"]["meta_info"]["dp_rank"] == decode_rank
            before, after = entry["reports"]
            assert change(before["decode_routing"], after["decode_routing"], "routed")[decode_rank] == 1
            assert change(before["decode_routing"], after["decode_routing"], "predicted_hits")[decode_rank] == 1
            rank = serving_prefill_rank(entry)
            assert change(before["prefill_routing"], after["prefill_routing"], "predicted_hits")[rank] == 1
            assert change(before["sent"], after["sent"], "decode_prefix_tokens")[rank] > 0  # the decode rank held it
            ranks.add(rank)
        assert len(ranks) == 1
        prefill_ranks += ranks
    assert sorted(prefill_ranks) == [0, 1]


def test_each_prefill_rank_moves_the_ledgers_bytes_past_what_the_decode_rank_held(sessions, tiny_path):
    for session_turns in sessions:
        for turn, entry in enumerate(session_turns[1:], start=1):
            before, after = entry["reports"]
            rank = serving_prefill_rank(entry)
            held = change(before["sent"], after["sent"], "decode_prefix_tokens")[rank]
            previous_end = len(session_turns[turn - 1]["prompt"]) + NEW_TOKENS
            assert previous_end - 1 <= held <= previous_end
            moved = change(before["sent"], after["sent"], "bytes_sent")[rank]
            assert moved == layout(tiny_path).state_bytes_past(held, len(entry["prompt"]))


def test_every_row_is_back_on_every_rank_of_both_sides_after_the_sessions(pair, sessions):
    for side in ("prefill", "decode"):
        assert_pools_idle(pair[side])


def test_every_row_comes_back_after_a_client_disconnects(pair, tiny_server):
    params = {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}
    prompt = new_tokens(7, 0)
    with pytest.raises(requests.Timeout):
        requests.post(f"{pair['router']}/generate", json={"input_ids": prompt, "sampling_params": params},
                      timeout=3)  # fmt: skip
    assert greedy(pair["router"], prompt, 4) == greedy(tiny_server, prompt, 4)
    for side in ("prefill", "decode"):
        assert_pools_idle(pair[side])


def test_an_abort_sent_to_the_prefill_instance_while_it_prefills_ends_the_request_on_both(pair, tiny_server):
    rid = "dp-abort-while-prefilling"
    request = PDRequest(pair["prefill"], pair["decode"], pair["bootstrap"],
                        random_ids(3000, INNOCENT_VOCAB, seed=4630).tolist(), rid)  # fmt: skip
    abort_at_the_prefill_while_it_prefills(pair, request, rid, ended_within_s=60)
    prompt = new_tokens(8, 0)
    assert greedy(pair["router"], prompt, 4) == greedy(tiny_server, prompt, 4)


def two_turns(prefill: str, decode: str, bootstrap: int, tiny_server: str, seed: int) -> list[dict]:
    """A two-turn session sent to the two instances as a PD router sends it: outputs equal one server's; per turn
    the decode reply and the prefill instance's per-rank transfer reports before and after."""
    prompt, turns = new_tokens(seed, 0), []
    for turn in range(2):
        before = rank_states(prefill)
        replies = PDRequest(prefill, decode, bootstrap, prompt, f"one-side-{seed}-{turn}", new_tokens=NEW_TOKENS).wait()
        assert replies["prefill"].status_code == 200 and replies["decode"].status_code == 200, replies
        reply = replies["decode"].json()
        assert reply["output_ids"] == greedy(tiny_server, prompt, NEW_TOKENS)
        sent = {"sent": ({r: s["dsv4_transfer"] for r, s in before.items()},
                         {r: s["dsv4_transfer"] for r, s in rank_states(prefill).items()})}  # fmt: skip
        turns.append({"prompt": prompt, "reply": reply, **sent})
        prompt = prompt + reply["output_ids"] + new_tokens(seed, 1)
    return turns


def the_ledgers_bytes(turns: list[dict], tiny_path: Path) -> set[int]:
    """Each turn moved the ledger's state past what the decode instance held, from one prefill rank: the ranks."""
    ranks = set()
    for entry in turns:
        before, after = entry["sent"]
        sent = change(before, after, "states_sent")
        (rank,) = (rank for rank, count in sent.items() if count)
        held = change(before, after, "decode_prefix_tokens")[rank]
        moved = change(before, after, "bytes_sent")[rank]
        assert moved == layout(tiny_path).state_bytes_past(held, len(entry["prompt"]))
        ranks.add(rank)
    return ranks


def test_a_prefill_instance_under_dp_pairs_with_a_decode_instance_without(pair, tiny_server, tiny_path, log_dir):
    """The decode instance asks the prefill instance's bootstrap server for the rank each room landed on; the
    session's second turn goes to the prefill rank holding its checkpoints."""
    with running_server(tiny_path, *PLAIN_DECODE_ARGS, "--disaggregation-bootstrap-port", str(free_port()),
                        log_path=log_dir / "pd-plain-decode.log") as decode:  # fmt: skip
        turns = two_turns(pair["prefill"], decode, pair["bootstrap"], tiny_server, seed=11)
        assert len(the_ledgers_bytes(turns, tiny_path)) == 1
        assert_pools_idle(decode)
    assert_pools_idle(pair["prefill"])


def test_a_decode_instance_under_dp_pairs_with_a_prefill_instance_without(pair, tiny_server, tiny_path, log_dir):
    """The decode ranks fetch from the prefill instance's one rank; the session's second turn goes to the decode rank
    that resumed its first."""
    bootstrap = free_port()
    with running_server(tiny_path, *PLAIN_PREFILL_ARGS, "--disaggregation-bootstrap-port", str(bootstrap),
                        log_path=log_dir / "pd-plain-prefill.log") as prefill:  # fmt: skip
        turns = two_turns(prefill, pair["decode"], bootstrap, tiny_server, seed=12)
        assert the_ledgers_bytes(turns, tiny_path) == {0}
        assert turns[0]["reply"]["meta_info"]["dp_rank"] == turns[1]["reply"]["meta_info"]["dp_rank"]
        assert change(*turns[1]["sent"], "decode_prefix_tokens")[0] > 0
        assert_pools_idle(prefill)
    assert_pools_idle(pair["decode"])
