"""Expert-parallel placement of V4-Flash's hash-routed layers, planned from token frequencies, on real text.

Corpus, all offline: the licence texts under /usr/share/common-licenses, the Python standard
library's sources (test packages and site-packages left out), and the message contents of the
shared agent sessions (../shared/data/agentic_trajectories.jsonl.gz). Each document (a file, a
session) goes by a stable hash of its name to one of three parts:

* tokenizer (20%): trains a byte-level BPE of 32,000 tokens with the ``tokenizers`` package;
* planning (40%): its tokens (their histogram, and 64 steps of them) are all that planners see;
* held-out (40%): where rank loads are measured.

Token ids map onto V4-Flash's shapes (vocabulary 129,280 — the BPE's ids are its first 32,000 —
256 experts, top 6, 3 hash layers) with a random ``tid2eid`` (distinct experts per token, fixed
seed) until a real table is given. Batches are built like a server's: 64 spans of 128
consecutive tokens from shuffled documents make one 8,192-token step
(``sglang_dsv4.moe.load.traffic_windows``).

For EP 8, 16, 32, 64, without and with one redundant slot per rank, placements of the same
hash layers, all planned from the planning part only:

* none: SGLang's trivial layout;
* SGLang ``deepseek`` (EPLB): fed the planning histogram's expected expert loads;
* SGLang ``deepseek_vec``: fed per-step expert counts of 64 planning steps, as it takes
  SGLang's recorded per-step counts;
* ours, histogram: ``sglang_dsv4.moe.placement`` fed the same expected loads as ``deepseek``;
* ours, + windows: also given the 64 planning steps that ``deepseek_vec`` gets.

Measured on the held-out part: max over mean rank load, mean over the 3 hash layers, (a) per
8,192-token step, averaged over steps, and (b) over the whole held-out part at once. Tokens
reach replicas as SGLang's rank-invariant dynamic dispatch sends them
(``HashLoadPredictor.rank_counts``).

    python benchmarks/ep_planning.py [--step-tokens 8192] [--seed 0]
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import sysconfig
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from sglang.srt.eplb import eplb_algorithms
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from sglang_dsv4.config import named_config
from sglang_dsv4.moe import HashLoadPredictor, Placement, expected_hash_loads, plan_placement, token_histogram
from sglang_dsv4.moe.load import random_hash_tables, traffic_windows
from sglang_dsv4.moe.placement import LayerLoads, trivial_layer

SESSIONS = Path(__file__).resolve().parents[2] / "shared/data/agentic_trajectories.jsonl.gz"
LICENCES = Path("/usr/share/common-licenses")
BPE_VOCAB = 32000
PLANNING_WINDOWS = 64
EP_SIZES = (8, 16, 32, 64)
PARTS = {"tokenizer": range(2), "planning": range(2, 6), "held-out": range(6, 10)}


def documents() -> Iterator[tuple[str, str]]:
    """``(name, text)`` of every document of the corpus, in a fixed order."""
    for path in sorted({p.resolve() for p in LICENCES.iterdir()}):
        yield f"licence/{path.name}", path.read_text(errors="replace")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.rglob("*.py")):
        parts = path.relative_to(stdlib).parts
        if not {"site-packages", "test", "tests", "idle_test"} & set(parts):
            yield f"stdlib/{'/'.join(parts)}", path.read_text(errors="replace")
    with gzip.open(SESSIONS, "rt") as lines:
        for line in lines:
            session = json.loads(line)
            texts = [m["content"] for m in session["messages"] if isinstance(m.get("content"), str)]
            yield f"session/{session['id']}", "\n".join(texts)


def part_of(name: str) -> str:
    bucket = int(hashlib.sha256(name.encode()).hexdigest(), 16) % 10
    return next(part for part, buckets in PARTS.items() if bucket in buckets)


def train_tokenizer(texts: list[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def tokenize(tokenizer: Tokenizer, texts: list[str]) -> list[torch.Tensor]:
    return [torch.tensor(e.ids, dtype=torch.long) for e in tokenizer.encode_batch(texts, add_special_tokens=False)]


Planner = Callable[[torch.Tensor, torch.Tensor, int, int], Placement]


def sglang_eplb(algorithm: eplb_algorithms.EplbAlgorithm, per_step: bool) -> Planner:
    """One of SGLang's EPLB algorithms, called as ``init_by_eplb`` calls it for V4 (no expert groups)."""

    def plan(expected: torch.Tensor, windows: torch.Tensor, ep_size: int, redundant: int) -> Placement:
        num_experts = expected.shape[-1]
        num_slots = num_experts + redundant
        physical_to_logical, _, _ = eplb_algorithms.rebalance_experts(
            tokens_per_expert=(windows if per_step else expected[None]).float(),
            num_physical_experts=num_slots,
            num_local_physical_experts=num_slots // ep_size,
            num_groups=None,
            num_nodes=1,
            algorithm=algorithm,
        )
        return Placement(physical_to_logical.long(), ep_size, num_experts)

    return plan


def unplanned(expected: torch.Tensor, windows: torch.Tensor, ep_size: int, redundant: int) -> Placement:
    layers, num_experts = expected.shape
    return Placement(trivial_layer(num_experts, num_experts + redundant).repeat(layers, 1), ep_size, num_experts)


def ours(with_windows: bool) -> Planner:
    def plan(expected: torch.Tensor, windows: torch.Tensor, ep_size: int, redundant: int) -> Placement:
        layers = [
            LayerLoads(expected[layer], windows[:, layer] if with_windows else None)
            for layer in range(expected.shape[0])
        ]
        return plan_placement(layers, expected.shape[-1], ep_size, redundant)

    return plan


PLANNERS: dict[str, Planner] = {
    "none": unplanned,
    "SGLang deepseek": sglang_eplb(eplb_algorithms.EplbAlgorithm.deepseek, per_step=False),
    "SGLang deepseek_vec": sglang_eplb(eplb_algorithms.EplbAlgorithm.deepseek_vec, per_step=True),
    "ours, histogram": ours(with_windows=False),
    "ours, + windows": ours(with_windows=True),
}


def imbalance(rank_counts: torch.Tensor) -> float:
    """Max over mean rank load, averaged over layers (``rank_counts [layers, ranks]``)."""
    counts = rank_counts.double()
    return float((counts.max(-1).values / counts.mean(-1)).mean())


def _ratios(expert_counts: torch.Tensor) -> str:
    """Busiest over mean expert of each layer (``[..., layers, experts]``; leading dims averaged)."""
    ratio = expert_counts.max(-1).values / expert_counts.mean(-1)
    return ", ".join(f"{float(r):.2f}" for r in ratio.reshape(-1, ratio.shape[-1]).mean(0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--step-tokens", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0, help="seed of tid2eid and of the held-out shuffle")
    args = parser.parse_args()
    started = time.perf_counter()

    parts: dict[str, list[str]] = {part: [] for part in PARTS}
    for name, text in documents():
        parts[part_of(name)].append(text)
    tokenizer = train_tokenizer(parts["tokenizer"])
    planning_docs = tokenize(tokenizer, parts["planning"])
    planning = torch.cat(planning_docs)
    held_out_docs = tokenize(tokenizer, parts["held-out"])
    held_out = torch.cat(held_out_docs)
    steps = traffic_windows(held_out_docs, args.step_tokens, seed=args.seed)
    planning_steps = traffic_windows(planning_docs, args.step_tokens, seed=args.seed + 1)[:PLANNING_WINDOWS]

    config = named_config("flash")
    tables = random_hash_tables(config, seed=args.seed)
    predictor = HashLoadPredictor(config, tables)
    expert_loads = expected_hash_loads(config, tables, token_histogram(planning, config.vocab_size))
    planning_windows = torch.stack([predictor.expert_counts(step) for step in planning_steps])
    held_out_experts = predictor.expert_counts(held_out).double()

    print(f"tokenizer: byte-level BPE, {tokenizer.get_vocab_size()} tokens, on {len(parts['tokenizer'])} documents")
    print(
        f"planning: {len(parts['planning'])} documents, {planning.numel():,} tokens; "
        f"held-out: {len(parts['held-out'])} documents, {held_out.numel():,} tokens, "
        f"{len(steps)} steps of {args.step_tokens}"
    )
    step_experts = torch.stack([predictor.expert_counts(step) for step in steps]).double()
    print(
        "busiest expert / mean expert per hash layer: "
        f"planning {_ratios(expert_loads)}; held-out {_ratios(held_out_experts)}; "
        f"held-out steps (mean) {_ratios(step_experts)}"
    )

    timer = time.perf_counter()
    for step in steps[:50]:
        predictor.expert_counts(step)
    per_step_ms = (time.perf_counter() - timer) / min(len(steps), 50) * 1e3
    print(f"load prediction: {per_step_ms:.2f} ms per {args.step_tokens}-token step (3 hash layers, CPU)")

    columns = [
        f"{scope}: {name}" for scope in (f"{args.step_tokens}-token steps", "whole held-out") for name in PLANNERS
    ]
    print(f"\n| EP | slots/rank (redundant) | {' | '.join(columns)} |")
    print("|---|---|" + "---|" * len(columns))
    planning_seconds = dict.fromkeys(PLANNERS, 0.0)
    for ep_size in EP_SIZES:
        for redundant in (0, ep_size):
            step_cells, whole_cells = [], []
            for name, plan in PLANNERS.items():
                timer = time.perf_counter()
                placement = plan(expert_loads, planning_windows, ep_size, redundant)
                planning_seconds[name] += time.perf_counter() - timer
                step_cells.append(sum(imbalance(predictor.rank_counts(s, placement)) for s in steps) / len(steps))
                whole_cells.append(imbalance(predictor.rank_counts(held_out, placement)))
            slots = f"{(256 + redundant) // ep_size} ({redundant})"
            cells = " | ".join(f"{v:.3f}" for v in step_cells + whole_cells)
            print(f"| {ep_size} | {slots} | {cells} |")
    print("\n(max/mean rank load, mean over the 3 hash layers)")
    print("planning time, all 8 rows: " + ", ".join(f"{k} {v:.1f} s" for k, v in planning_seconds.items()))
    print(f"{time.perf_counter() - started:.0f} s in all")


if __name__ == "__main__":
    main()
