"""The router's state in SGLang's DP controller: what each rank reported it holds, what it was sent.

:meth:`CacheAwareRouter.route` scores a prompt on every active rank (:mod:`.scoring`) against the
ranks' checkpoint indexes (:mod:`.checkpoint_index`) and their loads, never asking a rank;
:meth:`CacheAwareRouter.sent` notes a request sent to a rank (routed here or pinned by
``routed_dp_rank``), and :meth:`CacheAwareRouter.apply` what a rank reported (:mod:`.rank_reports`).

A checkpoint enters a rank's index when the rank reports making it, not when its request is sent: a
prompt routed while an identical one is still queued on a rank finds nothing there yet (the two prefill
side by side), so back-to-back requests spread by load (SGLang's start-up warmup sends one identical
prompt per rank at once).

A rank's load is its last published figure (SGLang's load snapshot: queued and running tokens) plus the
prompt tokens sent to it since that figure was taken (:meth:`CacheAwareRouter.loads`): SGLang refreshes
its figures every 20 ms and a fresh figure does not yet count a request still on its way to the rank.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from .checkpoint_index import CheckpointIndex
from .rank_reports import Dropped, Flushed, Made, RankReport, Released
from .scoring import LOAD_WEIGHT, choose_rank

# Edge tokens each rank's index holds (a few hundred bytes a token for the trie's tuples and ints).
INDEX_TOKENS_PER_RANK = 1 << 20
# Prompt tokens (int32) of requests sent and not yet reported released, 256 MiB (a request SGLang refuses
# before its rank's tree sees it is never reported released; past the bound the oldest prompts go first).
PROMPT_TOKENS_KEPT = 1 << 26


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
    def __init__(
        self,
        ranks: int,
        weight: float = LOAD_WEIGHT,
        max_tokens: int = INDEX_TOKENS_PER_RANK,
        prompt_tokens_kept: int = PROMPT_TOKENS_KEPT,
    ):
        self.weight = weight
        self.indexes = [CheckpointIndex(max_tokens) for _ in range(ranks)]
        self.routing = [RankRouting() for _ in range(ranks)]
        self._prompts: OrderedDict[str, array] = OrderedDict()  # rid -> prompt, while on its rank
        self._prompt_tokens, self._prompt_tokens_kept = 0, prompt_tokens_kept
        self._made = [{} for _ in range(ranks)]  # (rid, position) -> its index node, per rank
        self._sent_since = [deque() for _ in range(ranks)]  # (when, prompt tokens) per rank

    def route(self, prompt: Sequence[int], loads: Sequence[float], active: Sequence[int]) -> int:
        """The active rank of least (uncached prompt tokens + weight x load)."""
        matched = [self._resumable(rank, prompt) for rank in active]
        return active[choose_rank(len(prompt), matched, [loads[rank] for rank in active], self.weight)]

    def sent(self, rank: int, rid: str, prompt: Sequence[int], when: float) -> None:
        """``prompt`` (request ``rid``) went to ``rank`` at time ``when``."""
        matched = self._resumable(rank, prompt)
        routing = self.routing[rank]
        routing.routed += 1
        routing.predicted_hits += matched > 0
        routing.uncached_tokens += len(prompt) - matched
        self._keep_prompt(rid, prompt)
        self._sent_since[rank].append((when, len(prompt)))

    def _keep_prompt(self, rid: str, prompt: Sequence[int]) -> None:
        self._forget_prompt(rid)
        self._prompts[rid] = array("i", prompt)
        self._prompt_tokens += len(prompt)
        while self._prompt_tokens > self._prompt_tokens_kept:
            self._forget_prompt(next(iter(self._prompts)))

    def _forget_prompt(self, rid: str) -> None:
        self._prompt_tokens -= len(self._prompts.pop(rid, ()))

    def loads(self, figures: Sequence[int], taken_at: Sequence[float]) -> list[int]:
        """Each rank's load: its last figure (``figures[r]``, taken at ``taken_at[r]``) plus the prompt tokens
        sent to it since."""
        loads = []
        for rank, (figure, taken) in enumerate(zip(figures, taken_at, strict=True)):
            since = self._sent_since[rank]
            while since and since[0][0] <= taken:
                since.popleft()
            loads.append(figure + sum(tokens for _, tokens in since))
        return loads

    def apply(self, report: RankReport) -> None:
        """A rank's report: checkpoints made or dropped, a request gone, the tree flushed."""
        match report:
            case Made(rank, rid, positions, past_prompt) if rid in self._prompts:
                nodes = self.indexes[rank].insert(self._prompts[rid] + array("i", past_prompt), positions)
                self._made[rank].update(((rid, p), node) for p, node in zip(positions, nodes, strict=True))
            case Dropped(rank, rid, position) if (rid, position) in self._made[rank]:
                self.indexes[rank].drop(self._made[rank].pop((rid, position)))
            case Released(_, rid):
                self._forget_prompt(rid)
            case Flushed(rank):
                self.indexes[rank] = CheckpointIndex(self.indexes[rank].max_tokens)
                self._made[rank].clear()

    def _resumable(self, rank: int, prompt: Sequence[int]) -> int:
        """The predicted cached prefix of ``prompt`` on ``rank``: at most all but its last token (SGLang
        always computes a prompt's last token)."""
        return min(self.indexes[rank].longest_checkpointed_prefix(prompt), max(len(prompt) - 1, 0))

    def report(self) -> list[dict[str, float]]:
        return [routing.report() for routing in self.routing]
