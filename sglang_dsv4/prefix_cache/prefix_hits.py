"""Where a prefix-cache hit may land: one type per mode, chosen once when the mode is set.

``exact`` resumes at any checkpointed token position: checkpoints at every ``checkpoint`` call
SGLang makes (chunk, prompt and request ends), one token before the end of each prefill, and
every ``checkpoint_interval`` tokens inside forwards. ``aligned`` resumes only at multiples of
``ALIGNED_PAGE`` tokens, the whole pages upstream SGLang reuses (the baseline), and so
checkpoints only there.
"""

from __future__ import annotations

from typing import Protocol

ALIGNED_PAGE = 256  # upstream's V4 page: it reuses prefixes in multiples of it


class PrefixHits(Protocol):
    name: str
    # Whether SGLang's checkpoint calls (chunk, prompt and request ends) leave a checkpoint there,
    # and whether each prefill also leaves one a token before its end (where a retry resumes).
    checkpoints_at_calls: bool

    def resumable(self, position: int) -> bool:
        """Whether a request may resume from a checkpoint at ``position``."""

    def snapshot_interval(self, checkpoint_interval: int) -> int:
        """Tokens between the snapshots taken inside forwards."""


class Exact:
    name = "exact"
    checkpoints_at_calls = True

    def resumable(self, position: int) -> bool:
        return True

    def snapshot_interval(self, checkpoint_interval: int) -> int:
        return checkpoint_interval


class Aligned:
    name = "aligned"
    checkpoints_at_calls = False

    def resumable(self, position: int) -> bool:
        return position % ALIGNED_PAGE == 0

    def snapshot_interval(self, checkpoint_interval: int) -> int:
        return ALIGNED_PAGE


EXACT, ALIGNED = Exact(), Aligned()
PREFIX_HITS_OF = {mode.name: mode for mode in (EXACT, ALIGNED)}
