"""sglang-dsv4: DeepSeek-V4 for SGLang, with a prefix cache built for agentic multi-turn traffic."""

from .config import ConfigError, DeepseekV4Config, load_config, parse_config
from .model import CheckpointError, DeepseekV4, RequestState, load_model

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DeepseekV4",
    "DeepseekV4Config",
    "RequestState",
    "load_config",
    "load_model",
    "parse_config",
]
