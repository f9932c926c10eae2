"""The plugin's typed settings: one prefix, one default each, named errors."""

from __future__ import annotations

import pytest

from sglang_dsv4.settings import Settings, SettingsError


def test_defaults_apply_when_nothing_is_set():
    assert Settings.from_env({}) == Settings(disable=False, cpu_platform="auto")


@pytest.mark.parametrize(("raw", "value"), [("1", True), ("true", True), ("off", False), ("0", False)])
def test_disable_reads_booleans(raw, value):
    assert Settings.from_env({"SGLANG_DSV4_PLUGIN_DISABLE": raw}).disable is value


def test_cpu_platform_can_be_forced_off():
    assert Settings.from_env({"SGLANG_DSV4_PLUGIN_CPU_PLATFORM": "off"}).cpu_platform == "off"


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"SGLANG_DSV4_PLUGIN_DISABLE": "maybe"}, "SGLANG_DSV4_PLUGIN_DISABLE is 'maybe'"),
        ({"SGLANG_DSV4_PLUGIN_CPU_PLATFORM": "on"}, "SGLANG_DSV4_PLUGIN_CPU_PLATFORM is 'on'; allowed: 'auto', 'off'"),
        ({"SGLANG_DSV4_PLUGIN_EMULATE_ATTENTION_TP": "8"}, "tensor-parallel attention is timed only as upstream's"),
        ({"SGLANG_DSV4_PLUGIN_EMULATE_ATTENTION_TP": "4"}, "allowed: 1 or EMULATE_GPUS (8)"),
        ({"SGLANG_DSV4_PLUGIN_EMULATE_HOST_SPEED": "fast"}, "SGLANG_DSV4_PLUGIN_EMULATE_HOST_SPEED is 'fast'"),
    ],
)
def test_malformed_values_name_the_variable(environ, message):
    with pytest.raises(SettingsError) as error:
        Settings.from_env(environ)
    assert message in str(error.value)


def test_emulation_timing_settings_read_numbers():
    chosen = Settings.from_env(
        {
            "SGLANG_DSV4_PLUGIN_EMULATE_ATTENTION": "flashmla",
            "SGLANG_DSV4_PLUGIN_EMULATE_ATTENTION_TP": "8",
            "SGLANG_DSV4_PLUGIN_EMULATE_HOST_SPEED": "0.5",
        }
    )
    assert (chosen.emulate_attention_tp, chosen.emulate_host_speed) == (8, 0.5)


def test_unrelated_variables_are_ignored():
    assert Settings.from_env({"SGLANG_DSV4_ATTN": "x", "SGLANG_DSV4_PLUGIN": "1"}) == Settings()
