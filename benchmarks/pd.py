"""Prefill/decode disaggregation against one server (issue 44): the recorded agent sessions replayed turn by turn.

Two phases, one per pair; in each, side by side and interleaved turn by turn (the order alternating), on the tiny
random checkpoint in float32 with ``--enable-metrics``:

- ``one server``: a single server pinned to both cores of this host, the client straight to it, twice: with two
  torch threads (SGLang's default there), and with one (``ONE_TORCH_THREAD``: on a loaded host a second thread's
  barriers wait out other processes' time slices);
- the pair: a prefill instance pinned to core 0 and a decode instance to core 1 (one torch thread each),
  ``mooncake_tcp`` between them, behind ``smg launch --pd-disaggregation`` (the router and the client unpinned);
  phase ``pair``, then phase ``pair + decode radix cache`` (``--disaggregation-decode-enable-radix-cache`` on the
  decode instance), each against fresh one servers.

Per turn and setup: TTFT and output speed (tokens after the first over the time after the first) as the client sees
them, and the greedy output (each pair's must equal the one server's); the server's own TTFT (its ``meta_info``'s
``first_token_latency``, from the request's arrival at the server answering the client: the decode instance on a
pair) and the rest of the client's TTFT, the client's and on a pair the router's time; the tokens prefilled
(prompt tokens less the reply's ``cached_tokens``). On a pair also, from what its instances report: SGLang's stage
times on the prefill instance (``sglang:per_stage_req_latency_seconds``: ``prefill_bootstrap``, ``prefill_forward``
and ``prefill_transfer_kv_cache``, from the prompt's last chunk to the transfer's success), the seconds the state
sends took, the bytes and contiguous blocks the prefill instance handed the transfer engine and the prompt tokens
the decode instance held (``/server_info``'s ``dsv4_transfer``), against the ledger's state past that prefix
(``PoolLayout.state_bytes_past``) and the whole session's state at the turn's prompt (``PoolLayout.state_bytes_at``).
Turns run one at a time; the host's load average is recorded with each. Ratios are taken turn by turn (the pair's
turn against a one server's same turn, run next to it), then their median.

    python benchmarks/pd.py [--sessions 3] [--turns 5] [--out benchmarks/results/pd.json] [--sessions-file PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import requests
import torch
from prefix_reuse import DATA, SCALE, first_turns, render
from transformers import AutoTokenizer

from sglang_dsv4.agentperf.traces import load_sessions
from sglang_dsv4.agentperf.trajectory import ToolLatency
from sglang_dsv4.config import load_config
from sglang_dsv4.launch import ONE_TORCH_THREAD, free_port, running_pd_router, running_server
from sglang_dsv4.memory_pool.layout import PoolLayout
from sglang_dsv4.tiny import build_checkpoint

TRANSFER = ("--disaggregation-transfer-backend", "mooncake_tcp")
STARTUP_TIMEOUT_S = 900  # servers start one after another on a shared 2-core host
PREFILL_STAGES = ("prefill_bootstrap", "prefill_forward", "prefill_transfer_kv_cache")
ONE_SERVERS = {"one server, 2 threads (cores 0,1)": None, "one server, 1 thread (cores 0,1)": ONE_TORCH_THREAD}
PAIRS = {"pair": (), "pair + decode radix cache": ("--disaggregation-decode-enable-radix-cache",)}


@dataclass(frozen=True)
class Setup:
    """Where a setup's client sends its turns, and on a pair its prefill instance (None on one server)."""

    name: str
    url: str
    prefill: str | None = None


@contextlib.contextmanager
def pinned(cores: set[int]) -> Iterator[None]:
    """Processes started inside inherit ``cores`` (as ``taskset`` would give them)."""
    own = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, own)


def pinned_server(
    stack: contextlib.ExitStack, cores: set[int], model: Path, *args: str, log_path: Path, env: dict | None = None
) -> str:
    with pinned(cores):
        return stack.enter_context(
            running_server(model, "--dtype", "float32", "--enable-metrics", *args, log_path=log_path, env=env,
                           startup_timeout_s=STARTUP_TIMEOUT_S)
        )  # fmt: skip


def started_pair(stack: contextlib.ExitStack, model: Path, work: Path, name: str, *decode_flags: str) -> Setup:
    """A prefill instance (core 0) and a decode instance (core 1) behind smg."""
    bootstrap = free_port()
    prefill_args = ("--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bootstrap))
    decode_args = ("--disaggregation-mode", "decode", "--disaggregation-bootstrap-port", str(free_port()))
    slug = name.replace(" ", "-").replace("+", "")
    prefill = pinned_server(stack, {0}, model, *TRANSFER, *prefill_args, log_path=work / f"{slug}-prefill.log")
    decode = pinned_server(stack, {1}, model, *TRANSFER, *decode_args, *decode_flags,
                           log_path=work / f"{slug}-decode.log")  # fmt: skip
    router = stack.enter_context(running_pd_router(prefill, bootstrap, decode, work / f"{slug}-smg.log"))
    return Setup(name, router, prefill)


def turn(url: str, history: list[int], new_tokens: int) -> dict:
    """One streamed greedy turn: the client's TTFT and output speed, and the server's own TTFT."""
    payload = {
        "input_ids": history,
        "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True},
        "stream": True,
    }
    start, first, output = time.perf_counter(), None, []
    with requests.post(f"{url}/generate", json=payload, stream=True, timeout=(30, None)) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            first = first or time.perf_counter()
            chunk = json.loads(line[5:])
            output, meta = chunk["output_ids"], chunk["meta_info"]
    end = time.perf_counter()
    speed = (len(output) - 1) / (end - first) if len(output) > 1 else float("nan")
    ttft, server_ttft = first - start, meta["first_token_latency"]
    return {"ttft_s": ttft, "server_ttft_s": server_ttft, "off_server_s": ttft - server_ttft,
            "tokens_per_s": speed, "output": output, "cached_tokens": meta["cached_tokens"]}  # fmt: skip


def transfer_report(url: str) -> dict:
    return requests.get(f"{url}/server_info", timeout=30).json()["internal_states"][0]["dsv4_transfer"]


def stage_seconds(url: str) -> dict[str, float]:
    """The prefill instance's summed seconds in each of :data:`PREFILL_STAGES` (its Prometheus histograms)."""
    text = requests.get(f"{url}/metrics", timeout=30).text
    found = re.findall(r'^sglang:per_stage_req_latency_seconds_sum\{[^}]*stage="(\w+)"[^}]*\} (\S+)$', text, re.M)
    sums = dict.fromkeys(PREFILL_STAGES, 0.0)
    for stage, value in found:
        if stage in sums:
            sums[stage] += float(value)
    return sums


def pair_counters(prefill: str) -> dict[str, float]:
    report = transfer_report(prefill)
    return {"bytes_sent": report["bytes_sent"], "blocks_sent": report["blocks_sent"], "send_s": report["send_seconds"],
            "decode_prefix_tokens": report["decode_prefix_tokens"],
            **{f"{stage}_s": seconds for stage, seconds in stage_seconds(prefill).items()}}  # fmt: skip


def run_turn(setup: Setup, history: list[int], new_tokens: int) -> dict:
    """One turn on ``setup``; on a pair, what its prefill instance reports for it (its counters' growth)."""
    before = pair_counters(setup.prefill) if setup.prefill else {}
    row = {"load_1min": os.getloadavg()[0], **turn(setup.url, history, new_tokens)}
    row["prefilled_tokens"] = len(history) - row["cached_tokens"]
    if setup.prefill:
        after = pair_counters(setup.prefill)
        row.update({key: after[key] - before[key] for key in after})
    return row


def replay_interleaved(setups: list[Setup], sessions, tokenizer) -> dict[str, list[dict]]:
    """Every session's turns in order, one at a time, each turn on every setup next to each other (the order
    alternating turn by turn); each setup's next prompt is its last one, its reply and the turn's new messages."""
    rows: dict[str, list[dict]] = {s.name: [] for s in setups}
    count = 0
    for session in sessions:
        histories = {s.name: [] for s in setups}
        for number, recorded in enumerate(session.turns):
            order = setups if count % 2 == 0 else setups[::-1]
            count += 1
            for setup in order:
                history = histories[setup.name] + render(tokenizer, recorded.new_messages)
                row = {"session": session.name, "turn": number, "prompt_tokens": len(history),
                       **run_turn(setup, history, recorded.output_tokens)}  # fmt: skip
                rows[setup.name].append(row)
                histories[setup.name] = history + row["output"]
    return rows


def median(values) -> float:
    return statistics.median(list(values))


def against(alone: list[dict], paired: list[dict]) -> dict:
    """The pair's turns against one server's same turns: medians of the turn-by-turn ratios, and the router's time
    (the pair's time off its servers less the one server's: the client's is in both)."""
    both = list(zip(alone, paired, strict=True))
    return {
        "all_equal": all(a["output"] == b["output"] for a, b in both),
        "ttft_over_one_server_median": median(b["ttft_s"] / a["ttft_s"] for a, b in both),
        "server_ttft_over_one_server_median": median(b["server_ttft_s"] / a["server_ttft_s"] for a, b in both),
        "speed_over_one_server_median": median(
            b["tokens_per_s"] / a["tokens_per_s"] for a, b in both if len(b["output"]) > 1
        ),
        "router_s_median": median(b["off_server_s"] - a["off_server_s"] for a, b in both),
    }


def pair_totals(alone: list[dict], paired: list[dict], layout: PoolLayout) -> dict:
    """What the pair moved against the ledger, where its TTFT went, and the tokens it prefilled against one
    server's (``alone``)."""
    for b in paired:
        b["ledger_bytes"] = layout.state_bytes_past(b["decode_prefix_tokens"], b["prompt_tokens"])
        b["session_state_bytes"] = layout.state_bytes_at(b["prompt_tokens"])
    later = [r for r in paired if r["turn"] > 0]
    return {
        "bytes_equal_to_ledger": all(r["bytes_sent"] == r["ledger_bytes"] for r in paired),
        "transfer_share_of_ttft_median": median(r["prefill_transfer_kv_cache_s"] / r["ttft_s"] for r in paired),
        "send_share_of_ttft_median": median(r["send_s"] / r["ttft_s"] for r in paired),
        "prefill_forward_share_of_ttft_median": median(r["prefill_forward_s"] / r["ttft_s"] for r in paired),
        "bytes_sent": sum(r["bytes_sent"] for r in paired),
        "blocks_sent_per_turn_median": median(r["blocks_sent"] for r in paired),
        "session_state_bytes": sum(r["session_state_bytes"] for r in paired),
        "bytes_over_session_state_later_turns_median": median(
            r["bytes_sent"] / r["session_state_bytes"] for r in later
        ),
        "decode_prefix_tokens": sum(r["decode_prefix_tokens"] for r in paired),
        "prefilled_tokens": sum(r["prefilled_tokens"] for r in paired),
        "prefilled_tokens_one_server": sum(r["prefilled_tokens"] for r in alone),
    }


def summary(rows: list[dict]) -> dict:
    timed = {key: median(r[key] for r in rows) for key in ("ttft_s", "server_ttft_s", "off_server_s")}
    keys = ("send_s", *(f"{stage}_s" for stage in PREFILL_STAGES))
    pair = {key: median(r[key] for r in rows) for key in keys if key in rows[0]}
    return {
        "turns": len(rows),
        **{f"{key}_median": value for key, value in {**timed, **pair}.items()},
        "tokens_per_s_median": median(r["tokens_per_s"] for r in rows if len(r["output"]) > 1),
        "load_1min_range": [min(r["load_1min"] for r in rows), max(r["load_1min"] for r in rows)],
    }


def run_phase(model: Path, work: Path, name: str, decode_flags: tuple[str, ...], sessions, tokenizer, layout) -> dict:
    """Fresh one servers and the pair ``name``, up together, the sessions interleaved on all of them."""
    with contextlib.ExitStack() as stack:
        singles = [
            Setup(one, pinned_server(stack, {0, 1}, model, log_path=work / f"{name[:4]}-one-{i}.log", env=env))
            for i, (one, env) in enumerate(ONE_SERVERS.items())
        ]
        pair = started_pair(stack, model, work, name, *decode_flags)
        rows = replay_interleaved([*singles, pair], sessions, tokenizer)
    paired = rows[name]
    return {
        "summary": {setup: summary(rows[setup]) for setup in rows},
        "against_one_server": {one: against(rows[one], paired) for one in ONE_SERVERS},
        "pair": pair_totals(rows[next(iter(ONE_SERVERS))], paired, layout),
        "turns": {setup: [{k: v for k, v in r.items() if k != "output"} for r in rows[setup]] for setup in rows},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=3)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "pd.json")
    parser.add_argument("--sessions-file", type=Path, default=DATA, help="the recorded sessions")
    args = parser.parse_args()
    recorded = load_sessions(args.sessions_file, SCALE, ToolLatency(median_s=0.0), seed=0)
    sessions = [first_turns(t, args.turns) for t in recorded[: args.sessions]]
    with tempfile.TemporaryDirectory(prefix="pd-") as folder:
        work = Path(folder)
        model = build_checkpoint(work / "tiny")
        tokenizer = AutoTokenizer.from_pretrained(str(model))
        layout = PoolLayout(load_config(model), torch.float32)
        phases = {
            name: run_phase(model, work, name, flags, sessions, tokenizer, layout) for name, flags in PAIRS.items()
        }
    result = {
        "what": "recorded sessions turn by turn, one at a time, each turn on the one servers and on the pair next to "
        "each other; tiny random checkpoint, float32, this CPU host (2 cores, shared)",
        **{name: phase for name, phase in phases.items()},
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({name: {k: v for k, v in p.items() if k != "turns"} for name, p in phases.items()}, indent=1))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
