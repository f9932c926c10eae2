"""The DeepSeek-V4 network in torch: modules (its mixture of experts too), per-request state and checkpoint loader."""

from .checkpoint_check import load_model
from .loader import CheckpointError
from .network import DeepseekV4
from .state import RequestState

__all__ = ["CheckpointError", "DeepseekV4", "RequestState", "load_model"]
