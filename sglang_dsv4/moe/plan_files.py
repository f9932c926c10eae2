"""Files around expert planning: hash tables from a checkpoint, token histograms, recorded
routing statistics, and the plan file SGLang's ``--init-expert-location`` reads.

SGLang (``sglang/srt/eplb/expert_location.py``) reads a ``.pt`` (``torch.load``), a ``.json``,
or inline JSON, and passes every key of the dict to ``ExpertLocationMetadata.init_by_mapping``
when ``physical_to_logical_map`` is present, so a plan file holds exactly that one key:
``[num_hidden_layers, num_experts + redundant]`` logical expert ids.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from ..config import DeepseekV4Config
from ..model.loader import release_name
from .placement import ExpertPlanError, Placement

PLAN_KEY = "physical_to_logical_map"
_TID2EID = re.compile(r"^layers\.(\d+)\.ffn\.gate\.tid2eid$")


def read_hash_tables(model_dir: str | Path, config: DeepseekV4Config) -> torch.Tensor:
    """``[num_hash_layers, vocab, top_k]``: the ``tid2eid`` tensors of a checkpoint, read without loading the rest.

    Accepts release names (``layers.N.ffn.gate.tid2eid``) and Hugging Face names.
    """
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ExpertPlanError(f"{model_dir}: no *.safetensors files to read tid2eid from")
    tables: dict[int, torch.Tensor] = {}
    for file in files:
        with safe_open(file, framework="pt") as handle:
            for name in handle.keys():
                match = _TID2EID.match(release_name(name))
                if match:
                    tables[int(match.group(1))] = handle.get_tensor(name)
    wanted = list(range(config.num_hash_layers))
    if sorted(tables) != wanted:
        raise ExpertPlanError(
            f"{model_dir}: tid2eid found for layers {sorted(tables)}; the config's hash layers are {wanted}"
        )
    return torch.stack([tables[layer].long() for layer in wanted])


def read_token_histogram(path: str | Path) -> torch.Tensor:
    """A ``[vocab]`` token-id frequency histogram from a ``.pt`` tensor or a ``.json`` list of counts."""
    path = Path(path)
    if path.suffix == ".pt":
        histogram = torch.load(path, map_location="cpu", weights_only=True)
    elif path.suffix == ".json":
        histogram = torch.tensor(json.loads(path.read_text()), dtype=torch.float64)
    else:
        raise ExpertPlanError(f"{path}: a token histogram must be a .pt tensor or a .json list")
    if not isinstance(histogram, torch.Tensor) or histogram.dim() != 1:
        raise ExpertPlanError(f"{path}: a token histogram must be one list of counts indexed by token id")
    return histogram


def read_recorded_loads(path: str | Path, config: DeepseekV4Config) -> torch.Tensor:
    """``[steps, num_layers, num_experts]`` float64 expert loads from SGLang's expert-distribution recorder.

    The recorder's ``stat`` mode dumps ``{"logical_count": [steps, layers, experts], ...}`` to a
    ``.pt`` file (``/dump_expert_distribution_record``). A plain ``[steps, layers, experts]``
    tensor, or ``[layers, experts]`` (one step), is accepted too.
    """
    data = torch.load(Path(path), map_location="cpu", weights_only=True)
    counts = data.get("logical_count") if isinstance(data, dict) else data
    if not isinstance(counts, torch.Tensor):
        raise ExpertPlanError(f"{path}: no 'logical_count' tensor (SGLang's expert-distribution 'stat' dump)")
    if counts.dim() == 2:
        counts = counts[None]
    expected = (config.num_layers, config.n_routed_experts)
    if counts.dim() != 3 or tuple(counts.shape[1:]) != expected:
        raise ExpertPlanError(
            f"{path}: recorded logical_count has shape {tuple(counts.shape)}; "
            f"the config needs [steps, {expected[0]}, {expected[1]}] (num_hidden_layers, n_routed_experts)"
        )
    return counts.double()


def write_plan(placement: Placement, path: str | Path) -> Path:
    """Write ``placement`` for ``--init-expert-location``: ``.pt`` (int64 tensor) or ``.json``."""
    path = Path(path)
    table = placement.physical_to_logical.long().cpu()
    if path.suffix == ".pt":
        torch.save({PLAN_KEY: table}, path)
    elif path.suffix == ".json":
        path.write_text(json.dumps({PLAN_KEY: table.tolist()}))
    else:
        raise ExpertPlanError(f"{path}: SGLang reads --init-expert-location files ending in .pt or .json")
    return path
