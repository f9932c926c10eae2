"""Which checkpoint goes first when one must: the one worth least.

A checkpoint's worth is the prefill it saves a request that resumes from it: the tokens from the
nearest shallower checkpoint on its path (which would remain) to its own position, per byte it
holds (its window slots and its state record). Three things come before worth:

* a checkpoint *superseded* — a request of its prefix resumed from a deeper checkpoint on its
  path, so the session's later turns resume there or deeper — is worth nothing to that session
  and goes first;
* a session's deepest checkpoint (none below it on any path: its request end) is the last of its
  own to go, after every shallower one;
* checkpoints a request holds its lock on (about to resume, or just made) never go; they are not
  candidates here.

Ties go to the least recently used.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..memory_pool.checkpoint import Checkpoint


@dataclass(frozen=True)
class Standing:
    """Where a checkpoint stands when one must go; the smallest :meth:`order` goes first."""

    superseded: bool
    deepest: bool  # no checkpoint below it on any path
    saves_tokens: int  # from the nearest shallower checkpoint on its path (or the start) to its position
    held_bytes: int
    last_used: float

    @property
    def worth_per_byte(self) -> float:
        return self.saves_tokens / max(self.held_bytes, 1)

    def order(self) -> tuple[bool, bool, float, float]:
        return (not self.superseded, self.deepest, self.worth_per_byte, self.last_used)

    @property
    def reason(self) -> str:
        """Why it went, for the eviction counts."""
        return "superseded" if self.superseded else "deepest" if self.deepest else "shallower"


def standing(
    checkpoint: Checkpoint, shallower_position: int, deepest: bool, window_slot_bytes: int, record_bytes: int
) -> Standing:
    """The standing of ``checkpoint``, the nearest shallower checkpoint on its path being at ``shallower_position``."""
    return Standing(
        superseded=checkpoint.superseded,
        deepest=deepest,
        saves_tokens=checkpoint.position - shallower_position,
        held_bytes=len(checkpoint.window) * window_slot_bytes + record_bytes,
        last_used=checkpoint.last_used,
    )
