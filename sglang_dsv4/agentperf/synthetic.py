"""A seeded synthetic trace calibrated to AgentPerf's published shape.

Published (Artificial Analysis' AA-AgentPerf methodology): inputs from ~1K to ~131K tokens with a mean of
~27K, outputs with a median of ~150 tokens and a p95 of ~2K, sessions of up to ~200 turns, tool latency
between turns. The generator below reproduces that with lognormal pieces (``SyntheticShape``'s defaults;
with them 2,000 trajectories give a request-weighted mean input of ~27K, output median 150 and p95 2.0K,
inputs from 1K to 131K and up to 200 turns):

* every trajectory opens with a system prompt shared by all of them (a harness's) and its own task; the
  first input is lognormal (median 5,000 tokens), at least 1,024;
* each turn's reply is lognormal (median 150, sigma 1.575: p95 = 150 x e^(1.645 x 1.575) ~ 2K);
* each tool output is lognormal (median 100 tokens, sigma 1.2);
* a trajectory has a lognormal number of turns (median 18, sigma 1.0), at most 200, and ends before its
  input would pass 131,072 tokens.

Text is made of common English words that byte-level BPEs (DeepSeek's, GPT's, the tiny checkpoint's) each
encode as about one token, so a length in words is a length in tokens; the server reports the real counts.
Tool outputs are sent as ``user`` messages, which every chat template accepts.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from .trajectory import Message, ToolLatency, TraceScale, Trajectory, Turn

WORDS = (
    "the of to in is for on with as by at from this that it be are or an not function test error value model"
    " request server cache token prefix layer window block expert attention index state memory page tree turn"
    " agent tool call output input fix bug issue patch change run check return list string number config path"
    " line class data result item node count"
).split()


def words(rng: random.Random, count: int) -> str:
    """``count`` words (about ``count`` tokens) drawn from ``rng``."""
    return " ".join(rng.choices(WORDS, k=count))


@dataclass(frozen=True)
class SyntheticShape:
    """The generator's parameters, in tokens before scaling (see the module docstring)."""

    system_tokens: int = 1024
    first_input_median: float = 5000.0
    first_input_sigma: float = 0.6
    output_median: float = 150.0
    output_sigma: float = 1.575
    tool_output_median: float = 100.0
    tool_output_sigma: float = 1.2
    turns_median: float = 18.0
    turns_sigma: float = 1.0
    max_turns: int = 200
    max_context_tokens: int = 131072


def _lognormal(rng: random.Random, median: float, sigma: float) -> float:
    return median * math.exp(rng.gauss(0.0, sigma))


def synthesize(
    count: int, scale: TraceScale, tool_latency: ToolLatency, seed: int, shape: SyntheticShape = SyntheticShape()
) -> list[Trajectory]:
    """``count`` trajectories drawn from ``shape`` with ``seed``, scaled by ``scale``."""
    system = {
        "role": "system",
        "content": words(random.Random("agentperf system prompt"), _scaled(shape.system_tokens, scale)),
    }
    return [
        _trajectory(f"synthetic/{seed}/{index}", random.Random(f"{seed}/{index}"), system, scale, tool_latency, shape)
        for index in range(count)
    ]


def _scaled(tokens: float, scale: TraceScale) -> int:
    return max(1, round(tokens * scale.input_fraction))


def _trajectory(
    name: str, rng: random.Random, system: Message, scale: TraceScale, tool_latency: ToolLatency, shape: SyntheticShape
) -> Trajectory:
    """Turns until the planned count, or until the input (as recorded, or as scaled and sent) is too long."""
    planned_turns = min(shape.max_turns, max(1, round(_lognormal(rng, shape.turns_median, shape.turns_sigma))))
    first_input = round(_lognormal(rng, shape.first_input_median, shape.first_input_sigma))
    recorded_input = min(shape.max_context_tokens, max(shape.system_tokens + 1, first_input))
    task = words(rng, _scaled(recorded_input - shape.system_tokens, scale))
    new_messages: tuple[Message, ...] = (system, {"role": "user", "content": task})
    sent_input = sum(len(message["content"].split()) for message in new_messages)
    turns = []
    for _ in range(planned_turns):
        if recorded_input > shape.max_context_tokens or sent_input > scale.max_context_tokens:
            break
        recorded_output = max(1.0, _lognormal(rng, shape.output_median, shape.output_sigma))
        output = scale.output_tokens(recorded_output)
        reply = {"role": "assistant", "content": words(rng, output)}
        turns.append(Turn(new_messages, output, reply, tool_latency.draw(rng)))
        tool_output = max(1, round(_lognormal(rng, shape.tool_output_median, shape.tool_output_sigma)))
        new_messages = ({"role": "user", "content": words(rng, _scaled(tool_output, scale))},)
        recorded_input += round(recorded_output) + tool_output
        sent_input += output + _scaled(tool_output, scale)
    return Trajectory(name, tuple(turns))
