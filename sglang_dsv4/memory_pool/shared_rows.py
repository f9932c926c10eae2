"""Rows of a pool buffer handed out with reference counts.

A row (a window slot, a compressed entry, a checkpoint's state record) is written once
and then only read, so a running request, its checkpoints and the requests resumed from
them share it by counting references; it returns to the free list when the last one
lets go. Row 0 is padding: never handed out, the value unused table cells point at.

Rows are only ever taken from what is free: :meth:`SharedRows.alloc` for what a forward cannot
run without (a shortage raises :class:`PoolExhausted`: whoever asks makes room first, and the
pool's sizing leaves room once everything optional is given back, :mod:`.layout`),
:meth:`SharedRows.try_alloc` for what is optional (``None`` when short). Making room is the
cache manager's (:mod:`sglang_dsv4.prefix_cache.manager`); an allocator calls nothing.
"""

from __future__ import annotations

import torch


class PoolExhausted(RuntimeError):
    """Fewer free rows than a forward cannot run without."""


BOOKKEEPING_BYTES_PER_ROW = 4 + 8
"""A row's reference count (int32) and its place on the free stack (int64)."""


class SharedRows:
    def __init__(self, capacity: int, name: str):
        self.capacity = capacity
        self.name = name
        self.refs = torch.zeros(capacity + 1, dtype=torch.int32)
        # The free rows are free_stack[:free], the next one handed out last.
        self.free_stack = torch.empty(capacity, dtype=torch.int64)
        self.free = 0
        self.clear()

    def alloc(self, count: int) -> torch.Tensor:
        """``count`` free rows, each with one reference, for what a forward cannot run without."""
        if count > self.free:
            raise PoolExhausted(f"{self.name}: {count} rows wanted, {self.free} free of {self.capacity}")
        return self._take(count)

    def try_alloc(self, count: int) -> torch.Tensor | None:
        """``count`` free rows for something optional, or ``None`` when fewer are free."""
        return self._take(count) if count <= self.free else None

    def take_each(self, count: int) -> torch.Tensor | None:
        """``count`` rows, in the order ``count`` successive one-row :meth:`alloc` calls hand them out; ``None``
        (nothing taken) when fewer are free."""
        return self._take(count).flip(0) if count <= self.free else None

    def recycle_each(self, released: torch.Tensor) -> torch.Tensor | None:
        """One row for each entry of ``released`` (a row to let go of first, 0 for none), exactly as releasing it
        and then allocating one row would, entry by entry in order: a row whose last reference goes comes straight
        back, the others take the free stack's top rows in turn. ``None`` (nothing changed) when a released row
        repeats or fewer rows are free than are taken. All tensors here are host tensors."""
        let_go = released[released > 0]
        if let_go.unique().numel() != let_go.numel():
            return None
        refs_after = self.refs[released] - (released > 0).to(torch.int32)
        if (refs_after < 0).any():
            raise AssertionError(f"{self.name}: row released more often than it was shared")
        comes_back = (released > 0) & (refs_after == 0)
        taking = ~comes_back
        taken_before = torch.cumsum(taking, 0) - taking.long()
        count = int(taking.sum())
        if count > self.free:
            return None
        self.refs.index_add_(0, let_go, torch.full_like(let_go, -1, dtype=torch.int32))
        rows = torch.where(comes_back, released, self.free_stack[(self.free - 1 - taken_before).clamp(min=0)])
        self.free -= count
        self.refs[rows] = 1
        return rows

    def _take(self, count: int) -> torch.Tensor:
        if count == 0:
            return torch.zeros(0, dtype=torch.int64)
        self.free -= count
        rows = self.free_stack[self.free : self.free + count].clone()
        self.refs[rows] = 1
        return rows

    def share(self, rows: torch.Tensor) -> None:
        """One more reference on each of ``rows`` (0s are padding and skipped; a row may repeat)."""
        rows = _without_padding(rows)
        if len(rows) and int(torch.index_select(self.refs, 0, rows).min()) <= 0:
            raise AssertionError(f"{self.name}: sharing a free row")
        self.refs.index_add_(0, rows, torch.ones_like(rows, dtype=torch.int32))

    def release(self, rows: torch.Tensor) -> None:
        """One reference fewer on each of ``rows`` (0s skipped; a row may repeat); those left with none are free.
        Only the rows whose count reached 0 are deduplicated, not all of ``rows`` (a resumed prefix's entries)."""
        rows = _without_padding(rows)
        if not len(rows):
            return
        self.refs.index_add_(0, rows, torch.full_like(rows, -1, dtype=torch.int32))
        counts = torch.index_select(self.refs, 0, rows)
        if int(counts.min()) < 0:
            raise AssertionError(f"{self.name}: row released more often than it was shared")
        freed = torch.unique(rows[counts == 0])
        self.free_stack[self.free : self.free + len(freed)] = freed
        self.free += len(freed)

    def clear(self) -> None:
        self.refs.zero_()
        torch.arange(self.capacity, 0, -1, out=self.free_stack)
        self.free = self.capacity

    def miscounted(self, held: torch.Tensor) -> int:
        """How many rows' reference counts differ from the number of times they appear in ``held``
        (everything that holds rows, concatenated), or are free but referenced, or the reverse."""
        held = held[held > 0]
        counts = torch.zeros_like(self.refs)
        counts.index_add_(0, held, torch.ones_like(held, dtype=torch.int32))
        free = torch.zeros_like(self.refs, dtype=torch.bool)
        free[self.free_stack[: self.free]] = True
        wrong = (counts != self.refs) | (free != (self.refs == 0))
        wrong[0] = False
        return int(wrong.sum())

    def usage(self) -> dict[str, int]:
        return {"total": self.capacity, "free": self.free}


def _without_padding(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` without row 0 (padding), copied only when it holds one."""
    return rows if not len(rows) or int(rows.min()) > 0 else rows[rows > 0]
