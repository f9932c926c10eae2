"""One trial: ``concurrency`` agents replaying trajectories against a server for a warm-up and a measurement window.

Agent ``i`` starts ``i * warmup_s / (2 * concurrency)`` seconds in (all have started halfway through the
warm-up), walks trajectories ``order[(i + k * concurrency) % n]`` for its ``k``-th one (a seeded order, so
agents take different trajectories), and begins its first trajectory at a seeded random turn, its history
rebuilt from the recorded replies, so the window sees agents at every depth of their sessions rather than
all at their first, short turns. Each turn sends the whole history, reads the streamed reply, appends it,
then waits the turn's tool latency. A failed turn ends the agent's trajectory: after the tool latency
it starts the next.

A turn is measured when it is sent inside the measurement window ``[warmup_s, warmup_s + measure_s)``:
turns sent during the warm-up (every agent's first, which prefills a whole history) never count. No turn
is sent after the window; those in flight finish (each bounded by ``request_timeout_s``). All times are
the event loop's clock, in seconds from the trial's start.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from .server import Server, ServerError, TokensArrived, Usage
from .trajectory import Message, Trajectory, Turn


@dataclass(frozen=True)
class TrialPlan:
    """The shape of one trial."""

    concurrency: int
    warmup_s: float
    measure_s: float
    request_timeout_s: float
    served_history: bool
    seed: int


@dataclass
class TurnRecord:
    """What one request did, on the trial's clock (``None`` times: that point was never reached)."""

    agent: int
    trajectory: str
    turn: int
    sent_at: float
    first_token_at: float | None
    last_token_at: float | None
    requested_tokens: int
    output_tokens: int
    prompt_tokens: int | None
    cached_tokens: int | None
    error: str | None
    measured: bool  # sent inside the measurement window

    @property
    def ttft_s(self) -> float:
        assert self.first_token_at is not None, "a completed turn has a first token"
        return self.first_token_at - self.sent_at

    @property
    def decode_s(self) -> float:
        assert self.first_token_at is not None and self.last_token_at is not None
        return self.last_token_at - self.first_token_at


class RequestBudget:
    """The requests a whole benchmark may still send."""

    def __init__(self, requests: int) -> None:
        self.remaining = requests

    def take(self) -> bool:
        if self.remaining <= 0:
            return False
        self.remaining -= 1
        return True


@dataclass
class TrialRecords:
    """Every turn of a trial; ``cut_short`` says why the trial could not run to its end, if it did not."""

    records: list[TurnRecord] = field(default_factory=list)
    cut_short: str | None = None


async def run_trial(
    server: Server, trajectories: list[Trajectory], plan: TrialPlan, budget: RequestBudget
) -> TrialRecords:
    """Run one trial to its end (the window's, then the last reply's)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    trial = TrialRecords()
    order = list(range(len(trajectories)))
    random.Random(plan.seed).shuffle(order)
    agents = [
        _Agent(index, server, [trajectories[i] for i in order], plan, budget, trial, lambda: loop.time() - start)
        for index in range(plan.concurrency)
    ]
    await asyncio.gather(*(agent.run() for agent in agents))
    return trial


class _Agent:
    def __init__(
        self,
        index: int,
        server: Server,
        trajectories: list[Trajectory],
        plan: TrialPlan,
        budget: RequestBudget,
        trial: TrialRecords,
        clock: Callable[[], float],
    ) -> None:
        self.index, self.server, self.trajectories, self.plan = index, server, trajectories, plan
        self.budget, self.trial, self.clock = budget, trial, clock
        self.rng = random.Random(f"{plan.seed}/{index}")
        self.window_end = plan.warmup_s + plan.measure_s

    async def run(self) -> None:
        await asyncio.sleep(self.index * self.plan.warmup_s / (2 * self.plan.concurrency))
        for k in itertools.count():
            trajectory = self.trajectories[(self.index + k * self.plan.concurrency) % len(self.trajectories)]
            first_turn = self._first_turn(trajectory) if k == 0 else 0
            if not await self._walk(trajectory, first_turn):
                return

    def _first_turn(self, trajectory: Trajectory) -> int:
        if any(turn.recorded_reply is None for turn in trajectory.turns):
            return 0
        return self.rng.randrange(len(trajectory.turns))

    async def _walk(self, trajectory: Trajectory, first_turn: int) -> bool:
        """Replay ``trajectory`` from ``first_turn``; ``False`` once the agent must stop sending."""
        history = _recorded_history(trajectory.turns[:first_turn])
        for number, turn in enumerate(trajectory.turns[first_turn:], start=first_turn):
            if self.clock() >= self.window_end:
                return False
            if not self.budget.take():
                self.trial.cut_short = "the benchmark's request limit was reached"
                return False
            history.extend(turn.new_messages)
            record, reply = await self._request(trajectory, number, turn, history)
            self.trial.records.append(record)
            await asyncio.sleep(turn.tool_latency_s)
            if record.error is not None:
                return True  # this trajectory is given up; the agent goes on with its next
            history.append(reply if self.plan.served_history or turn.recorded_reply is None else turn.recorded_reply)
        return True

    async def _request(
        self, trajectory: Trajectory, number: int, turn: Turn, history: list[Message]
    ) -> tuple[TurnRecord, Message]:
        sent_at = self.clock()
        record = TurnRecord(
            agent=self.index,
            trajectory=trajectory.name,
            turn=number,
            sent_at=sent_at,
            first_token_at=None,
            last_token_at=None,
            requested_tokens=turn.output_tokens,
            output_tokens=0,
            prompt_tokens=None,
            cached_tokens=None,
            error=None,
            measured=sent_at >= self.plan.warmup_s,
        )
        text: list[str] = []
        try:
            async with asyncio.timeout(self.plan.request_timeout_s):
                async for event in self.server.stream(list(history), turn.output_tokens, trajectory.tools):
                    self._note(record, event, text)
        except TimeoutError:
            record.error = f"no complete reply within {self.plan.request_timeout_s:g}s"
        except ServerError as error:
            record.error = str(error)
        if record.error is None and record.first_token_at is None:
            record.error = "the reply had no tokens"
        return record, {"role": "assistant", "content": "".join(text)}

    def _note(self, record: TurnRecord, event: TokensArrived | Usage, text: list[str]) -> None:
        if isinstance(event, TokensArrived):
            now = self.clock()
            if record.first_token_at is None:
                record.first_token_at = now
            record.last_token_at = now
            record.output_tokens = event.total
            text.append(event.text)
        else:
            record.output_tokens = event.completion_tokens
            record.prompt_tokens = event.prompt_tokens
            record.cached_tokens = event.cached_tokens


def _recorded_history(turns: tuple[Turn, ...]) -> list[Message]:
    history: list[Message] = []
    for turn in turns:
        assert turn.recorded_reply is not None, "a replay starts mid-trajectory only where every reply is recorded"
        history.extend(turn.new_messages)
        history.append(turn.recorded_reply)
    return history
