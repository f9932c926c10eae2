"""The router's state in SGLang's DP controller: each rank's predicted checkpoints and what it routed.

:meth:`CacheAwareRouter.route` scores a prompt on every active rank (:mod:`.scoring`) against the
ranks' checkpoint indexes (:mod:`.checkpoint_index`) and the loads it is given, never asking a rank;
:meth:`CacheAwareRouter.record` adds the checkpoints a prompt leaves on the rank it went to (routed
here or pinned by ``routed_dp_rank``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .checkpoint_index import CheckpointIndex, predicted_positions
from .scoring import LOAD_WEIGHT, choose_rank

# Edge tokens each rank's index holds (a few hundred bytes a token for the trie's tuples and ints).
INDEX_TOKENS_PER_RANK = 1 << 20


@dataclass
class RankRouting:
    """What the router sent to one rank: requests, those it predicted a checkpoint for, and the prompt
    tokens it predicted uncached."""

    routed: int = 0
    predicted_hits: int = 0
    uncached_tokens: int = 0

    def report(self) -> dict[str, float]:
        routed = max(self.routed, 1)
        return {
            "routed": self.routed,
            "predicted_hit_share": self.predicted_hits / routed,
            "mean_uncached_prompt_tokens": self.uncached_tokens / routed,
        }


class CacheAwareRouter:
    def __init__(self, ranks: int, interval: int, weight: float = LOAD_WEIGHT, max_tokens: int = INDEX_TOKENS_PER_RANK):
        self.interval, self.weight = interval, weight
        self.indexes = [CheckpointIndex(max_tokens) for _ in range(ranks)]
        self.routing = [RankRouting() for _ in range(ranks)]

    def route(self, prompt: Sequence[int], loads: Sequence[int], active: Sequence[int]) -> int:
        """The active rank of least (uncached prompt tokens + weight x load); its checkpoints recorded."""
        matched = [self._resumable(rank, prompt) for rank in active]
        chosen = active[choose_rank(len(prompt), matched, [loads[rank] for rank in active], self.weight)]
        self.record(chosen, prompt, matched[active.index(chosen)])
        return chosen

    def record(self, rank: int, prompt: Sequence[int], matched: int | None = None) -> None:
        """``prompt`` went to ``rank`` (``matched``: its predicted cached prefix there, found if not given)."""
        if matched is None:
            matched = self._resumable(rank, prompt)
        routing = self.routing[rank]
        routing.routed += 1
        routing.predicted_hits += matched > 0
        routing.uncached_tokens += len(prompt) - matched
        self.indexes[rank].insert(prompt, predicted_positions(len(prompt), self.interval))

    def _resumable(self, rank: int, prompt: Sequence[int]) -> int:
        """The predicted cached prefix of ``prompt`` on ``rank``: at most all but its last token (SGLang
        always computes a prompt's last token)."""
        return min(self.indexes[rank].longest_checkpointed_prefix(prompt), max(len(prompt) - 1, 0))

    def report(self) -> list[dict[str, float]]:
        return [routing.report() for routing in self.routing]
