"""Prefill/decode disaggregation against one server (issue 44): the recorded agent sessions replayed turn by turn.

Side by side in one run, on the tiny random checkpoint in float32:

- ``one server``: a single server pinned to both cores of this host;
- ``pair``: a prefill instance pinned to core 0 and a decode instance to core 1, ``mooncake_tcp`` between them, behind
  ``smg launch --pd-disaggregation`` (the router and the client unpinned);
- ``pair + decode radix cache``: the same with ``--disaggregation-decode-enable-radix-cache`` on the decode instance.

Per turn: TTFT and output speed (tokens after the first over the time after the first) as the client sees them, the
greedy output (each pair's must equal the server's), the tokens prefilled (prompt tokens less the reply's
``cached_tokens``: on a pair the prefill instance's count, raised by SGLang's decode side to its own prefix where that
is longer), and on each pair the bytes the prefill instance handed the transfer engine, the
seconds its sends took and the prompt tokens the decode instance held (``/server_info``'s ``dsv4_transfer``),
against the ledger's state past that prefix (``PoolLayout.state_bytes_past``) and the whole session's state at the
turn's prompt (``PoolLayout.state_bytes_at``). Turns run one at a time.

    python benchmarks/pd.py [--sessions 4] [--turns 6] [--out benchmarks/results/pd.json] [--sessions-file PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import requests
import torch
from prefix_reuse import DATA, SCALE, first_turns, render
from transformers import AutoTokenizer

from sglang_dsv4.agentperf.traces import load_sessions
from sglang_dsv4.agentperf.trajectory import ToolLatency
from sglang_dsv4.config import load_config
from sglang_dsv4.launch import free_port, running_pd_router, running_server
from sglang_dsv4.memory_pool.layout import PoolLayout
from sglang_dsv4.tiny import build_checkpoint

TRANSFER = ("--disaggregation-transfer-backend", "mooncake_tcp")


@contextlib.contextmanager
def pinned(cores: set[int]) -> Iterator[None]:
    """Processes started inside inherit ``cores`` (as ``taskset`` would give them)."""
    own = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, own)


def pinned_server(stack: contextlib.ExitStack, cores: set[int], model: Path, *args: str, log_path: Path) -> str:
    with pinned(cores):
        return stack.enter_context(
            running_server(model, "--dtype", "float32", *args, log_path=log_path)
        )


def turn(url: str, history: list[int], new_tokens: int) -> dict:
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
            output, cached = chunk["output_ids"], chunk["meta_info"]["cached_tokens"]
    end = time.perf_counter()
    speed = (len(output) - 1) / (end - first) if len(output) > 1 else float("nan")
    return {"ttft_s": first - start, "tokens_per_s": speed, "output": output, "cached_tokens": cached}


def transfer_report(url: str) -> dict:
    return requests.get(f"{url}/server_info", timeout=30).json()["internal_states"][0]["dsv4_transfer"]


def replay(url: str, sessions, tokenizer, prefill: str | None) -> list[dict]:
    """Every session's turns in order, one at a time; each turn's history is the last one's, its reply and the
    turn's new messages. ``prefill``: a pair's prefill instance (None for one server)."""
    rows = []
    for session in sessions:
        history: list[int] = []
        for number, recorded in enumerate(session.turns):
            history = history + render(tokenizer, recorded.new_messages)
            before = transfer_report(prefill) if prefill else None
            row = {"session": session.name, "turn": number, "prompt_tokens": len(history),
                   **turn(url, history, recorded.output_tokens)}  # fmt: skip
            row["prefilled_tokens"] = len(history) - row["cached_tokens"]
            if prefill:
                after = transfer_report(prefill)
                row["bytes_sent"] = after["bytes_sent"] - before["bytes_sent"]
                row["send_s"] = after["send_seconds"] - before["send_seconds"]
                row["decode_prefix_tokens"] = after["decode_prefix_tokens"] - before["decode_prefix_tokens"]
            rows.append(row)
            history = history + row["output"]
    return rows


def replay_on_pair(model: Path, work: Path, name: str, sessions, tokenizer, *decode_flags: str) -> list[dict]:
    """The sessions on a prefill instance (core 0) and a decode instance (core 1) behind smg."""
    with contextlib.ExitStack() as stack:
        bootstrap = free_port()
        prefill_args = ("--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bootstrap))
        decode_args = ("--disaggregation-mode", "decode", "--disaggregation-bootstrap-port", str(free_port()))
        prefill = pinned_server(stack, {0}, model, *TRANSFER, *prefill_args, log_path=work / f"{name}-prefill.log")
        decode = pinned_server(stack, {1}, model, *TRANSFER, *decode_args, *decode_flags,
                               log_path=work / f"{name}-decode.log")  # fmt: skip
        router = stack.enter_context(running_pd_router(prefill, bootstrap, decode, work / f"{name}-smg.log"))
        return replay(router, sessions, tokenizer, prefill)


def compare(alone: list[dict], paired: list[dict], layout: PoolLayout) -> dict:
    """Each turn of a pair against one server's, and the pair's totals."""
    for a, b in zip(alone, paired, strict=True):
        b["equal_to_one_server"] = a["output"] == b["output"]
        b["ledger_bytes"] = layout.state_bytes_past(b["decode_prefix_tokens"], b["prompt_tokens"])
        b["session_state_bytes"] = layout.state_bytes_at(b["prompt_tokens"])
        b["transfer_share_of_ttft"] = b["send_s"] / b["ttft_s"]
    later = [r for r in paired if r["turn"] > 0]
    return {
        "all_equal": all(r["equal_to_one_server"] for r in paired),
        "bytes_equal_to_ledger": all(r["bytes_sent"] == r["ledger_bytes"] for r in paired),
        "bytes_sent": sum(r["bytes_sent"] for r in paired),
        "session_state_bytes": sum(r["session_state_bytes"] for r in paired),
        "bytes_over_session_state_later_turns_median": statistics.median(
            r["bytes_sent"] / r["session_state_bytes"] for r in later
        ),
        "decode_prefix_tokens": sum(r["decode_prefix_tokens"] for r in paired),
        "prefilled_tokens": sum(r["prefilled_tokens"] for r in paired),
        "prefilled_tokens_one_server": sum(r["prefilled_tokens"] for r in alone),
        "transfer_share_of_ttft_median": statistics.median(r["transfer_share_of_ttft"] for r in paired),
    }


def summary(name: str, rows: list[dict]) -> dict:
    return {
        "setup": name,
        "turns": len(rows),
        "ttft_median_s": statistics.median(r["ttft_s"] for r in rows),
        "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in rows if len(r["output"]) > 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "pd.json")
    parser.add_argument("--sessions-file", type=Path, default=DATA, help="the recorded sessions")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pd-"))
    model = build_checkpoint(work / "tiny")
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    layout = PoolLayout(load_config(model), torch.float32)
    recorded = load_sessions(args.sessions_file, SCALE, ToolLatency(median_s=0.0), seed=0)
    sessions = [first_turns(t, args.turns) for t in recorded[: args.sessions]]

    with contextlib.ExitStack() as stack:
        single = pinned_server(stack, {0, 1}, model, log_path=work / "single.log")
        alone = replay(single, sessions, tokenizer, None)
    pairs = {
        "pair (core 0 + core 1) + smg": replay_on_pair(model, work, "pair", sessions, tokenizer),
        "pair + decode radix cache": replay_on_pair(
            model, work, "radix", sessions, tokenizer, "--disaggregation-decode-enable-radix-cache"
        ),
    }
    comparisons = {name: compare(alone, rows, layout) for name, rows in pairs.items()}
    result = {
        "what": "recorded sessions turn by turn, one at a time; tiny random checkpoint, float32, this CPU host",
        "summary": [summary("one server (cores 0,1)", alone)] + [summary(name, rows) for name, rows in pairs.items()],
        "against_one_server": comparisons,
        "one_server": [{k: v for k, v in r.items() if k != "output"} for r in alone],
        **{name: [{k: v for k, v in r.items() if k != "output"} for r in rows] for name, rows in pairs.items()},
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("summary", "against_one_server")}, indent=1))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
