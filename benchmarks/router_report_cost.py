"""What our DP router (``dsv4_cache_aware``, issue 24) costs the controller per decision and per rank report.

No server: a :class:`~sglang_dsv4.routing.router.CacheAwareRouter` over two ranks, each rank's index first
filled with ``--sessions`` agent sessions of ``context`` tokens (random ids, every session its own), then
``--turns`` further turns of those sessions timed one call at a time, in the order the controller sees them:

- ``route``: the decision (scores the prompt on both ranks' indexes);
- ``sent``: the router notes the prompt it sent;
- ``made, prompt``: the rank reports the checkpoints its prefill made (every ``CHECKPOINT_INTERVAL`` tokens
  past the resumed prefix, a token before the prompt's end and at its end: one chunk, as a turn that
  resumes its previous prompt prefills only the new messages);
- ``made, request end``: the finished request's checkpoint, with its output's tokens;
- ``dropped``: the checkpoint a token before the prompt's end is superseded;
- ``released``: the request left the rank.

A turn adds ``OUTPUT_TOKENS`` of reply and ``NEW_MESSAGE_TOKENS`` of new messages to its session's history
(the recorded sessions' shape at full scale). The controller handles each call on its one thread between
dispatching requests, so the sum per turn is what a request's dispatch waits on at most.

    python benchmarks/router_report_cost.py [--contexts 8192 32768 131072] [--sessions 8] [--turns 64]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

from sglang_dsv4.routing.rank_reports import Dropped, Made, Released
from sglang_dsv4.routing.router import CacheAwareRouter

RANKS = 2
CHECKPOINT_INTERVAL = 1024  # the plugin's default (DSV4_CHECKPOINT_INTERVAL)
OUTPUT_TOKENS = 400
NEW_MESSAGE_TOKENS = 1200
VOCABULARY = 129_280
CALLS = ("route", "sent", "made, prompt", "made, request end", "dropped", "released")


class Sessions:
    """Each session's history (token ids) and the rank its last turn ran on; requests named in order."""

    def __init__(self, count: int, context: int, rng: random.Random):
        self.rng = rng
        self.histories = [self.tokens(context) for _ in range(count)]
        self.ranks: list[int | None] = [None] * count  # where each session's last turn ran
        self.requests = 0

    def tokens(self, count: int) -> list[int]:
        return [self.rng.randrange(VOCABULARY) for _ in range(count)]

    def loads(self) -> list[int]:
        """Each rank's load: its sessions' history tokens (a stand-in for SGLang's queued and running tokens)."""
        loads = [0] * RANKS
        for history, rank in zip(self.histories, self.ranks, strict=True):
            if rank is not None:
                loads[rank] += len(history)
        return loads

    def next_rid(self) -> str:
        self.requests += 1
        return f"request-{self.requests}"


def prompt_checkpoints(resumed: int, prompt: int) -> list[int]:
    """Checkpoints a prefill from ``resumed`` to ``prompt`` makes: interval points, a token before the end, the end."""
    first_interval = (resumed // CHECKPOINT_INTERVAL + 1) * CHECKPOINT_INTERVAL
    return sorted({*range(first_interval, prompt - 1, CHECKPOINT_INTERVAL), prompt - 1, prompt})


def timed(spent: dict[str, list[float]], call: str, function: Callable[[], object]) -> object:
    start = time.perf_counter_ns()
    result = function()
    spent[call].append((time.perf_counter_ns() - start) / 1e3)
    return result


def run_turn(router: CacheAwareRouter, sessions: Sessions, session: int, spent: dict[str, list[float]]) -> None:
    """One turn of ``session``: its new messages appended, routed, sent, prefilled, finished, released."""
    history = sessions.histories[session]
    resumed = len(history)
    prompt = history + sessions.tokens(NEW_MESSAGE_TOKENS)
    rid = sessions.next_rid()
    rank = timed(spent, "route", lambda: router.route(prompt, sessions.loads(), list(range(RANKS))))
    timed(spent, "sent", lambda: router.sent(rank, rid, prompt, time.time()))
    made = Made(rank, rid, tuple(prompt_checkpoints(resumed, len(prompt))), ())
    timed(spent, "made, prompt", lambda: router.apply(made))
    output = sessions.tokens(OUTPUT_TOKENS)
    finished = Made(rank, rid, (len(prompt) + OUTPUT_TOKENS - 1,), tuple(output[:-1]))
    timed(spent, "made, request end", lambda: router.apply(finished))
    timed(spent, "dropped", lambda: router.apply(Dropped(rank, rid, len(prompt) - 1)))
    timed(spent, "released", lambda: router.apply(Released(rank, rid)))
    sessions.histories[session], sessions.ranks[session] = prompt + output, rank


def measure(context: int, session_count: int, turns: int, seed: int) -> dict[str, list[float]]:
    """Per call, the microseconds each of ``turns`` timed turns took, after every session's first turn."""
    router, sessions = CacheAwareRouter(RANKS), Sessions(session_count, context, random.Random(seed))
    warm: dict[str, list[float]] = defaultdict(list)
    for session in range(session_count):
        run_turn(router, sessions, session, warm)
    spent: dict[str, list[float]] = defaultdict(list)
    for turn in range(turns):
        run_turn(router, sessions, turn % session_count, spent)
    indexed = [index.tokens for index in router.indexes]
    print(f"context {context:,}: index tokens per rank {indexed}, checkpoints {[len(i) for i in router.indexes]}")
    return spent


def table(results: dict[int, dict[str, list[float]]]) -> str:
    lines = [
        "| session history before the timed turns (tokens) | "
        + " | ".join(f"{call} (µs, median / p90)" for call in CALLS)
        + " | sum of medians (µs) |",
        "|---|" + "---|" * (len(CALLS) + 1),
    ]
    for context, spent in results.items():
        medians = [statistics.median(spent[call]) for call in CALLS]
        cells = [f"{m:,.0f} / {statistics.quantiles(spent[call], n=10)[-1]:,.0f}" for m, call in zip(medians, CALLS)]
        lines.append(f"| {context:,} | " + " | ".join(cells) + f" | {sum(medians):,.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--sessions", type=int, default=8, help="sessions over the two ranks")
    parser.add_argument("--turns", type=int, default=64, help="turns timed per context")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    results = {context: measure(context, args.sessions, args.turns, args.seed) for context in args.contexts}
    print(table(results))


if __name__ == "__main__":
    main()
