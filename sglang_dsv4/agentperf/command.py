"""``dsv4 agentperf``: concurrent agents per GPU (CPG) under TTFT and output-speed SLOs, AgentPerf-style.

``run --url URL`` searches one server's CPG; ``compare --config ... --config ...`` measures several
configurations interleaved and reports each one's CPG and its ratio to the first. A configuration is
``name=NAME,url=URL[,KEY=VALUE...]``: the extra keys are ``server_args`` the server is switched to (SGLang's
``/set_internal_state``, then ``/flush_cache``) before each of its trials, so one server can be compared with
itself in several modes, every trial from an empty cache, e.g. sglang-dsv4's prefix-cache modes::

    dsv4 agentperf compare --scale cpu \\
      --config name=exact,url=http://127.0.0.1:30000,dsv4_prefix_hits=exact,dsv4_window_policy=per_request \\
      --config name=aligned,url=http://127.0.0.1:30000,dsv4_prefix_hits=aligned,dsv4_window_policy=per_request

``--scale`` picks the trace scaling and the defaults of the SLO tier and windows (``gpu``: traces as
recorded, ``slo20``, 60 s warm-up, 300 s measurement; ``cpu``: traces for the tiny V4 on a CPU host,
``cpu-slo20``, 5 s and 30 s); every one of them can be overridden. Results go to ``--out``
(``agentperf.json``, ``agentperf.md``, ``agentperf.png``) and the table is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

from .benchmark import Configuration, Settings, measure
from .report import write_all
from .server import ServerError, require_loopback
from .slo import TIERS, Slo
from .synthetic import synthesize
from .traces import load_mooncake, load_sessions, load_sglang_trace
from .trajectory import SCALES, ToolLatency, Trajectory

SCALE_DEFAULTS: dict[str, dict[str, Any]] = {
    "gpu": {"slo": "slo20", "warmup_s": 60.0, "measure_s": 300.0, "request_timeout_s": 600.0, "max_concurrency": 1024},
    "cpu": {"slo": "cpu-slo20", "warmup_s": 5.0, "measure_s": 30.0, "request_timeout_s": 60.0, "max_concurrency": 32},
}
REPORTED_ERRORS = (ValueError, ServerError, OSError)
"""What ``run`` raises for bad arguments, traces or servers: reported as a message, not a traceback."""
LOADERS = {"sessions": load_sessions, "sglang": load_sglang_trace, "mooncake": load_mooncake}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    modes = parser.add_subparsers(dest="agentperf_command", required=True)
    single = modes.add_parser("run", help="search one server's CPG")
    single.add_argument("--url", required=True, help="server base URL (loopback), e.g. http://127.0.0.1:30000")
    compare = modes.add_parser("compare", help="several configurations interleaved; CPG and ratio to the first")
    compare.add_argument(
        "--config",
        dest="configs",
        action="append",
        required=True,
        metavar="name=NAME,url=URL[,KEY=VALUE...]",
        help="a configuration (repeat); extra keys are server_args set before each of its trials",
    )
    for sub in (single, compare):
        _add_common(sub)


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scale", choices=sorted(SCALES), default="gpu", help="trace scaling and default SLO/windows")
    parser.add_argument("--trace", choices=["synthetic", *LOADERS], default="synthetic", help="trajectories to replay")
    parser.add_argument("--trace-path", type=Path, help="the trace file (every --trace but synthetic)")
    parser.add_argument("--trajectories", type=int, default=64, help="synthetic trajectories to draw")
    parser.add_argument("--slo", choices=sorted(TIERS), help="SLO tier (default: the scale's)")
    parser.add_argument("--min-speed", type=float, help="override the tier's per-agent output speed, tok/s")
    parser.add_argument("--max-ttft", type=float, help="override the tier's TTFT limit, s")
    parser.add_argument("--ttft-quantile", type=float, help="override the tier's TTFT quantile (0.9: p90)")
    parser.add_argument("--api", choices=["chat", "generate"], default="chat", help="OpenAI chat or SGLang /generate")
    parser.add_argument("--model", help="model name for chat requests (default: the server's first listed)")
    parser.add_argument("--tokenizer", help="tokenizer (path or hub id) for --api generate")
    parser.add_argument("--warmup-s", type=float, help="warm-up window per trial")
    parser.add_argument("--measure-s", type=float, help="measurement window per trial")
    parser.add_argument("--request-timeout-s", type=float, help="a turn without a complete reply by then fails")
    parser.add_argument("--trials", type=int, default=3, help="trials at each boundary level (majority decides)")
    parser.add_argument("--max-concurrency", type=int, help="highest concurrency the search tries")
    parser.add_argument("--gpus", type=int, default=1, help="GPUs behind each configuration (1 on a CPU host)")
    parser.add_argument("--max-seconds", type=float, default=3600.0, help="the whole run's time limit")
    parser.add_argument("--max-requests", type=int, default=100_000, help="the whole run's request limit")
    parser.add_argument(
        "--history", choices=["recorded", "served"], default="recorded", help="replies appended to each history"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/agentperf"), help="results folder")


def run(args: argparse.Namespace) -> None:
    """Parse, load, measure, write; raises ``ValueError`` (bad arguments or trace) or ``ServerError``."""
    defaults = SCALE_DEFAULTS[args.scale]
    configurations = (
        [Configuration("server", args.url)] if args.agentperf_command == "run" else _configurations(args.configs)
    )
    for configuration in configurations:
        require_loopback(configuration.url)
    trajectories, trace = load_trajectories(args.trace, args.trace_path, args.scale, args.trajectories, args.seed)
    settings = Settings(
        slo=_slo(args, defaults["slo"]),
        warmup_s=_given(args.warmup_s, defaults["warmup_s"]),
        measure_s=_given(args.measure_s, defaults["measure_s"]),
        request_timeout_s=_given(args.request_timeout_s, defaults["request_timeout_s"]),
        trials=args.trials,
        max_concurrency=_given(args.max_concurrency, defaults["max_concurrency"]),
        gpus=args.gpus,
        max_seconds=args.max_seconds,
        max_requests=args.max_requests,
        served_history=args.history == "served",
        seed=args.seed,
    )
    if args.api == "generate" and not args.tokenizer:
        raise ValueError("--api generate needs --tokenizer (the server's chat template turns history into ids)")
    result = asyncio.run(measure(configurations, trajectories, settings, trace, args.api, args.model, args.tokenizer))
    print(write_all(result, args.out))


def load_trajectories(kind: str, path: Path | None, scale: str, count: int, seed: int) -> tuple[list[Trajectory], str]:
    """The trajectories of ``--trace`` at ``--scale``, and a one-line description of them for the results."""
    if kind == "synthetic":
        trajectories = synthesize(count, SCALES[scale], ToolLatency(), seed)
        return trajectories, f"synthetic, {count} trajectories (seed {seed}), {scale} scale"
    if path is None:
        raise ValueError(f"--trace {kind} needs --trace-path")
    trajectories = LOADERS[kind](path, SCALES[scale], ToolLatency(), seed)
    return trajectories, f"{kind} {path.name}, {len(trajectories)} trajectories, {scale} scale"


def _configurations(specs: list[str]) -> list[Configuration]:
    configurations = [_configuration(spec) for spec in specs]
    names = [c.name for c in configurations]
    if len(set(names)) != len(names):
        raise ValueError(f"configuration names must differ: {names}")
    return configurations


def _configuration(spec: str) -> Configuration:
    """``name=NAME,url=URL,KEY=VALUE...``; values are read as JSON where they parse (numbers, booleans)."""
    fields = dict(item.split("=", 1) for item in spec.split(",") if "=" in item)
    if "name" not in fields or "url" not in fields or spec.count("=") != len(fields):
        raise ValueError(f"a configuration is name=NAME,url=URL[,KEY=VALUE...], not {spec!r}")
    name, url = fields.pop("name"), fields.pop("url")
    return Configuration(name, url, {key: _value(text) for key, text in fields.items()} or None)


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _slo(args: argparse.Namespace, default_tier: str) -> Slo:
    tier = TIERS[args.slo or default_tier]
    return Slo(
        name=tier.name if args.min_speed is None and args.max_ttft is None and args.ttft_quantile is None else "custom",
        min_output_speed=_given(args.min_speed, tier.min_output_speed),
        max_ttft_s=_given(args.max_ttft, tier.max_ttft_s),
        ttft_quantile=_given(args.ttft_quantile, tier.ttft_quantile),
    )


def _given(value: Any, default: Any) -> Any:
    return default if value is None else value
