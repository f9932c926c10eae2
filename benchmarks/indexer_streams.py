"""The tiny model's lightning indexer during greedy decode: how much its top-k changes from step to step.

    python benchmarks/indexer_streams.py [--context 8192] [--steps 64] [--out benchmarks/results/indexer_streams.json]

The prompt is real text a coding agent reads (this repository's own ``sglang_dsv4`` sources, in path order,
through the shipped tokenizer; the model never trained on them); the model then decodes greedily. At every
decode step each ratio-4 layer's indexer scores the new token's query against every visible indexer key; the
overlap of two steps is the share of step ``t``'s top-k that step ``t - 1`` also chose. The shipped (trained)
checkpoint is measured beside the random one of the same config. ``score_streams`` is also what the H200
benchmark (``benchmarks/kernels/attention_indexer.py``) times the temporal top-k on.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from sglang_dsv4 import DeepseekV4, load_model
from sglang_dsv4.model.rope import ForwardRope
from sglang_dsv4.tiny import TINY_CONFIG, random_model, shipped_checkpoint

REPO = Path(__file__).resolve().parents[1]
PREFILL_CHUNK = 1024  # bounds the indexer's [chunk, heads, keys] scores on a CPU host


def source_prompt(context: int) -> torch.Tensor:
    """``context`` token ids: ``bos``, then this repository's ``sglang_dsv4/**/*.py`` through the shipped tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(shipped_checkpoint())
    text = "\n".join(path.read_text() for path in sorted((REPO / "sglang_dsv4").rglob("*.py")))
    ids = [tokenizer.bos_token_id, *tokenizer.encode(text, add_special_tokens=False)]
    if len(ids) < context:
        raise ValueError(f"the sources make {len(ids)} tokens; --context {context} wants more")
    return torch.tensor(ids[:context])


@torch.inference_mode()
def score_streams(model: DeepseekV4, prompt: torch.Tensor, steps: int, chunk: int = PREFILL_CHUNK) -> dict[int, list]:
    """Per ratio-4 layer, the indexer scores ``[visible keys]`` (float32) of each of ``steps`` greedy decode steps."""
    streams: dict[int, list[torch.Tensor]] = {}
    handles = []
    for layer, block in enumerate(model.layers):
        if block.attn.indexer is None:
            continue
        streams[layer] = []

        def record(module, args, output, recorded=streams[layer]):
            x, start, state = args
            position = torch.tensor([start + x.shape[0] - 1], device=x.device)
            keys = state.indexer.entries[: (int(position) + 1) // module.indexer.compressor.ratio]
            q_residual = module.q_norm(module.wq_a(x[-1:]))
            rope = ForwardRope.at(position, (module.indexer.rotary,))
            recorded.append(module.indexer.scores(x[-1:], q_residual, rope, keys)[0])

        handles.append((block.attn, record))
    state = model.new_state()
    prompt = prompt.to(model.device)
    for first in range(0, prompt.numel(), chunk):
        logits = model(prompt[first : first + chunk], state)
    hooks = [attn.register_forward_hook(record) for attn, record in handles]
    try:
        token = logits[-1].argmax()
        for _ in range(steps):
            logits = model(token[None], state)
            token = logits[-1].argmax()
    finally:
        for hook in hooks:
            hook.remove()
    return streams


def top_k_overlap(previous: torch.Tensor, current: torch.Tensor, k: int) -> float:
    """Share of ``current``'s top-k keys that were in ``previous``'s top-k (keys new this step count as changed)."""
    before = set(previous.topk(min(k, previous.numel())).indices.tolist())
    now = current.topk(min(k, current.numel())).indices.tolist()
    return sum(key in before for key in now) / len(now)


def overlap_rows(name: str, streams: dict[int, list[torch.Tensor]], ks: tuple[int, ...]) -> list[dict]:
    rows = []
    for layer, stream in streams.items():
        for k in ks:
            overlaps = [top_k_overlap(a, b, k) for a, b in zip(stream[:-1], stream[1:], strict=True)]
            rows.append({"checkpoint": name, "layer": layer, "k": k, "keys": stream[-1].numel(),
                         "mean_overlap": statistics.mean(overlaps), "min_overlap": min(overlaps),
                         "median_overlap": statistics.median(overlaps)})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--k", type=int, nargs="+", default=[TINY_CONFIG["index_topk"], 64, 512])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "indexer_streams.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    prompt = source_prompt(args.context)
    rows = []
    for name, model in (("shipped", load_model(shipped_checkpoint())), ("random", random_model(TINY_CONFIG, seed=0))):
        started = time.perf_counter()
        rows += overlap_rows(name, score_streams(model, prompt, args.steps), tuple(args.k))
        print(f"{name}: {time.perf_counter() - started:.0f}s", flush=True)
    record = {"context": args.context, "steps": args.steps, "prompt": "sglang_dsv4/**/*.py", "rows": rows}
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print("checkpoint | layer | k | keys | mean overlap | median | min")
    for row in rows:
        print(f"{row['checkpoint']} | {row['layer']} | {row['k']} | {row['keys']} | {row['mean_overlap']:.2f} | "
              f"{row['median_overlap']:.2f} | {row['min_overlap']:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
