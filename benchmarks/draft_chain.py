"""The MTP layer's draft steps (:class:`batched.DraftChain`) in a CUDA graph against the same steps run eagerly.

``cd benchmarks && PYTHONPATH=.. python3 draft_chain.py [--out DIR]`` on a CUDA host (no SGLang). V4-Flash's window
layer (the releases' MTP layer is window-only), bf16 and FP8 pools of 8 requests at 8K: the chain's three steps
(each request's window rows before its chain copied from the pool into the scratch, the steps' indexes built, each
step's attention and output projection on the scratch) captured once for 8 requests, then replayed for batches of
8, 5 (padded) and 1 at chain starts inside the first window, at its edge and far past it. Checks each replay's
output bitwise against the eager steps on the same inputs and the pool untouched; times one replay and the eager
steps at 8 requests. The inputs of each step are random, not the previous step's streams: the check is the
attention's, which the CPU test (``tests/test_draft_decode.py``) runs through the MTP layer.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from engine_step import DEVICE, DTYPE, Timer, build_attention, capture

from sglang_dsv4.attention_backend import batched
from sglang_dsv4.config import named_config
from sglang_dsv4.memory_pool.layout import PoolLayout
from sglang_dsv4.memory_pool.ledger import KV_DTYPES

MAX_REQUESTS, FORWARDS, CONTEXT = 8, 3, 8192
# Chain starts: inside the first window, at its edge, past it, near the context's end.
STARTS = (5, 127, 128, 129, 300, 1000, 4096, CONTEXT - FORWARDS - 1)


@torch.no_grad()
def bench(kv: str, timer: Timer) -> list[dict]:
    config = named_config("flash")
    _, attention = build_attention(config, "window")
    formats = PoolLayout(config, KV_DTYPES[kv]).formats
    torch.manual_seed(0)
    table = torch.zeros(MAX_REQUESTS + 1, CONTEXT + 1, dtype=torch.int64, device=DEVICE)
    table[1:, :CONTEXT] = 1 + torch.randperm(MAX_REQUESTS * CONTEXT, device=DEVICE).view(MAX_REQUESTS, CONTEXT)
    values = torch.randn(1 + MAX_REQUESTS * CONTEXT, config.head_dim, device=DEVICE, dtype=DTYPE)
    pool_window = formats.entries.encode(values)
    pool_before = pool_window.clone()
    chain = batched.DraftChain(MAX_REQUESTS, FORWARDS, config, formats, DEVICE)
    rows = torch.zeros(MAX_REQUESTS, dtype=torch.int64, device=DEVICE)
    starts = torch.zeros_like(rows)
    xs = torch.zeros(FORWARDS, MAX_REQUESTS, config.hidden_size, device=DEVICE, dtype=DTYPE)

    def steps() -> torch.Tensor:
        indexes = chain.begin(rows, starts, pool_window, table)
        outputs = [batched.attend(attention, 0, xs[s], indexes[s], chain.storage) for s in range(FORWARDS)]
        return torch.stack([attention.project_out(output) for output in outputs])

    def set_batch(requests: int, seed: int) -> None:
        """``requests`` real requests, the rest padding (row 0 at position 0, as SGLang pads)."""
        generator = torch.Generator().manual_seed(seed)
        rows.zero_()
        starts.zero_()
        rows[:requests] = (torch.randperm(MAX_REQUESTS, generator=generator)[:requests] + 1).to(DEVICE)
        chosen = torch.randperm(len(STARTS), generator=generator)[:requests]
        starts[:requests] = torch.tensor(STARTS)[chosen].to(DEVICE)
        xs.copy_(torch.randn(xs.shape, generator=generator).to(DEVICE, DTYPE))

    set_batch(MAX_REQUESTS, 1)
    graph = capture(steps)
    rows_out = []
    for requests, seed in ((MAX_REQUESTS, 2), (5, 3), (1, 4), (MAX_REQUESTS, 5)):
        set_batch(requests, seed)
        eager = steps()[:, :requests].clone()
        graph.replay()
        torch.cuda.synchronize()
        replayed = steps.output[:, :requests]
        rows_out.append({
            "kv": kv, "requests": requests, "graph_equals_eager": torch.equal(replayed, eager),
            "pool_untouched": torch.equal(pool_window, pool_before), "finite": bool(replayed.isfinite().all()),
        })  # fmt: skip
        print(json.dumps(rows_out[-1]), flush=True)
    set_batch(MAX_REQUESTS, 6)
    timing = {"kv": kv, "requests": MAX_REQUESTS, "graph_us": timer.median_us(graph.replay)}
    timing["eager_us"] = timer.median_us(steps)
    print(json.dumps(timing), flush=True)
    return [*rows_out, timing]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    timer = Timer(budget_ms=200)
    rows = [row for kv in ("bf16", "fp8") for row in bench(kv, timer)]
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "draft_chain.json").write_text(json.dumps(rows, indent=1))
    failed = [row for row in rows if not row.get("graph_equals_eager", True) or not row.get("pool_untouched", True)]
    if failed:
        raise SystemExit(f"replays unequal to their eager steps or a pool written: {failed}")


if __name__ == "__main__":
    main()
