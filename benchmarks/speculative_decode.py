"""Served decode speed with and without speculation (EAGLE with the MTP layer), in one run, on the CPU.

    cd benchmarks && python speculative_decode.py [--rounds 3] [--new-tokens 96]

Two servers of the shipped tiny checkpoint, started the way a user starts them: one plain, one with
``--speculative-algorithm EAGLE --speculative-num-steps 3 --speculative-eagle-topk 1
--speculative-num-draft-tokens 4``. Prompts are the held-out recorded agent sessions, each cut where the
assistant starts a reply (``mtp_acceptance.held_out_prompts``), so the drafts meet the text the MTP layer
was trained on. At batch 1 and batch 8 (the first 1 and 8 prompts, sent together), each request decodes
``--new-tokens`` greedy tokens, streamed: a request's decode speed is its tokens after the first over the
time from its first token to its last, the prefix cache flushed before each batch. The servers are
measured in turn for ``--rounds`` rounds and each keeps its best (the host is shared: the best round is
the least disturbed). Prints tokens/s per request for each, the speculative / plain ratio, the mean
accepted length SGLang reports (tokens a verify step), and checks that both servers' outputs are equal
token for token (speculation must not change a greedy output).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import tempfile
import time
from pathlib import Path

import requests
from mtp_acceptance import held_out_prompts
from train_tiny import REPO
from transformers import AutoTokenizer

from sglang_dsv4.launch import running_server
from sglang_dsv4.speculation import SPECULATION
from sglang_dsv4.tiny import shipped_checkpoint

SERVERS = {"plain": (), "EAGLE k=3": SPECULATION}
BATCHES = (1, 8)
MAX_PROMPT = 4096  # the sessions open with about 3K tokens of system prompt and tools
SERVER_ARGS = ("--dtype", "float32", "--max-total-tokens", "40000")


def decode_speed(url: str, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[dict]]:
    """Decode tokens/s per request, the prompts sent together and streamed: each request's tokens after its first
    over the time from its first token to its last (its prefill and queueing excluded), averaged over the
    requests; and the replies (output ids, and SGLang's ``meta_info``)."""

    def one(prompt: list[int]) -> tuple[float, dict]:
        params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
        body = {"input_ids": prompt, "sampling_params": params, "stream": True}
        first = last = None
        with requests.post(f"{url}/generate", json=body, stream=True, timeout=1200) as reply:
            reply.raise_for_status()
            for line in reply.iter_lines():
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                last, chunk = time.perf_counter(), json.loads(line[len(b"data:") :])
                first = first or last
        if len(chunk["output_ids"]) != new_tokens:
            raise AssertionError(f"{len(chunk['output_ids'])} output ids in the last chunk, {new_tokens} asked")
        return (new_tokens - 1) / (last - first), chunk

    requests.post(f"{url}/flush_cache", timeout=60).raise_for_status()
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        speeds, replies = zip(*pool.map(one, prompts), strict=True)
    return sum(speeds) / len(speeds), list(replies)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=96)
    sessions = REPO.parent / "shared" / "data" / "agentic_trajectories.jsonl.gz"
    parser.add_argument("--sessions", type=Path, default=sessions)
    parser.add_argument("--record", type=Path, default=REPO / "benchmarks" / "results" / "speculative_decode.json")
    args = parser.parse_args(argv)
    checkpoint = shipped_checkpoint()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    prompts = [p.tolist() for p in held_out_prompts(args.sessions, tokenizer, 1, MAX_PROMPT)][: max(BATCHES)]
    best = {(name, batch): 0.0 for name in SERVERS for batch in BATCHES}
    outputs: dict[tuple[str, int], list[list[int]]] = {}
    accepted: dict[int, list[float]] = {batch: [] for batch in BATCHES}
    with tempfile.TemporaryDirectory() as scratch, contextlib.ExitStack() as servers:
        urls = {}
        for name, flags in SERVERS.items():
            log = Path(scratch) / f"{name.split()[0]}.log"
            urls[name] = servers.enter_context(running_server(checkpoint, *SERVER_ARGS, *flags, log_path=log))
        for url in urls.values():
            decode_speed(url, prompts[:1], 8)  # warm-up
        for round_ in range(args.rounds):
            for (name, batch), so_far in best.items():
                speed, replies = decode_speed(urls[name], prompts[:batch], args.new_tokens)
                print(f"  round {round_}, {name}, batch {batch}: {speed:.1f} tok/s per request", flush=True)
                best[name, batch] = max(so_far, speed)
                outputs[name, batch] = [reply["output_ids"] for reply in replies]
                if name != "plain":
                    accepted[batch] += [reply["meta_info"]["spec_accept_length"] for reply in replies]
    equal = all(outputs["plain", batch] == outputs["EAGLE k=3", batch] for batch in BATCHES)
    record = {
        "checkpoint": "sglang_dsv4/checkpoints/tiny",
        "prompt_tokens": [len(p) for p in prompts],
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "outputs_equal": equal,
        "tokens_per_s_per_request": {f"{name}, batch {batch}": round(v, 1) for (name, batch), v in best.items()},
        "speculative_over_plain": {
            str(batch): round(best["EAGLE k=3", batch] / best["plain", batch], 2) for batch in BATCHES
        },
        "mean_accepted_length": {str(batch): round(sum(a) / len(a), 2) for batch, a in accepted.items()},
    }
    args.record.write_text(json.dumps(record, indent=1) + "\n")
    for batch in BATCHES:
        plain, drafted = best["plain", batch], best["EAGLE k=3", batch]
        print(
            f"batch {batch}: plain {plain:.1f}, EAGLE k=3 {drafted:.1f} tok/s per request ({drafted / plain:.2f}x),"
            f" mean accepted length {record['mean_accepted_length'][str(batch)]}"
        )
    print(f"outputs equal with and without speculation: {equal}")
    if not equal:
        raise SystemExit("speculation changed a greedy output")


if __name__ == "__main__":
    main()
