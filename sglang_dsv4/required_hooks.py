"""The SGLang hooks the plugin requires, and the check that every one applied.

SGLang's ``HookRegistry`` only logs a hook whose target moved (another SGLang version). The plugin, which keeps the
list of targets beside the hooks it installs (:data:`sglang_dsv4.plugin.REQUIRED_HOOKS`), declares them here before
it registers any (:func:`require`); the launcher and SGLang's model class refuse to start instead
(:func:`require_hooks_applied`), naming the hooks that did not apply. This module sits below the model that reads it
and names no hook itself.
"""

from __future__ import annotations

from collections.abc import Iterable

from sglang.srt.plugins.hook_registry import HookRegistry

_required: tuple[str, ...] = ()


def require(targets: Iterable[str]) -> None:
    """Declare the hook targets this process's plugin needs applied."""
    global _required
    _required = tuple(targets)


def require_hooks_applied() -> None:
    """Refuse to start when a hook this plugin needs did not apply (SGLang only logs that)."""
    missing = [target for target in _required if target not in HookRegistry._patched]
    if missing:
        raise RuntimeError(
            f"sglang-dsv4: hooks not applied: {missing}. This SGLang version is not the one the plugin "
            "supports (sglang==0.5.23); set SGLANG_DSV4_PLUGIN_DISABLE=1 to use upstream's V4 path."
        )
