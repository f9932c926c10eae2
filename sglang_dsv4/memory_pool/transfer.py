"""What a prefill instance sends a decode instance for one request: the pool's rows as transfer groups.

Under prefill/decode disaggregation the decode instance continues a request at the prompt's end ``n``. It reads
what a forward from ``n`` reads; of that, it already holds the state at ``p`` tokens (``p``: SGLang's
``decode_prefix_len``, the prefix the decode instance resumed from its own checkpoint; 0 without its radix cache),
and nothing else moves:

* ``window``: the window rows of positions ``max(p, n - sliding_window) .. n - 1``, every layer's;
* ``ratio_R`` (one group per compression ratio): the compressed entries of blocks ``p // R .. n // R - 1`` (those
  complete at ``n`` and not at ``p``), and under ratio 4 their indexer keys;
* ``state``: the compressors' state records at ``n`` (the partial blocks, every layer's), one record.

Each group is a list of buffers addressed by one kind of row (window slots, entry rows of one ratio, request rows),
so a request's rows in a group are one list of indices on each side, paired position by position. Rows move as
stored (FP8-packed under an FP8 KV dtype). :meth:`PoolLayout.state_bytes_past` is the ledger's count of the same
bytes. Nothing here imports SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .storage import V4PoolStorage

WINDOW, STATE = "window", "state"


def ratio_group(ratio: int) -> str:
    return f"ratio_{ratio}"


@dataclass(frozen=True)
class TransferGroup:
    """Buffers whose rows a request's indices in this group address (``layer_ids`` name each buffer's layer)."""

    name: str
    buffers: tuple[torch.Tensor, ...]
    layer_ids: tuple[int, ...]

    def buffer_infos(self) -> tuple[list[int], list[int], list[int]]:
        """Each buffer's address, length and row length in bytes (what a transfer engine registers)."""
        pointers = [b.data_ptr() for b in self.buffers]
        lengths = [b.numel() * b.element_size() for b in self.buffers]
        return pointers, lengths, [length // b.shape[0] for length, b in zip(lengths, self.buffers, strict=True)]


class RequestStateTransfer:
    """The pool's transfer groups, and the rows of one request in each."""

    def __init__(self, storage: V4PoolStorage):
        self.storage, self.tables = storage, storage.tables
        layers = tuple(storage.layout.layers)
        groups = [TransferGroup(WINDOW, tuple(storage.window[layer] for layer in layers), layers)]
        for ratio in self.tables.ratios:
            keys = [key for key, r in storage.ratio.items() if r == ratio]
            groups.append(
                TransferGroup(ratio_group(ratio), tuple(storage.compressed[k] for k in keys), tuple(k[0] for k in keys))
            )
        keys = list(storage.state)
        groups.append(TransferGroup(STATE, tuple(storage.state[k] for k in keys), tuple(k[0] for k in keys)))
        self.groups = tuple(groups)

    def rows(self, group: str, row: int, length: int, prefix: int = 0) -> np.ndarray:
        """The rows of request row ``row`` at ``length`` tokens in ``group`` that a decode instance holding the
        state at ``prefix`` tokens lacks (int32, in position order)."""
        if group == WINDOW:
            first = max(prefix, length - self.storage.config.sliding_window)
            rows = self.tables.window_rows(row, first, length)
            if bool((rows == 0).any()):
                raise RuntimeError(f"request row {row} holds no window slot for some of positions {first}..{length}")
        elif group == STATE:
            rows = torch.tensor([row])
        else:
            ratio = int(group.removeprefix("ratio_"))
            rows = self.tables.entries(row, ratio, prefix // ratio, length // ratio)
        return rows.numpy().astype(np.int32)
