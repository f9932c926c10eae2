"""Which attention-DP rank a request goes to: the least prefill plus a penalty for the rank's load.

For a prompt of ``P`` tokens, rank ``r`` costs

    cost_r = (P - matched_r) + weight * load_r

where ``matched_r`` is the longest prefix of the prompt that ends at a checkpoint rank ``r`` is
believed to hold (it resumes there and prefills the rest), and ``load_r`` the rank's queued and
running tokens. The request goes to the rank of least cost; ties go to the least-loaded rank,
then the lowest; with an empty index every ``matched_r`` is 0 and the least-loaded rank wins.

``LOAD_WEIGHT``, the weight: prefill tokens one queued or running token is worth. A rank holding
``load_r - load_s`` more tokens than rank ``s`` keeps a session whose cached prefix there is longer
than ``weight * (load_r - load_s)`` tokens. At 0.25 a session leaves its cache only for a rank
with four times its cached prefix fewer tokens: a running token costs the steps it shares
with ours an attention read, a prefill token a pass through every layer, so a token of load is
worth a fraction of a token of prefill. Placing a request whose ``P`` tokens join the load of its
rank keeps every pair of ranks within ``(1 + 1/weight) * P_max`` tokens of each other
(:func:`load_spread_bound`): a rank is chosen over another only when its extra load is paid for
by at most ``P`` tokens of prefill saved.
"""

from __future__ import annotations

from collections.abc import Sequence

LOAD_WEIGHT = 0.25


def rank_costs(prompt_tokens: int, matched: Sequence[int], loads: Sequence[int], weight: float) -> list[float]:
    """``cost_r = (prompt_tokens - matched_r) + weight * load_r`` for each rank ``r``."""
    return [prompt_tokens - hit + weight * load for hit, load in zip(matched, loads, strict=True)]


def choose_rank(prompt_tokens: int, matched: Sequence[int], loads: Sequence[int], weight: float = LOAD_WEIGHT) -> int:
    """The rank of least cost; ties to the least-loaded rank, then the lowest."""
    costs = rank_costs(prompt_tokens, matched, loads, weight)
    return min(range(len(costs)), key=lambda rank: (costs[rank], loads[rank], rank))


def load_spread_bound(longest_prompt: int, weight: float = LOAD_WEIGHT) -> float:
    """How far apart (in tokens) any two ranks' loads stay when every request's prompt joins its rank's
    load: ``(1 + 1/weight) * longest_prompt``."""
    return (1 + 1 / weight) * longest_prompt
