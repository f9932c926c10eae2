"""The plugin's guard rails: missing hooks refuse to start; DISABLE gives upstream's path back."""

from __future__ import annotations

import pytest
from sglang.srt.plugins.hook_registry import HookRegistry

from sglang_dsv4 import plugin, required_hooks
from sglang_dsv4.launch import running_server


def test_missing_hook_refuses_to_start_and_names_it(monkeypatch):
    applied = set(plugin.REQUIRED_HOOKS)
    missing = plugin.REQUIRED_HOOKS[1]
    required_hooks.require(plugin.REQUIRED_HOOKS)  # as the plugin declares them when it registers
    monkeypatch.setattr(HookRegistry, "_patched", applied - {missing})
    with pytest.raises(RuntimeError) as error:
        required_hooks.require_hooks_applied()
    assert missing in str(error.value) and "sglang==0.5.23" in str(error.value)


def test_all_hooks_apply_to_this_sglang(plugin_in_own_registry):
    required_hooks.require_hooks_applied()


def test_the_plugin_declares_every_hook_it_needs(plugin_in_own_registry):
    # The model's check reads what the plugin declared (required_hooks sits below the model, the list in the plugin).
    assert required_hooks._required == plugin.REQUIRED_HOOKS


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
