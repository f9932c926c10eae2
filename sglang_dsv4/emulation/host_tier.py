"""The host tier under emulation: each copy between the tiers takes the time ours takes on an H200.

The host tier runs as on a GPU server (:mod:`sglang_dsv4.prefix_cache.host_tier`), over rows of no width: its
sizes and the bytes it moves are the layout's (what the device stores). Each copy is timed per byte from our copies
of one 27,648-token V4-Flash session measured on the H200 (RESULTS, "Host-tier loads"; ``host_tier_loads.py``):

* a load (:meth:`~sglang_dsv4.memory_pool.host_pools.HostRowKind.restore`, pinned rows in runs, on a stream of its
  own): 8.98 ms for 187.4 MiB bf16, of which the host thread issuing it 6.01 ms (FP8 7.46 / 5.92 ms for
  105.2 MiB). The host is held for the issue (:meth:`~.device.EmulatedDevice.hold_host`), and the rest runs on the
  copy engine (:meth:`~.device.EmulatedDevice.load`), so the next forward waits for the rows;
* a write-back (:meth:`~sglang_dsv4.memory_pool.host_pools.HostRowKind.save`: a gather and a synchronous copy to
  pageable memory a buffer): the host held for the whole copy, taken as the synchronous load of the same table
  (36.4 ms bf16, 26.0 ms FP8 for the session: the same path the other way; the device-to-host direction was not
  measured).

Per byte: a copy's cost a call (167 buffers each launched from Python) is spread over its bytes, so a small copy
is timed as cheaper than it is.
"""

from __future__ import annotations

from typing import Any

import torch

from .device import device
from .model import served_kv_dtype

MIB = 2**20
SESSION_BYTES = {"bf16": 187.4 * MIB, "fp8": 105.2 * MIB}
LOAD_S = {"bf16": 8.98e-3, "fp8": 7.46e-3}
LOAD_ISSUE_S = {"bf16": 6.01e-3, "fp8": 5.92e-3}
WRITE_BACK_S = {"bf16": 36.4e-3, "fp8": 26.0e-3}


def session_share(kind: Any, rows: int, dtype: str) -> float:
    """``rows`` rows of ``kind`` as a share of the measured session's bytes in the KV dtype ``dtype``."""
    return rows * kind.row_bytes / SESSION_BYTES[dtype]


def timed_load(original, kind: Any, host_rows: torch.Tensor, device_rows: torch.Tensor) -> None:
    """Around ``HostRowKind.restore``: the host issues the load, the copy engine lands it."""
    original(kind, host_rows, device_rows)
    dtype = served_kv_dtype()
    share = session_share(kind, len(host_rows), dtype)
    device().hold_host(share * LOAD_ISSUE_S[dtype])
    device().load(share * (LOAD_S[dtype] - LOAD_ISSUE_S[dtype]))


def timed_write_back(original, kind: Any, device_rows: torch.Tensor) -> torch.Tensor | None:
    """Around ``HostRowKind.save``: the host waits for the copy (none when the host was short and nothing moved)."""
    host_rows = original(kind, device_rows)
    if host_rows is not None:
        dtype = served_kv_dtype()
        device().hold_host(session_share(kind, len(device_rows), dtype) * WRITE_BACK_S[dtype])
    return host_rows
