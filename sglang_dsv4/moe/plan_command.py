"""``dsv4 plan-experts``: an expert placement file for SGLang's ``--init-expert-location``.

Hash layers are planned from token ids and the checkpoint's ``tid2eid``: a ``.pt``/``.json``
histogram, or text files tokenized with the checkpoint's tokenizer (which also give windows of
server-batch size, so the plan sees which experts get busy together). Learned-gate layers are
planned from routing statistics recorded by SGLang's expert-distribution recorder (its
recorded steps are the windows). A layer with neither keeps SGLang's trivial layout. Serve
with ``--ep-size N --ep-num-redundant-experts R --init-expert-location PLAN`` (the same N and
R as here).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from ..config import DeepseekV4Config, load_config
from .load import HashLoadPredictor, expected_hash_loads, token_histogram, traffic_windows
from .placement import ExpertPlanError, LayerLoads, Placement, plan_placement, trivial_layer
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
    parser.add_argument("--window-tokens", type=int, default=8192, help="tokens per --corpus window (a batch)")
    parser.add_argument("--windows", type=int, default=64, help="most windows (steps) the planner weighs")


def run(args: argparse.Namespace) -> None:
    config = load_config(args.model)
    if args.token_histogram and args.corpus:
        raise ExpertPlanError("give --token-histogram or --corpus, not both")
    hash_loads = None
    if config.num_hash_layers and (args.token_histogram or args.corpus):
        predictor = HashLoadPredictor(config, read_hash_tables(args.model, config))
        if args.token_histogram:
            histogram, windows = read_token_histogram(args.token_histogram), []
        else:
            documents = tokenize_files(args.model, args.corpus)
            histogram = token_histogram(torch.cat(documents), config.vocab_size)
            windows = traffic_windows(documents, args.window_tokens)[: args.windows]
        hash_loads = _layer_loads(
            expected_hash_loads(config, predictor.tables, histogram),
            torch.stack([predictor.expert_counts(w) for w in windows]) if windows else None,
        )
    recorded = None
    if args.expert_distribution:
        steps = read_recorded_loads(args.expert_distribution, config)
        recorded = _layer_loads(steps.sum(0), _spread(steps[steps.sum((1, 2)) > 0], args.windows))
    loads, sources = plan_inputs(config, hash_loads, recorded)
    placement = plan_placement(loads, config.n_routed_experts, args.ep_size, args.redundant_experts)
    write_plan(placement, args.output)
    print(_summary(config, placement, loads, sources, args.redundant_experts), file=sys.stderr)
    print(args.output)


def plan_inputs(
    config: DeepseekV4Config, hash_loads: list[LayerLoads] | None, recorded_loads: list[LayerLoads] | None
) -> tuple[list[LayerLoads | None], list[str]]:
    """Per layer, the loads to plan with and where they come from.

    Hash layers prefer the token-id prediction (exact in expectation, no warm-up needed);
    every other layer uses the recorded statistics; ``None`` (trivial layout) where neither exists.
    """
    loads: list[LayerLoads | None] = []
    sources: list[str] = []
    for layer in range(config.num_layers):
        if hash_loads is not None and config.is_hash_layer(layer):
            loads.append(hash_loads[layer])
            sources.append("token ids")
        elif recorded_loads is not None and float(recorded_loads[layer].expected.sum()) > 0:
            loads.append(recorded_loads[layer])
            sources.append("recorded routing")
        else:
            loads.append(None)
            sources.append("no statistics: trivial layout")
    return loads, sources


def _layer_loads(expected: torch.Tensor, windows: torch.Tensor | None) -> list[LayerLoads]:
    """Split ``expected [layers, E]`` and ``windows [W, layers, E]`` into one record per layer."""
    return [
        LayerLoads(expected[layer], None if windows is None else windows[:, layer])
        for layer in range(expected.shape[0])
    ]


def _spread(steps: torch.Tensor, most: int) -> torch.Tensor | None:
    """At most ``most`` recorded steps, evenly spaced over the recording; ``None`` for fewer than two."""
    if steps.shape[0] < 2:
        return None
    return steps[torch.linspace(0, steps.shape[0] - 1, min(most, steps.shape[0])).round().long()]


def tokenize_files(model_dir: Path, files: Sequence[Path]) -> list[torch.Tensor]:
    """Token ids of each text file, with the checkpoint's ``tokenizer.json``."""
    from tokenizers import Tokenizer

    tokenizer_file = model_dir / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ExpertPlanError(f"{tokenizer_file}: --corpus needs the checkpoint's tokenizer.json")
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    documents = []
    for file in files:
        lines = file.read_text(errors="replace").splitlines(keepends=True)
        ids = [i for encoding in tokenizer.encode_batch(lines, add_special_tokens=False) for i in encoding.ids]
        documents.append(torch.tensor(ids, dtype=torch.long))
    return documents


def _summary(
    config: DeepseekV4Config,
    placement: Placement,
    loads: list[LayerLoads | None],
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
        before = _imbalance(trivial, layer_load.expected, placement.ep_size)
        after = _imbalance(placement.physical_to_logical[layer], layer_load.expected, placement.ep_size)
        lines.append(f"  layer {layer} ({source}): {before:.3f} unplanned -> {after:.3f}")
    return "\n".join(lines)


def _imbalance(slots: torch.Tensor, expert_loads: torch.Tensor, ep_size: int) -> float:
    """Max over mean rank load of one layer's ``slots`` under ``expert_loads``."""
    ranks = Placement(slots[None], ep_size, expert_loads.numel()).rank_loads(expert_loads[None])[0]
    mean = float(ranks.mean())
    return float(ranks.max()) / mean if mean > 0 else 1.0
