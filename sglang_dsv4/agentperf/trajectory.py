"""What every trace becomes: trajectories of turns, and how a trace is scaled to the model under test."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

Message = dict[str, Any]
"""One OpenAI-style chat message (``role``, ``content``, optional ``tool_calls`` / ``tool_call_id``)."""


@dataclass(frozen=True)
class Turn:
    """One request of an agent.

    Before the request the agent appends ``new_messages`` to its history (the task, tool outputs); it asks
    for exactly ``output_tokens`` tokens (``ignore_eos``); after the reply it appends ``recorded_reply`` (the
    trace's own assistant message) or, when that is ``None`` or the replay keeps served replies, the
    server's reply; then it waits ``tool_latency_s`` (the simulated tool) before its next turn.
    """

    new_messages: tuple[Message, ...]
    output_tokens: int
    recorded_reply: Message | None
    tool_latency_s: float


@dataclass(frozen=True)
class Trajectory:
    """One agent session, replayed turn by turn; every request defines ``tools`` (OpenAI tool definitions)."""

    name: str
    turns: tuple[Turn, ...]
    tools: tuple[dict[str, Any], ...] = ()


SESSION_TOOLS: tuple[dict[str, Any], ...] = (
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a bash command in the repository and return its exit code and output.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string", "description": "The command to run."}},
                "required": ["command"],
            },
        },
    },
)
"""The tool the recorded coding-agent sessions call (mini-swe-agent's shell), as an agent defines it."""


@dataclass(frozen=True)
class TraceScale:
    """How a trace is shrunk to fit the model under test.

    Inputs keep ``input_fraction`` of every message's text (or token count, for traces given in tokens),
    so long tool outputs stay longer than short ones; outputs ask for ``output_fraction`` of the recorded
    length, between 2 (so every turn has an output speed) and ``max_output_tokens``. A trajectory ends
    before the first turn whose (estimated) input would pass ``max_context_tokens``, as AgentPerf truncates
    trajectories to the context of the model under test.
    """

    input_fraction: float
    output_fraction: float
    max_output_tokens: int
    max_context_tokens: int

    def output_tokens(self, recorded_tokens: float) -> int:
        return max(2, min(self.max_output_tokens, round(recorded_tokens * self.output_fraction)))

    def shorten(self, text: str) -> str:
        """The first ``input_fraction`` of ``text`` (at least one character of a non-empty text)."""
        return text[: math.ceil(len(text) * self.input_fraction)]


SCALES: dict[str, TraceScale] = {
    # Traces as recorded: AgentPerf's regime (inputs up to 131K tokens, outputs to a few thousand).
    "gpu": TraceScale(input_fraction=1.0, output_fraction=1.0, max_output_tokens=16384, max_context_tokens=131072),
    # The tiny V4 on a CPU host: 1/64 of every input (the synthetic 27K-token mean becomes ~400), a quarter
    # of every output capped at 64 tokens (a turn decodes in about a second), histories cut at 1,024 tokens
    # (an unloaded prefill of ~0.3 s; the server re-prefills every turn until the prefix cache lands) so a
    # few agents fit the server's default 4,096-token pool.
    "cpu": TraceScale(input_fraction=1 / 64, output_fraction=1 / 4, max_output_tokens=64, max_context_tokens=1024),
}


@dataclass(frozen=True)
class ToolLatency:
    """Seconds a simulated tool runs between two turns: lognormal around ``median_s``, clipped to 10x either way.

    None of the supported traces records tool time, so every loader draws it from here, seeded, at load
    time: every configuration of a comparison then waits exactly the same.
    """

    median_s: float = 1.0
    sigma: float = 0.8

    def draw(self, rng: random.Random) -> float:
        factor = min(10.0, max(0.1, math.exp(rng.gauss(0.0, self.sigma))))
        return self.median_s * factor
