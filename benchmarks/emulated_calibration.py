"""The emulator against upstream SGLang's published DeepSeek-V4-Flash H200 figures (fixed-shape 8K-in / 1K-out).

Upstream's cookbook publishes, per recipe, the median TTFT, median TPOT and total (input + output) tokens per second
per GPU of ``bench_serving --dataset-name random --random-input-len 8192 --random-output-len 1024`` at a few
concurrencies (:data:`PUBLISHED`, with its sources). This runs the same shape through ``dsv4 emulate``'s real
server in upstream-like settings (hits at 256-token pages, ``all_committed`` windows; random prompts share no
prefix), with each recipe's parallelism as far as the emulator has it:

* TP recipes (``--tp 4``): one tensor-parallel group, attention timed as upstream's kernels' roofline
  (``flashmla``; this project never measured TP attention);
* DP-attention recipes (``--tp 4 --dp 4 --enable-dp-attention``, DeepEP): one of the 4 ranks, taking a quarter of
  the concurrency (round-robin DP gives each rank an equal share of fixed-shape requests), attention both as
  measured (this project's kernels) and as upstream's roofline.

Both with FP8 routed experts (the H200 FP8 recipes set ``SGLANG_DSV4_FP4_EXPERTS=0``). The emulator runs without
speculation; the published low-latency and balanced figures use EAGLE MTP, the high-throughput ones do not
(:data:`PUBLISHED` says which): only those compare like with like, the others bound the acceptance length upstream
needed (:func:`implied_acceptance`). Every request streams from ``/generate`` with its token ids (exact lengths).
Results go to ``benchmarks/results/emulated_calibration.json``.

    python benchmarks/emulated_calibration.py [--cases c1-tp,c64-dp,...] [--host-speed 1.0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
import requests

from sglang_dsv4.config import named_config
from sglang_dsv4.emulation.timing import Deployment, ForwardShape, TimingModel
from sglang_dsv4.launch import ONE_TORCH_THREAD, running_emulated_server

REPOSITORY = Path(__file__).resolve().parents[1]
OUT = REPOSITORY / "benchmarks" / "results" / "emulated_calibration.json"
INPUT, OUTPUT = 8192, 1024
GPUS = 4
UPSTREAM = "https://github.com/sgl-project/sglang/blob"
SOURCES = {
    "figures": f"{UPSTREAM}/08587007c81585756076d965a3af856ac620f1b9/docs_new/src/snippets/configs/deepseek-ai/"
    "deepseek-v4-benchmarks.jsx",
    "recipes": f"{UPSTREAM}/acee17e37656be6aa7aaeb9ddffe135bd7505bbc/docs_new/src/snippets/configs/deepseek-ai/"
    "deepseek-v4.jsx",
    "page": "https://docs.sglang.io/cookbook/autoregressive/DeepSeek/DeepSeek-V4",
}
UPSTREAM_LIKE = {"SGLANG_DSV4_PLUGIN_PREFIX_HITS": "aligned", "SGLANG_DSV4_PLUGIN_WINDOW_POLICY": "all_committed"}


@dataclass(frozen=True)
class Published:
    """One published cell: H200, V4-Flash FP8 checkpoint (FP8 experts), SGLang 0.5.15, 4 GPUs, random 8K/1K."""

    recipe: str
    flags: str
    speculation: str  # "" when none
    concurrency: int
    ttft_ms: float
    tpot_ms: float
    total_tokens_per_s_per_gpu: float


PUBLISHED = {
    "low-latency c1": Published("low-latency", "--tp 4", "EAGLE 3-1-4", 1, 178, 3.28, 631),
    "balanced c64": Published(
        "balanced", "--tp 4 --dp 4 --enable-dp-attention --moe-a2a-backend deepep --max-running-requests 128",
        "EAGLE 1-1-2", 64, 897, 41.27, 3098,
    ),
    "high-throughput c1024": Published(
        "high-throughput", "--tp 4 --dp 4 --enable-dp-attention --moe-a2a-backend deepep --max-running-requests 256",
        "", 1024, 218999, 147.51, 3958,
    ),
}  # fmt: skip


@dataclass(frozen=True)
class Case:
    """An emulator run: one rank of the published recipe's deployment."""

    published: str
    attention: str
    attention_tp: int
    concurrency: int  # this rank's
    prompts: int
    max_running: int | None = None
    lockstep: bool = False

    @property
    def name(self) -> str:
        parallel = "tp4" if self.attention_tp > 1 else "dp4"
        return f"{self.published.split()[-1]}-{parallel}-{self.attention}" + ("-lockstep" if self.lockstep else "")

    def ranks_busy(self, published: Published) -> float:
        """The deployment's ranks this rank stands for: its concurrency is the published one's share."""
        return published.concurrency / self.concurrency


CASES = [
    Case("low-latency c1", "flashmla", GPUS, 1, 3),
    Case("low-latency c1", "flashmla", 1, 1, 3),
    Case("low-latency c1", "measured", 1, 1, 3),
    Case("balanced c64", "flashmla", 1, 16, 32),
    Case("balanced c64", "measured", 1, 16, 32),
    Case("high-throughput c1024", "flashmla", 1, 256, 128, max_running=64),
    Case("high-throughput c1024", "measured", 1, 256, 128, max_running=64),
    Case("high-throughput c1024", "flashmla", 1, 256, 128, max_running=64, lockstep=True),
]


async def one_request(session: aiohttp.ClientSession, url: str, ids: list[int]) -> dict:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": OUTPUT, "ignore_eos": True, "temperature": 0},
        "stream": True,
    }
    sent, times = time.monotonic(), []
    async with session.post(f"{url}/generate", json=body) as reply:
        async for line in reply.content:
            if line.startswith(b"data:") and not line.startswith(b"data: [DONE]"):
                times.append((time.monotonic(), json.loads(line[5:])["meta_info"]["completion_tokens"]))
    (first, _), (last, tokens) = times[0], times[-1]
    return {"sent": sent, "ttft_s": first - sent, "tpot_s": (last - first) / max(tokens - 1, 1), "end": last,
            "tokens": tokens}  # fmt: skip


async def drive(url: str, concurrency: int, prompts: int, seed: int = 0) -> list[dict]:
    """``prompts`` random fixed-shape requests, at most ``concurrency`` in flight (bench_serving's
    ``--max-concurrency`` at an infinite request rate)."""
    rng = random.Random(seed)
    gate = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=1800)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def gated(ids: list[int]) -> dict:
            async with gate:
                return await one_request(session, url, ids)

        batches = [[rng.randrange(20, 900) for _ in range(INPUT)] for _ in range(prompts)]
        return await asyncio.gather(*(gated(ids) for ids in batches))


def summarize(case: Case, records: list[dict], device: dict) -> dict:
    duration = max(r["end"] for r in records) - min(r["sent"] for r in records)
    output_tokens = sum(r["tokens"] for r in records)
    published = PUBLISHED[case.published]
    total_per_gpu = output_tokens * (INPUT + OUTPUT) / OUTPUT / duration * case.ranks_busy(published) / GPUS
    queued = sorted(records, key=lambda r: r["sent"])[case.max_running or case.concurrency :]
    measured = {
        "ttft_ms": round(1e3 * statistics.median(r["ttft_s"] for r in records), 1),
        "tpot_ms": round(1e3 * statistics.median(r["tpot_s"] for r in records), 2),
        "total_tokens_per_s_per_gpu": round(total_per_gpu),
    }
    rank_time = device["wall_s"]  # the rank's clock from its first forward: no contention, host work scaled
    rank_clock = {
        "total_tokens_per_s_per_gpu": round(total_per_gpu * duration / rank_time),
        "mean_forward_ms": round(1e3 * rank_time / device["forwards"], 2),
        "occupancy": device["occupancy"],
    }
    return {
        "case": asdict(case),
        "run_s": round(duration, 1),
        "emulated": measured,
        # the requests that waited in the queue: their decode shares the steps with the others' prefills, as in
        # upstream's long runs (2048 requests at concurrency 1024)
        "tpot_ms_queued": round(1e3 * statistics.median(r["tpot_s"] for r in queued), 2) if queued else None,
        "rank_clock": rank_clock,
        "published": asdict(published),
        "emulated_over_published": {k: round(v / getattr(published, k), 3) for k, v in measured.items()},
        "device": device,
    }


def model_budget(case: Case) -> dict:
    """The timing model's decode step at the case's batch and a mid-output context and its 8K prefill, by part;
    and the steady-state TPOT they give when every finished request is replaced at once (a queue): each decode
    step plus the running requests' prefills spread over their outputs, this rank's alone or, under attention
    DP, every rank's (the ranks run each layer's MoE in lockstep, so one rank's prefill stalls all of them)."""
    timing = case_timing(case)
    batch = min(case.concurrency, case.max_running or case.concurrency)
    context = INPUT + OUTPUT // 2
    step = timing.forward(ForwardShape((1,) * batch, (context,) * batch))
    prefill = timing.forward(ForwardShape((INPUT,), (INPUT,)))
    prefills_per_token = batch * prefill.total_s / OUTPUT
    ranks = 1 if case.attention_tp > 1 else GPUS
    return {
        "decode_step_ms": {k: round(v * 1e3, 3) for k, v in {**step.parts, "total": step.total_s}.items()},
        "prefill_8k_ms": {k: round(v * 1e3, 2) for k, v in {**prefill.parts, "total": prefill.total_s}.items()},
        "steady_tpot_ms": {
            "this_rank": round(1e3 * (step.total_s + prefills_per_token), 2),
            "dp_lockstep": round(1e3 * (step.total_s + ranks * prefills_per_token), 2),
        },
    }


def case_timing(case: Case) -> TimingModel:
    deployment = Deployment(GPUS, "bf16", case.attention_tp, "fp8", lockstep=case.lockstep)  # the servers' KV
    return TimingModel(named_config("flash"), "flash", deployment, attention=case.attention)


def implied_acceptance(case: Case, result: dict) -> float | None:
    """For a speculative published figure: the tokens per verify step upstream's MTP must have accepted for its
    TPOT, were each step as long as the timing model's plain decode step (a lower bound on a verify step's time)."""
    published = PUBLISHED[case.published]
    if not published.speculation:
        return None
    return round(result["model"]["decode_step_ms"]["total"] / published.tpot_ms, 2)


def run_case(case: Case, host_speed: float, scratch: Path) -> dict:
    args = ["--enable-cache-report", "--chunked-prefill-size", "8192"]
    if case.max_running:
        args += ["--max-running-requests", str(case.max_running)]
    timing = {
        "attention": case.attention,
        "attention_tp": case.attention_tp,
        "experts": "fp8",
        "host_speed": host_speed,
        "lockstep": case.lockstep,
    }
    with running_emulated_server(
        "flash", *args, log_path=scratch / f"{case.name}.log", gpus=GPUS, context_length=16384,
        env={**ONE_TORCH_THREAD, **UPSTREAM_LIKE}, timing=timing,
    ) as url:  # fmt: skip
        records = asyncio.run(drive(url, case.concurrency, case.prompts))
        device = requests.get(f"{url}/server_info", timeout=60).json()["internal_states"][0]["dsv4_emulation"]
    result = summarize(case, records, device["device_time"])
    result["model"] = model_budget(case)
    result["implied_acceptance"] = implied_acceptance(case, result)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(c.name for c in CASES), help="comma-separated case names")
    parser.add_argument("--host-speed", type=float, default=1.0, help="the emulated host's time over this host's")
    parser.add_argument("--label", default="", help="a suffix for the runs' names (another host speed, say)")
    parser.add_argument("--model-only", action="store_true", help="refresh the runs' timing-model budgets only")
    args = parser.parse_args()
    chosen = [c for c in CASES if c.name in args.cases.split(",")]
    results = json.loads(OUT.read_text()) if OUT.is_file() else {"sources": SOURCES, "runs": {}}
    if args.model_only:
        for case in CASES:
            for name, run in results["runs"].items():
                if name.split("@")[0] == case.name:
                    run["model"] = model_budget(case)
                    run["implied_acceptance"] = implied_acceptance(case, run)
        OUT.write_text(json.dumps(results, indent=1) + "\n")
        return
    with tempfile.TemporaryDirectory() as scratch:
        for case in chosen:
            result = run_case(case, args.host_speed, Path(scratch))
            result["host_speed"] = args.host_speed
            results["runs"][case.name + args.label] = result
            print(case.name, json.dumps(result["emulated"]), json.dumps(result["emulated_over_published"]), flush=True)
            OUT.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
