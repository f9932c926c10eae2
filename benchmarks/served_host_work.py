"""The scheduler's host work on a served run at GPU speed, ours against SGLang's own stages (issue 43).

    python benchmarks/served_host_work.py [--histories 2000,131072,1000000] [--running 32,128,256]

`benchmarks/host_work.py` times our prefix-cache calls in-process; this measures the real server. SGLang's
scheduler serves V4-Flash's config under emulation (``dsv4 emulate``'s server, docs/emulation.md: the real
scheduler, overlap loop, tree, pools, request tables and attention metadata, a forward taking the emulated H200's
time), so the host work is not hidden behind a CPU forward, and py-spy samples the scheduler process at 200 Hz:

* **resumed turns**: one session is prefilled to each history (random token ids through ``/generate`` with
  ``input_ids``: the tokenizer is skipped), then ``--turns`` turns of 16 new tokens and one output token, each
  checked to resume its whole prompt but the new tokens and the last turn's output token, whose
  entries the next forward computes (``cached_tokens``). Per turn: the client's TTFT, and the
  scheduler's samples by stage of SGLang's overlap loop (receive, schedule, run the batch, process the result)
  split into ours (the innermost frame of this package) and SGLang's (``benchmarks/scheduler_profile.py``'s
  classification), as milliseconds a turn.
* **decode steps**: ``N`` requests of 200-token prompts decoding together (``ignore_eos``); over a window of steps
  with all ``N`` running, the same split as milliseconds a step (the emulated device's forwards counted), the
  stage ``run_batch`` being the forward's launch: our attention metadata and request-table bookkeeping inside it.

What a sample counts is this host's CPU (one torch thread), not the H200 host's (1.76x slower single thread,
docs/emulation.md). Writes ``benchmarks/results/served_host_work.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).parent))
from scheduler_profile import tally  # noqa: E402

from sglang_dsv4.launch import ONE_TORCH_THREAD, running_emulated_server  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PY_SPY = Path(sys.executable).parent / "py-spy"
RATE_HZ = 200
VOCAB = 120_000  # below V4's special tokens


class Sampler:
    """py-spy recording the scheduler process (the server's child that runs ``event_loop_overlap``) until stopped."""

    def __init__(self, pid: int, output: Path) -> None:
        self.output = output
        self.process = subprocess.Popen(
            [str(PY_SPY), "record", "--pid", str(pid), "--rate", str(RATE_HZ), "--nonblocking", "--idle",
             "--threads", "--format", "raw", "--output", str(output)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        time.sleep(1.0)  # py-spy attaches

    def stop(self) -> Path:
        self.process.send_signal(signal.SIGINT)
        self.process.wait(timeout=60)
        return self.output


def split(profile: Path, per: int) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """Milliseconds per ``per`` (turns or steps) of the scheduler's main thread, by loop stage and by owner of the
    work (waits left out: the emulated device's sleep, the idle poll), and ours by our outermost function."""
    by_stage, ours, _ = tally(profile)
    ms = lambda samples: round(1e3 * samples / RATE_HZ / per, 3)  # noqa: E731
    table: dict[str, dict[str, float]] = {}
    for (stage, kind), samples in sorted(by_stage.items()):
        if kind.startswith("work: "):
            table.setdefault(stage.removeprefix("Scheduler."), {})[kind.removeprefix("work: ")] = ms(samples)
    return table, {function: ms(samples) for function, samples in ours.most_common(8)}


def totals(table: dict[str, dict[str, float]]) -> dict[str, float]:
    owners: Counter[str] = Counter()
    for row in table.values():
        owners.update(row)
    return {owner: round(ms, 3) for owner, ms in owners.most_common()}


def scheduler_pid(url: str) -> int:
    return requests.get(f"{url}/server_info", timeout=60).json()["internal_states"][0]["dsv4_emulation"]["pid"]


def generate(url: str, input_ids: list[int], max_new_tokens: int) -> dict:
    started = time.perf_counter()
    reply = requests.post(f"{url}/generate", timeout=3600, json={
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True},
    })  # fmt: skip
    reply.raise_for_status()
    body = reply.json()
    body["client_s"] = time.perf_counter() - started
    return body


def resumed_turns(url: str, history: int, turns: int, scratch: Path, rng: random.Random) -> dict:
    prompt = [rng.randrange(VOCAB) for _ in range(history)]
    first = generate(url, prompt, 1)
    prompt += first["output_ids"]
    sampler = Sampler(scheduler_pid(url), scratch / f"turns_{history}.txt")
    ttft, resumed = [], 0
    for _ in range(turns):
        new = [rng.randrange(VOCAB) for _ in range(16)]
        reply = generate(url, prompt + new, 1)
        resumed += reply["meta_info"]["cached_tokens"] == len(prompt) - 1  # all but the last output token
        ttft.append(reply["client_s"])
        prompt += new + reply["output_ids"]
    table, ours = split(sampler.stop(), turns)
    return {"history": history, "turns": turns, "resumed_whole": resumed, "client_ttft_ms_median":
            round(1e3 * sorted(ttft)[turns // 2], 2), "ms_per_turn": totals(table), "by_stage": table,
            "ours_by_function": ours}  # fmt: skip


def decode_steps(url: str, running: int, scratch: Path, rng: random.Random, window_s: float) -> dict:
    prompts = [[rng.randrange(VOCAB) for _ in range(200)] for _ in range(running)]
    pid = scheduler_pid(url)
    with ThreadPoolExecutor(running) as pool:
        replies = [pool.submit(generate, url, prompt, 8_000) for prompt in prompts]
        time.sleep(5.0)  # every request admitted and prefilled at emulated speed
        before = device(url)
        sampler = Sampler(pid, scratch / f"decode_{running}.txt")
        time.sleep(window_s)
        profile = sampler.stop()
        after = device(url)
        requests.post(f"{url}/abort_request", json={"abort_all": True}, timeout=60)
        for reply in replies:
            try:
                reply.result()
            except requests.RequestException:
                pass  # aborted
    forwards = after["forwards"] - before["forwards"]
    table, ours = split(profile, forwards)
    return {"running": running, "forwards": forwards, "device_step_ms": round(1e3 * (after["busy_s"] -
            before["busy_s"]) / forwards, 2), "ms_per_step": totals(table), "by_stage": table,
            "ours_by_function": ours}  # fmt: skip


def device(url: str) -> dict:
    return requests.get(f"{url}/server_info", timeout=60).json()["internal_states"][0]["dsv4_emulation"]["device_time"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--histories", default="2000,131072,1000000")
    parser.add_argument("--running", default="32,128,256")
    parser.add_argument("--turns", type=int, default=100)
    parser.add_argument("--window-s", type=float, default=10.0)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "served_host_work.json")
    args = parser.parse_args()
    rng = random.Random(0)
    results: dict = {"rate_hz": RATE_HZ, "turns": [], "decode": []}
    with tempfile.TemporaryDirectory() as folder:
        scratch = Path(folder)
        histories = [int(h) for h in args.histories.split(",") if h]
        if histories:
            with running_emulated_server(
                "flash", "--skip-tokenizer-init", "--max-running-requests", "8", "--enable-cache-report",
                log_path=scratch / "turns.log", context_length=1048576, env=ONE_TORCH_THREAD,
            ) as url:  # fmt: skip
                for history in histories:
                    results["turns"].append(resumed_turns(url, history, args.turns, scratch, rng))
                    print(json.dumps(results["turns"][-1]), flush=True)
        counts = [int(n) for n in args.running.split(",") if n]
        if counts:
            with running_emulated_server(
                "flash", "--skip-tokenizer-init", "--max-running-requests", str(max(counts)),
                log_path=scratch / "decode.log", context_length=16384, env=ONE_TORCH_THREAD,
            ) as url:  # fmt: skip
                for running in counts:
                    results["decode"].append(decode_steps(url, running, scratch, rng, args.window_s))
                    print(json.dumps(results["decode"][-1]), flush=True)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
