"""Sparse decode attention and the indexer (scoring, top-k) on the GPU: checks, then timings against floors.

``python benchmarks/kernels/attention_indexer.py [--out DIR] [--sweep] [--quick]`` on a CUDA host
(the H200: torch 2.11, Triton 3.6, no SGLang needed). In one run it

1. measures the two ceilings: device-to-device copy bandwidth (bytes read + written) and a
   8192^3 bf16 matrix product on random data;
2. checks every kernel on the GPU against a torch reference on fresh random inputs (relative
   error against float64 for attention and scoring; the exact set of ``torch.topk`` for the
   top-k kernels) and the tiny model's logits with the kernels on CUDA against the CPU
   reference;
3. times, for V4-Flash (64 heads, top-k 512) and V4-Pro (128 heads, top-k 1024), decode batch
   1, 64, 256 and 1024 at contexts 8K, 128K and 1M: attention of ratio-4 layers (window 128 +
   top-k entries) and ratio-128 layers (window + all context/128 entries), indexer scoring
   over context/4 keys, the top-k over those scores; each against its torch reference timed
   in the same run, with bytes and FLOPs counted and the floor they imply at the ceilings;
4. times the temporal top-k against the plain one on synthetic score streams of controlled
   step-to-step overlap and on the shipped (trained) tiny model's own indexer scores during greedy
   decode after a long prompt of real code (``benchmarks/indexer_streams.py``).

``--only-tiny`` runs the network check and the tiny-model rows alone.

Timings: median over repetitions, the L2 cache flushed before each. Our kernels are timed as
served, captured in a CUDA graph and replayed (no Python launch cost); the torch references
eagerly, as the issue's baselines were taken.

Memory (1M context, batch 1024): ratio-4 entries are read only where selected, so all
requests share one 4 GiB pool of compressed rows, each request selecting from its own
context/4-row region of it (regions wrap around the pool; selected rows are spread over the
region, so reads miss the L2 as distinct requests' would). Indexer keys likewise come from one
shared pool of up to 16M rows (4 GiB) through each request's own table of context/4 rows. The
ratio-128 entries (context/128 per request, read in full) are distinct per request: 8.6 GB at
1M x 1024. Bytes are counted as distinct requests would move them.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import triton

from sglang_dsv4.kernels.attention import (
    KVSelection,
    LaunchShape,
    sparse_decode_attention,
    sparse_decode_attention_reference,
)
from sglang_dsv4.kernels.indexer import index_scores, index_scores_reference
from sglang_dsv4.kernels.topk import temporal_top_k, top_k, top_k_reference
from sglang_dsv4.tiny import shipped_checkpoint

HEAD_DIM, ROPE_DIM, WINDOW = 512, 64, 128
INDEX_HEADS, INDEX_DIM = 64, 128
MODELS = {"flash": {"heads": 64, "topk": 512}, "pro": {"heads": 128, "topk": 1024}}
BATCHES = (1, 64, 256, 1024)
CONTEXTS = (8192, 131072, 1048576)
CSA_POOL_ROWS = 1 << 22  # 4 GiB of bf16 entries
KEY_POOL_ROWS = 1 << 24  # 4 GiB of bf16 indexer keys
FLUSH_BYTES = 256 << 20
DEVICE = torch.device("cuda")


# --- timing and ceilings --------------------------------------------------------------------------


class Timer:
    """Median time of a callable, the L2 flushed before every repetition."""

    def __init__(self, budget_ms: float):
        self.budget_ms = budget_ms
        self.flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=DEVICE)

    def median_us(self, run: Callable[[], object], *, min_reps: int = 3, max_reps: int = 300) -> float:
        run()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        estimate = max(start.elapsed_time(end), 1e-3)
        reps = int(min(max(self.budget_ms / (estimate + 0.05), min_reps), max_reps))
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for first, last in events:
            self.flush.zero_()
            first.record()
            run()
            last.record()
        torch.cuda.synchronize()
        return 1000 * statistics.median(first.elapsed_time(last) for first, last in events)

    def graph_us(self, fn: Callable[[], object], **kwargs) -> float:
        """Median time of ``fn`` captured in a CUDA graph and replayed."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()  # compile and warm outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        try:
            return self.median_us(graph.replay, **kwargs)
        finally:
            del graph


def measure_ceilings(timer: Timer) -> dict[str, float]:
    source = torch.randn(1 << 29, device=DEVICE)  # 2 GiB
    target = torch.empty_like(source)
    copy_us = timer.median_us(lambda: target.copy_(source))
    copy_tbps = 2 * source.numel() * 4 / copy_us / 1e6
    a = torch.randn(8192, 8192, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=DEVICE, dtype=torch.bfloat16)
    matmul_us = timer.median_us(lambda: a @ b)
    return {"copy_tbps": copy_tbps, "matmul_tflops": 2 * 8192**3 / matmul_us / 1e6}


def floor_us(bytes_moved: float, flops: float, ceilings: dict[str, float]) -> tuple[float, str]:
    """The larger of the traffic time and the arithmetic time at the measured ceilings, and which it is."""
    traffic = bytes_moved / ceilings["copy_tbps"] / 1e6
    arithmetic = flops / ceilings["matmul_tflops"] / 1e6
    return (traffic, "bytes") if traffic >= arithmetic else (arithmetic, "flops")


# --- inputs ---------------------------------------------------------------------------------------


def rope_tables(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.rand(rows, ROPE_DIM // 2, device=DEVICE) * 2 * math.pi
    return angles.cos(), angles.sin()


def spread_offsets(rows: int, count: int, region: int) -> torch.Tensor:
    """``count`` distinct random offsets per row in ``[0, region)``, one per equal stratum."""
    stride = region // count
    jitter = torch.randint(0, stride, (rows, count), device=DEVICE)
    return torch.arange(count, device=DEVICE) * stride + jitter


class AttentionCase:
    """One decode batch of one layer kind: queries, the window and compressed selections."""

    def __init__(self, heads: int, topk: int, kind: str, context: int, batch: int, csa_pool: torch.Tensor):
        self.heads, self.batch = heads, batch
        self.q = torch.randn(batch, heads, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
        self.sink = torch.randn(heads, device=DEVICE)
        self.cos, self.sin = rope_tables(batch)
        window_pool = torch.randn(batch * WINDOW, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
        window_rows = torch.arange(batch, device=DEVICE)[:, None] * WINDOW + torch.arange(WINDOW, device=DEVICE)
        self.window = KVSelection(window_pool, window_rows.int(), torch.full((batch,), WINDOW, device=DEVICE).int())
        if kind == "csa":
            region = context // 4
            self.entries = min(topk, region)
            base = (torch.arange(batch, device=DEVICE)[:, None] * region) % csa_pool.shape[0]
            rows = (base + spread_offsets(batch, self.entries, region)) % csa_pool.shape[0]
            pool = csa_pool
        else:
            self.entries = context // 128
            pool = torch.randn(batch * self.entries, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
            rows = torch.arange(batch * self.entries, device=DEVICE).view(batch, self.entries)
        lengths = torch.full((batch,), self.entries, device=DEVICE).int()
        self.compressed = KVSelection(pool, rows.int(), lengths)

    @property
    def bytes(self) -> float:
        kv_rows = self.batch * (WINDOW + self.entries)
        return 2 * self.q.numel() * 2 + kv_rows * (HEAD_DIM * 2 + 4)

    @property
    def flops(self) -> float:
        return 4 * self.batch * self.heads * (WINDOW + self.entries) * HEAD_DIM

    def run(self, **launch) -> torch.Tensor:
        return sparse_decode_attention(
            self.q, self.window, self.compressed, self.sink, self.cos, self.sin, scale=HEAD_DIM**-0.5, **launch
        )

    def reference(self) -> torch.Tensor:
        return sparse_decode_attention_reference(
            self.q, self.window, self.compressed, self.sink, self.cos, self.sin, scale=HEAD_DIM**-0.5
        )


class IndexerCase:
    """One decode batch of indexer scoring over ``context // 4`` keys per request."""

    def __init__(self, context: int, batch: int, key_pool: torch.Tensor):
        self.batch, self.entries = batch, context // 4
        self.q = torch.randn(batch, INDEX_HEADS, INDEX_DIM, device=DEVICE, dtype=torch.bfloat16)
        self.weights = torch.randn(batch, INDEX_HEADS, device=DEVICE) * INDEX_HEADS**-0.5
        pool_rows = min(batch * self.entries, key_pool.shape[0])
        self.keys = key_pool[:pool_rows]
        first = torch.arange(batch, device=DEVICE)[:, None] * self.entries
        self.table = ((first + torch.arange(self.entries, device=DEVICE)) % pool_rows).int()
        self.lengths = torch.full((batch,), self.entries, device=DEVICE).int()

    @property
    def score_bytes(self) -> float:
        return self.batch * self.entries * (INDEX_DIM * 2 + 4 + 4) + self.q.numel() * 2

    @property
    def score_flops(self) -> float:
        return 2 * self.batch * self.entries * INDEX_HEADS * INDEX_DIM

    def scores(self) -> torch.Tensor:
        return index_scores(self.q, self.weights, self.keys, self.lengths, scale=INDEX_DIM**-0.5, table=self.table)

    def reference_scores(self) -> torch.Tensor:
        """Torch scoring in row chunks small enough for the gathered float32 keys."""
        per_row = self.entries * (INDEX_DIM + INDEX_HEADS) * 4
        chunk = max(1, min(self.batch, (2 << 30) // per_row))
        parts = [
            index_scores_reference(
                self.q[i : i + chunk],
                self.weights[i : i + chunk],
                self.keys,
                self.lengths[i : i + chunk],
                scale=INDEX_DIM**-0.5,
                table=self.table[i : i + chunk],
            )
            for i in range(0, self.batch, chunk)
        ]
        return torch.cat(parts)


# --- correctness ----------------------------------------------------------------------------------


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    if torch.isnan(actual).any():
        return float("nan")
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


def same_sets(chosen: torch.Tensor, expected: torch.Tensor, scores: torch.Tensor) -> bool:
    """Equal as sets per row, except where the two differ only in equal scores at the boundary."""
    a, b = chosen.sort(dim=1).values, expected.sort(dim=1).values
    if torch.equal(a, b):
        return True
    picked = torch.where(chosen >= 0, scores.gather(1, chosen.clamp(min=0).long()), float("-inf"))
    wanted = torch.where(expected >= 0, scores.gather(1, expected.clamp(min=0).long()), float("-inf"))
    return torch.equal(picked.sort(dim=1).values, wanted.sort(dim=1).values)


def check_attention() -> list[dict]:
    results = []
    for heads, entries, dtype, splits in [
        (64, 512, torch.bfloat16, None),
        (128, 1024, torch.bfloat16, None),
        (64, 3000, torch.bfloat16, 8),
        (128, 77, torch.bfloat16, 1),
        (4, 40, torch.float32, None),
    ]:
        rows = 9
        head_dim, rope_dim = (HEAD_DIM, ROPE_DIM) if heads > 4 else (64, 16)
        q = torch.randn(rows, heads, head_dim, device=DEVICE).to(dtype)
        window_pool = torch.randn(rows * WINDOW, head_dim, device=DEVICE).to(dtype)
        pool = torch.randn(4 * entries, head_dim, device=DEVICE).to(dtype)
        window = KVSelection(
            window_pool,
            torch.randint(0, rows * WINDOW, (rows, WINDOW), device=DEVICE).int(),
            torch.randint(0, WINDOW + 1, (rows,), device=DEVICE).int(),
        )
        lengths = torch.randint(0, entries + 1, (rows,), device=DEVICE).int()
        lengths[0], lengths[1] = 0, entries  # empty and full selections
        compressed = KVSelection(pool, torch.randint(0, 4 * entries, (rows, entries), device=DEVICE).int(), lengths)
        sink = torch.randn(heads, device=DEVICE)
        angles = torch.rand(rows, rope_dim // 2, device=DEVICE) * 6
        cos, sin = angles.cos(), angles.sin()
        out = sparse_decode_attention(q, window, compressed, sink, cos, sin, scale=head_dim**-0.5, splits=splits)

        def wide(s):
            return KVSelection(s.pool.double(), s.indices, s.lengths)

        expected = sparse_decode_attention_reference(
            q.double(), wide(window), wide(compressed), sink.double(), cos.double(), sin.double(), scale=head_dim**-0.5
        )
        error = relative_error(out, expected)
        limit = 1e-2 if dtype == torch.bfloat16 else 1e-5
        results.append({"check": f"attention heads={heads} entries={entries} {dtype} splits={splits}",
                        "error": error, "ok": error < limit})  # fmt: skip
    return results


def check_indexer() -> list[dict]:
    results = []
    for dtype in (torch.bfloat16, torch.float32):
        rows, width = 5, 5000
        q = torch.randn(rows, INDEX_HEADS, INDEX_DIM, device=DEVICE).to(dtype)
        weights = torch.randn(rows, INDEX_HEADS, device=DEVICE)
        keys = torch.randn(3 * width, INDEX_DIM, device=DEVICE).to(dtype)
        table = torch.randint(0, 3 * width, (rows, width), device=DEVICE).int()
        lengths = torch.tensor([0, width, 1, 4097, 333], device=DEVICE).int()
        scores = index_scores(q, weights, keys, lengths, scale=INDEX_DIM**-0.5, table=table)
        expected = index_scores_reference(
            q.double(), weights.double(), keys.double(), lengths, scale=INDEX_DIM**-0.5, table=table
        )
        finite = torch.isfinite(expected)
        error = relative_error(scores[finite], expected[finite])
        ok = error < (1e-2 if dtype == torch.bfloat16 else 1e-5) and torch.equal(finite, torch.isfinite(scores))
        results.append({"check": f"index scores {dtype}", "error": error, "ok": bool(ok)})
    for rows, width, k in [(64, 262144, 512), (64, 262144, 1024), (7, 70000, 512), (3, 5000, 1024), (2, 3, 16)]:
        scores = torch.randn(rows, width, device=DEVICE)
        lengths = torch.randint(1, width + 1, (rows,), device=DEVICE).int()
        lengths[0] = width
        expected = top_k_reference(scores, lengths, k)
        plain = top_k(scores, lengths, k)
        drifted = scores + 0.1 * torch.randn_like(scores)
        temporal = temporal_top_k(drifted, lengths, k, plain)
        results.append({"check": f"top-k rows={rows} width={width} k={k}",
                        "ok": same_sets(plain, expected, scores)
                        and same_sets(temporal, top_k_reference(drifted, lengths, k), drifted)})  # fmt: skip
    ties = torch.zeros(4, 20000, device=DEVICE)  # every score equal: the streaming path
    lengths = torch.full((4,), 20000, device=DEVICE).int()
    chosen = top_k(ties, lengths, 512)
    distinct = all(len(set(row.tolist())) == 512 for row in chosen.cpu())
    results.append({"check": "top-k all-equal scores (streaming)", "ok": distinct and bool((chosen >= 0).all())})
    return results


def check_network(path: Path) -> dict:
    """The tiny model on CUDA (kernels) against CPU (torch reference): 600-token prefill, then 8 decode steps."""
    from sglang_dsv4 import load_model

    gpu, cpu = load_model(path, device="cuda"), load_model(path)
    ids = torch.randint(0, gpu.config.vocab_size, (608,), generator=torch.Generator().manual_seed(0))
    gpu_state, cpu_state = gpu.new_state(), cpu.new_state()
    gpu_logits = [gpu(ids[:600], gpu_state).cpu()]
    cpu_logits = [cpu(ids[:600], cpu_state)]
    for token in ids[600:]:
        gpu_logits.append(gpu(token[None], gpu_state).cpu())
        cpu_logits.append(cpu(token[None], cpu_state))
    actual, expected = torch.cat(gpu_logits), torch.cat(cpu_logits)
    scale = expected.abs().max().item()
    worst = (actual - expected).abs().max().item()
    return {"check": "tiny network, CUDA kernels vs CPU reference (608 positions)",
            "max_abs_diff_over_logit_scale": worst / scale, "ok": worst <= 1e-3 * scale}  # fmt: skip


# --- timings --------------------------------------------------------------------------------------


def bench_attention(timer: Timer, ceilings: dict, quick: bool, launches: dict[str, LaunchShape]) -> list[dict]:
    csa_pool = torch.randn(CSA_POOL_ROWS, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
    rows = []
    for model, shape in MODELS.items():
        launch = launches.get(model)
        for kind in ("csa", "hca"):
            for context in CONTEXTS if not quick else (131072,):
                for batch in BATCHES if not quick else (64,):
                    case = AttentionCase(shape["heads"], shape["topk"], kind, context, batch, csa_pool)
                    kernel_us = timer.graph_us(lambda: case.run(launch=launch))  # noqa: B023
                    torch_us = timer.median_us(case.reference, max_reps=50)
                    rows.append(result_row("attention", model, kind, context, batch, kernel_us, torch_us,
                                           case.bytes, case.flops, ceilings))  # fmt: skip
                    case = None
                    torch.cuda.empty_cache()
    return rows


def bench_indexer(timer: Timer, ceilings: dict, quick: bool) -> list[dict]:
    key_pool = torch.randn(KEY_POOL_ROWS, INDEX_DIM, device=DEVICE, dtype=torch.bfloat16)
    rows = []
    for context in CONTEXTS if not quick else (1048576,):
        for batch in BATCHES if not quick else (1, 64):
            case = IndexerCase(context, batch, key_pool)
            kernel_us = timer.graph_us(case.scores)
            torch_us = timer.median_us(case.reference_scores, max_reps=20)
            rows.append(result_row("index scores", "both", "csa", context, batch, kernel_us, torch_us,
                                   case.score_bytes, case.score_flops, ceilings))  # fmt: skip
            scores = case.scores()
            for model, shape in MODELS.items():
                k = shape["topk"]
                kernel_us = timer.graph_us(lambda: top_k(scores, case.lengths, k))  # noqa: B023
                torch_us = timer.median_us(lambda: scores.topk(k, dim=-1), max_reps=100)  # noqa: B023
                top_bytes = scores.numel() * 4 + batch * k * 4
                rows.append(result_row("top-k", model, "csa", context, batch, kernel_us, torch_us,
                                       top_bytes, 0.0, ceilings))  # fmt: skip
            case = scores = None
            torch.cuda.empty_cache()
    return rows


def bench_topk_stages(timer: Timer) -> list[dict]:
    """Where the top-k's time goes at 262,144 scores: the sampled threshold, then keeping and selecting."""
    from sglang_dsv4.kernels import topk as kernels

    rows = []
    for batch in (1, 64):
        scores = torch.randn(batch, 262144, device=DEVICE)
        lengths = torch.full((batch,), 262144, device=DEVICE).int()
        for k in (512, 1024):
            thresholds = torch.empty(batch, device=DEVICE)
            threshold = partial(sampled_threshold, scores, lengths, thresholds, k)
            threshold()
            rows.append(
                {
                    "batch": batch,
                    "k": k,
                    "all_us": timer.graph_us(partial(top_k, scores, lengths, k)),
                    "threshold_us": timer.graph_us(threshold),
                    "keep_select_us": timer.graph_us(partial(kernels._keep_and_select, scores, lengths, k, thresholds)),
                }
            )
    return rows


def sampled_threshold(scores: torch.Tensor, lengths: torch.Tensor, thresholds: torch.Tensor, k: int) -> None:
    from sglang_dsv4.kernels import topk as kernels

    kernels._sampled_threshold_kernel[(scores.shape[0],)](
        scores, scores.stride(0), lengths, thresholds, k, RUNS=kernels.SAMPLE_RUNS, RUN=kernels.RUN_LENGTH,
        MARGIN=kernels.SAMPLE_MARGIN, EXTRA=kernels.SAMPLE_EXTRA, num_warps=4,
    )  # fmt: skip


def result_row(kernel, model, kind, context, batch, kernel_us, torch_us, bytes_moved, flops, ceilings) -> dict:
    floor, bound = floor_us(bytes_moved, flops, ceilings)
    return {
        "kernel": kernel, "model": model, "kind": kind, "context": context, "batch": batch,
        "us": kernel_us, "torch_us": torch_us, "speedup": torch_us / kernel_us,
        "bytes": bytes_moved, "flops": flops, "floor_us": floor, "bound": bound, "of_floor": floor / kernel_us,
    }  # fmt: skip


def overlap(previous: torch.Tensor, current: torch.Tensor, k: int) -> float:
    shared = 0
    for a, b in zip(previous.cpu().tolist(), current.cpu().tolist(), strict=True):
        shared += len({x for x in a if x >= 0} & {x for x in b if x >= 0})
    return shared / (len(previous) * k)


def bench_temporal_synthetic(timer: Timer) -> list[dict]:
    """Score streams ``s' = s + noise``: the noise level sets the step-to-step overlap of the top-k."""
    rows = []
    width = 262144
    for batch in (1, 64):
        base = torch.randn(batch, width, device=DEVICE)
        lengths = torch.full((batch,), width, device=DEVICE).int()
        for k in (512, 1024):
            previous = top_k(base, lengths, k)
            for noise in (0.02, 0.05, 0.1, 0.15, 0.2, 0.3):
                scores = base + noise * torch.randn_like(base)
                current = temporal_top_k(scores, lengths, k, previous)
                exact = same_sets(current, top_k_reference(scores, lengths, k), scores)
                plain_us = timer.graph_us(lambda: top_k(scores, lengths, k))  # noqa: B023
                temporal_us = timer.graph_us(lambda: temporal_top_k(scores, lengths, k, previous))  # noqa: B023
                rows.append({"stream": f"synthetic noise {noise}", "batch": batch, "k": k, "width": width,
                             "overlap": overlap(previous, current, k), "plain_us": plain_us,
                             "temporal_us": temporal_us, "speedup": plain_us / temporal_us,
                             "exact": exact})  # fmt: skip
    return rows


def tiny_model_streams(path: Path, context: int, steps: int) -> dict[int, list[torch.Tensor]]:
    """The shipped tiny model's indexer scores, per ratio-4 layer, at each of ``steps`` greedy decode steps
    after a ``context``-token prompt of real code: one ``[visible entries]`` float32 tensor per step."""
    from benchmarks.indexer_streams import score_streams, source_prompt
    from sglang_dsv4 import load_model

    return score_streams(load_model(path, device="cuda"), source_prompt(context), steps, chunk=4096)


def bench_temporal_tiny(timer: Timer, path: Path, context: int) -> list[dict]:
    rows = []
    for layer, streams in tiny_model_streams(path, context, steps=33).items():
        rows += temporal_rows(timer, f"tiny model layer {layer}, {context} tokens", streams)
    return rows


def temporal_rows(timer: Timer, name: str, streams: list[torch.Tensor]) -> list[dict]:
    rows = []
    for k in (16, 512):
        for batch in (1, 64):
            plain_total = temporal_total = 0.0
            overlaps, exact = [], True
            for before, now in zip(streams[:-1], streams[1:], strict=True):
                width = now.shape[0]
                lengths = torch.full((batch,), width, device=DEVICE).int()
                scores = now[None].expand(batch, -1).contiguous()
                previous_scores = before[None].expand(batch, -1).contiguous()
                previous = top_k(previous_scores, torch.full_like(lengths, before.shape[0]), k)
                current = temporal_top_k(scores, lengths, k, previous)
                exact &= same_sets(current, top_k_reference(scores, lengths, k), scores)
                overlaps.append(overlap(previous[:1], current[:1], k))
                plain_total += timer.graph_us(lambda: top_k(scores, lengths, k), max_reps=100)  # noqa: B023
                temporal_total += timer.graph_us(
                    lambda: temporal_top_k(scores, lengths, k, previous),  # noqa: B023
                    max_reps=100,
                )
            steps = len(streams) - 1
            rows.append({"stream": f"{name} ({streams[-1].shape[0]} entries)", "batch": batch,
                         "k": k, "width": streams[-1].shape[0], "overlap": statistics.mean(overlaps),
                         "plain_us": plain_total / steps, "temporal_us": temporal_total / steps,
                         "speedup": plain_total / temporal_total, "exact": exact})  # fmt: skip
    return rows


def sweep_attention_launch(timer: Timer) -> list[dict]:
    """Tile sizes of the attention kernel at batch 64 (ratio-4 layers), to pick the defaults."""
    csa_pool = torch.randn(CSA_POOL_ROWS // 4, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
    shapes = [LaunchShape(64, 64, 8, 2), LaunchShape(64, 32, 8, 3), LaunchShape(32, 64, 8, 2),
              LaunchShape(32, 64, 4, 2)]  # fmt: skip
    rows = []
    for model, shape in MODELS.items():
        case = AttentionCase(shape["heads"], shape["topk"], "csa", 131072, 64, csa_pool)
        for launch in shapes:
            for splits in (1, 2):
                try:
                    us = timer.graph_us(lambda: case.run(launch=launch, splits=splits))  # noqa: B023
                except Exception as error:  # a shape the compiler refuses (shared memory, registers)
                    rows.append({"model": model, "launch": str(launch), "splits": splits, "error": str(error)[:200]})
                    continue
                rows.append({"model": model, "launch": str(launch), "splits": splits, "us": us})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."), help="where results.json goes")
    parser.add_argument("--quick", action="store_true", help="batch 64 and one context only")
    parser.add_argument("--sweep", action="store_true", help="also sweep the attention kernel's tile sizes")
    parser.add_argument("--tiny-context", type=int, default=32768, help="prompt length of the tiny-model stream")
    parser.add_argument("--profile", action="store_true", help="run one attention and one top-k call, for ncu")
    parser.add_argument("--only-tiny", action="store_true", help="the network check and the tiny-model rows alone")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.profile:
        profile_once()
        return
    began = time.time()
    timer = Timer(budget_ms=40)
    results: dict[str, object] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                  "triton": triton.__version__}  # fmt: skip
    path = shipped_checkpoint()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.only_tiny:
        results["checks"] = guarded(lambda: [check_network(path)], "network check")
        sections = {"temporal_tiny_model": lambda: bench_temporal_tiny(timer, path, args.tiny_context)}
    else:
        results["ceilings"] = ceilings = measure_ceilings(timer)
        print(f"ceilings: copy {ceilings['copy_tbps']:.2f} TB/s, bf16 matmul {ceilings['matmul_tflops']:.0f} TFLOP/s")
        network = guarded(lambda: [check_network(path)], "network check")
        results["checks"] = check_attention() + check_indexer() + network
        launches: dict[str, LaunchShape] = {}
        if args.sweep:
            results["sweep"] = guarded(lambda: sweep_attention_launch(timer), "sweep")
            for row in results["sweep"]:
                print(json.dumps(row), flush=True)
            launches = best_launches(results["sweep"])
        results["launches"] = {model: str(launch) for model, launch in launches.items()}
        results["topk_stages"] = guarded(lambda: bench_topk_stages(timer), "top-k stages")
        for row in results["topk_stages"]:
            print(json.dumps(row), flush=True)
        sections = {
            "attention": lambda: bench_attention(timer, ceilings, args.quick, launches),
            "indexer": lambda: bench_indexer(timer, ceilings, args.quick),
            "temporal": lambda: bench_temporal_synthetic(timer),
            "temporal_tiny_model": lambda: bench_temporal_tiny(timer, path, args.tiny_context),
        }
    for check in results["checks"]:
        print(("PASS " if check["ok"] else "FAIL ") + json.dumps(check), flush=True)
    for name, section in sections.items():
        results[name] = guarded(section, name)
        results["seconds"] = time.time() - began
        (args.out / "results.json").write_text(json.dumps(results, indent=1))  # kept if a later section dies
    print_tables(results)


def best_launches(sweep: list[dict]) -> dict[str, LaunchShape]:
    """The fastest tile sizes per model in the sweep (splits stay automatic in the main table)."""
    best: dict[str, tuple[float, LaunchShape]] = {}
    for row in sweep:
        if "us" in row and (row["model"] not in best or row["us"] < best[row["model"]][0]):
            best[row["model"]] = (row["us"], eval(row["launch"], {"LaunchShape": LaunchShape}))
    return {model: launch for model, (_, launch) in best.items()}


def profile_once() -> None:
    """One V4-Flash batch-64 attention call and one top-k call, eagerly: the run to put under ``ncu``."""
    csa_pool = torch.randn(CSA_POOL_ROWS // 4, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
    AttentionCase(64, 512, "csa", 131072, 64, csa_pool).run()
    scores = torch.randn(64, 262144, device=DEVICE)
    top_k(scores, torch.full((64,), 262144, device=DEVICE).int(), 512)
    torch.cuda.synchronize()


def guarded(section: Callable[[], list[dict]], name: str) -> list[dict]:
    """Run one section; a failure is recorded and printed, and the run goes on to the next."""
    try:
        return section()
    except Exception as error:
        print(f"SECTION FAILED: {name}: {error!r}", flush=True)
        traceback.print_exc()
        return [{"section": name, "error": repr(error), "ok": False}]


def print_tables(results: dict) -> None:
    print("\nkernel | model | kind | context | batch | us | torch us | speedup | floor us (bound) | of floor")
    for row in results.get("attention", []) + results.get("indexer", []):
        if "error" in row:
            continue
        print(f"{row['kernel']} | {row['model']} | {row['kind']} | {row['context']} | {row['batch']} | "
              f"{row['us']:.1f} | {row['torch_us']:.1f} | {row['speedup']:.1f}x | "
              f"{row['floor_us']:.1f} ({row['bound']}) | {row['of_floor']:.0%}")  # fmt: skip
    print("\nstream | batch | k | width | overlap | plain us | temporal us | speedup | exact")
    for row in results.get("temporal", []) + results["temporal_tiny_model"]:
        if "error" in row:
            continue
        print(f"{row['stream']} | {row['batch']} | {row['k']} | {row['width']} | {row['overlap']:.2f} | "
              f"{row['plain_us']:.1f} | {row['temporal_us']:.1f} | {row['speedup']:.2f}x | {row['exact']}")  # fmt: skip
    print(f"\n{sum(c['ok'] for c in results['checks'])}/{len(results['checks'])} checks passed; "
          f"{results['seconds']:.0f} s")  # fmt: skip


if __name__ == "__main__":
    main()
