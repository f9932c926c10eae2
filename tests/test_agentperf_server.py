"""``agentperf`` against the real tiny V4 server: every turn completes, and what it reports is what it timed."""

from __future__ import annotations

import asyncio
import itertools
import time

import aiohttp
import pytest
import requests
from transformers import AutoTokenizer

from sglang_dsv4.agentperf.benchmark import Configuration, Settings, measure
from sglang_dsv4.agentperf.server import GenerateServer, TokensArrived, Usage
from sglang_dsv4.agentperf.slo import Slo, nearest_rank
from sglang_dsv4.agentperf.synthetic import synthesize
from sglang_dsv4.agentperf.trajectory import SESSION_TOOLS, ToolLatency, TraceScale

# Short turns (at most 16 tokens out, histories under 512 tokens) keep the run within seconds on a busy CPU.
SHORT_TURNS = TraceScale(input_fraction=1 / 64, output_fraction=1 / 8, max_output_tokens=16, max_context_tokens=512)
# Loose enough that a shared, loaded 2-core host still meets it with one agent.
LOOSE = Slo("loose", min_output_speed=1.0, max_ttft_s=30.0)


@pytest.fixture(scope="module")
def server(tiny_server):
    """The session's tiny server (a short run's few agents need no server of their own)."""
    return tiny_server


def short_run(max_concurrency: int, measure_s: float) -> Settings:
    return Settings(
        slo=LOOSE,
        warmup_s=2.0,
        measure_s=measure_s,
        request_timeout_s=30.0,
        trials=1,
        max_concurrency=max_concurrency,
        gpus=1,
        max_seconds=40.0,
        max_requests=1000,
        served_history=False,
        seed=0,
    )


def test_short_cpg_run_completes_every_turn_and_reports_what_it_timed(server):
    trajectories = synthesize(8, SHORT_TURNS, ToolLatency(median_s=0.2), seed=0)
    settings = short_run(max_concurrency=2, measure_s=12.0)
    started = time.monotonic()
    result = asyncio.run(measure([Configuration("tiny", server)], trajectories, settings, "synthetic, short turns"))
    elapsed = time.monotonic() - started
    (outcome,) = result.configurations
    assert outcome.cpg >= 1, [agent for trial in outcome.trials for agent in trial.agents]
    for trial in outcome.trials:
        assert trial.records and {record.agent for record in trial.records} == set(range(trial.concurrency))
        for record in trial.records:
            assert record.error is None, record
            assert record.output_tokens == record.requested_tokens
            assert record.prompt_tokens and record.prompt_tokens > 0
            assert 0 <= record.sent_at < record.first_token_at <= record.last_token_at <= elapsed
        for agent in trial.agents:
            measured = [r for r in trial.records if r.agent == agent.agent and r.measured]
            assert agent.turns == len(measured)
            if not measured:  # its one reply outlasted the window (a loaded host): the agent misses the SLO
                assert agent.ttft_quantile_s is None and agent.output_speed is None and not trial.passed
                continue
            assert agent.ttft_quantile_s == nearest_rank([r.first_token_at - r.sent_at for r in measured], 0.9)
            decoded = [r for r in measured if r.output_tokens >= 2]
            tokens_after_first = sum(r.output_tokens - 1 for r in decoded)
            assert agent.output_speed == pytest.approx(
                tokens_after_first / sum(r.last_token_at - r.first_token_at for r in decoded)
            )
    # The trials' clocks agree with the wall clock: they ran one after another inside the run.
    assert sum(max(r.last_token_at for r in trial.records) for trial in outcome.trials) <= elapsed


def test_generate_api_sends_the_history_as_the_chat_templates_token_ids(server, tiny_path):
    call = {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "pytest -x"}'}}
    messages = [
        {"role": "system", "content": "You fix bugs."},
        {"role": "user", "content": "tests fail: ÿ→é"},
        {"role": "assistant", "content": "Running them.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "1 failed"},
    ]
    chat = requests.post(
        f"{server}/v1/chat/completions",
        json={"messages": messages, "tools": list(SESSION_TOOLS), "max_tokens": 1},
        timeout=60,
    )
    assert chat.status_code == 200, chat.text

    async def one_turn() -> list:
        async with aiohttp.ClientSession() as session:
            generate = GenerateServer(server, session, AutoTokenizer.from_pretrained(tiny_path))
            return [event async for event in generate.stream(messages, 5, SESSION_TOOLS)]

    events = asyncio.run(one_turn())
    # The server's count so far, as it streams: one event a token, unless SGLang sends two steps' tokens
    # in one event (it does when the next step's output is ready before the last was sent).
    totals = [event.total for event in events if isinstance(event, TokensArrived)]
    assert totals == sorted(set(totals)) and totals[0] >= 1 and totals[-1] == 5
    (usage,) = [event for event in events if isinstance(event, Usage)]
    assert usage.completion_tokens == 5
    assert usage.prompt_tokens == chat.json()["usage"]["prompt_tokens"]  # the server's own chat template


def test_generate_api_run_completes_every_turn_and_resumes_each_history_from_the_cache(server, tiny_path):
    trajectories = synthesize(4, SHORT_TURNS, ToolLatency(median_s=0.2), seed=1)
    settings = short_run(max_concurrency=1, measure_s=8.0)
    configurations = [Configuration("tiny", server)]
    result = asyncio.run(measure(configurations, trajectories, settings, "short", "generate", None, str(tiny_path)))
    records = [record for trial in result.configurations[0].trials for record in trial.records]
    assert records and all(r.error is None and r.output_tokens == r.requested_tokens for r in records), records
    # A turn that follows its trajectory's previous turn on the same agent resumes it (an agent's first turn may
    # start mid-trajectory, with a history the server never saw).
    resumed = [
        turn for previous, turn in itertools.pairwise(sorted(records, key=lambda record: record.agent))
        if (turn.agent, turn.trajectory, turn.turn) == (previous.agent, previous.trajectory, previous.turn + 1)
    ]  # fmt: skip
    assert resumed and all(r.cached_tokens and r.cached_tokens > 0 for r in resumed), resumed
