"""Rows of a pool buffer handed out with reference counts.

A row (a window slot, a compressed entry, a checkpoint's state record) is written once
and then only read, so a running request, its checkpoints and the requests resumed from
them share it by counting references; it returns to the free list when the last one
lets go. Row 0 is padding: never handed out, the value unused table cells point at.

Two kinds of allocation. What a forward cannot run without (its window and entry rows) is
:meth:`SharedRows.alloc`: it first lets everything optional give rows back
(``reclaim_for_forwards``: for window slots, what rows hold beyond what forwards read, the prefix
cache's least recently used checkpoints, snapshots not taken yet), and raises only if even that is
not enough — which the pool's sizing rules out (:mod:`.layout`). What is optional (a checkpoint)
is :meth:`SharedRows.try_alloc`: what the prefix cache gives back (``reclaim_optional``), else
nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class PoolExhausted(RuntimeError):
    """No free row even after reclaiming what the prefix cache and other requests could give back."""


class SharedRows:
    def __init__(self, capacity: int, name: str):
        self.capacity = capacity
        self.name = name
        self.refs = torch.zeros(capacity + 1, dtype=torch.int32)
        self.free_list: list[int] = []
        # Called in turn when rows run short, each until it frees nothing more: for an optional row,
        # and for a row a forward cannot run without.
        self.reclaim_optional: tuple[Callable[[], bool], ...] = ()
        self.reclaim_for_forwards: tuple[Callable[[], bool], ...] = ()
        self.clear()

    @property
    def free(self) -> int:
        return len(self.free_list)

    def alloc(self, count: int) -> torch.Tensor:
        """``count`` fresh rows, each with one reference, for what a forward cannot run without."""
        if not self.room_for_forwards(count):
            raise PoolExhausted(f"{self.name}: {count} rows wanted, {self.free} free of {self.capacity}")
        return self._take(count)

    def try_alloc(self, count: int) -> torch.Tensor | None:
        """``count`` fresh rows if they can be had by taking back what the cache holds, else ``None``."""
        return self._take(count) if self.room_for_optional(count) else None

    def room_for_forwards(self, count: int) -> bool:
        """Whether ``count`` rows are free once everything optional gave back what it could."""
        return self._make_room(count, self.reclaim_for_forwards)

    def room_for_optional(self, count: int) -> bool:
        """Whether ``count`` rows are free once the prefix cache gave back what it could."""
        return self._make_room(count, self.reclaim_optional)

    def _make_room(self, count: int, reclaimers: tuple[Callable[[], bool], ...]) -> bool:
        for reclaim in reclaimers:
            while count > len(self.free_list) and reclaim():
                pass
        return count <= len(self.free_list)

    def _take(self, count: int) -> torch.Tensor:
        if count == 0:
            return torch.zeros(0, dtype=torch.int64)
        rows = torch.tensor(self.free_list[-count:], dtype=torch.int64)
        del self.free_list[-count:]
        self.refs[rows] = 1
        return rows

    def share(self, rows: torch.Tensor) -> None:
        rows = rows[rows > 0]
        if (self.refs[rows] <= 0).any():
            raise AssertionError(f"{self.name}: sharing a free row")
        self.refs.index_add_(0, rows, torch.ones_like(rows, dtype=torch.int32))

    def release(self, rows: torch.Tensor) -> None:
        rows = rows[rows > 0]
        self.refs.index_add_(0, rows, torch.full_like(rows, -1, dtype=torch.int32))
        if (self.refs[rows] < 0).any():
            raise AssertionError(f"{self.name}: row released more often than it was shared")
        rows = torch.unique(rows)
        self.free_list.extend(rows[self.refs[rows] == 0].tolist())

    def clear(self) -> None:
        self.refs.zero_()
        self.free_list = list(range(self.capacity, 0, -1))

    def usage(self) -> dict[str, int]:
        return {"total": self.capacity, "free": self.free}
