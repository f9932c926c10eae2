"""The V4 model class SGLang loads under emulation: no parameters, no arithmetic, the H200's time.

Registered under the checkpoint's architecture instead of the real one when ``SGLANG_DSV4_PLUGIN_EMULATE=h200``.
Each forward reads the batch's shape (every request's new tokens and context, as the attention backend sees
them), issues the forward's time from :class:`~.timing.TimingModel` on the rank's
:class:`~.device.EmulatedDevice` and returns at once, with logits that make every request sample
:data:`FIXED_TOKEN` (not an end-of-sequence token: agents run with ``ignore_eos`` and their trace's output
lengths). The logits are ``FIXED_TOKEN + 1`` wide, not the vocabulary: a sampler reading the whole vocabulary
would be host work a GPU does not do. Nothing a later forward reads is written.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.runtime_context import get_model
from torch import nn

from ..attention_backend.torch_reference import request_spans
from ..config import ConfigError, DeepseekV4Config, named_config
from ..served_config import served_config
from ..settings import settings
from .device import device
from .timing import Deployment, ForwardShape, TimingModel

FIXED_TOKEN = 318
"""What every emulated request samples: " the" in the shipped tiny tokenizer (``dsv4 emulate``'s)."""
TIMED_MODELS = ("flash", "pro")


class EmulatedDeepseekV4ForCausalLM(nn.Module):
    """Registered under ``DeepseekV4ForCausalLM`` under emulation: the served config, its timing model, no weights."""

    def __init__(self, config, quant_config=None, prefix: str = ""):
        super().__init__()
        self.config = config
        self.v4_config = served_config(config)
        chosen = settings()
        deployment = Deployment(
            gpus=chosen.emulate_gpus,
            kv_dtype=served_kv_dtype(),
            attention_tp=chosen.emulate_attention_tp,
            experts=chosen.emulate_experts,
            lockstep=chosen.emulate_lockstep,
        )
        self.timing = TimingModel(
            self.v4_config, timed_model(self.v4_config), deployment, attention=chosen.emulate_attention
        )
        self.register_buffer("choice", _fixed_choice(), persistent=False)

    @torch.no_grad()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch, **kwargs
    ) -> LogitsProcessorOutput:
        if forward_batch.forward_mode.is_idle():
            return LogitsProcessorOutput(next_token_logits=self.choice[:0].expand(0, -1))
        spans = request_spans(forward_batch)
        shape = ForwardShape(tuple(s.length for s in spans), tuple(s.start + s.length for s in spans))
        device().issue(self.timing.forward(shape).total_s)
        return LogitsProcessorOutput(next_token_logits=self.choice.repeat(len(spans), 1))  # a copy: sampled in place

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """No weights: whatever a loader offers is not read."""


def served_kv_dtype() -> str:
    """The timing model's name for SGLang's ``--kv-cache-dtype``: ``fp8`` or ``bf16``."""
    return "fp8" if "fp8" in str(get_model().kv_cache_dtype) else "bf16"


def timed_model(config: DeepseekV4Config) -> str:
    """Which measured model a config is (the timing model has H200 figures for V4-Flash and V4-Pro only)."""
    for name in TIMED_MODELS:
        if named_config(name) == config:
            return name
    raise ConfigError(f"emulation times only the shipped V4 configs ({', '.join(TIMED_MODELS)}); this one is neither")


def _fixed_choice() -> torch.Tensor:
    logits = torch.zeros(1, FIXED_TOKEN + 1)  # sampled at any temperature, never another token; where SGLang
    logits[0, FIXED_TOKEN] = 1e4  # pads the rows to the vocabulary, its zeros lose too
    return logits
