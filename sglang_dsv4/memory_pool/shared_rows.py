"""Rows of a pool buffer handed out with reference counts.

A row (a window slot, a compressed entry, a checkpoint's state record) is written once
and then only read, so a running request, its checkpoints and the requests resumed from
them share it by counting references; it returns to the free list when the last one
lets go. Row 0 is padding: never handed out, the value unused table cells point at.

Two kinds of allocation. What a request cannot run without (its window and entry rows for a
forward) is :meth:`SharedRows.alloc`: it takes back what the prefix cache holds (``reclaim``)
and then what other requests hold but can do without (``last_resort``: windows kept beyond
what a forward reads, snapshots not taken yet), and raises only if even that is not enough.
What is optional (a checkpoint) is :meth:`SharedRows.try_alloc`: the cache only, else nothing.
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
        # Called when rows run short; each frees something and says whether it could: first what
        # the prefix cache holds, then (for a request's own rows only) what others can do without.
        self.reclaim: Callable[[], bool] | None = None
        self.last_resort: Callable[[], bool] | None = None
        self.clear()

    @property
    def free(self) -> int:
        return len(self.free_list)

    def alloc(self, count: int) -> torch.Tensor:
        """``count`` fresh rows, each with one reference, for what a request cannot run without."""
        if not self.make_room(count, self.reclaim, self.last_resort):
            raise PoolExhausted(f"{self.name}: {count} rows wanted, {self.free} free of {self.capacity}")
        return self._take(count)

    def try_alloc(self, count: int) -> torch.Tensor | None:
        """``count`` fresh rows if they can be had by taking back what the cache holds, else ``None``."""
        return self._take(count) if self.make_room(count, self.reclaim) else None

    def make_room(self, count: int, *reclaimers: Callable[[], bool] | None) -> bool:
        """Call each reclaimer in turn until ``count`` rows are free; whether they are."""
        for reclaim in reclaimers:
            while count > len(self.free_list) and reclaim is not None and reclaim():
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
