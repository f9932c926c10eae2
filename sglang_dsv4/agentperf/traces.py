"""Trace loaders: recorded agent sessions, SGLang's agentic-trace file, Mooncake JSONL, and the synthetic shape.

Every loader returns ``Trajectory`` objects scaled by a ``TraceScale`` and with tool latencies drawn
(seeded) from a ``ToolLatency``:

* ``sessions`` (JSONL, optionally gzipped; one ``{"id", "messages"}`` object a line, as in
  ``agentic_trajectories.jsonl.gz``): each assistant message is a turn whose prompt is every message
  before it; its recorded reply is that assistant message. The harness's final ``exit`` record is not a
  message and is dropped. Scaling keeps the first ``input_fraction`` of every message's text (tool-call
  arguments are shortened value by value, so they stay valid JSON); lengths are estimated at 4 characters
  a token, plus 8 tokens of chat-template framing a message.
* ``sglang`` (SGLang's ``agentic_trace`` file: ``{"metadata", "conversations": [[{"messages",
  "prompt_tokens"}, ...]]}``): each turn's ``messages`` are the new non-assistant messages; the reply is
  the server's own, of 220 tokens before scaling (SGLang's loader's default).
* ``mooncake`` (JSONL of ``timestamp``, ``input_length``, ``output_length``, ``hash_ids`` of 512-token
  blocks): requests whose blocks extend an earlier request's blocks continue its session (a turn); a
  block's text is a function of its hash, so sessions with the same leading blocks share a prompt prefix.
  A later turn sends the blocks it adds, less the previous reply's length (the history already holds the
  reply, as a filler of that length).
* ``synthetic``: ``synthetic.synthesize``.
"""

from __future__ import annotations

import gzip
import itertools
import json
import random
from pathlib import Path
from typing import Any

from .synthetic import words
from .trajectory import SESSION_TOOLS, Message, ToolLatency, TraceScale, Trajectory, Turn

CHARS_PER_TOKEN = 4
"""Estimate for DeepSeek-style BPEs on code and English, used where a trace gives text but no token count."""

TEMPLATE_TOKENS_PER_MESSAGE = 8
"""Role markers and tool-call framing a chat template adds to each message (DeepSeek's and the tiny one's)."""
SGLANG_TRACE_OUTPUT_TOKENS = 220
MOONCAKE_BLOCK_TOKENS = 512
MESSAGE_ROLES = ("system", "user", "assistant", "tool")


class TraceError(ValueError):
    """A trace file that cannot be read as the format it was named as."""


def load_sessions(path: Path, scale: TraceScale, tool_latency: ToolLatency, seed: int) -> list[Trajectory]:
    """Recorded sessions (``agentic_trajectories.jsonl.gz``'s format), one trajectory each."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as lines:
        rows = [json.loads(line) for line in lines if line.strip()]
    rng = random.Random(seed)
    trajectories = [_session(row, scale, tool_latency, rng) for row in rows]
    return _non_empty(trajectories, path)


def _session(row: dict[str, Any], scale: TraceScale, tool_latency: ToolLatency, rng: random.Random) -> Trajectory:
    pending: list[Message] = []
    turns = []
    sent_tokens = 0.0
    for message in row["messages"]:
        if message["role"] not in MESSAGE_ROLES:
            continue
        shortened = _shorten_message(message, scale)
        if message["role"] != "assistant":
            pending.append(shortened)
            continue
        sent_tokens += sum(_estimated_tokens(m) for m in pending)
        if sent_tokens > scale.max_context_tokens:
            break
        output = scale.output_tokens(_chars(message) / CHARS_PER_TOKEN)
        turns.append(Turn(tuple(pending), output, shortened, tool_latency.draw(rng)))
        sent_tokens += _estimated_tokens(shortened)
        pending = []
    return Trajectory(str(row.get("id", "session")), tuple(turns), SESSION_TOOLS)


def _estimated_tokens(message: Message) -> float:
    """Text at ``CHARS_PER_TOKEN``, plus the chat template's framing (which scaling does not shrink)."""
    return _chars(message) / CHARS_PER_TOKEN + TEMPLATE_TOKENS_PER_MESSAGE


def _chars(message: Message) -> int:
    calls = message.get("tool_calls") or []
    return len(message.get("content") or "") + sum(len(call["function"]["arguments"]) for call in calls)


def _shorten_message(message: Message, scale: TraceScale) -> Message:
    shortened = {**message, "content": scale.shorten(message.get("content") or "")}
    if message.get("tool_calls"):
        shortened["tool_calls"] = [_shorten_call(call, scale) for call in message["tool_calls"]]
    return shortened


def _shorten_call(call: dict[str, Any], scale: TraceScale) -> dict[str, Any]:
    try:
        arguments = json.loads(call["function"]["arguments"])
    except json.JSONDecodeError:
        shortened = scale.shorten(call["function"]["arguments"])
    else:
        shortened = json.dumps(_shorten_values(arguments, scale))
    return {**call, "function": {**call["function"], "arguments": shortened}}


def _shorten_values(value: Any, scale: TraceScale) -> Any:
    if isinstance(value, str):
        return scale.shorten(value)
    if isinstance(value, dict):
        return {key: _shorten_values(item, scale) for key, item in value.items()}
    if isinstance(value, list):
        return [_shorten_values(item, scale) for item in value]
    return value


def load_sglang_trace(path: Path, scale: TraceScale, tool_latency: ToolLatency, seed: int) -> list[Trajectory]:
    """SGLang's agentic-trace file (``sglang/benchmark/datasets/agentic_trace.py``): replies are the server's."""
    with open(path, encoding="utf-8") as file:
        document = json.load(file)
    conversations = document.get("conversations") if isinstance(document, dict) else None
    if not conversations:
        raise TraceError(f"{path}: no 'conversations' (an SGLang agentic trace is {{'metadata', 'conversations'}})")
    rng = random.Random(seed)
    output = scale.output_tokens(SGLANG_TRACE_OUTPUT_TOKENS)
    trajectories = []
    for index, conversation in enumerate(conversations):
        turns = []
        for turn in conversation:
            messages = [_shorten_message(m, scale) for m in turn.get("messages") or []]
            if not messages:
                continue
            if turn.get("prompt_tokens", 0) * scale.input_fraction > scale.max_context_tokens:
                break
            turns.append(Turn(tuple(messages), output, None, tool_latency.draw(rng)))
        trajectories.append(Trajectory(f"{path.stem}/{index}", tuple(turns)))
    return _non_empty(trajectories, path)


def load_mooncake(path: Path, scale: TraceScale, tool_latency: ToolLatency, seed: int) -> list[Trajectory]:
    """Mooncake's request trace, requests chained into sessions by their block hashes."""
    with open(path, encoding="utf-8") as lines:
        records = sorted((json.loads(line) for line in lines if line.strip()), key=lambda r: r["timestamp"])
    rng = random.Random(seed)
    trajectories = []
    for index, session in enumerate(_chain_sessions(records)):
        trajectories.append(
            Trajectory(f"{path.stem}/{index}", tuple(_mooncake_turns(session, scale, tool_latency, rng)))
        )
    return _non_empty(trajectories, path)


def _chain_sessions(records: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Group requests so each continues the session whose last request's blocks are its longest block prefix."""
    sessions: list[list[dict[str, Any]]] = []
    open_by_blocks: dict[int, int] = {}  # key of a session's last request's blocks -> session index
    for record in records:
        keys = list(itertools.accumulate(record["hash_ids"], lambda key, block: hash((key, block)), initial=0))
        session = next((open_by_blocks.pop(key) for key in reversed(keys[1:-1]) if key in open_by_blocks), None)
        if session is None:
            session = len(sessions)
            sessions.append([])
        sessions[session].append(record)
        open_by_blocks[keys[-1]] = session
    return sessions


def _mooncake_turns(
    session: list[dict[str, Any]], scale: TraceScale, tool_latency: ToolLatency, rng: random.Random
) -> list[Turn]:
    turns = []
    previous_blocks, previous_tokens = 0, 0
    for record in session:
        if record["input_length"] * scale.input_fraction > scale.max_context_tokens:
            break
        new_tokens = max(1, record["input_length"] - previous_tokens)
        text = _block_text(record["hash_ids"][previous_blocks:], round(new_tokens * scale.input_fraction), scale)
        output = scale.output_tokens(record["output_length"])
        reply = {"role": "assistant", "content": words(rng, output)}
        turns.append(Turn(({"role": "user", "content": text},), output, reply, tool_latency.draw(rng)))
        previous_blocks = len(record["hash_ids"])
        previous_tokens = record["input_length"] + record["output_length"]
    return turns


def _block_text(hash_ids: list[int], tokens: int, scale: TraceScale) -> str:
    """``tokens`` words: each block's own words (a function of its hash) in order, then filler if short."""
    block_words = max(1, round(MOONCAKE_BLOCK_TOKENS * scale.input_fraction))
    text = [words(random.Random(f"mooncake block {block}"), block_words) for block in hash_ids]
    pieces = " ".join(text).split()[: max(1, tokens)]
    return " ".join(pieces + ["the"] * (max(1, tokens) - len(pieces)))


def _non_empty(trajectories: list[Trajectory], path: Path) -> list[Trajectory]:
    kept = [trajectory for trajectory in trajectories if trajectory.turns]
    if not kept:
        raise TraceError(f"{path}: no trajectory has a turn that fits the scale's context")
    return kept
