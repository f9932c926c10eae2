"""How many of the demo agent's tool-call attempts come back from the server as parsed ``tool_calls``.

    python benchmarks/demo_tool_calls.py [--checkpoint DIR] [--agents 6] [--seed 0]

Serves the checkpoint (default: the shipped tiny one) as ``dsv4 demo`` does (its flags: float32, the cache
report, ``--tool-call-parser deepseekv4 --reasoning-parser deepseek-v4``) and runs the demo's agent loop
(:func:`sglang_dsv4.demo.run_agent`: the OpenAI client, ``tools`` defined, no ``tool_choice``, greedy and
unconstrained decoding, ``max_tokens`` :data:`~sglang_dsv4.demo.MAX_TOKENS`) for ``--agents`` agents: the
first on the demo's own task (``dsv4 demo``'s default: its turns are the demo's), the others on distinct tasks
drawn with ``--seed`` from the rest of :data:`TASKS`; each for the demo's four turns: every turn is one tool-call attempt
(the bash tool is the only way a turn moves the task on). Counts the turns whose reply came back with parsed
``tool_calls`` (a call of the ``bash`` tool whose arguments are a JSON object with a ``command`` string), and
checks no reply's ``content`` holds a special token of the tokenizer. Writes every turn's ``content``,
``tool_calls`` and usage, and the counts, to ``benchmarks/results/demo_tool_calls.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from transformers import AutoTokenizer

from sglang_dsv4.demo import FREQUENCY_PENALTY, MAX_TOKENS, SERVER_ARGUMENTS, run_agent
from sglang_dsv4.launch import ONE_TORCH_THREAD, running_server
from sglang_dsv4.tiny import shipped_checkpoint

REPO = Path(__file__).resolve().parents[1]
TASKS = (
    "Fix the failing test in tests/test_cache.py.",
    "The CLI crashes on an empty config file: find the bug and fix it.",
    "Add a --verbose flag to scripts/run.py that prints each step.",
    "Find out why the test suite fails on Python 3.12 and fix it.",
    "Rename the function `load` to `load_config` everywhere in src/.",
    "Make `parse_date` in utils/dates.py accept ISO week dates, with a test.",
    "Remove the unused imports in src/app/ and check the tests still pass.",
    "The docs build warns about a missing reference in docs/index.rst; fix it.",
)


def parsed_bash_call(call: dict) -> bool:
    """A call of the bash tool with a JSON-object argument holding a ``command`` string."""
    try:
        arguments = json.loads(call["function"]["arguments"])
    except json.JSONDecodeError:
        return False
    is_command = isinstance(arguments, dict) and isinstance(arguments.get("command"), str)
    return call["function"]["name"] == "bash" and is_command


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, default=shipped_checkpoint())
    parser.add_argument("--agents", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--record", type=Path, default=REPO / "benchmarks" / "results" / "demo_tool_calls.json")
    args = parser.parse_args(argv)

    rng = random.Random(args.seed)
    tasks = [TASKS[0], *rng.sample(TASKS[1:], args.agents - 1)]
    special = AutoTokenizer.from_pretrained(args.checkpoint).all_special_tokens + ["｜DSML｜", "<think>", "</think>"]
    turns = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        log_path = Path(scratch) / "server.log"
        with running_server(args.checkpoint, *SERVER_ARGUMENTS, log_path=log_path, env=ONE_TORCH_THREAD) as url:
            for agent, task in enumerate(tasks):
                print(f"agent {agent}: {task}", flush=True)
                for number, report in enumerate(run_agent(url, task, show=False)):
                    parsed = bool(report.tool_calls) and all(parsed_bash_call(call) for call in report.tool_calls)
                    leaked = [token for token in special if token in (report.content or "")]
                    outcome = "parsed tool call" if parsed else "no tool call"
                    calls = json.dumps(report.tool_calls, ensure_ascii=False)
                    print(f"  turn {number + 1}: {outcome}; content {report.content!r}; tool_calls {calls}", flush=True)
                    turns.append({
                        "agent": agent, "task": task, "turn": number + 1, "parsed_tool_call": parsed,
                        "special_tokens_in_content": leaked, "content": report.content,
                        "reasoning_content": report.reasoning_content, "tool_calls": report.tool_calls,
                        "finish_reason": report.finish_reason, "prompt_tokens": report.prompt_tokens,
                        "cached_tokens": report.cached_tokens, "completion_tokens": report.completion_tokens,
                        "ttft_s": round(report.ttft_s, 3),
                    })  # fmt: skip
    parsed = sum(turn["parsed_tool_call"] for turn in turns)
    record = {
        "checkpoint": str(
            args.checkpoint.relative_to(REPO) if args.checkpoint.is_relative_to(REPO) else args.checkpoint
        ),
        "server_arguments": list(SERVER_ARGUMENTS),
        "decoding": {
            "temperature": 0, "frequency_penalty": FREQUENCY_PENALTY, "max_tokens": MAX_TOKENS,
            "tool_choice": None, "constrained": False,
        },  # fmt: skip
        "seed": args.seed,
        "agents": args.agents,
        "attempts": len(turns),
        "parsed_tool_calls": parsed,
        "turns_with_special_tokens_in_content": sum(bool(turn["special_tokens_in_content"]) for turn in turns),
        "wall_s": round(time.perf_counter() - started, 1),
        "turns": turns,
    }
    args.record.parent.mkdir(parents=True, exist_ok=True)
    args.record.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    print(f"{parsed} of {len(turns)} tool-call attempts came back as parsed tool_calls; wrote {args.record}")


if __name__ == "__main__":
    main()
