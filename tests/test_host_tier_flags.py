"""SGLang's HiCache flags under the V4 host tier: each works or is refused at start, naming why (issue 28).

Checked in the launcher's own resolution step, in this process (:func:`launch_checks.refusal_at_resolution`).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from launch_checks import config_only_checkpoint, refusal_at_resolution, resolved_at_resolution

from sglang_dsv4.config import ConfigError
from sglang_dsv4.memory_pool.host_pools import device_kinds, host_rows_for_bytes
from sglang_dsv4.prefix_cache.host_tier_size import GB, check_fits_host_memory, host_tier_bytes, mirrored_device_bytes

TIER = ("--enable-hierarchical-cache", "--hicache-write-policy", "write_back")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return config_only_checkpoint(tmp_path_factory.mktemp("host-tier") / "tiny")


def test_the_host_tier_with_write_back_resolves_with_a_ratio_or_without(checkpoint, sglang_with_plugin):
    resolved = resolved_at_resolution(checkpoint, *TIER, "--hicache-ratio", "1.5")
    assert resolved.enable_hierarchical_cache and resolved.hicache_ratio == 1.5
    assert resolved_at_resolution(checkpoint, *TIER).enable_hierarchical_cache


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective"])
def test_the_write_through_policies_resolve(checkpoint, sglang_with_plugin, policy):
    resolved = resolved_at_resolution(checkpoint, "--enable-hierarchical-cache", "--hicache-write-policy", policy)
    assert resolved.enable_hierarchical_cache and resolved.hicache_write_policy == policy


def test_the_plain_flag_resolves_to_sglangs_default_write_through(checkpoint, sglang_with_plugin):
    plain = resolved_at_resolution(checkpoint, "--enable-hierarchical-cache")
    assert plain.enable_hierarchical_cache and plain.hicache_write_policy == "write_through"


def test_the_alias_and_a_size_in_gigabytes_resolve(checkpoint, sglang_with_plugin):
    resolved = resolved_at_resolution(checkpoint, "--enable-hicache", "--hicache-write-policy", "write_back",
                                      "--hicache-size", "2")  # fmt: skip
    assert resolved.enable_hierarchical_cache and resolved.hicache_size == 2


@pytest.mark.parametrize(
    ("args", "refusal"),
    [
        ((*TIER, "--hicache-storage-backend", "file"), "--hicache-storage-backend file: DeepSeek-V4's host tier has"),
        ((*TIER, "--hicache-io-backend", "direct"), "--hicache-io-backend direct: DeepSeek-V4's host tier copies"),
        ((*TIER, "--hicache-mem-layout", "layer_first"), "--hicache-mem-layout layer_first: DeepSeek-V4's host"),
    ],
)
def test_a_hicache_setting_the_host_tier_has_not_is_refused_naming_it(checkpoint, sglang_with_plugin, args, refusal):
    assert refusal in refusal_at_resolution(checkpoint, *args)


def test_the_host_tier_with_speculation_is_refused(sglang_with_plugin):
    # In process: the launcher's speculation check reads the checkpoint's MTP weights, which a config-only
    # checkpoint has not.
    from sglang.srt.server_args import ServerArgs

    from sglang_dsv4.radix_cache import check_cache_tiers

    view = ServerArgs(model_path="tiny", enable_hierarchical_cache=True, hicache_write_policy="write_back",
                      speculative_algorithm="EAGLE")  # fmt: skip
    with pytest.raises(ConfigError, match="host tier is not built for speculative decoding yet"):
        check_cache_tiers(view)


def test_buffer_only_host_memory_is_refused(checkpoint, sglang_with_plugin):
    # SGLang refuses buffer_only without a storage backend before the plugin's check runs; with one, the plugin
    # refuses the storage backend. Either way the start stops with the reason.
    refusal = refusal_at_resolution(checkpoint, *TIER, "--hicache-host-memory-mode", "buffer_only")
    assert "buffer_only" in refusal


def test_lmcache_is_refused_naming_it(checkpoint, sglang_with_plugin):
    assert refusal_at_resolution(checkpoint, "--enable-lmcache").startswith("ConfigError: --enable-lmcache:")


# --- the host tier's size -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def storage():
    from sglang_dsv4.config import parse_config
    from sglang_dsv4.kv_cache import V4KVPool
    from sglang_dsv4.tiny import TINY_CONFIG

    config = parse_config(TINY_CONFIG)
    return V4KVPool(4096, 1, config, torch.bfloat16, max_requests=4, max_context=4096, device="cpu").storage


def test_sglangs_auto_sizing_reads_the_bytes_of_the_rows_the_host_tier_mirrors(storage, sglang_with_plugin):
    from sglang.srt.mem_cache import hicache_auto_size

    from sglang_dsv4.kv_cache import V4KVPool

    pool = V4KVPool.__new__(V4KVPool)  # the pool SGLang holds, around the storage under test
    pool.storage = storage
    # The oracle: the pool's own tensors (a padding row each besides the rows handed out).
    tensors = [*storage.window, *storage.compressed.values(), *storage.checkpoint_state.values()]
    allocated = sum(t.nbytes - t[0].nbytes for t in tensors)
    params = SimpleNamespace(
        token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: pool),
        req_to_token_pool=None,
        mtp_draft_device_pools=[],
    )
    assert hicache_auto_size._estimate_hicache_bytes(params, None) == allocated == mirrored_device_bytes(storage)


def test_the_host_tier_holds_ratio_times_the_device_rows_or_the_size_asked(storage):
    # Twice the device's bytes of each kind, less one padding row of each and what a row count rounds off.
    row_bytes = {name: sum(b[0].nbytes for b in buffers) for name, (_, buffers) in device_kinds(storage).items()}
    doubled = host_rows_for_bytes(storage, host_tier_bytes(storage, ratio=2.0, size_gb=0))
    held = sum(rows * row_bytes[name] for name, rows in doubled.items())
    doubled_bytes = 2 * mirrored_device_bytes(storage)
    assert doubled_bytes - 2 * sum(row_bytes.values()) <= held <= doubled_bytes
    assert host_tier_bytes(storage, ratio=2.0, size_gb=3) == 3 * GB  # --hicache-size overrides the ratio


def test_a_host_tier_larger_than_free_host_memory_is_refused_naming_the_flags():
    check_fits_host_memory(10 * GB, 11 * GB)
    with pytest.raises(ConfigError, match="asks 12.00 GB of host memory and 11.00 GB is free; lower --hicache-ratio"):
        check_fits_host_memory(12 * GB, 11 * GB)
