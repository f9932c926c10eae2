"""Mixture of experts: routing (sqrt-softplus gate, hash routing), the expert FFN, EP load planning."""

from .experts import MoE
from .load import HashLoadPredictor, expected_hash_loads, token_histogram, traffic_windows
from .placement import ExpertPlanError, LayerLoads, Placement, plan_placement
from .routing import Gate, sqrt_softplus

__all__ = [
    "ExpertPlanError",
    "Gate",
    "HashLoadPredictor",
    "LayerLoads",
    "MoE",
    "Placement",
    "expected_hash_loads",
    "plan_placement",
    "sqrt_softplus",
    "token_histogram",
    "traffic_windows",
]
