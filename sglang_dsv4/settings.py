"""The plugin's settings, read from ``SGLANG_DSV4_PLUGIN_*`` environment variables.

Upstream SGLang uses ``SGLANG_DSV4_*`` for its own V4 path, hence the longer prefix.
Each setting has one documented default; a malformed value raises
:class:`SettingsError` naming the variable and what is allowed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

PREFIX = "SGLANG_DSV4_PLUGIN_"
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}
# The prefix cache's modes a setting may name (prefix_cache/prefix_hits.py, prefix_cache/window_policy.py).
PREFIX_HITS = ("exact", "aligned")
WINDOW_POLICIES = ("per_request", "all_committed")
EMULATED_DEVICES = ("", "h200")
EMULATED_ATTENTION = ("measured", "flashmla")
EMULATED_EXPERTS = ("fp4", "fp8")


class SettingsError(ValueError):
    """A malformed ``SGLANG_DSV4_PLUGIN_*`` value; the message names the variable."""


@dataclass(frozen=True)
class Settings:
    # SGLANG_DSV4_PLUGIN_DISABLE=1: leave DeepSeek-V4 checkpoints to upstream SGLang's own path.
    disable: bool = False
    # SGLANG_DSV4_PLUGIN_CPU_PLATFORM: "auto" activates the torch-native CPU platform on hosts
    # without a GPU; "off" never activates it.
    cpu_platform: str = "auto"
    # SGLANG_DSV4_PLUGIN_PREFIX_HITS: "exact" resumes at any checkpointed token position;
    # "aligned" only at multiples of 256 tokens, like upstream's V4 pages (the baseline).
    prefix_hits: str = "exact"
    # SGLANG_DSV4_PLUGIN_WINDOW_POLICY: "per_request" keeps of a finished request only the
    # windows its checkpoints need; "all_committed" keeps every window slot it wrote (upstream).
    window_policy: str = "per_request"
    # SGLANG_DSV4_PLUGIN_CHECKPOINT_INTERVAL: in "exact" mode, also checkpoint every this many
    # tokens along a sequence (0: only at chunk, prompt and request ends).
    checkpoint_interval: int = 1024
    # SGLANG_DSV4_PLUGIN_EMULATE: "h200" serves the config with no weights and no arithmetic, each forward
    # taking the time an H200 would (sglang_dsv4/emulation; `dsv4 emulate`); "" (the default) computes.
    emulate: str = ""
    # SGLANG_DSV4_PLUGIN_EMULATE_GPUS: under emulation, the H200s of the deployment each rank is one of (one
    # attention-DP rank a GPU, the routed experts split over all of them): its memory and all-to-all.
    emulate_gpus: int = 8
    # SGLANG_DSV4_PLUGIN_EMULATE_ATTENTION: the timing model's attention, "measured" (this project's kernels on the
    # H200) or "flashmla" (upstream's kernels at their roofline, for calibration against upstream's figures).
    emulate_attention: str = "measured"
    # SGLANG_DSV4_PLUGIN_EMULATE_ATTENTION_TP: 1 (attention DP, one rank a GPU, experts over EP) or EMULATE_GPUS
    # (one tensor-parallel group: a rank is all the GPUs; flashmla attention only).
    emulate_attention_tp: int = 1
    # SGLANG_DSV4_PLUGIN_EMULATE_EXPERTS: the routed experts' weights, "fp4" (as released) or "fp8" (upstream's
    # H200 FP8 recipes).
    emulate_experts: str = "fp4"
    # SGLANG_DSV4_PLUGIN_EMULATE_HOST_SPEED: the emulated host's single-thread time over this host's; the scheduler's
    # own thread CPU time between forwards, times this, is what the emulated device sees of its host work.
    emulate_host_speed: float = 1.0
    # SGLANG_DSV4_PLUGIN_EMULATE_LOCKSTEP=1: the attention-DP ranks' forwards run together, so every rank's extends
    # stall this one (each of this rank's extends also charges the other ranks' equal ones); 0 (the default): the
    # other ranks never stall it.
    emulate_lockstep: bool = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for field in fields(cls):
            name = PREFIX + field.name.upper()
            if name in environ:
                values[field.name] = _parse(name, environ[name], field.default)
        settings = cls(**values)
        settings._validate()
        return settings

    def _validate(self) -> None:
        allowed = {
            "cpu_platform": ("auto", "off"),
            "prefix_hits": PREFIX_HITS,
            "window_policy": WINDOW_POLICIES,
            "emulate": EMULATED_DEVICES,
            "emulate_attention": EMULATED_ATTENTION,
            "emulate_experts": EMULATED_EXPERTS,
        }
        for name, choices in allowed.items():
            if getattr(self, name) not in choices:
                shown = ", ".join(map(repr, choices))
                raise SettingsError(f"{PREFIX}{name.upper()} is {getattr(self, name)!r}; allowed: {shown}")
        if self.checkpoint_interval < 0:
            raise SettingsError(f"{PREFIX}CHECKPOINT_INTERVAL is {self.checkpoint_interval}; allowed: 0 or more")
        if self.emulate_gpus < 1:
            raise SettingsError(f"{PREFIX}EMULATE_GPUS is {self.emulate_gpus}; allowed: 1 or more")
        if self.emulate_attention_tp not in (1, self.emulate_gpus):
            raise SettingsError(
                f"{PREFIX}EMULATE_ATTENTION_TP is {self.emulate_attention_tp}; allowed: 1 or EMULATE_GPUS "
                f"({self.emulate_gpus})"
            )
        if self.emulate_attention_tp > 1 and self.emulate_attention != "flashmla":
            raise SettingsError(
                f"{PREFIX}EMULATE_ATTENTION_TP is {self.emulate_attention_tp}: tensor-parallel attention is timed only "
                f"as upstream's (EMULATE_ATTENTION=flashmla); the measured kernels are one GPU's whole attention"
            )
        if self.emulate_host_speed <= 0:
            raise SettingsError(f"{PREFIX}EMULATE_HOST_SPEED is {self.emulate_host_speed}; allowed: more than 0")


def _parse(name: str, raw: str, default: Any) -> Any:
    if isinstance(default, bool):
        value = raw.strip().lower()
        if value not in _TRUE | _FALSE:
            raise SettingsError(f"{name} is {raw!r}; allowed: 1/0, true/false, yes/no, on/off")
        return value in _TRUE
    if isinstance(default, int):
        try:
            return int(raw)
        except ValueError:
            raise SettingsError(f"{name} is {raw!r}; allowed: an integer") from None
    if isinstance(default, float):
        try:
            return float(raw)
        except ValueError:
            raise SettingsError(f"{name} is {raw!r}; allowed: a number") from None
    return raw.strip()


def settings() -> Settings:
    """The settings of this process (read from the environment each call)."""
    return Settings.from_env()
