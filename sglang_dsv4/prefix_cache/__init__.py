"""The radix-cache backend for V4: token-exact hits through compressor-state checkpoints.

:func:`~sglang_dsv4.radix_cache.build_v4_radix_cache` is what SGLang's radix-cache registry calls (the default
for V4 checkpoints while the plugin is active, or ``--radix-cache-backend dsv4``);
:func:`~sglang_dsv4.radix_cache.runtime_mode_updates` lets ``/set_internal_state`` switch its modes on a running
server. That route takes numbers only, so each mode is sent as its index in
:data:`MODE_CODES`::

    POST /set_internal_state {"server_args": {"dsv4_prefix_hits": 1,     # aligned
                                              "dsv4_window_policy": 1}}  # all_committed

``dsv4_checkpoint_retention`` (0: by worth, the default; 1: plain LRU) is there to measure the
retention rule against the behaviour before it. SGLang answers ``[true]`` (one flag per scheduler);
``/server_info`` reads the modes back, by name, under ``dsv4_prefix_cache``.
"""

from __future__ import annotations

from ..settings import PREFIX_HITS, WINDOW_POLICIES

# Which checkpoint goes first (.retention): by worth (the default), or plain LRU (the baseline it is measured against).
CHECKPOINT_RETENTIONS = ("worth", "lru")
# /set_internal_state key -> the mode's values, in the order of their codes.
MODE_CODES = {
    "dsv4_prefix_hits": PREFIX_HITS,
    "dsv4_window_policy": WINDOW_POLICIES,
    "dsv4_checkpoint_retention": CHECKPOINT_RETENTIONS,
}


def mode_code(key: str, name: str) -> int:
    """The number ``/set_internal_state`` takes for mode value ``name`` of ``key``."""
    return MODE_CODES[key].index(name)
