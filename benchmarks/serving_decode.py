"""Decode speed of the tiny V4 served by sglang.launch_server, beside HF's generate, in one run.

Starts the server (timing its start), then measures decode tokens/s at batch 1 and batch 8
(each request: a 256-token prompt, 128 new tokens, greedy, ignore_eos; decode time = the
batch's time minus that of the same batch generating one token), and HF transformers'
``generate`` at batch 1 on the same checkpoint, measured the same way.

    python benchmarks/serving_decode.py
"""

from __future__ import annotations

import concurrent.futures
import tempfile
import time
from pathlib import Path

import requests
import torch

from sglang_dsv4.launch import running_server
from sglang_dsv4.tiny import build_checkpoint

PROMPT, NEW_TOKENS = 256, 128


def timed_batch(url: str, prompts: list[list[int]], new_tokens: int) -> float:
    """Seconds for all ``prompts`` to finish ``new_tokens`` greedy tokens, sent together."""

    def one(prompt: list[int]) -> None:
        params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
        requests.post(f"{url}/generate", json={"input_ids": prompt, "sampling_params": params}, timeout=600)

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        list(pool.map(one, prompts))
    return time.perf_counter() - started


def served_tokens_per_second(url: str, batch: int) -> float:
    """Decode tokens/s per request: the time beyond a prefill-only run of the same batch."""
    prompts = [
        torch.randint(0, 1024, (PROMPT,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(batch)
    ]
    prefill = timed_batch(url, prompts, 1)
    full = timed_batch(url, prompts, NEW_TOKENS)
    per_request = (NEW_TOKENS - 1) / (full - prefill)
    print(f"  batch {batch}: {per_request:.1f} tok/s per request, {batch * per_request:.1f} tok/s in all")
    return per_request


def hf_tokens_per_second(path: Path) -> float:
    from transformers import DeepseekV4ForCausalLM

    hf = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = torch.randint(0, 1024, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        started = time.perf_counter()
        hf.generate(prompt, max_new_tokens=1, do_sample=False)
        first = time.perf_counter() - started
        started = time.perf_counter()
        hf.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
        total = time.perf_counter() - started
    return (NEW_TOKENS - 1) / (total - first)


def main() -> None:
    with tempfile.TemporaryDirectory() as scratch:
        path = build_checkpoint(Path(scratch) / "tiny")
        started = time.perf_counter()
        with running_server(path, "--dtype", "float32", log_path=Path(scratch) / "server.log") as url:
            print(f"server start: {time.perf_counter() - started:.1f}s (to a healthy /health)")
            served_tokens_per_second(url, 1)  # warm-up
            one = served_tokens_per_second(url, 1)
            eight = served_tokens_per_second(url, 8)
        hf = hf_tokens_per_second(path)
    print(f"HF generate, batch 1: {hf:.1f} tok/s")
    print(f"ratios: served batch 1 / HF = {one / hf:.2f}x; served batch 8 total / HF = {8 * eight / hf:.2f}x")


if __name__ == "__main__":
    main()
