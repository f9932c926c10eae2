"""Fused mHC and the compressor on the GPU: checks, then timings against floors, in one run.

``python benchmarks/kernels/mhc_compressor.py [--out DIR] [--quick]`` on a CUDA host (the H200:
torch 2.11, Triton 3.6, no SGLang needed). In one run it

1. measures the ceilings: device-to-device copy bandwidth (bytes read + written) and an
   8192^3 bf16 matrix product on random data;
2. checks every kernel on the GPU against the torch reference on fresh random inputs (relative
   error against float64; outputs start as NaN, so an element never written fails), checks that
   a CUDA graph of the decode-step kernels replays to the same results on new inputs, and
   runs the tiny model's forward (prefill and decode steps) with the kernels on CUDA against
   the CPU reference;
3. times, for V4-Flash (hidden 4096) and V4-Pro (hidden 7168) at decode batch 1, 64, 256 and
   1024: the fused post + next pre (the hot path, twice per layer) and the fused pre, against
   the torch chain (post, pre, the sublayer's RMSNorm); and the compressor's decode step
   (ratio-4 entries of 512 and indexer keys of 128, ratio-128 entries of 512; the same for
   both models) and a prefill of 8192 tokens, against the model's torch reference;
4. at batch 64 and 1024, times the post + pre's two launches alone and the post + pre at other
   shapes of its partials pass;
5. at batch 64 and 1024, the post + pre on one rank's token shard under TP 2, 4 and 8 (the
   residual sharded by tokens, ``sglang_dsv4/model/mhc_communicator.py``) against the whole
   batch every rank runs after an all-reduce. ``--token-shards`` runs the ceilings and this alone.

Our kernels are timed as served: captured in a CUDA graph, several calls per graph on distinct
input sets (so the data of one call is not in L2 for the next), median over replays. The
torch references run eagerly, as the issue's baselines were taken. Bytes are counted as each
input read once and each output written once; the floor is the larger of bytes over the copy
bandwidth and FLOPs over the matrix rate.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch
import triton

from sglang_dsv4.kernels import compressor as compressor_kernel
from sglang_dsv4.kernels import mhc as mhc_kernel
from sglang_dsv4.model.compressor import Compressor, CompressorState, SoftmaxPool
from sglang_dsv4.model.mhc import HyperConnection
from sglang_dsv4.model.norms import RMSNorm
from sglang_dsv4.model.rope import Rotary

HIDDEN = {"flash": 4096, "pro": 7168}
BATCHES = (1, 64, 256, 1024)
STREAMS, MIXES = 4, 24
HEAD_DIM, INDEX_DIM, ROPE_DIM = 512, 128, 64
COMPRESSORS = {
    "ratio4": (4, True, HEAD_DIM),
    "ratio4_indexer": (4, True, INDEX_DIM),
    "ratio128": (128, False, HEAD_DIM),
}
PREFILL_TOKENS = 8192
L2_BYTES = 60 * 2**20
DTYPE = torch.bfloat16


# --- timing -----------------------------------------------------------------------------------


def time_graph(calls: list[Callable[[], object]], replays: int = 30) -> float:
    """Median seconds per call of ``calls`` (one per input set) captured into one CUDA graph."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / len(calls))
    return statistics.median(times)


def time_eager(call: Callable[[], object], rep_ms: int = 200) -> float:
    return triton.testing.do_bench(call, warmup=25, rep=rep_ms, return_mode="median") / 1e3


def input_sets(bytes_per_call: int) -> int:
    """How many distinct input sets keep one call's data out of L2 for the next (at most 32)."""
    return max(1, min(32, math.ceil(2 * L2_BYTES / max(bytes_per_call, 1))))


def ceilings() -> dict[str, float]:
    source = torch.randn(2**29, device="cuda", dtype=torch.float32)  # 2 GiB
    target = torch.empty_like(source)
    copy_s = time_eager(lambda: target.copy_(source))
    copy_bw = 2 * source.numel() * 4 / copy_s
    a = torch.randn(8192, 8192, device="cuda", dtype=DTYPE)
    b = torch.randn(8192, 8192, device="cuda", dtype=DTYPE)
    matmul_s = time_eager(lambda: a @ b)
    return {"copy_bytes_per_s": copy_bw, "bf16_flops_per_s": 2 * 8192**3 / matmul_s}


def floor_s(bytes_moved: float, flops: float, ceiling: dict[str, float]) -> tuple[float, str]:
    memory, compute = bytes_moved / ceiling["copy_bytes_per_s"], flops / ceiling["bf16_flops_per_s"]
    return (memory, "memory") if memory >= compute else (compute, "compute")


# --- checks ------------------------------------------------------------------------------------


class Poisoned:
    """Within the block, float tensors from ``new_empty`` / ``empty_like`` start as NaN."""

    def __enter__(self):
        self.saved = torch.Tensor.new_empty, torch.empty_like
        new_empty, empty_like = self.saved

        def poisoned(t):
            return t.fill_(float("nan")) if t.is_floating_point() else t

        torch.Tensor.new_empty = lambda self, *a, **k: poisoned(new_empty(self, *a, **k))
        torch.empty_like = lambda *a, **k: poisoned(empty_like(*a, **k))

    def __exit__(self, *exc):
        torch.Tensor.new_empty, torch.empty_like = self.saved


def rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    if torch.isnan(actual).any():
        return float("nan")
    expected = expected.double()
    return ((actual.double() - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def random_mhc(hidden: int, seed: int) -> tuple[HyperConnection, RMSNorm]:
    generator = torch.Generator().manual_seed(seed)
    config = SimpleNamespace(hc_mult=STREAMS, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6, hidden_size=hidden)
    hc, norm = HyperConnection(config), RMSNorm(hidden, 1e-6)
    with torch.no_grad():
        hc.fn.copy_(torch.randn(hc.fn.shape, generator=generator) / math.sqrt(STREAMS * hidden))
        hc.base.copy_(torch.randn(hc.base.shape, generator=generator))
        hc.scale.copy_(torch.rand(3, generator=generator) + 0.5)
        norm.weight.copy_(1 + 0.1 * torch.randn(hidden, generator=generator))
    return hc.to("cuda", DTYPE).requires_grad_(False), norm.to("cuda", DTYPE).requires_grad_(False)


def mixing(hc: HyperConnection) -> mhc_kernel.MixingWeights:
    return mhc_kernel.MixingWeights(hc.fn, hc.base, hc.scale, hc.sinkhorn_iters, hc.hc_eps, hc.norm_eps)


def mhc_inputs(tokens: int, hidden: int) -> dict[str, torch.Tensor]:
    return {
        "streams": torch.randn(tokens, STREAMS, hidden, device="cuda", dtype=DTYPE),
        "output": torch.randn(tokens, hidden, device="cuda", dtype=DTYPE),
        "post": 2 * torch.rand(tokens, STREAMS, device="cuda"),
        "comb": torch.softmax(torch.randn(tokens, STREAMS, STREAMS, device="cuda"), dim=-1),
    }


def torch_mhc(hc: HyperConnection, norm: RMSNorm, inputs: dict[str, torch.Tensor], with_post: bool):
    """The model's reference chain: (post,) the next pre, the next sublayer's RMSNorm."""
    streams = inputs["streams"]
    if with_post:
        streams = HyperConnection.post(inputs["output"], streams, inputs["post"], inputs["comb"])
    x, post, comb = hc.pre(streams)
    return streams, norm(x), post, comb


def check_mhc(hidden: int, tokens: int) -> dict[str, float]:
    hc, norm = random_mhc(hidden, seed=tokens)
    inputs = mhc_inputs(tokens, hidden)
    with Poisoned():
        streams, x, post, comb = mhc_kernel.fused_post_pre(
            inputs["output"], inputs["streams"], inputs["post"], inputs["comb"], mixing(hc), norm.weight, norm.eps
        )
        pre_x, pre_post, pre_comb = mhc_kernel.fused_pre(inputs["streams"], mixing(hc), norm.weight, norm.eps)
    hc64, norm64 = copy.deepcopy(hc).double(), copy.deepcopy(norm).double()
    expected_streams = HyperConnection.post(
        inputs["output"].double(), inputs["streams"].double(), inputs["post"].double(), inputs["comb"].double()
    )
    ex, epost, ecomb = hc64.pre(streams.double())  # the next pre reads the streams as stored
    px, ppost, pcomb = hc64.pre(inputs["streams"].double())
    return {
        "post_pre.streams": rel(streams, expected_streams),
        "post_pre.x": rel(x, norm64(ex)),
        "post_pre.post": rel(post, epost),
        "post_pre.comb": rel(comb, ecomb),
        "pre.x": rel(pre_x, norm64(px)),
        "pre.post": rel(pre_post, ppost),
        "pre.comb": rel(pre_comb, pcomb),
    }


def random_compressor(ratio: int, overlapping: bool, dim: int, seed: int) -> Compressor:
    generator = torch.Generator().manual_seed(seed)
    compressor = Compressor(64, dim, ratio, overlapping, Rotary(ROPE_DIM, 160000.0, None), 1e-6)
    with torch.no_grad():
        compressor.ape.copy_(torch.randn(compressor.ape.shape, generator=generator))
        compressor.norm.weight.copy_(1 + 0.1 * torch.randn(dim, generator=generator))
    return compressor.to("cuda", DTYPE).requires_grad_(False)


def compressor_weights(compressor: Compressor) -> compressor_kernel.CompressorWeights:
    return compressor_kernel.CompressorWeights(
        ape=compressor.ape,
        norm_weight=compressor.norm.weight,
        norm_eps=compressor.norm.eps,
        inv_freq=compressor.rotary.inv_freq_on(torch.device("cuda")),
        ratio=compressor.ratio,
        overlapping=compressor.overlapping,
    )


def random_states(batch: int, ratio: int, overlapping: bool, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions and online states ``[batch, pools, 3, dim]`` as a running decode would hold them."""
    positions = torch.randint(0, 64 * ratio, (batch,), device="cuda")
    pools = 3 if overlapping else 1
    state = torch.empty(batch, pools, 3, dim, device="cuda")
    state[:, :, 0] = torch.randn(batch, pools, dim, device="cuda")
    state[:, :, 1] = 1 + torch.rand(batch, pools, dim, device="cuda")
    state[:, :, 2] = torch.randn(batch, pools, dim, device="cuda")
    return positions, state


def state_of(record: torch.Tensor, overlapping: bool, position: int, ratio: int, dtype: torch.dtype) -> CompressorState:
    """The model's state for one request from its record, its pools emptied where the position says
    they are (the kernel never reads those), with ``dtype`` entries."""
    pools = [SoftmaxPool(r[0].clone(), r[1].clone(), r[2].clone()) for r in record]
    dim = record.shape[-1]
    if position % ratio == 0:
        pools[0] = SoftmaxPool.empty((dim,), record.device)
        if overlapping:
            pools[1] = SoftmaxPool.empty((dim,), record.device)
    if overlapping and position < ratio:
        pools[2] = SoftmaxPool.empty((dim,), record.device)
    entries = torch.zeros(position // ratio, dim, dtype=dtype, device=record.device)
    return CompressorState(entries, *pools) if overlapping else CompressorState(entries, pools[0], None, None)


def record_of(state: CompressorState) -> torch.Tensor:
    pools = [state.current] if state.next_half is None else [state.current, state.next_half, state.previous_half]
    return torch.stack([torch.stack([p.max, p.denom, p.weighted]) for p in pools])


def torch_decode(compressor: Compressor, kv, gate, positions: list[int], states: list[CompressorState]) -> None:
    """The model's reference, one request at a time (what the per-request network runs)."""
    for i, position in enumerate(positions):
        compressor.pool_reference(kv[i : i + 1], gate[i : i + 1], position, states[i])


def check_compressor(name: str, batch: int) -> dict[str, float | bool]:
    ratio, overlapping, dim = COMPRESSORS[name]
    compressor = random_compressor(ratio, overlapping, dim, seed=batch)
    series = 2 if overlapping else 1
    positions, state = random_states(batch, ratio, overlapping, dim)
    corner_cases = torch.tensor([0, ratio - 1, ratio, 2 * ratio - 1], device="cuda")[: min(batch, 4)]
    positions[: corner_cases.shape[0]] = corner_cases
    kv = torch.randn(batch, series * dim, device="cuda", dtype=DTYPE)
    gate = torch.randn(batch, series * dim, device="cuda", dtype=DTYPE)
    kernel_state = state.clone()
    rows = torch.arange(batch, device="cuda", dtype=torch.int32)
    with Poisoned():
        entries = compressor_kernel.compress_decode(
            kv, gate, positions, kernel_state, rows, compressor_weights(compressor)
        )
    reference = copy.deepcopy(compressor).double()
    expected_entries, actual_entries, expected_states, actual_states = [], [], [], []
    absent_entries_zero = empty_pools_match = True
    for i, position in enumerate(positions.tolist()):
        expected = state_of(state[i].double(), overlapping, position, ratio, torch.float64)
        if reference.pool_reference(kv[i : i + 1].double(), gate[i : i + 1].double(), position, expected):
            expected_entries.append(expected.entries[-1])
            actual_entries.append(entries[i])
        else:
            absent_entries_zero &= bool((entries[i] == 0).all())
        expected_record = record_of(expected)
        finite = torch.isfinite(expected_record)
        empty_pools_match &= torch.equal(finite, torch.isfinite(kernel_state[i]))
        expected_states.append(expected_record[finite])
        actual_states.append(kernel_state[i][finite])
    return {
        "entries": rel(torch.stack(actual_entries), torch.stack(expected_entries)) if actual_entries else 0.0,
        "state": rel(torch.cat(actual_states), torch.cat(expected_states)),
        "absent_entries_zero": absent_entries_zero,
        "empty_pools_match": empty_pools_match,
    }


def check_prefill(name: str, tokens: int) -> dict[str, float]:
    ratio, overlapping, dim = COMPRESSORS[name]
    compressor = random_compressor(ratio, overlapping, dim, seed=tokens)
    series = 2 if overlapping else 1
    kv = torch.randn(tokens, series * dim, device="cuda", dtype=DTYPE)
    gate = torch.randn(tokens, series * dim, device="cuda", dtype=DTYPE)
    c64 = copy.deepcopy(compressor).double()
    reference = c64.new_state(torch.float64, "cuda")
    start = 5  # a partial block in the state first
    c64.pool_reference(kv[:start].double(), gate[:start].double(), 0, reference)
    state = record_of(reference).float()[None].contiguous()
    before = reference.entries.shape[0]
    c64.pool_reference(kv[start:].double(), gate[start:].double(), start, reference)
    rows = torch.zeros(1, dtype=torch.int32, device="cuda")
    with Poisoned():
        entries = compressor_kernel.compress_extend(
            kv[start:], gate[start:], [start], [tokens - start], state, rows, compressor_weights(compressor)
        )
    expected = record_of(reference)
    finite = torch.isfinite(expected)
    return {"entries": rel(entries, reference.entries[before:]), "state": rel(state[0][finite], expected[finite])}


def check_graph_replay() -> dict[str, float]:
    """A decode step's kernels captured once, replayed on new inputs, equal the eager calls."""
    hidden, tokens = 4096, 64
    hc, norm = random_mhc(hidden, seed=1)
    compressor = random_compressor(4, True, HEAD_DIM, seed=1)
    static = mhc_inputs(tokens, hidden)
    positions, state = random_states(tokens, 4, True, HEAD_DIM)
    kv = torch.randn(tokens, 2 * HEAD_DIM, device="cuda", dtype=DTYPE)
    gate = torch.randn_like(kv)
    rows = torch.arange(tokens, device="cuda", dtype=torch.int32)
    weights, mixing_weights = compressor_weights(compressor), mixing(hc)

    def step(state_tensor):
        out = mhc_kernel.fused_post_pre(
            static["output"], static["streams"], static["post"], static["comb"], mixing_weights, norm.weight, norm.eps
        )
        entries = compressor_kernel.compress_decode(kv, gate, positions, state_tensor, rows, weights)
        return (*out, entries)

    graph_state = state.clone()
    step(graph_state.clone())
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(graph_state)
    fresh = mhc_inputs(tokens, hidden)
    for key, value in fresh.items():
        static[key].copy_(value)
    kv.copy_(torch.randn_like(kv))
    positions.copy_(torch.randint(0, 256, (tokens,), device="cuda"))
    graph_state.copy_(state)
    graph.replay()
    eager_state = state.clone()
    eager = step(eager_state)
    errors = {f"output{i}": rel(a, b) for i, (a, b) in enumerate(zip(captured, eager, strict=True))}
    errors["state"] = rel(graph_state.nan_to_num(neginf=-1.0), eager_state.nan_to_num(neginf=-1.0))
    return errors


def check_tiny_model() -> dict[str, float]:
    """The tiny model with the kernels on CUDA against the CPU reference: a prefill, then decode steps.
    In bfloat16 the model itself departs from float32; the CPU's bfloat16 departure is the yardstick."""
    from sglang_dsv4 import load_model
    from sglang_dsv4.tiny import build_checkpoint

    path = build_checkpoint(Path(tempfile.mkdtemp()) / "tiny")
    ids = torch.randint(0, 1024, (300,), generator=torch.Generator().manual_seed(0))
    prompt = 250  # then decode steps across ratio-4 block ends and the ratio-128 one at position 255

    def logits(model) -> torch.Tensor:
        state = model.new_state()
        steps = [model(ids[:prompt], state)] + [model(ids[i : i + 1], state) for i in range(prompt, len(ids))]
        return torch.cat([step.cpu() for step in steps])

    reference = logits(load_model(path))
    return {
        "gpu.float32_vs_cpu.float32": rel(logits(load_model(path, device="cuda")), reference),
        "gpu.bfloat16_vs_cpu.float32": rel(logits(load_model(path, dtype=torch.bfloat16, device="cuda")), reference),
        "cpu.bfloat16_vs_cpu.float32": rel(logits(load_model(path, dtype=torch.bfloat16)), reference),
    }


# --- timings -----------------------------------------------------------------------------------


def mhc_bytes(tokens: int, hidden: int, with_post: bool) -> int:
    """Each input read once, each output written once (bf16 streams, fn in the model's dtype)."""
    element = 2
    streams = tokens * STREAMS * hidden * element
    fn = MIXES * STREAMS * hidden * element
    mixing_out = tokens * (STREAMS + STREAMS * STREAMS) * 4
    x = tokens * hidden * element
    if with_post:
        return streams + x + mixing_out + fn + streams + x + mixing_out  # + output in, new streams out
    return streams + fn + x + mixing_out


def mhc_flops(tokens: int, hidden: int, with_post: bool) -> int:
    width = STREAMS * hidden
    flops = 2 * tokens * width * MIXES + 2 * tokens * width  # projection, sum of squares
    flops += 2 * tokens * width + 4 * tokens * hidden  # collapse, norm
    if with_post:
        flops += 2 * tokens * width * (STREAMS + 1)
    return flops


def time_mhc(model: str, tokens: int, ceiling: dict[str, float] | None, with_reference: bool = True) -> list[dict]:
    hidden = HIDDEN[model]
    rows = []
    for with_post in (True, False) if with_reference else (True,):
        bytes_moved, flops = mhc_bytes(tokens, hidden, with_post), mhc_flops(tokens, hidden, with_post)
        sets = input_sets(bytes_moved)
        layers = [random_mhc(hidden, seed=i) for i in range(min(sets, 4))]
        inputs = [mhc_inputs(tokens, hidden) for _ in range(sets)]
        calls = []
        for i, data in enumerate(inputs):
            hc, norm = layers[i % len(layers)]
            weights = mixing(hc)
            if with_post:
                calls.append(
                    lambda d=data, w=weights, n=norm: mhc_kernel.fused_post_pre(
                        d["output"], d["streams"], d["post"], d["comb"], w, n.weight, n.eps
                    )
                )
            else:
                calls.append(lambda d=data, w=weights, n=norm: mhc_kernel.fused_pre(d["streams"], w, n.weight, n.eps))
        ours = time_graph(calls)
        if not with_reference:
            rows.append({"us": ours * 1e6})
            continue
        reference = time_eager(lambda w=with_post, d=inputs[0], m=layers[0]: torch_mhc(*m, d, w))
        floor, bound = floor_s(bytes_moved, flops, ceiling)
        kernel = f"mhc.{'post_pre' if with_post else 'pre'}"
        rows.append(row(kernel, model, tokens, ours, reference, bytes_moved, flops, floor, bound))
        del inputs, calls
    return rows


def mhc_breakdown(model: str, tokens: int) -> dict[str, float]:
    """Microseconds of the post + pre's two launches, each alone."""
    hidden = HIDDEN[model]
    hc, norm = random_mhc(hidden, seed=0)
    weights = mixing(hc)
    sets = input_sets(mhc_bytes(tokens, hidden, True))
    inputs = [mhc_inputs(tokens, hidden) for _ in range(sets)]
    new_streams = [torch.empty_like(d["streams"]) for d in inputs]

    def partials(d, out):
        return mhc_kernel._launch_partials(d["output"], d["streams"], d["post"], d["comb"], out, weights)

    done = [partials(d, out) for d, out in zip(inputs, new_streams, strict=True)]
    return {
        "partials_us": 1e6
        * time_graph([lambda d=d, o=o: partials(d, o) for d, o in zip(inputs, new_streams, strict=True)]),
        "collapse_us": 1e6
        * time_graph(
            [
                lambda o=o, p=p: mhc_kernel._launch_collapse(o, p, weights, norm.weight, norm.eps)
                for o, p in zip(new_streams, done, strict=True)
            ]
        ),
    }


def mhc_sweep(model: str, tokens: int) -> dict[str, float]:
    """Microseconds of the post + pre at other partials-pass shapes (channels per step, programs wanted)."""
    defaults = mhc_kernel.BLOCK_CHANNELS, mhc_kernel.PROGRAMS_WANTED
    results = {}
    try:
        for channels, programs in ((64, 528), (64, 2112), (128, 1056), (32, 4224)):
            mhc_kernel.BLOCK_CHANNELS, mhc_kernel.PROGRAMS_WANTED = channels, programs
            results[f"{channels}ch_{programs}prog_us"] = time_mhc(model, tokens, None, with_reference=False)[0]["us"]
    finally:
        mhc_kernel.BLOCK_CHANNELS, mhc_kernel.PROGRAMS_WANTED = defaults
    return results


def compressor_bytes(batch: int, ratio: int, overlapping: bool, dim: int) -> int:
    series, pools = (2, 3) if overlapping else (1, 1)
    projections = 2 * batch * series * dim * 2
    state = 2 * batch * pools * 3 * dim * 4
    entries = batch * dim * 2 // ratio  # one entry per ratio tokens, on average
    return projections + state + entries + ratio * series * dim * 2


def time_compressor(name: str, batch: int, ceiling: dict[str, float]) -> dict:
    ratio, overlapping, dim = COMPRESSORS[name]
    compressor = random_compressor(ratio, overlapping, dim, seed=batch)
    weights = compressor_weights(compressor)
    series = 2 if overlapping else 1
    bytes_moved = compressor_bytes(batch, ratio, overlapping, dim)
    calls = []
    for _ in range(input_sets(bytes_moved)):
        positions, state = random_states(batch, ratio, overlapping, dim)
        kv = torch.randn(batch, series * dim, device="cuda", dtype=DTYPE)
        gate = torch.randn_like(kv)
        rows = torch.randperm(batch, device="cuda").to(torch.int32)
        calls.append(
            lambda kv=kv, gate=gate, p=positions, s=state, r=rows: compressor_kernel.compress_decode(
                kv, gate, p, s, r, weights
            )
        )
    ours = time_graph(calls)
    positions, state = random_states(batch, ratio, overlapping, dim)
    kv = torch.randn(batch, series * dim, device="cuda", dtype=DTYPE)
    gate = torch.randn_like(kv)
    # The reference loops over requests: time it over at most 64 and scale to the batch.
    timed_requests = min(batch, 64)
    position_list = positions[:timed_requests].tolist()
    states = [state_of(state[i], overlapping, p, ratio, DTYPE) for i, p in enumerate(position_list)]
    # Repeated steps from the same positions: the states drift, the work per step does not.
    reference = time_eager(lambda: torch_decode(compressor, kv, gate, position_list, states), rep_ms=300)
    reference *= batch / timed_requests
    flops = batch * dim * series * 12
    floor, bound = floor_s(bytes_moved, flops, ceiling)
    return row(f"compressor.decode.{name}", "both", batch, ours, reference, bytes_moved, flops, floor, bound)


def time_prefill(name: str, ceiling: dict[str, float]) -> dict:
    ratio, overlapping, dim = COMPRESSORS[name]
    compressor = random_compressor(ratio, overlapping, dim, seed=0)
    weights = compressor_weights(compressor)
    series = 2 if overlapping else 1
    tokens = PREFILL_TOKENS
    kv = torch.randn(tokens, series * dim, device="cuda", dtype=DTYPE)
    gate = torch.randn_like(kv)
    state = torch.zeros(1, 3 if overlapping else 1, 3, dim, device="cuda")
    rows = torch.zeros(1, dtype=torch.int32, device="cuda")
    ours = time_eager(lambda: compressor_kernel.compress_extend(kv, gate, [0], [tokens], state, rows, weights))
    fresh = compressor.new_state(DTYPE, "cuda")
    reference = time_eager(lambda: compressor.pool_reference(kv, gate, 0, fresh.clone()))
    bytes_moved = 2 * tokens * series * dim * 2 + tokens // ratio * dim * 2
    flops = tokens * series * dim * 8
    floor, bound = floor_s(bytes_moved, flops, ceiling)
    return row(f"compressor.prefill.{name}", "both", tokens, ours, reference, bytes_moved, flops, floor, bound)


def token_shards(model: str, tokens: int, ceiling: dict[str, float]) -> list[dict]:
    """The post + pre on ``ceil(tokens / tp)`` tokens (one rank's shard) against all ``tokens``."""
    hidden = HIDDEN[model]
    (full,) = time_mhc(model, tokens, ceiling, with_reference=False)
    rows = []
    for tp in (2, 4, 8):
        shard = -(-tokens // tp)
        (ours,) = time_mhc(model, shard, ceiling, with_reference=False)
        bytes_moved, flops = mhc_bytes(shard, hidden, True), mhc_flops(shard, hidden, True)
        floor, bound = floor_s(bytes_moved, flops, ceiling)
        rows.append({
            "model": model, "batch": tokens, "tp": tp, "shard_tokens": shard, "shard_us": ours["us"],
            "full_batch_us": full["us"], "full_over_shard": full["us"] / ours["us"],
            "shard_floor_us": floor * 1e6, "bound": bound, "of_floor": floor * 1e6 / ours["us"],
        })  # fmt: skip
    return rows


def row(kernel, model, batch, ours, reference, bytes_moved, flops, floor, bound) -> dict:
    return {
        "kernel": kernel,
        "model": model,
        "batch": batch,
        "us": ours * 1e6,
        "torch_us": reference * 1e6,
        "speedup": reference / ours,
        "bytes": bytes_moved,
        "flops": flops,
        "floor_us": floor * 1e6,
        "bound": bound,
        "of_floor": floor / ours,
    }


# --- main --------------------------------------------------------------------------------------


def section(name: str, results: dict, run: Callable[[], object]) -> None:
    try:
        results[name] = run()
    except Exception:  # one broken section must not cost the rest of the run
        results[name] = {"error": traceback.format_exc()}
    print(f"== {name}: {json.dumps(results[name], default=str)[:2000]}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="batch 64 and 1024 only")
    parser.add_argument("--token-shards", action="store_true", help="only the ceilings and the TP token shards")
    args = parser.parse_args()
    batches = (64, 1024) if args.quick else BATCHES
    torch.manual_seed(0)
    results: dict = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
    }
    section("ceilings", results, ceilings)
    ceiling = results["ceilings"]
    for model in HIDDEN:
        for batch in (64, 1024):
            section(f"shards.mhc.{model}.{batch}", results, lambda m=model, b=batch: token_shards(m, b, ceiling))
    if args.token_shards:
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "mhc_token_shards.json").write_text(json.dumps(results, indent=1, default=str))
        print_token_shards(results)
        return
    section("check.mhc", results, lambda: {f"{h}x{t}": check_mhc(h, t) for h in (4096, 7168) for t in (1, 64, 1024)})
    section(
        "check.compressor",
        results,
        lambda: {f"{n}x{b}": check_compressor(n, b) for n in COMPRESSORS for b in (1, 64, 1024)},
    )
    section("check.prefill", results, lambda: {n: check_prefill(n, 1029) for n in COMPRESSORS})
    section("check.graph_replay", results, check_graph_replay)
    section("check.tiny_model", results, check_tiny_model)
    timings: list[dict] = []
    results["timings"] = timings

    def timed(key: str, run: Callable[[], dict | list[dict]]) -> None:
        section(key, results, run)
        if "error" not in results[key]:
            timings.extend(results[key] if isinstance(results[key], list) else [results[key]])

    for model in HIDDEN:
        for batch in batches:
            timed(f"time.mhc.{model}.{batch}", lambda m=model, b=batch: time_mhc(m, b, ceiling))
    for model in HIDDEN:
        for batch in (64, 1024):
            section(f"breakdown.mhc.{model}.{batch}", results, lambda m=model, b=batch: mhc_breakdown(m, b))
            section(f"sweep.mhc.{model}.{batch}", results, lambda m=model, b=batch: mhc_sweep(m, b))
    for name in COMPRESSORS:
        for batch in batches:
            timed(f"time.compressor.{name}.{batch}", lambda n=name, b=batch: time_compressor(n, b, ceiling))
        timed(f"time.prefill.{name}", lambda n=name: time_prefill(n, ceiling))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "mhc_compressor.json").write_text(json.dumps(results, indent=1, default=str))
    print_token_shards(results)
    copy_tb, matmul_tf = ceiling["copy_bytes_per_s"] / 1e12, ceiling["bf16_flops_per_s"] / 1e12
    print(f"\ncopy {copy_tb:.2f} TB/s, bf16 matmul {matmul_tf:.0f} TFLOP/s")
    header = ("kernel", "model", "batch", "us", "torch us", "speedup", "floor us", "of floor")
    print("{:34} {:5} {:>5} {:>9} {:>10} {:>8} {:>9} {:>8} bound".format(*header))
    for t in timings:
        print(
            f"{t['kernel']:34} {t['model']:5} {t['batch']:>5} {t['us']:9.2f} {t['torch_us']:10.1f} {t['speedup']:8.1f}"
            f" {t['floor_us']:9.2f} {t['of_floor']:8.1%} {t['bound']}"
        )


def print_token_shards(results: dict) -> None:
    print("\nmHC post + pre per rank: one token shard under TP against the whole batch")
    print("{:5} {:>5} {:>3} {:>6} {:>9} {:>9} {:>7} {:>8} bound".format(
        "model", "batch", "tp", "shard", "shard us", "full us", "ratio", "of floor"))  # fmt: skip
    for key, rows in results.items():
        if key.startswith("shards.") and isinstance(rows, list):
            for r in rows:
                print(
                    f"{r['model']:5} {r['batch']:>5} {r['tp']:>3} {r['shard_tokens']:>6} {r['shard_us']:9.2f}"
                    f" {r['full_batch_us']:9.2f} {r['full_over_shard']:7.2f} {r['of_floor']:8.1%} {r['bound']}"
                )


if __name__ == "__main__":
    main()
