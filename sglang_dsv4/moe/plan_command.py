"""``dsv4 plan-experts``: an expert placement file for SGLang's ``--init-expert-location``.

Hash layers are planned from a token-id histogram (a ``.pt``/``.json`` histogram, or text
files tokenized with the checkpoint's tokenizer) and the checkpoint's ``tid2eid``; learned-gate
layers from routing statistics recorded by SGLang's expert-distribution recorder. A layer with
neither keeps SGLang's trivial layout. Serve with ``--ep-size N --ep-num-redundant-experts R
--init-expert-location PLAN`` (the same N and R as here).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from ..config import DeepseekV4Config, load_config
from .load import expected_hash_loads, token_histogram
from .placement import ExpertPlanError, Placement, plan_placement, trivial_layer
from .plan_files import read_hash_tables, read_recorded_loads, read_token_histogram, write_plan


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, required=True, help="V4 checkpoint directory (config.json, tid2eid)")
    parser.add_argument("--ep-size", type=int, required=True, help="expert-parallel ranks (SGLang's --ep-size)")
    parser.add_argument(
        "--redundant-experts", type=int, default=0, help="extra slots (SGLang's --ep-num-redundant-experts)"
    )
    parser.add_argument("--output", type=Path, required=True, help="plan file to write: .pt or .json")
    parser.add_argument("--token-histogram", type=Path, help="token-id counts for the hash layers: .pt or .json")
    parser.add_argument(
        "--corpus", type=Path, nargs="+", help="text files whose tokens (checkpoint tokenizer) give the histogram"
    )
    parser.add_argument(
        "--expert-distribution", type=Path, help="SGLang expert-distribution recorder dump (.pt, 'stat' mode)"
    )


def run(args: argparse.Namespace) -> None:
    config = load_config(args.model)
    if args.token_histogram and args.corpus:
        raise ExpertPlanError("give --token-histogram or --corpus, not both")
    histogram = None
    if args.token_histogram:
        histogram = read_token_histogram(args.token_histogram)
    elif args.corpus:
        histogram = corpus_histogram(args.model, args.corpus, config.vocab_size)
    hash_loads = (
        expected_hash_loads(config, read_hash_tables(args.model, config), histogram)
        if histogram is not None and config.num_hash_layers
        else None
    )
    recorded = read_recorded_loads(args.expert_distribution, config) if args.expert_distribution else None
    loads, sources = layer_loads(config, hash_loads, recorded)
    placement = plan_placement(loads, config.n_routed_experts, args.ep_size, args.redundant_experts)
    write_plan(placement, args.output)
    print(_summary(config, placement, loads, sources, args.redundant_experts), file=sys.stderr)
    print(args.output)


def layer_loads(
    config: DeepseekV4Config, hash_loads: torch.Tensor | None, recorded_loads: torch.Tensor | None
) -> tuple[list[torch.Tensor | None], list[str]]:
    """Per layer, the expected expert loads to plan with and where they come from.

    Hash layers prefer the histogram prediction (exact in expectation, no warm-up needed);
    every other layer uses the recorded statistics; ``None`` (trivial layout) where neither exists.
    """
    loads: list[torch.Tensor | None] = []
    sources: list[str] = []
    for layer in range(config.num_layers):
        if hash_loads is not None and config.is_hash_layer(layer):
            loads.append(hash_loads[layer])
            sources.append("token histogram")
        elif recorded_loads is not None and float(recorded_loads[layer].sum()) > 0:
            loads.append(recorded_loads[layer])
            sources.append("recorded routing")
        else:
            loads.append(None)
            sources.append("no statistics: trivial layout")
    return loads, sources


def corpus_histogram(model_dir: Path, files: Sequence[Path], vocab_size: int) -> torch.Tensor:
    """Token-id counts of text files, tokenized with the checkpoint's ``tokenizer.json``."""
    from tokenizers import Tokenizer

    tokenizer_file = model_dir / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ExpertPlanError(f"{tokenizer_file}: --corpus needs the checkpoint's tokenizer.json")
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    histogram = torch.zeros(vocab_size, dtype=torch.long)
    for file in files:
        lines = file.read_text(errors="replace").splitlines(keepends=True)
        for encoding in tokenizer.encode_batch(lines, add_special_tokens=False):
            if encoding.ids:
                histogram += token_histogram(torch.tensor(encoding.ids), vocab_size)
    return histogram


def _summary(
    config: DeepseekV4Config,
    placement: Placement,
    loads: list[torch.Tensor | None],
    sources: list[str],
    redundant_experts: int,
) -> str:
    """One line per layer: expected max/mean rank load without planning and with the plan."""
    trivial = trivial_layer(config.n_routed_experts, placement.num_slots)
    header = (
        f"EP {placement.ep_size}, {placement.slots_per_rank} slots per rank "
        f"({config.n_routed_experts} experts + {redundant_experts} redundant); expected max/mean rank load:"
    )
    lines = [header]
    for layer, (layer_load, source) in enumerate(zip(loads, sources, strict=True)):
        if layer_load is None:
            lines.append(f"  layer {layer}: {source}")
            continue
        before = _imbalance(trivial, layer_load, placement.ep_size)
        after = _imbalance(placement.physical_to_logical[layer], layer_load, placement.ep_size)
        lines.append(f"  layer {layer} ({source}): {before:.3f} unplanned -> {after:.3f}")
    return "\n".join(lines)


def _imbalance(slots: torch.Tensor, expert_loads: torch.Tensor, ep_size: int) -> float:
    """Max over mean rank load of one layer's ``slots`` under ``expert_loads``."""
    ranks = Placement(slots[None], ep_size, expert_loads.numel()).rank_loads(expert_loads[None])[0]
    mean = float(ranks.mean())
    return float(ranks.max()) / mean if mean > 0 else 1.0
