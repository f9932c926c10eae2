"""The plugin's guard rails: missing hooks refuse to start; DISABLE gives upstream's path back."""

from __future__ import annotations

import pytest
from sglang.srt.plugins.hook_registry import HookRegistry

from sglang_dsv4 import hooks
from sglang_dsv4.launch import running_server


def test_missing_hook_refuses_to_start_and_names_it(monkeypatch):
    applied = set(hooks.REQUIRED_HOOKS)
    missing = hooks.REQUIRED_HOOKS[1]
    monkeypatch.setattr(HookRegistry, "_patched", applied - {missing})
    with pytest.raises(RuntimeError) as error:
        hooks.require_hooks_applied()
    assert missing in str(error.value) and "sglang==0.5.23" in str(error.value)


def test_all_hooks_apply_to_this_sglang(plugin_in_own_registry):
    hooks.require_hooks_applied()


def test_disable_hands_v4_back_to_upstream(tiny_path, log_dir):
    # Upstream's own V4 path has no CPU implementation: with the plugin off, the server
    # takes upstream's decisions (its dsv4 backend and 256-token pages) and fails in its model.
    log = log_dir / "disabled-server.log"
    with pytest.raises(RuntimeError):
        with running_server(tiny_path, log_path=log, env={"SGLANG_DSV4_PLUGIN_DISABLE": "1"}):
            pass
    text = log.read_text()
    assert "Use dsv4 attention backend for DeepseekV4ForCausalLM, setting page_size to 256" in text
    assert "sglang/srt/models/deepseek_v4.py" in text
