"""The main job: serve the shipped tiny V4, run a multi-turn coding agent on it, measure its CPG, stop.

``dsv4 demo`` starts ``python -m sglang.launch_server`` with this plugin on the trained tiny DeepSeek-V4
checkpoint, with SGLang's V4 parsers (``--tool-call-parser deepseekv4 --reasoning-parser deepseek-v4``) and
``--enable-cache-report``, and drives it as a coding agent does, through the OpenAI client's tool calling:
every turn one streamed ``/v1/chat/completions`` request carrying the whole history and the bash tool's
definition (``tools`` in), the server's parsed ``tool_calls`` out, and each call's result sent back as a
``tool`` message. Each turn prints the reply's ``content`` and ``tool_calls`` exactly as the API returned
them (the streamed deltas joined, as an OpenAI client joins them), the prompt's tokens, how many of them the
server resumed from its prefix cache and the time to the first token. Decoding is greedy with a frequency
penalty of 0.5, unconstrained (no ``tool_choice``, no grammar). When the model calls no tool, the agent runs
the turn's scripted command instead and says so; the tool outputs are canned (nothing is executed). Then a
short ``agentperf`` run (under a minute) finds how many concurrent agents the server sustains and prints its
table, with the share of prompt tokens served from the cache.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .agentperf.benchmark import Configuration, Settings, measure
from .agentperf.report import markdown_table
from .agentperf.slo import TIERS
from .agentperf.synthetic import synthesize
from .agentperf.trajectory import SCALES, SESSION_TOOLS, ToolLatency
from .launch import ONE_TORCH_THREAD, running_server
from .tiny import shipped_checkpoint

SYSTEM = "You are a helpful assistant that can interact with a computer shell to solve programming tasks."
SCRIPTED_TOOLS = (
    ("python -m pytest -q tests/test_cache.py",
     "F.\nFAILED tests/test_cache.py::test_evict - assert 3 == 4\n1 failed, 1 passed in 0.21s"),
    ("sed -n 1,12p src/cache.py",
     "class Cache:\n    def __init__(self, size):\n        self.size = size - 1\n        self.items = {}\n"),
    ("sed -i 's/size - 1/size/' src/cache.py && python -m pytest -q tests/test_cache.py", "..\n2 passed in 0.18s"),
    ("git diff", "-        self.size = size - 1\n+        self.size = size\n"),
)  # fmt: skip
"""``(command, output)`` of the simulated shell: the command when the model calls no tool, and what every call
prints (the turn's canned output, whatever the command)."""

TOOL_CALL_PARSER = "deepseekv4"
REASONING_PARSER = "deepseek-v4"
"""SGLang's parsers for V4's output (``--tool-call-parser``, ``--reasoning-parser``): they read the DSML tool calls
and the ``<think>`` block the shipped chat template writes (``tests/test_chat_template_parsers.py``)."""

SERVER_ARGUMENTS = (
    "--dtype", "float32", "--enable-cache-report",
    "--tool-call-parser", TOOL_CALL_PARSER, "--reasoning-parser", REASONING_PARSER,
)  # fmt: skip
"""The demo server's flags (besides the model): float32 on the CPU, the cache report, V4's parsers."""

FREQUENCY_PENALTY = 0.5
"""Greedy decoding, each logit lowered by half its token's count in the reply so far: plain greedy, the tiny
model's reply can repeat a phrase to the end; 1.0 also breaks the DSML a call repeats (``<｜DSML｜`` six times)."""

MAX_TOKENS = 256
"""Room for a reply and a whole DSML tool call (a call alone is ~40 tokens of the tiny tokenizer)."""


@dataclass(frozen=True)
class TurnReport:
    """One turn as the API returned it: the reply's ``content`` (``None`` when the server sent none) and its
    parsed ``tool_calls`` (OpenAI's shape: ``id``, ``type``, ``function.name``, ``function.arguments`` as a
    JSON string), with the server's usage and timing."""

    content: str | None
    tool_calls: list[dict[str, Any]]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    ttft_s: float
    reasoning_content: str | None = None
    scripted: list[str] = field(default_factory=list)
    """The commands the agent ran instead when the model called no tool (empty when it called one)."""


def client_for(url: str):
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key="none", timeout=300, max_retries=0)


def chat_turn(client, messages: list[dict[str, Any]], max_tokens: int = MAX_TOKENS) -> TurnReport:
    """One streamed greedy turn with the bash tool defined, no ``tool_choice``; the deltas joined."""
    started = time.perf_counter()
    first_token_s, content, reasoning, finish_reason, usage = None, None, None, None, None
    calls: dict[int, dict[str, Any]] = {}
    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        tools=list(SESSION_TOOLS),
        max_tokens=max_tokens,
        temperature=0,
        frequency_penalty=FREQUENCY_PENALTY,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            delta = choice.delta
            finish_reason = choice.finish_reason or finish_reason
            reasoning_piece = (delta.model_extra or {}).get("reasoning_content")
            if (delta.content or delta.tool_calls or reasoning_piece) and first_token_s is None:
                first_token_s = time.perf_counter() - started
            if delta.content is not None:
                content = (content or "") + delta.content
            if reasoning_piece is not None:
                reasoning = (reasoning or "") + reasoning_piece
            for piece in delta.tool_calls or []:
                empty = {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
                call = calls.setdefault(piece.index, empty)
                call["id"] = piece.id or call["id"]
                if piece.function is not None:
                    call["function"]["name"] += piece.function.name or ""
                    call["function"]["arguments"] += piece.function.arguments or ""
    details = usage.prompt_tokens_details if usage is not None else None
    return TurnReport(
        content=content,
        tool_calls=[calls[index] for index in sorted(calls)],
        finish_reason=finish_reason,
        prompt_tokens=usage.prompt_tokens if usage is not None else 0,
        completion_tokens=usage.completion_tokens if usage is not None else 0,
        cached_tokens=(details.cached_tokens or 0) if details is not None else 0,
        ttft_s=first_token_s if first_token_s is not None else time.perf_counter() - started,
        reasoning_content=reasoning,
    )


def run_agent(url: str, task: str, show: bool = True) -> list[TurnReport]:
    """The agent loop: a turn per scripted step; the model's tool calls (or, when it calls none, the step's
    scripted command) answered with the step's canned output as ``tool`` messages before the next turn."""
    client = client_for(url)
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]
    reports = []
    for index, (scripted_command, output) in enumerate(SCRIPTED_TOOLS):
        report = chat_turn(client, messages)
        calls = report.tool_calls
        if not calls:
            arguments = json.dumps({"command": scripted_command})
            function = {"name": "bash", "arguments": arguments}
            calls = [{"id": f"scripted_{index}", "type": "function", "function": function}]
            report = TurnReport(**{**report.__dict__, "scripted": [scripted_command]})
        reports.append(report)
        if show:
            print_turn(index + 1, report)
        messages.append({"role": "assistant", "content": report.content or "", "tool_calls": calls})
        messages += [{"role": "tool", "tool_call_id": call["id"], "content": output} for call in calls]
    return reports


def print_turn(number: int, report: TurnReport) -> None:
    """The turn's cache and timing, then ``content`` and ``tool_calls`` as the API returned them (``repr``: no
    character hidden or stripped)."""
    share = report.cached_tokens / report.prompt_tokens if report.prompt_tokens else 0.0
    print(
        f"turn {number}: {report.prompt_tokens} prompt tokens, {report.cached_tokens} resumed from the cache "
        f"({share:.0%}), TTFT {report.ttft_s * 1000:.0f} ms, {report.completion_tokens} tokens out "
        f"(finish: {report.finish_reason})"
    )
    if report.reasoning_content is not None:
        print(f"  reasoning_content: {report.reasoning_content!r}")
    print(f"  content: {report.content!r}")
    print(f"  tool_calls: {json.dumps(report.tool_calls, ensure_ascii=False)}")
    for command in report.scripted:
        print(f"  (the model called no tool: the agent runs a scripted command instead) bash: {command}")


def run_demo(task: str) -> None:
    model = shipped_checkpoint()
    print(f"serving the trained tiny DeepSeek-V4 checkpoint in {model}")
    with tempfile.TemporaryDirectory() as scratch:
        started = time.perf_counter()
        log_path = Path(scratch) / "server.log"
        with running_server(model, *SERVER_ARGUMENTS, log_path=log_path, env=ONE_TORCH_THREAD) as url:
            print(f"server up at {url} after {time.perf_counter() - started:.1f}s\n")
            print(f"task: {task}")
            run_agent(url, task)
            print("\nagentperf: concurrent agents this server sustains (one trial a level; `dsv4 agentperf` repeats")
            print("the boundary's trials and measures longer)")
            print(short_cpg_table(url))
        print("server stopped")


def short_cpg_table(url: str) -> str:
    """Under a minute of ``agentperf`` on ``url``: CPU-scale synthetic agents against the ``cpu-slo20`` tier."""
    settings = Settings(
        slo=TIERS["cpu-slo20"],
        warmup_s=2.0,
        measure_s=8.0,
        request_timeout_s=30.0,
        trials=1,
        max_concurrency=8,
        gpus=1,
        max_seconds=50.0,
        max_requests=5000,
        served_history=False,
        seed=0,
    )
    trajectories = synthesize(16, SCALES["cpu"], ToolLatency(), seed=0)
    trace = "synthetic, 16 trajectories (seed 0), cpu scale"
    return markdown_table(asyncio.run(measure([Configuration("tiny V4", url)], trajectories, settings, trace)))
