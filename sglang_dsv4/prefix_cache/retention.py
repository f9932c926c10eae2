"""Which checkpoint goes first when one must: the one worth least.

A checkpoint's worth is the prefill it saves a request that resumes from it: the tokens from the
nearest shallower checkpoint on its path (which would remain) to its own position, per byte it
holds (its window slots and its state record). Four things come before worth:

* a checkpoint *superseded* — a request of its prefix resumed from a deeper checkpoint on its
  path, and no other prefix branches off between them, so the session's later turns resume there
  or deeper and no other session's can resume from it — is worth nothing and goes first;
* a session's deepest checkpoint (none below it on any path: its request end) is the last of its
  own to go, after every shallower one; one a running request resumed from and has run past (its lock
  lies below) is not, though the request's own checkpoint is not made yet: that one replaces it;
* checkpoints a request holds its lock on (about to resume, or just made) never go; they are not
  candidates here;
* a snapshot a forward plans (a prompt's end, the token before it, an interval) or the window
  slots all_committed keeps is never had at the price of a session's deepest checkpoint: the
  forward's request leaves its own end below the snapshot, so the snapshot is worth less than a
  deepest one whatever its tokens. Skipped instead (the planner counts it). A request's end or a
  chunk's end may take a deepest one's place, by the order above.

Ties go to the least recently used.

Under ``per_request`` (which keeps what a later turn can use, and nothing else) a superseded
checkpoint is released at once, when the request that supersedes it takes its resume point; under
``all_committed`` (upstream's behaviour: every committed window slot stays until memory runs short)
it stays, ranked first.

Plain least-recently-used eviction (``lru``: no superseding, no worth), the behaviour before this
rule, is kept selectable on a running server as the baseline the rule is measured against
(``benchmarks/prefix_reuse.py --full-length``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..memory_pool.checkpoint import Checkpoint


@dataclass(frozen=True)
class Standing:
    """Where a checkpoint stands when one must go; the smallest :meth:`order` goes first."""

    superseded: bool
    deepest: bool  # no checkpoint, nor a running request, below it on any path
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


class ByWorth:
    """The rule above (the default)."""

    name = "worth"
    marks_superseded = True

    def order(self, standing: Standing) -> tuple:
        return standing.order()

    def may_go_for_snapshot(self, standing: Standing) -> bool:
        return not standing.deepest


class LeastRecentlyUsed:
    """The least recently used checkpoint goes first; nothing is superseded (the baseline)."""

    name = "lru"
    marks_superseded = False

    def order(self, standing: Standing) -> tuple:
        return (standing.last_used,)

    def may_go_for_snapshot(self, standing: Standing) -> bool:
        return True


BY_WORTH, LEAST_RECENTLY_USED = ByWorth(), LeastRecentlyUsed()
RETENTION_OF = {retention.name: retention for retention in (BY_WORTH, LEAST_RECENTLY_USED)}


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
