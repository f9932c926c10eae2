"""The main job: serve the shipped tiny V4, run a multi-turn coding agent on it, measure its CPG, stop.

``dsv4 demo`` starts ``python -m sglang.launch_server`` with this plugin on the trained tiny DeepSeek-V4
checkpoint (with ``--enable-cache-report``) and drives it as a coding agent does: every turn one streamed
``/v1/chat/completions`` request carrying the whole history and the bash tool's definition. Each turn
prints the reply, the prompt's tokens, how many of them the server resumed from its prefix cache and the
time to the first token. The agent's tool calls are the model's own when it writes one (a DSML block, parsed
here) and a scripted command otherwise; the tool outputs are canned (nothing is executed). Then a short
``agentperf`` run (under a minute) finds how many concurrent agents the server sustains and prints its table,
with the share of prompt tokens served from the cache.
"""

from __future__ import annotations

import asyncio
import json
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

from .agentperf.benchmark import Configuration, Settings, measure
from .agentperf.report import markdown_table
from .agentperf.slo import TIERS
from .agentperf.synthetic import synthesize
from .agentperf.trajectory import SCALES, SESSION_TOOLS, ToolLatency
from .chat_template import DSML
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
"""``(command, output)`` of the simulated shell: the command when the model writes none, and what every call
prints (the turn's canned output, whatever the command)."""

TOOL_CALL_PARSER = "deepseekv4"
REASONING_PARSER = "deepseek-v4"
"""SGLang's parsers for V4's output (``--tool-call-parser``, ``--reasoning-parser``): they read the DSML tool calls
and the ``<think>`` block the shipped chat template writes (``tests/test_chat_template_parsers.py``)."""

FREQUENCY_PENALTY = 1.0
"""Greedy decoding, each logit lowered by its token's count in the reply so far: the tiny model's plain greedy
reply repeats its likeliest token (a newline) to the end."""

_INVOKE = re.compile(
    rf'<{DSML}invoke name="bash">\s*<{DSML}parameter name="command" string="true">(.*?)</{DSML}parameter>', re.S
)


@dataclass(frozen=True)
class TurnReport:
    """One turn: the reply as decoded (special tokens kept), its text before any tool-call block, the command
    of the model's bash call if it wrote a well-formed one, and the server's usage and timing."""

    reply: str
    content: str
    command: str | None
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float


def chat_turn(url: str, messages: list[dict[str, Any]], max_tokens: int = 48) -> TurnReport:
    """One streamed greedy turn with the bash tool defined; the model's DSML tool call, if any, parsed."""
    payload = {
        "model": "tiny",
        "messages": messages,
        "tools": list(SESSION_TOOLS),
        "max_tokens": max_tokens,
        "temperature": 0,
        "frequency_penalty": FREQUENCY_PENALTY,
        "skip_special_tokens": False,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    first_token_s, text, usage = None, "", {}
    with requests.post(f"{url}/v1/chat/completions", json=payload, stream=True, timeout=120) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[len(b"data: ") :])
            for choice in event.get("choices") or []:
                content = (choice.get("delta") or {}).get("content") or ""
                if content and first_token_s is None:
                    first_token_s = time.perf_counter() - started
                text += content
            usage = event.get("usage") or usage
    details = usage.get("prompt_tokens_details") or {}
    call = _INVOKE.search(text)
    return TurnReport(
        reply=text.strip(),
        content=text.split(f"<{DSML}tool_calls>")[0].strip(),
        command=call.group(1).strip() if call else None,
        prompt_tokens=usage["prompt_tokens"],
        cached_tokens=details.get("cached_tokens") or 0,
        ttft_s=first_token_s if first_token_s is not None else time.perf_counter() - started,
    )


def run_agent(url: str, task: str) -> list[TurnReport]:
    """The agent loop: a turn per scripted tool step, each result appended before the next turn."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]
    reports = []
    for index, (scripted_command, output) in enumerate(SCRIPTED_TOOLS):
        report = chat_turn(url, messages)
        reports.append(report)
        print_turn(index + 1, report)
        call = {
            "id": f"call_{index}",
            "type": "function",
            "function": {"name": "bash", "arguments": json.dumps({"command": report.command or scripted_command})},
        }
        messages += [
            {"role": "assistant", "content": report.content, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": output},
        ]
    return reports


def print_turn(number: int, report: TurnReport) -> None:
    share = report.cached_tokens / report.prompt_tokens if report.prompt_tokens else 0.0
    print(
        f"turn {number}: {report.prompt_tokens} prompt tokens, {report.cached_tokens} resumed from the cache "
        f"({share:.0%}), TTFT {report.ttft_s * 1000:.0f} ms"
    )
    print(f"  agent: {report.reply!r}")
    source = "the model's call" if report.command else "scripted"
    print(f"  bash ({source}): {report.command or '(none written: the scripted command runs)'}")


def run_demo(task: str) -> None:
    model = shipped_checkpoint()
    print(f"serving the trained tiny DeepSeek-V4 checkpoint in {model}")
    with tempfile.TemporaryDirectory() as scratch:
        started = time.perf_counter()
        log_path = Path(scratch) / "server.log"
        arguments = ("--dtype", "float32", "--enable-cache-report")
        with running_server(model, *arguments, log_path=log_path, env=ONE_TORCH_THREAD) as url:
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
