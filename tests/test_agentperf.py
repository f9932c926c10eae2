"""The AgentPerf harness's own arithmetic, against an in-process fake server on a fake clock.

The fake clock is an event loop whose time jumps to the next timer whenever nothing is ready, so a trial
of minutes runs in milliseconds and every timestamp is exact: the tests check what the harness computes
from the stream (TTFT, output speed, windows, the search, the limits), not how fast anything is.
"""

from __future__ import annotations

import asyncio
import gzip
import io
import json
import selectors
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from sglang_dsv4.agentperf import command
from sglang_dsv4.agentperf.benchmark import Configuration, Settings, measure, run_benchmark
from sglang_dsv4.agentperf.progress import Progress
from sglang_dsv4.agentperf.replay import TurnRecord
from sglang_dsv4.agentperf.report import markdown_table, write_all
from sglang_dsv4.agentperf.search import CpgSearch
from sglang_dsv4.agentperf.server import ServerError, TokensArrived, Usage, parse_sse_line, require_loopback
from sglang_dsv4.agentperf.slo import Slo, agent_metrics, nearest_rank
from sglang_dsv4.agentperf.synthetic import synthesize
from sglang_dsv4.agentperf.traces import load_mooncake, load_sessions, load_sglang_trace
from sglang_dsv4.agentperf.trajectory import SCALES, ToolLatency, TraceScale, Trajectory, Turn
from sglang_dsv4.launch import free_port
from sglang_dsv4.prefix_cache import MODE_CODES


class _JumpingSelector(selectors.DefaultSelector):
    """Polls for I/O without waiting; where the loop would wait for a timer, moves the clock to it instead."""

    loop: FakeClockLoop

    def select(self, timeout=None):
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:
            raise RuntimeError("nothing scheduled: the fake clock would wait forever")
        self.loop.now += timeout
        return []


class FakeClockLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        selector = _JumpingSelector()
        super().__init__(selector)
        selector.loop = self
        self.now = 0.0

    def time(self) -> float:
        return self.now


def on_fake_clock(coroutine):
    with asyncio.Runner(loop_factory=FakeClockLoop) as runner:
        return runner.run(coroutine)


class FakeServer:
    """Streams each reply's tokens: the first after ``ttft_s`` plus ``prefill_s_per_char`` of history, the rest
    ``open streams / capacity`` seconds apart (``capacity`` tok/s shared by the streams open now)."""

    def __init__(
        self, capacity: float = 110.0, ttft_s: float = 0.2, prefill_s_per_char: float = 0.0, stall: bool = False
    ) -> None:
        self.url = "fake"
        self.capacity, self.ttft_s, self.prefill_s_per_char, self.stall = capacity, ttft_s, prefill_s_per_char, stall
        self.open = 0
        self.requests = 0
        self.applied: list[dict] = []
        self.error: str | None = None

    async def stream(self, messages, output_tokens, tools) -> AsyncIterator[TokensArrived | Usage]:
        self.requests += 1
        if self.error:
            raise ServerError(self.error)
        chars = sum(len(message["content"]) for message in messages)
        self.open += 1
        try:
            await asyncio.sleep(self.ttft_s + chars * self.prefill_s_per_char)
            if self.stall:
                await asyncio.Event().wait()
            for token in range(1, output_tokens + 1):
                if token > 1:
                    await asyncio.sleep(self.open / self.capacity)
                yield TokensArrived(token, "x")
            yield Usage(output_tokens, chars, 0)
        finally:
            self.open -= 1

    async def apply(self, server_args):
        self.applied.append(dict(server_args))
        self.capacity = server_args["capacity"]
        return {"capacity": self.capacity}


def flat_trajectory(name: str, turns: int = 400, output_tokens: int = 11, tool_latency_s: float = 0.0) -> Trajectory:
    turn = Turn(
        ({"role": "user", "content": "x" * 100},), output_tokens, {"role": "assistant", "content": "ok"}, tool_latency_s
    )
    return Trajectory(name, (turn,) * turns)


def settings(**overrides) -> Settings:
    values = dict(
        slo=Slo("test", min_output_speed=20.0, max_ttft_s=2.0),
        warmup_s=10.0,
        measure_s=30.0,
        request_timeout_s=20.0,
        trials=3,
        max_concurrency=64,
        gpus=1,
        max_seconds=10_000.0,
        max_requests=1_000_000,
        served_history=False,
        seed=0,
    )
    return Settings(**{**values, **overrides})


def benchmark(servers, run_settings, configurations=None, trajectories=None):
    configurations = configurations or [Configuration("fake", "fake")]
    trajectories = trajectories or [flat_trajectory(f"t{i}") for i in range(8)]
    progress = Progress(run_settings.max_seconds, stream=io.StringIO())
    return on_fake_clock(run_benchmark(configurations, servers, trajectories, run_settings, "fake trace", progress))


# --- the arithmetic of one trial -------------------------------------------------------------------------


def test_one_agent_ttft_and_speed_are_read_exactly_from_the_stream():
    server = FakeServer(capacity=25.0, ttft_s=0.5, prefill_s_per_char=0.001)
    trajectory = Trajectory(
        "one", (Turn(({"role": "user", "content": "x" * 100},), 11, {"role": "assistant", "content": "ok"}, 1.0),) * 50
    )
    result = benchmark([server], settings(max_concurrency=1, trials=1), trajectories=[trajectory])
    trial = result.configurations[0].trials[0]
    records = trial.records
    assert all(record.error is None and record.output_tokens == 11 for record in records)
    for record in records:
        # 0.5 s + 1 ms per character of the history it was sent; 10 more tokens at 25 tok/s.
        assert record.decode_s == pytest.approx(0.4)
        assert record.ttft_s == pytest.approx(0.5 + 0.001 * record.prompt_tokens)
    # Turns are back to back: reply, 1 s of tool, next turn.
    for earlier, later in zip(records, records[1:], strict=False):
        assert later.sent_at == pytest.approx(earlier.last_token_at + 1.0)
    assert [r.measured for r in records] == [r.sent_at >= 10.0 for r in records]
    assert max(r.sent_at for r in records) < 40.0
    (agent,) = trial.agents
    assert agent.output_speed == pytest.approx(25.0)
    assert agent.ttft_quantile_s == nearest_rank([r.ttft_s for r in records if r.measured], 0.9)


def test_agent_metrics_use_nearest_rank_quantiles_and_token_weighted_speed():
    def record(agent, sent, ttft, decode, tokens, error=None, measured=True):
        first = None if error else sent + ttft
        return TurnRecord(
            agent, "t", 0, sent, first, None if error else first + decode, tokens, tokens, None, None, error, measured
        )

    records = [record(0, 10.0 + i, ttft=0.1 * (i + 1), decode=1.0, tokens=11) for i in range(10)]
    records.append(record(0, 30.0, ttft=0.1, decode=3.0, tokens=61))  # 60 tokens in 3 s weigh more than 10 in 1 s
    records.append(record(0, 1.0, ttft=50.0, decode=100.0, tokens=2, measured=False))  # warm-up: ignored
    records.append(record(1, 12.0, ttft=0.0, decode=0.0, tokens=0, error="HTTP 500"))
    zero, one, two = agent_metrics(records, concurrency=3, ttft_quantile=0.9)
    assert zero.turns == 11 and zero.errors == 0
    assert zero.ttft_quantile_s == pytest.approx(0.9)  # 10th of 11 sorted TTFTs: ceil(0.9 * 11) = 10
    assert zero.output_speed == pytest.approx((10 * 10 + 60) / (10 * 1.0 + 3.0))
    slo = Slo("t", min_output_speed=5.0, max_ttft_s=0.85)
    assert zero.failures(slo) == ["TTFT p90 0.90s > 0.85s"]
    assert one.errors == 1 and one.failures(slo) == ["1 failed turns"]
    assert two.turns == 0 and two.failures(slo) == ["no turn sent in the measurement window"]
    assert nearest_rank([3.0, 1.0, 2.0], 0.5) == 2.0 and nearest_rank([5.0], 0.9) == 5.0


# --- the search ------------------------------------------------------------------------------------------


def drive(search: CpgSearch, verdict) -> tuple[int, list[int]]:
    steps, tried = search.steps(), []
    try:
        concurrency = next(steps)
        while True:
            tried.append(concurrency)
            concurrency = steps.send(verdict(concurrency, len(tried)))
    except StopIteration as done:
        return done.value, tried


def test_search_doubles_bisects_and_repeats_only_the_boundary():
    cpg, tried = drive(CpgSearch(max_concurrency=64, trials=3), lambda c, _: c <= 5)
    assert cpg == 5
    assert tried == [1, 2, 4, 8, 6, 5, 5, 6]  # 5 and 6 each confirmed by a majority of 3 (2 agreeing)


def test_search_outvotes_one_noisy_trial_at_the_boundary():
    # The first trial at 6 passes by luck; its repeats fail, so the majority says 6 fails.
    cpg, tried = drive(CpgSearch(max_concurrency=64, trials=3), lambda c, n: c <= 5 or (c == 6 and n == 5))
    assert cpg == 5
    assert tried.count(6) == 3
    # A boundary that fails its confirmation sends the search back down.
    cpg, tried = drive(CpgSearch(max_concurrency=64, trials=3), lambda c, n: c <= 4 or (c == 5 and n == 6))
    assert cpg == 4


def test_a_search_cut_short_reports_only_levels_whose_trials_mostly_passed():
    search = CpgSearch(max_concurrency=64, trials=3)
    steps = search.steps()
    assert next(steps) == 1
    for verdict in (True, True, True, True, False, True):  # 1, 2, 4, 8 pass, 16 fails, 12 passes once
        steps.send(verdict)
    assert search.passing == 12 and search.outcomes[12] == [True]
    assert search.lower_bound() == 12
    assert steps.send(False) == 13  # 14 fails
    assert steps.send(False) == 12  # 13 fails; 12 is being confirmed
    steps.send(False)  # its trials are tied: one pass, one fail
    assert search.outcomes[12] == [True, False] and search.lower_bound() == 8


def test_search_stops_at_its_maximum_and_at_zero():
    assert drive(CpgSearch(max_concurrency=6, trials=1), lambda c, _: True) == (6, [1, 2, 4, 6])
    assert drive(CpgSearch(max_concurrency=6, trials=3), lambda c, _: False) == (0, [1, 1])


def test_cpg_of_a_capacity_bound_server_is_where_the_per_agent_speed_crosses_the_slo():
    # 110 tok/s shared: 22 tok/s an agent at 5 agents, 18.3 at 6; the SLO asks 20.
    server = FakeServer(capacity=110.0)
    result = benchmark([server], settings(gpus=2))
    (outcome,) = result.configurations
    assert outcome.complete and outcome.cpg_concurrency == 5 and outcome.cpg == 2.5
    by_level = {}
    for trial in outcome.trials:
        by_level.setdefault(trial.concurrency, []).append(trial)
        speeds = [agent.output_speed for agent in trial.agents]
        assert min(speeds) == pytest.approx(110.0 / trial.concurrency, rel=0.02)
    assert sorted(by_level) == [1, 2, 4, 5, 6, 8]
    assert len(by_level[5]) == 2 and len(by_level[6]) == 2
    table = markdown_table(result)
    assert "| fake | 2.5 | 1.00 | 1: 1/1, 2: 1/1, 4: 1/1, 5: 2/2, 6: 0/2, 8: 0/1 |" in table


# --- servers that stall or fail, and the run's limits ------------------------------------------------------


def test_stalled_server_times_out_every_turn_and_scores_zero():
    server = FakeServer(stall=True)
    result = benchmark([server], settings(request_timeout_s=20.0))
    (outcome,) = result.configurations
    assert outcome.complete and outcome.cpg_concurrency == 0
    assert [t.concurrency for t in outcome.trials] == [1, 1]
    for trial in outcome.trials:
        assert trial.records and all(r.error == "no complete reply within 20s" for r in trial.records)
        # Each turn gives up 20 s after it was sent: none is left in flight past window + timeout.
        assert all(r.first_token_at is None for r in trial.records)
    assert server.open == 0


def test_failing_server_scores_zero_and_reports_the_error():
    server = FakeServer()
    server.error = "HTTP 500 from /v1/chat/completions: boom"
    trajectories = [flat_trajectory("t", tool_latency_s=1.0)]
    result = benchmark([server], settings(), trajectories=trajectories)
    (outcome,) = result.configurations
    assert outcome.cpg_concurrency == 0
    (agent,) = outcome.trials[0].agents
    assert agent.turns > 0 and agent.errors == agent.turns
    assert outcome.trials[0].records[0].error == server.error


def test_time_limit_stops_the_run_before_a_trial_that_would_not_fit():
    result = benchmark([FakeServer()], settings(max_seconds=100.0))
    (outcome,) = result.configurations
    assert not outcome.complete
    assert "100s limit" in result.stopped
    assert outcome.cpg_concurrency == max(t.concurrency for t in outcome.trials if t.passed)
    assert "(incomplete: at least)" in markdown_table(result)


def test_request_limit_stops_the_run_and_the_cut_trial_decides_nothing():
    server = FakeServer()
    result = benchmark([server], settings(max_requests=200))
    assert server.requests == 200
    assert "request limit" in result.stopped
    assert not result.configurations[0].complete


# --- compare mode ----------------------------------------------------------------------------------------


def test_compare_interleaves_configurations_and_switches_modes_before_each_trial():
    server = FakeServer()
    configurations = [
        Configuration("slow", "fake", {"capacity": 55.0}),  # 2 agents at 27.5 tok/s, 3 at 18.3
        Configuration("fast", "fake", {"capacity": 165.0}),  # 8 agents at 20.6 tok/s, 9 at 18.3
    ]
    result = benchmark([server, server], settings(trials=1), configurations)
    slow, fast = result.configurations
    assert (slow.cpg, fast.cpg) == (2, 8)
    assert fast.ratio_to_first == 4.0 and slow.ratio_to_first == 1.0
    # One trial each per round while both search; every trial ran in its own configuration's mode.
    assert [a["capacity"] for a in server.applied[:6]] == [55.0, 165.0] * 3
    assert all(t.modes == {"capacity": 55.0} for t in slow.trials)
    assert all(t.modes == {"capacity": 165.0} for t in fast.trials)
    # The same trial (level and repeat) replays the same workload in both configurations.
    first_slow, first_fast = slow.trials[0].records, fast.trials[0].records
    assert [(r.trajectory, r.turn) for r in first_slow][:3] == [(r.trajectory, r.turn) for r in first_fast][:3]


def test_configuration_specs_parse_names_urls_and_typed_server_args():
    spec = "name=exact/per_request,url=http://127.0.0.1:30000,dsv4_prefix_hits=exact,chunk=256,on=true"
    (config,) = command._configurations([spec])
    assert config == Configuration(
        "exact/per_request", "http://127.0.0.1:30000", {"dsv4_prefix_hits": "exact", "chunk": 256, "on": True}
    )
    with pytest.raises(ValueError, match="name=NAME,url=URL"):
        command._configurations(["url=http://127.0.0.1:1"])
    with pytest.raises(ValueError, match="must differ"):
        command._configurations(["name=a,url=http://127.0.0.1:1", "name=a,url=http://127.0.0.1:2"])


# --- the HTTP side: OpenAI chat streaming and mode switches, against a fake HTTP server ------------------


class FakeHttpServer:
    """OpenAI chat streaming plus SGLang's admin routes, with modes read back as sglang-dsv4 reports them."""

    def __init__(self) -> None:
        self.modes = {"prefix_hits": "exact", "window_policy": "per_request"}
        self.chat_requests: list[dict] = []
        self.flushes = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/set_internal_state", self.set_internal_state)
        app.router.add_post("/flush_cache", self.flush_cache)
        app.router.add_get("/server_info", self.server_info)
        return app

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "fake-v4"}]})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.chat_requests.append(body)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices": [{"delta": {"role": "assistant", "content": ""}}]}\n\n')
        for _ in range(body["max_tokens"]):
            await asyncio.sleep(0.002)
            await response.write(b'data: {"choices": [{"delta": {"content": "tok"}}]}\n\n')
        usage = {
            "prompt_tokens": 40,
            "completion_tokens": body["max_tokens"],
            "prompt_tokens_details": {"cached_tokens": 32},
        }
        await response.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
        return response

    async def set_internal_state(self, request: web.Request) -> web.Response:
        # As SGLang's route: numbers only (anything else is a 400), one flag per scheduler.
        server_args = (await request.json())["server_args"]
        if not all(isinstance(value, int) for value in server_args.values()):
            return web.json_response({"error": "server_args takes numbers"}, status=400)
        if any(value not in range(len(MODE_CODES[key])) for key, value in server_args.items()):
            return web.json_response([False])
        for key, value in server_args.items():
            self.modes[key.removeprefix("dsv4_")] = MODE_CODES[key][value]
        return web.json_response([True])

    async def flush_cache(self, request: web.Request) -> web.Response:
        assert float(request.query["timeout"]) > 0  # waits for the previous trial's requests to end
        self.flushes += 1
        return web.Response(text="Cache flushed.")

    async def server_info(self, _: web.Request) -> web.Response:
        return web.json_response({"internal_states": [{"dsv4_prefix_cache": dict(self.modes)}]})


def test_chat_streaming_and_mode_switches_that_empty_the_cache_over_http():
    fake = FakeHttpServer()

    async def scenario():
        runner = web.AppRunner(fake.app())
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        url = f"http://127.0.0.1:{port}"
        try:
            configurations = [
                Configuration(
                    "aligned/all", url, {"dsv4_prefix_hits": "aligned", "dsv4_window_policy": "all_committed"}
                ),
                Configuration("exact/per", url, {"dsv4_prefix_hits": "exact", "dsv4_window_policy": "per_request"}),
            ]
            trajectories = [flat_trajectory("t", turns=50, output_tokens=5, tool_latency_s=0.05)]
            run_settings = settings(
                warmup_s=0.2, measure_s=0.5, max_concurrency=1, trials=1, slo=Slo("loose", 1.0, 5.0)
            )
            result = await measure(configurations, trajectories, run_settings, "fake trace")
            with pytest.raises(ServerError, match="refused server_args"):
                refused = [Configuration("bad", url, {"dsv4_prefix_hits": "everything"})]
                await measure(refused, trajectories, run_settings, "fake trace")
            return result
        finally:
            await runner.cleanup()

    result = asyncio.run(scenario())
    aligned, exact = result.configurations
    assert aligned.trials[0].modes == {"prefix_hits": "aligned", "window_policy": "all_committed"}
    assert exact.trials[0].modes == {"prefix_hits": "exact", "window_policy": "per_request"}
    assert fake.flushes == 2  # one per trial; none after the refused switch
    records = [r for c in result.configurations for t in c.trials for r in t.records]
    assert records and all(r.error is None and r.output_tokens == 5 and r.cached_tokens == 32 for r in records)
    assert all(r.first_token_at > r.sent_at and r.last_token_at > r.first_token_at for r in records)
    # Each configuration's server first gets one short untimed request.
    assert [request["max_tokens"] for request in fake.chat_requests[:2]] == [2, 2]
    sent = fake.chat_requests[2]
    assert sent["model"] == "fake-v4" and sent["max_tokens"] == 5 and sent["ignore_eos"] and sent["stream"]


def test_only_loopback_servers_are_driven():
    require_loopback("http://127.0.0.1:30000")
    require_loopback("http://localhost:8000/")
    with pytest.raises(ValueError, match="loopback"):
        require_loopback("http://10.1.2.3:30000")
    with pytest.raises(ValueError, match="not an http"):
        require_loopback("127.0.0.1:30000")


def test_stream_lines_parse_and_stream_errors_raise():
    assert parse_sse_line(b'data: {"a": 1}\n') == {"a": 1}
    assert parse_sse_line(b"data: [DONE]\n") is None and parse_sse_line(b"\n") is None
    with pytest.raises(ServerError, match="overloaded"):
        parse_sse_line(b'data: {"error": {"message": "overloaded"}}\n')


# --- traces ----------------------------------------------------------------------------------------------


def test_synthetic_trace_matches_the_published_shape_and_is_seeded():
    trajectories = synthesize(400, SCALES["gpu"], ToolLatency(), seed=0)
    inputs, outputs = [], []
    for trajectory in trajectories:
        context = 0
        for turn in trajectory.turns:
            context += sum(len(m["content"].split()) for m in turn.new_messages)  # one word a token
            inputs.append(context)
            outputs.append(turn.output_tokens)
            context += len(turn.recorded_reply["content"].split())
    assert 0.85 * 27_000 < sum(inputs) / len(inputs) < 1.15 * 27_000
    assert 1_000 <= min(inputs) and max(inputs) <= 131_072
    assert 120 <= nearest_rank(outputs, 0.5) <= 180 and 1_500 <= nearest_rank(outputs, 0.95) <= 2_600
    assert max(len(t.turns) for t in trajectories) <= 200
    again = synthesize(3, SCALES["gpu"], ToolLatency(), seed=0)
    assert again == trajectories[:3] and synthesize(3, SCALES["gpu"], ToolLatency(), seed=1) != again


def test_cpu_scale_keeps_synthetic_histories_under_its_context():
    scale = SCALES["cpu"]
    for trajectory in synthesize(50, scale, ToolLatency(), seed=0):
        context = 0
        for turn in trajectory.turns:
            context += sum(len(m["content"].split()) for m in turn.new_messages)
            assert context <= scale.max_context_tokens and 2 <= turn.output_tokens <= scale.max_output_tokens
            context += turn.output_tokens


def test_sessions_become_turns_at_each_assistant_message_scaled(tmp_path):
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "bash", "arguments": json.dumps({"command": "ls -la " * 8})},
    }
    messages = [
        {"role": "system", "content": "s" * 64},
        {"role": "user", "content": "u" * 640},
        {"role": "assistant", "content": "a" * 400, "tool_calls": [call]},
        {"role": "tool", "content": "t" * 320, "tool_call_id": "c1"},
        {"role": "assistant", "content": "b" * 40, "tool_calls": [call]},
        {"role": "exit", "content": "diff --git ..."},
    ]
    path = tmp_path / "sessions.jsonl.gz"
    with gzip.open(path, "wt") as file:
        file.write(json.dumps({"id": "run/1", "messages": messages}) + "\n")
        file.write(json.dumps({"id": "run/empty", "messages": messages[:2] + messages[-1:]}) + "\n")
    scale = TraceScale(input_fraction=1 / 8, output_fraction=1 / 2, max_output_tokens=64, max_context_tokens=2048)
    (trajectory,) = load_sessions(path, scale, ToolLatency(), seed=0)
    first, second = trajectory.turns
    assert [m["role"] for m in first.new_messages] == ["system", "user"]
    assert [len(m["content"]) for m in first.new_messages] == [8, 80]
    assert [m["role"] for m in second.new_messages] == ["tool"] and second.new_messages[0]["tool_call_id"] == "c1"
    assert first.recorded_reply["content"] == "a" * 50
    assert json.loads(first.recorded_reply["tool_calls"][0]["function"]["arguments"]) == {
        "command": ("ls -la " * 8)[:7]
    }
    # (400 + 71 argument characters) / 4 characters a token / 2 = 59 tokens.
    assert first.output_tokens == 59
    assert 0.1 <= first.tool_latency_s <= 10.0


def test_sglang_agentic_trace_turns_take_the_servers_replies(tmp_path):
    conversation = [
        {"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "task"}], "prompt_tokens": 900},
        {"messages": [{"role": "user", "content": "output"}], "prompt_tokens": 1500},
        {"messages": [{"role": "user", "content": "too long"}], "prompt_tokens": 90_000},
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"metadata": {}, "conversations": [conversation]}))
    (trajectory,) = load_sglang_trace(path, SCALES["cpu"], ToolLatency(), seed=0)
    assert len(trajectory.turns) == 2  # 90,000 / 32 tokens would pass the CPU scale's 2,048
    assert all(turn.recorded_reply is None and turn.output_tokens == 55 for turn in trajectory.turns)


def test_mooncake_requests_chain_into_sessions_by_block_prefix(tmp_path):
    records = [
        {"timestamp": 0, "input_length": 1000, "output_length": 40, "hash_ids": [1, 2]},
        {"timestamp": 5, "input_length": 700, "output_length": 10, "hash_ids": [1, 9]},
        {"timestamp": 9, "input_length": 1600, "output_length": 20, "hash_ids": [1, 2, 3, 4]},
    ]
    path = tmp_path / "mooncake.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    scale = TraceScale(input_fraction=1 / 8, output_fraction=1.0, max_output_tokens=64, max_context_tokens=2048)
    first, second = load_mooncake(path, scale, ToolLatency(), seed=0)
    assert [len(t.turns) for t in (first, second)] == [2, 1]
    opening, follow_up = first.turns
    assert len(opening.new_messages[0]["content"].split()) == 125  # 1000 tokens / 8
    assert len(follow_up.new_messages[0]["content"].split()) == 70  # (1600 - 1000 - 40) / 8
    assert opening.output_tokens == 40 and len(opening.recorded_reply["content"].split()) == 40
    # Block 1's text opens both sessions: they share a prompt prefix.
    assert second.turns[0].new_messages[0]["content"][:200] == opening.new_messages[0]["content"][:200]


# --- outputs ---------------------------------------------------------------------------------------------


def test_results_folder_holds_json_table_and_plot(tmp_path):
    result = benchmark([FakeServer()], settings(trials=1, max_concurrency=8))
    table = write_all(result, tmp_path)
    saved = json.loads((tmp_path / "agentperf.json").read_text())
    assert saved["configurations"][0]["cpg_concurrency"] == 5
    assert saved["configurations"][0]["trials"][0]["records"][0]["first_token_at"] is not None
    assert (tmp_path / "agentperf.md").read_text() == table
    assert (tmp_path / "agentperf.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_progress_bar_line():
    progress = Progress(600.0, stream=io.StringIO())
    line = progress.line("fake  concurrency 4  trial 2", trial_s=15.0, window_s=30.0, run_s=140.0)
    assert line == "[############------------] fake  concurrency 4  trial 2  15/30s  run 140/600s"
