"""Mixture of experts: routing (sqrt-softplus gate, hash routing) and the expert FFN."""

from .experts import MoE
from .routing import Gate, sqrt_softplus

__all__ = ["Gate", "MoE", "sqrt_softplus"]
