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


class SettingsError(ValueError):
    """A malformed ``SGLANG_DSV4_PLUGIN_*`` value; the message names the variable."""


@dataclass(frozen=True)
class Settings:
    # SGLANG_DSV4_PLUGIN_DISABLE=1: leave DeepSeek-V4 checkpoints to upstream SGLang's own path.
    disable: bool = False
    # SGLANG_DSV4_PLUGIN_CPU_PLATFORM: "auto" activates the torch-native CPU platform on hosts
    # without a GPU; "off" never activates it.
    cpu_platform: str = "auto"

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
        if self.cpu_platform not in ("auto", "off"):
            raise SettingsError(f"{PREFIX}CPU_PLATFORM is {self.cpu_platform!r}; allowed: 'auto', 'off'")


def _parse(name: str, raw: str, default: Any) -> Any:
    if isinstance(default, bool):
        value = raw.strip().lower()
        if value not in _TRUE | _FALSE:
            raise SettingsError(f"{name} is {raw!r}; allowed: 1/0, true/false, yes/no, on/off")
        return value in _TRUE
    return raw.strip()


def settings() -> Settings:
    """The settings of this process (read from the environment each call)."""
    return Settings.from_env()
