"""Expert-parallel load planning: the hash layers' exact expert loads, the placement of experts over ranks, the
plan files SGLang reads (``dsv4 plan-experts``). The MoE the network runs (gate, experts, SGLang's ``FusedMoE``)
is the network's own, in :mod:`sglang_dsv4.model`; this package sits above it."""

from .load import HashLoadPredictor, expected_hash_loads, token_histogram, traffic_windows
from .placement import ExpertPlanError, LayerLoads, Placement, plan_placement

__all__ = [
    "ExpertPlanError",
    "HashLoadPredictor",
    "LayerLoads",
    "Placement",
    "expected_hash_loads",
    "plan_placement",
    "token_histogram",
    "traffic_windows",
]
