"""Decode speed of the tiny V4 served by sglang.launch_server, beside HF's generate, in one run.

Starts two servers, one per attention backend (the batched default, and the per-request
torch reference through ``--attention-backend dsv4_torch``), timing the first start; then
measures decode tokens/s at batch 1 and batch 8 on each (each request: a 256-token prompt,
128 new tokens, greedy, ignore_eos; decode time = the batch's time minus that of the same
batch generating one token), alternating between the servers for ``ROUNDS`` rounds and
keeping each one's best (the host is shared: the best round is the least disturbed), and HF
transformers' ``generate`` at batch 1 on the same checkpoint, measured the same way.

    python benchmarks/serving_decode.py
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import tempfile
import time
from pathlib import Path

import requests
import torch

from sglang_dsv4.launch import running_server
from sglang_dsv4.tiny import build_checkpoint

PROMPT, NEW_TOKENS = 256, 128
ROUNDS = 2
BACKENDS = ("dsv4_batched", "dsv4_torch")


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
    return (NEW_TOKENS - 1) / (full - prefill)


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
        best = served_by_backend(path, Path(scratch))
        hf = hf_tokens_per_second(path)
    for (backend, batch), per_request in best.items():
        print(f"{backend} batch {batch}: {per_request:.1f} tok/s per request, {batch * per_request:.1f} tok/s in all")
    print(f"HF generate, batch 1: {hf:.1f} tok/s")
    batched, reference = (best[b, 8] for b in BACKENDS)
    print(f"batch 8 total: {BACKENDS[0]} / {BACKENDS[1]} = {batched / reference:.2f}x")
    for backend in BACKENDS:
        one, eight = best[backend, 1], best[backend, 8]
        print(f"{backend}: batch 8 total / batch 1 = {8 * eight / one:.2f}x; batch 1 / HF = {one / hf:.2f}x")


def served_by_backend(path: Path, scratch: Path) -> dict[tuple[str, int], float]:
    """Best decode tokens/s per request of each backend at batch 1 and 8, the servers measured in turn."""
    with contextlib.ExitStack() as servers:
        urls = {}
        for backend in BACKENDS:
            started = time.perf_counter()
            args = ("--dtype", "float32", "--attention-backend", backend)
            urls[backend] = servers.enter_context(running_server(path, *args, log_path=scratch / f"{backend}.log"))
            print(f"server start ({backend}): {time.perf_counter() - started:.1f}s (to a healthy /health)")
        for url in urls.values():
            served_tokens_per_second(url, 1)  # warm-up
        best = {(backend, batch): 0.0 for backend in BACKENDS for batch in (1, 8)}
        for round_ in range(ROUNDS):
            for (backend, batch), so_far in best.items():
                per_request = served_tokens_per_second(urls[backend], batch)
                print(f"  round {round_}, {backend}, batch {batch}: {per_request:.1f} tok/s per request")
                best[backend, batch] = max(so_far, per_request)
    return best


if __name__ == "__main__":
    main()
