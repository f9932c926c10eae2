"""Where each running request's window rows and compressed entries are.

Per request row (SGLang's ``req_pool_idx``) two tables map positions to pool rows: the
window table maps a token position to the window slot holding that token's raw KV (in
every layer), an entry table per compression ratio maps a block index to the row
holding its compressed entry (and indexer key). Rows are shared by reference count
(:class:`~.shared_rows.SharedRows`), so a request resumed from a checkpoint points at
the checkpoint's rows instead of copying them.

The cache manager (:mod:`sglang_dsv4.prefix_cache.manager`), SGLang's auxiliary cache of its
request-to-token pool, reserves a row's rows before every forward up to the request's new length
(:meth:`RequestTables.reserve`, once it has made room) and returns them when SGLang frees the
request's row (:meth:`RequestTables.free`), on every path it frees requests. A row is bound to
a request (fresh, or resumed from a checkpoint) when SGLang allocates it. A row holds the slots a
forward or a checkpoint can still read (the last window plus one token, SGLang's one-step
scheduling lag, and the window behind each snapshot position), and under ``all_committed`` the
slots of every token it wrote, as far as the window slots allow; under pressure every row lets go
of what no forward reads (:meth:`RequestTables.keep_only_what_forwards_read`).

The scheduler changes the tables on the host (allocating rows is host work); the forward reads
them on the device. Each table is a :class:`MirroredTable`: written on the host, its changed
cells copied to a device twin in one transfer when a forward begins
(:meth:`RequestTables.begin_forward`, which the attention backend calls before it builds the
forward's index). A forward in flight on the device's stream reads the twin as it was when it
was launched, so from then on its rows need only what their next forward reads: a slot let go
then is written again only by a later forward, which runs after it on the same stream. On the
CPU the twin is the host table itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layout import TABLE_DTYPE
from .shared_rows import SharedRows


class UnboundRequestRow(RuntimeError):
    """A forward for a row no request was bound to: the dsv4 radix cache is not in use."""


def has_device_twins(device: torch.device | str) -> bool:
    """Whether request tables on ``device`` keep a twin of their own there (not on the CPU, whose
    forwards read the host tables)."""
    return torch.device(device).type != "cpu"


LONG_SPAN = 256
"""Columns from which a row's span written at once is noted as a span, copied as one slice at the flush (or, set to
one value, filled with it there), rather than cell by cell, sorted with every other noted cell (a resumed prefix's
entries, a long row's freed). A span's copy costs about as much whatever its width (4 µs on this host's CPU), a
cell about 10 ns more in the sort: from a few hundred columns the span is the cheaper."""


class MirroredTable:
    """An int64 table of pool rows written on the host, read by forwards from its ``device`` twin.

    :meth:`write` changes the host table at once and notes the cells (a long span as a span, or as a fill where it
    was set to one value); :meth:`flush` fills the noted fills on the twin first, then copies the other noted cells'
    current values, so the last write of a cell wins however often the scheduler rewrote it in between.
    """

    def __init__(self, rows: int, columns: int, device: torch.device):
        self.host = torch.zeros(rows, columns, dtype=TABLE_DTYPE)
        self.device = torch.zeros_like(self.host, device=device) if has_device_twins(device) else self.host
        self._changed: list[torch.Tensor] = []
        self._spans: list[tuple[int, int, int]] = []  # (row, first column, end column)
        self._fills: list[tuple[int, int, int, int]] = []  # (row, first column, end column, value)

    def write(self, row: int, columns: torch.Tensor | slice, values: torch.Tensor | int) -> None:
        """``host[row, columns] = values``, and the cells noted for the next flush."""
        self.host[row, columns] = values
        if self.device is not self.host:
            width = self.host.shape[1]
            if isinstance(columns, slice):
                first, end, step = columns.indices(width)
                if step == 1 and end - first >= LONG_SPAN:
                    if isinstance(values, int):  # (a freed row's: filled on the device, nothing copied)
                        self._fills.append((row, first, end, values))
                    else:
                        self._spans.append((row, first, end))
                    return
                columns = torch.arange(first, end, step)
            self._changed.append(row * width + columns)

    def write_cells(self, rows: torch.Tensor, columns: torch.Tensor, values: torch.Tensor | int) -> None:
        """``host[rows[i], columns[i]] = values[i]`` for every ``i``, and the cells noted for the next flush."""
        self.host[rows, columns] = values
        if self.device is not self.host:
            self._changed.append(rows * self.host.shape[1] + columns)

    @property
    def device_bytes(self) -> int:
        """The twin's bytes where it is a tensor of its own (on a GPU), else 0."""
        return 0 if self.device is self.host else self.device.numel() * self.device.element_size()

    def flush(self) -> None:
        # The fills first: a cell written after its fill gets the host's current value from a span or the cells.
        for row, first, end, value in self._fills:
            self.device[row, first:end] = value
        self._fills.clear()
        # Host to device, never waited for: the host values are read before the call returns (a copy from pageable
        # memory returns once CUDA has staged its source; the cells' values are gathered into a tensor of their
        # own), so the scheduler may write the tables again at once. Spans and cells both read the host's current
        # values, so their order does not matter.
        for row, first, end in self._spans:
            self.device[row, first:end].copy_(self.host[row, first:end], non_blocking=True)
        self._spans.clear()
        if not self._changed:
            return
        cells = torch.unique(torch.cat(self._changed))
        self._changed.clear()
        values = self.host.view(-1)[cells]
        device = self.device.device
        self.device.view(-1)[cells.to(device, non_blocking=True)] = values.to(device, non_blocking=True)


@dataclass(frozen=True)
class DeviceTables:
    """The request tables as a forward reads them (the batched core's ``RequestTableStorage``)."""

    window_table: torch.Tensor
    entry_table: dict[int, torch.Tensor]


class RequestTables:
    def __init__(
        self,
        ratios: list[int],
        request_rows: int,
        max_context: int,
        window: int,
        window_slots: SharedRows,
        entry_rows: dict[int, SharedRows],
        num_tokens: int,
        device: torch.device | str = "cpu",
    ):
        self.ratios = sorted(set(ratios))
        self.request_rows = request_rows
        self.window = window
        self.window_slots = window_slots
        self.entry_rows = entry_rows
        self.num_tokens = num_tokens
        device = torch.device(device)
        self._window = MirroredTable(request_rows, max_context + 1, device)
        self._entries = {r: MirroredTable(request_rows, max_context // r + 1, device) for r in self.ratios}
        # The host tables, read by the scheduler's side (written only through the mirrors).
        self.window_table = self._window.host
        self.entry_table = {r: table.host for r, table in self._entries.items()}
        self.on_device = DeviceTables(self._window.device, {r: table.device for r, table in self._entries.items()})
        self.entry_count = {r: [0] * request_rows for r in self.ratios}
        # Per ratio, the row's first entries that it borrows: read, not counted (a resumed prefix's, see bind).
        self.borrowed = {r: [0] * request_rows for r in self.ratios}
        self.position = [0] * request_rows  # tokens the row's state has run through
        self.last_step = [0] * request_rows  # tokens of the row's last forward
        self.held_from = [0] * request_rows  # window slots below this position are released
        self.bound = [False] * request_rows
        self.unlaunched: set[int] = set()  # rows reserved since the last forward began

    def flush(self) -> None:
        """Bring the device tables up to date with the host's (before a forward reads them)."""
        self._window.flush()
        for table in self._entries.values():
            table.flush()

    def begin_forward(self) -> None:
        """A forward begins: the device tables take the host's changes, and every row reserved so
        far belongs to a forward that is launched (it no longer needs the slots only it wrote)."""
        self.flush()
        self.unlaunched.clear()

    @property
    def device_bytes(self) -> int:
        """What the device twins hold (0 on the CPU, where the twins are the host tables)."""
        return self._window.device_bytes + sum(table.device_bytes for table in self._entries.values())

    def write_entries(self, ratio: int, row: int, blocks: torch.Tensor | slice, rows: torch.Tensor | int) -> None:
        """Point the row's ``blocks`` at entry rows ``rows``."""
        self._entries[ratio].write(row, blocks, rows)

    @property
    def dense_capacity(self) -> int:
        """Tokens the scheduler may place: the token pool's, which the entry rows cover."""
        return self.num_tokens

    # --- binding a row to a request --------------------------------------------------------

    def bind(
        self,
        row: int,
        position: int = 0,
        window: torch.Tensor | None = None,
        borrowed_entries: dict[int, torch.Tensor] | None = None,
    ) -> None:
        """Start ``row`` at ``position``: its window slots ``window`` (the tokens just before ``position``) are
        shared, not copied; its first entry rows, per ratio ``borrowed_entries`` (a cached prefix's), are
        borrowed: read, with no reference counted, for whoever keeps them keeps them for as long as the row is
        bound (the prefix tree, under the request's lock: ``Checkpoints.resume`` in
        :mod:`sglang_dsv4.prefix_cache.checkpoints`)."""
        if self.bound[row]:
            raise AssertionError(f"request row {row} is bound twice")
        self.bound[row] = True
        self.position[row] = position
        self.last_step[row] = 0
        if window is not None and len(window):
            self.window_slots.share(window)
            self._window.write(row, slice(position - len(window), position), window)
        self.held_from[row] = position - (0 if window is None else len(window))
        for ratio in self.ratios:
            rows = borrowed_entries[ratio] if borrowed_entries else torch.zeros(0, dtype=torch.int64)
            self.write_entries(ratio, row, slice(0, len(rows)), rows)
            self.entry_count[ratio][row] = self.borrowed[ratio][row] = len(rows)

    def reserve(self, row: int, target: int) -> None:
        """What a forward from the row's position up to ``target`` tokens cannot run without, from
        what is free: the window slots of its last ``window + 1`` tokens and the entry rows of its
        blocks (:meth:`SharedRows.alloc` reports a shortage)."""
        if not self.bound[row]:
            raise UnboundRequestRow(
                f"request row {row} runs a forward without a bound request: DeepSeek-V4 needs the dsv4 radix "
                "cache (leave --radix-cache-backend unset or set it to dsv4)"
            )
        start = self.position[row]
        if target <= start:
            return
        own = torch.arange(target - self.window_slots_for_forward(target - start), target)
        self._window.write(row, own, self.window_slots.alloc(len(own)))
        self.unlaunched.add(row)
        for ratio, count in self.entry_rows_for_forward(row, target).items():
            have = self.entry_count[ratio][row]
            self.write_entries(ratio, row, slice(have, have + count), self.entry_rows[ratio].alloc(count))
            self.entry_count[ratio][row] = have + count
        self.position[row], self.last_step[row] = target, target - start

    def steps_plainly(self, row: int, target: int, trims: bool) -> bool:
        """Whether a forward of the row up to ``target`` is a plain decode step, which :meth:`step_each` batches:
        one token after a bound row's position, letting go of at most one window slot first (when ``trims``,
        as :meth:`trim_to_forward` does) and taking at most one entry row per ratio."""
        start = self.position[row]
        return (
            self.bound[row]
            and target == start + 1
            and (not trims or start - self.window - 2 <= self.held_from[row])
            and all(target // r - self.entry_count[r][row] <= 1 for r in self.ratios)
        )

    def step_each(self, rows: list[int], trims: bool) -> bool:
        """One token more for each of ``rows`` (plain decode steps, :meth:`steps_plainly`): what
        :meth:`trim_to_forward` (when ``trims``) and :meth:`reserve` row after row, in order, do, in a few batched
        tensor operations; per-row work only for rows that let go of a slot or take an entry row. False, with
        nothing changed, when the rows free would run short (row after row then makes room first)."""
        index = torch.tensor(rows)
        starts = torch.tensor([self.position[row] for row in rows])
        new_blocks = {}
        for ratio in self.ratios:
            have = torch.tensor([self.entry_count[ratio][row] for row in rows])
            new_blocks[ratio] = ((starts + 1) // ratio > have).nonzero().flatten(), have
        if any(len(takes) > self.entry_rows[r].free for r, (takes, _) in new_blocks.items()):
            return False
        released, trimmed = torch.zeros_like(index), torch.zeros(0, dtype=torch.long)
        if trims:
            held_from = torch.tensor([self.held_from[row] for row in rows])
            trimmed = (held_from < starts - self.window - 1).nonzero().flatten()
            released[trimmed] = self.window_table[index[trimmed], held_from[trimmed]]
        slots = self.window_slots.recycle_each(released)
        if slots is None:
            return False
        if len(trimmed):
            self._window.write_cells(index[trimmed], held_from[trimmed], 0)
            for i in trimmed.tolist():  # host tensor
                self.held_from[rows[i]] += 1
        self._window.write_cells(index, starts, slots)
        for ratio, (takes, have) in new_blocks.items():
            if len(takes):
                entries = self.entry_rows[ratio].take_each(len(takes))
                self._entries[ratio].write_cells(index[takes], have[takes], entries)
                for i in takes.tolist():  # host tensor
                    self.entry_count[ratio][rows[i]] += 1
        self.unlaunched.update(rows)
        for row in rows:
            self.position[row] += 1
            self.last_step[row] = 1
        return True

    def window_slots_for_forward(self, tokens: int) -> int:
        """Window slots of its own a forward of ``tokens`` new tokens of one row takes: those of its
        last ``window + 1`` tokens (what the next forward and a checkpoint one decode step late read).
        The count SGLang's admission check asks room for (its decode check: :meth:`window_slots_for_decode_steps`)."""
        return min(tokens, self.window + 1)

    def window_slots_for_decode_steps(self, rows: list[int]) -> int:
        """Window slots of their own one decode step of each of ``rows`` takes from what is free, reserved as
        ``per_request`` reserves it (:meth:`trim_to_forward`, then a slot for the new token): one a row, less one
        for each launched row whose oldest slot goes as it moves on and comes back free (no checkpoint shares it).
        A count, nothing changed: SGLang's decode check asks room for it, so that a full pool whose rows recycle
        their slots decodes without a pass over every row to make room (:meth:`keep_only_what_forwards_read`)."""
        window = self.window
        lets_go = [r for r in rows if r not in self.unlaunched and self.held_from[r] < self.position[r] - window - 1]
        if not lets_go:
            return len(rows)
        oldest = self.window_table[torch.tensor(lets_go), torch.tensor([self.held_from[r] for r in lets_go])]
        return len(rows) - int(((oldest > 0) & (self.window_slots.refs[oldest] == 1)).sum())  # host tensors

    def entry_rows_for_forward(self, row: int, target: int) -> dict[int, int]:
        """Per ratio, the entry rows a forward of the row up to ``target`` tokens takes (its new blocks)."""
        return {r: max(0, target // r - self.entry_count[r][row]) for r in self.ratios}

    def missing_window(self, row: int, first: int, last: int) -> torch.Tensor:
        """The row's positions in ``first .. last - 1`` it holds no window slot for."""
        positions = torch.arange(max(first, self.held_from[row], 0), last)
        return positions[self.window_table[row, positions] == 0]

    def hold_window(self, row: int, missing: torch.Tensor) -> bool:
        """Optional slots for the row's ``missing`` positions (:meth:`missing_window`; a snapshot's
        window, or all_committed's): all of them from what is free, or none."""
        slots = self.window_slots.try_alloc(len(missing))
        if slots is None:
            return False
        self._window.write(row, missing, slots)
        return True

    def release_window(self, row: int, positions: torch.Tensor) -> None:
        """Let the row's slots at ``positions`` go (nothing reads them any more): a forward that
        has not run skips them."""
        positions = positions[positions >= self.held_from[row]]
        self.window_slots.release(self.window_table[row, positions])
        self._window.write(row, positions, 0)

    def trim(self, row: int, keep_from: int) -> None:
        """Release the row's window slots below position ``keep_from``."""
        if keep_from <= self.held_from[row]:
            return
        held = slice(self.held_from[row], keep_from)
        self.window_slots.release(self.window_table[row, held])
        self._window.write(row, held, 0)
        self.held_from[row] = keep_from

    def trim_to_forward(self, row: int, start: int) -> None:
        """Keep only what a forward from ``start`` reads: the window and one token before it."""
        self.trim(row, start - self.window - 1)

    def keep_only_what_forwards_read(self) -> bool:
        """Under window-slot pressure every row lets go of what no forward reads (all_committed rows
        fall back to what per_request keeps); whether that freed any slot.

        A row whose forward is launched keeps the window its next forward reads. A row whose
        forward is reserved but not launched keeps the window before that forward, the forward's
        own slots and those it shares with the snapshots planned in it; its other slots
        (all_committed's, which no one shares) go, and the forward skips their positions.
        """
        free_before = self.window_slots.free
        for row in range(self.request_rows):
            if not self.bound[row]:
                continue
            if row not in self.unlaunched:
                self.trim_to_forward(row, self.position[row])
                continue
            start, own_from = self.position[row] - self.last_step[row], self.position[row] - self.window - 1
            self.trim_to_forward(row, start)
            positions = torch.arange(max(start, self.held_from[row]), max(start, own_from))
            slots = self.window_table[row, positions]
            self.release_window(row, positions[(slots > 0) & (self.window_slots.refs[slots] == 1)])
        return self.window_slots.free > free_before

    def rewind(self, row: int, position: int) -> None:
        """The row's forward stopped being true after ``position`` (a speculative verify whose later drafts
        the target rejected): the window slots of the positions after it and the entry rows of the blocks
        only they completed go back, and the row continues from ``position``."""
        end = self.position[row]
        if position >= end:
            return
        if any(position // ratio < self.borrowed[ratio][row] for ratio in self.ratios):
            raise AssertionError(f"request row {row} rewound to {position}, into the prefix it borrows entries of")
        self.release_window(row, torch.arange(position, end))
        for ratio in self.ratios:
            keep, count = position // ratio, self.entry_count[ratio][row]
            if count > keep:
                self.entry_rows[ratio].release(self.entry_table[ratio][row, keep:count])
                self.write_entries(ratio, row, slice(keep, count), 0)
                self.entry_count[ratio][row] = keep
        self.position[row] = position
        self.last_step[row] -= end - position

    # --- reading ----------------------------------------------------------------------------

    def window_rows(self, row: int, first: int, last: int) -> torch.Tensor:
        return self.window_table[row, first:last]

    def entries(self, row: int, ratio: int, first: int, last: int) -> torch.Tensor:
        return self.entry_table[ratio][row, first:last]

    def counted_entries(self, row: int, ratio: int) -> torch.Tensor:
        """The row's entry rows it counts a reference on (all but those it borrows, :meth:`bind`)."""
        return self.entry_table[ratio][row, self.borrowed[ratio][row] : self.entry_count[ratio][row]]

    def window_suffix(self, row: int, position: int, limit: int) -> torch.Tensor:
        """The slots of the unbroken run of held positions ending at ``position`` (at most ``limit``)."""
        slots = self.window_table[row, max(position - limit, self.held_from[row], 0) : position]
        gaps = (slots == 0).nonzero()
        return slots[int(gaps[-1]) + 1 :].clone() if len(gaps) else slots.clone()

    # --- returning a row's rows -------------------------------------------------------------

    def free(self, row: int) -> None:
        """The row's request is gone: its window slots and entry rows go back (those it borrowed stay with
        whoever lent them)."""
        if not self.bound[row]:
            return
        held = slice(self.held_from[row], self.position[row])
        self.window_slots.release(self.window_table[row, held])
        self._window.write(row, held, 0)
        for ratio in self.ratios:
            self.entry_rows[ratio].release(self.counted_entries(row, ratio))
            self.write_entries(ratio, row, slice(0, self.entry_count[ratio][row]), 0)
            self.entry_count[ratio][row] = self.borrowed[ratio][row] = 0
        self.bound[row] = False
        self.unlaunched.discard(row)
        self.position[row] = self.held_from[row] = self.last_step[row] = 0

