"""The main job: build the tiny checkpoint, serve it, run a multi-turn agent program, measure its CPG, stop.

``dsv4 demo`` starts ``python -m sglang.launch_server`` with this plugin on the tiny
DeepSeek-V4 checkpoint and drives it with SGLang's own frontend language (``sgl.function``,
``sgl.gen``, ``fork``, ``RuntimeEndpoint``), printing each turn; then a short ``agentperf`` run
(under a minute) finds how many concurrent agents the server sustains and prints its table.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

from .agentperf.benchmark import Configuration, Settings, measure
from .agentperf.report import markdown_table
from .agentperf.slo import TIERS
from .agentperf.synthetic import synthesize
from .agentperf.trajectory import SCALES, ToolLatency
from .launch import ONE_TORCH_THREAD, running_server
from .tiny import build_checkpoint


def agent_program():
    import sglang as sgl

    @sgl.function
    def coding_agent(s, task: str):
        s += sgl.system("You are a coding agent. Answer with one shell command.")
        s += sgl.user(task)
        s += sgl.assistant(sgl.gen("first_command", max_tokens=16, temperature=0))
        s += sgl.user("Output: 2 files changed. What next?")
        s += sgl.assistant(sgl.gen("second_command", max_tokens=16, temperature=0))
        branches = s.fork(2)
        for branch, hint in zip(branches, ("Run the tests.", "Show the diff."), strict=True):
            branch += sgl.user(hint)
            branch += sgl.assistant(sgl.gen("command", max_tokens=12, temperature=0))
        s["branches"] = [branch["command"] for branch in branches]

    return coding_agent


def run_demo(task: str) -> None:
    import sglang as sgl

    with tempfile.TemporaryDirectory() as scratch:
        model = build_checkpoint(Path(scratch) / "tiny")
        print(f"built the tiny DeepSeek-V4 checkpoint in {model}")
        started = time.perf_counter()
        log_path = Path(scratch) / "server.log"
        with running_server(model, "--dtype", "float32", log_path=log_path, env=ONE_TORCH_THREAD) as url:
            print(f"server up at {url} after {time.perf_counter() - started:.1f}s")
            state = agent_program().run(task=task, backend=sgl.RuntimeEndpoint(url))
            print(f"turn 1  user: {task}\n        agent: {state['first_command']!r}")
            print(f"turn 2  user: Output: 2 files changed. What next?\n        agent: {state['second_command']!r}")
            for hint, command in zip(("Run the tests.", "Show the diff."), state["branches"], strict=True):
                print(f"fork    user: {hint}\n        agent: {command!r}")
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
