"""Which compressed entries the prefix cache owns: those of blocks whose last token it caches.

A block's entry (and indexer key) is persistent KV: it lives as long as the tree keeps the
token slot of the block's last token. The tree commits a request's blocks when it inserts
the request's tokens, adopts its own rows for blocks it already had, and lets the rows go
with the token slots it evicts; a request resumed from a checkpoint shares the entries of
its prefix from here.
"""

from __future__ import annotations

import torch

from ..memory_pool.layout import SLOT_ENTRY_DTYPE
from ..memory_pool.storage import V4PoolStorage


class EntryOwnership:
    def __init__(self, storage: V4PoolStorage):
        self.storage = storage
        # Per ratio, the entry row of each block whose last token's slot the tree holds (0: none).
        slots = storage.tables.num_tokens + 1
        self.of_slot = {r: torch.zeros(slots, dtype=SLOT_ENTRY_DTYPE) for r in storage.entry_rows}

    def commit(self, row: int, slots: torch.Tensor, first: int, last: int, offset: int = 0) -> None:
        """The tree now holds the token slots of row ``row``'s positions ``first .. last - 1`` (``slots``, from
        position ``offset`` on): each block ending there keeps its entry row for as long as the slot lives."""
        tables, entry_rows = self.storage.tables, self.storage.entry_rows
        for ratio, ends in self._block_ends(first, last).items():
            rows = tables.entry_table[ratio][row, (ends + 1) // ratio - 1]
            entry_rows[ratio].share(rows)
            self.of_slot[ratio][slots[ends - offset].long()] = rows

    def adopt(self, row: int, slots: torch.Tensor, first: int, last: int, offset: int = 0) -> None:
        """Row ``row`` computed its positions ``first .. last - 1`` again while the tree already held them (at
        ``slots``, from position ``offset`` on): its entries of blocks ending there become the tree's, its own
        go back."""
        tables, entry_rows = self.storage.tables, self.storage.entry_rows
        for ratio, ends in self._block_ends(first, last).items():
            blocks = (ends + 1) // ratio - 1
            ours = tables.entry_table[ratio][row, blocks]
            theirs = self.of_slot[ratio][slots[ends - offset].long()]
            entry_rows[ratio].share(theirs)
            entry_rows[ratio].release(ours)
            tables.write_entries(ratio, row, blocks, theirs)

    def release_slots(self, slots: torch.Tensor) -> None:
        """The tree let token slots go: the entry rows they kept go with them."""
        slots = slots.long()
        for ratio, of_slot in self.of_slot.items():
            self.storage.entry_rows[ratio].release(of_slot[slots])
            of_slot[slots] = 0

    def of_prefix(self, prefix_slots: torch.Tensor, position: int) -> dict[int, torch.Tensor]:
        """Per ratio, the entry rows of the complete blocks of a cached prefix of ``position`` tokens."""
        return self.of_positions(prefix_slots, 0, position)

    def of_positions(self, slots: torch.Tensor, first: int, last: int) -> dict[int, torch.Tensor]:
        """Per ratio, the entry rows of the blocks ending at positions ``first .. last - 1`` of a cached prefix whose
        token slots from position ``first`` on are ``slots`` (the blocks ``first // r`` up to ``last // r - 1``): the
        slots of the blocks' last tokens taken by a strided slice, ``(-first - 1) % r`` the first one's offset."""
        entries = {
            r: torch.index_select(of_slot, 0, slots[(-first - 1) % r : last - first : r])  # int32 or int64 slots
            for r, of_slot in self.of_slot.items()
        }
        if any(len(rows) and int(rows.min()) == 0 for rows in entries.values()):
            raise AssertionError("a cached prefix has a block without an entry row")
        return entries

    def _block_ends(self, first: int, last: int) -> dict[int, torch.Tensor]:
        """Per ratio, the positions in ``first .. last - 1`` that end a block."""
        starts = {r: first + (-first - 1) % r for r in self.of_slot}
        return {r: torch.arange(start, max(start, last), r) for r, start in starts.items()}
