"""Which rows of the compressed buffers hold each request's entries.

A request's ratio-``r`` entries (one per complete block of ``r`` tokens) live at rows
that this table hands out from a free list as blocks complete, so compressed entries
need no alignment between token slots and blocks and any page size works. SGLang
drives it as an auxiliary cache of its request-to-token pool: rows are reserved before
each forward up to the request's new length (``alloc_to_lengths``) and returned when
the request's row is freed (``free``), on every path SGLang frees requests.
"""

from __future__ import annotations

import torch


class BlockTables:
    def __init__(self, ratios: list[int], num_tokens: int, request_rows: int, max_context: int, device: str):
        self.ratios = sorted(set(ratios))
        self.num_tokens = num_tokens
        self.table = {
            r: torch.zeros(request_rows, max_context // r + 1, dtype=torch.int64, device=device) for r in self.ratios
        }
        self.request_rows = request_rows
        self.blocks = {r: [0] * request_rows for r in self.ratios}
        self.rows_per_ratio = {r: num_tokens // r + 1 for r in self.ratios}
        self.free_rows: dict[int, list[int]] = {}
        self.clear()

    @property
    def dense_capacity(self) -> int:
        """Tokens the scheduler may place: the token pool's, which the row counts cover."""
        return self.num_tokens

    def rows(self, ratio: int, request: int, first_block: int, last_block: int) -> torch.Tensor:
        return self.table[ratio][request, first_block:last_block]

    def alloc_to_lengths(self, *, req_pool_indices_cpu: torch.Tensor, target_seq_lens_cpu: torch.Tensor) -> None:
        for request, length in zip(req_pool_indices_cpu.tolist(), target_seq_lens_cpu.tolist(), strict=True):
            for ratio in self.ratios:
                have, need = self.blocks[ratio][request], int(length) // ratio
                if need > have:
                    free = self.free_rows[ratio]
                    if need - have > len(free):
                        raise RuntimeError(f"ratio-{ratio} entry rows exhausted ({self.rows_per_ratio[ratio]} rows)")
                    taken = [free.pop() for _ in range(need - have)]
                    self.table[ratio][request, have:need] = torch.tensor(taken, dtype=torch.int64)
                    self.blocks[ratio][request] = need

    def free(self, request: int) -> None:
        for ratio in self.ratios:
            count = self.blocks[ratio][request]
            self.free_rows[ratio].extend(self.table[ratio][request, :count].tolist())
            self.blocks[ratio][request] = 0

    def usage(self) -> dict[str, dict[str, int]]:
        """Per ratio: rows in all (row 0, padding, excluded) and rows free."""
        return {
            f"ratio_{r}": {"total": self.rows_per_ratio[r] - 1, "free": len(self.free_rows[r])} for r in self.ratios
        }

    def clear(self) -> None:
        # Row 0 is never handed out: unused table cells point at it.
        self.free_rows = {r: list(range(self.rows_per_ratio[r] - 1, 0, -1)) for r in self.ratios}
        for ratio in self.ratios:
            self.blocks[ratio] = [0] * len(self.blocks[ratio])

    def reset_allocator(self) -> None:
        self.clear()
