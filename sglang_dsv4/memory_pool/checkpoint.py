"""A checkpoint: a request's state at one token position, enough to resume there exactly."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass(eq=False)
class Checkpoint:
    """What a request resumed at ``position`` needs besides the persistent compressed entries,
    which the tree's token slots own (DESIGN.md, "The state of one request").

    ``window`` holds the window slots of the tokens just before ``position`` (the sliding
    window, or every token before it when there are fewer; more under ``all_committed``),
    shared by reference count with the request that made it and every request resumed
    from it; ``record`` is the row of its compressor-state record.
    """

    position: int
    window: torch.Tensor
    record: int
    last_used: float = field(default_factory=time.monotonic)
    # A request of its prefix resumed from a deeper checkpoint on its path: later turns resume there.
    superseded: bool = False

    def touch(self) -> None:
        self.last_used = time.monotonic()
