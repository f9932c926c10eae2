"""The shipped chat template and SGLang's own V4 parsers agree: what the template writes for an assistant turn
(its reply and DSML tool calls), read back by ``--reasoning-parser deepseek-v4`` then ``--tool-call-parser
deepseekv4`` as the server chains them, gives back the same content, tool names and arguments.

The oracle is SGLang's parser classes themselves (no server): the reasoning detector, then
``FunctionCallParser``, whole-text and streamed a token at a time as the server streams. The template is the
shipped tokenizer's (the one the server renders prompts with, and the one the model trained on).
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path
from typing import Any

import pytest
from sglang.srt.entrypoints.openai.protocol import Function, Tool
from sglang.srt.function_call.deepseekv4_detector import DeepSeekV4Detector
from sglang.srt.function_call.function_call_parser import FunctionCallParser
from sglang.srt.parser.reasoning_parser import DeepSeekV4Detector as DeepSeekV4ReasoningDetector
from sglang.srt.parser.reasoning_parser import ReasoningParser
from transformers import AutoTokenizer

from sglang_dsv4.agentperf.trajectory import SESSION_TOOLS
from sglang_dsv4.chat_template import ASSISTANT, END_THINK, THINK
from sglang_dsv4.demo import REASONING_PARSER, TOOL_CALL_PARSER
from sglang_dsv4.tiny import shipped_checkpoint

# The recorded sessions, where train_tiny.py reads them (beside the checkout), or DSV4_SESSIONS.
SESSIONS = Path(
    os.environ.get("DSV4_SESSIONS")
    or Path(__file__).resolve().parents[2] / "shared" / "data" / "agentic_trajectories.jsonl.gz"
)
EDIT_TOOL = {
    "type": "function",
    "function": {
        "name": "edit",
        "description": "Replace lines of a file.",
        "parameters": {
            "type": "object",
            "properties": {
                "path": {"type": "string"},
                "line": {"type": "integer"},
                "dry_run": {"type": "boolean"},
                "ranges": {"type": "array"},
                "options": {"type": "object"},
                "scale": {"type": "number"},
            },
        },
    },
}
TOOLS = [*SESSION_TOOLS, EDIT_TOOL]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(shipped_checkpoint())


def assistant_text(tokenizer, message: dict[str, Any], tools=TOOLS) -> str:
    """What the model writes for ``message``: the template's rendering of a conversation ending with it, past
    the generation prompt the server renders before it, up to its end-of-sentence."""
    history = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Fix it."}]
    prompt = tokenizer.apply_chat_template(history, tools=tools, add_generation_prompt=True, tokenize=False)
    rendered = tokenizer.apply_chat_template([*history, message], tools=tools, tokenize=False)
    assert prompt.endswith(ASSISTANT + END_THINK) and rendered.startswith(prompt)
    assert rendered.endswith(tokenizer.eos_token)  # generation stops there; the server never parses it
    return rendered[len(prompt) : -len(tokenizer.eos_token)]


def protocol_tools(tools) -> list[Tool]:
    return [Tool(type="function", function=Function(**tool["function"])) for tool in tools]


def parse_whole(text: str, tools) -> tuple[str, list[tuple[str, dict]]]:
    """The server's non-streamed path: the reasoning parser (thinking off, as the template renders), then the
    tool-call parser on the text it leaves."""
    reasoning, content = ReasoningParser(REASONING_PARSER, stream_reasoning=False).parse_non_stream(text)
    assert not reasoning, reasoning
    content, calls = FunctionCallParser(protocol_tools(tools), TOOL_CALL_PARSER).parse_non_stream(content)
    return content, [(call.name, json.loads(call.parameters)) for call in calls]


def parse_streamed(tokenizer, text: str, tools) -> tuple[str, list[tuple[str, dict]]]:
    """The streamed path, a token's text at a time; each call's streamed name and argument pieces joined as
    an OpenAI client joins the deltas."""
    reasoning_parser = ReasoningParser(REASONING_PARSER, stream_reasoning=True)
    tool_parser = FunctionCallParser(protocol_tools(tools), TOOL_CALL_PARSER)
    content, names, arguments = "", {}, {}
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    pieces = [tokenizer.decode(ids[: i + 1])[len(tokenizer.decode(ids[:i])) :] for i in range(len(ids))]
    for piece in pieces:
        reasoning, piece = reasoning_parser.parse_stream_chunk(piece)
        assert not reasoning, reasoning
        normal, calls = tool_parser.parse_stream_chunk(piece)
        content += normal
        for call in calls:
            if call.name:
                names[call.tool_index] = call.name
            arguments[call.tool_index] = arguments.get(call.tool_index, "") + (call.parameters or "")
    return content, [(names[index], json.loads(arguments[index])) for index in sorted(names)]


def call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"id": f"call_{name}", "type": "function", "function": {"name": name, "arguments": arguments}}


def test_the_demo_serves_with_sglangs_v4_parsers():
    assert FunctionCallParser.ToolCallParserEnum[TOOL_CALL_PARSER] is DeepSeekV4Detector
    assert type(ReasoningParser(REASONING_PARSER).detector) is DeepSeekV4ReasoningDetector


CASES = {
    "a reply then a bash call": {
        "content": "Let me look at the failing test first.",
        "tool_calls": [call("bash", {"command": 'grep -n "def test_evict" tests/*.py | head -5 && echo "<done>"'})],
    },
    "a call alone": {"content": "", "tool_calls": [call("bash", {"command": "cd /testbed && ls -la"})]},
    "two calls, every JSON type": {
        "content": "Two steps:\n\n1. look\n2. edit",
        "tool_calls": [
            call("bash", {"command": "sed -n 1,12p src/cache.py\ncat <<'EOF' > x.py\nprint(1)\nEOF"}),
            call(
                "edit",
                {
                    "path": "src/cache.py",
                    "line": 3,
                    "dry_run": False,
                    "ranges": [[1, 2], [5, 9]],
                    "options": {"indent": "    ", "nested": {"a": None}},
                    "scale": 0.5,
                },
            ),
        ],
    },
    "no call": {"content": "The test passes now: the cache keeps `size` items."},
}


@pytest.mark.parametrize("case", CASES)
def test_template_and_parsers_agree(tokenizer, case):
    message = {"role": "assistant", **CASES[case]}
    text = assistant_text(tokenizer, message)
    assert THINK not in text and END_THINK not in text  # the template writes no reasoning in a reply
    expected = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
    assert parse_whole(text, TOOLS) == (message["content"], expected)
    assert parse_streamed(tokenizer, text, TOOLS) == (message["content"], expected)


@pytest.mark.skipif(not SESSIONS.exists(), reason=f"{SESSIONS} is not here")
def test_every_recorded_tool_call_round_trips_through_template_and_parser(tokenizer):
    """Every tool call of the recorded sessions (the model's training text) as the template writes it parses
    back to its arguments; string values come back stripped (the V4 detector strips them)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from train_tiny import session_messages

    with gzip.open(SESSIONS, "rt", encoding="utf-8") as lines:
        rows = [json.loads(line) for line in lines if line.strip()]
    checked = 0
    for row in rows:
        for message in session_messages(row):
            if message["role"] != "assistant" or not message.get("tool_calls"):
                continue
            text = assistant_text(tokenizer, message, SESSION_TOOLS)
            expected = [
                (
                    c["function"]["name"],
                    {k: v.strip() if isinstance(v, str) else v for k, v in c["function"]["arguments"].items()},
                )
                for c in message["tool_calls"]
            ]
            assert parse_whole(text, SESSION_TOOLS) == (message["content"].removesuffix("\n\n"), expected), text
            checked += 1
    assert checked > 6000
