"""One batched decode step of one attention layer on the GPU, captured in a CUDA graph, against its floors.

``python benchmarks/engine_step.py [--out DIR] [--quick] [--kv-dtypes bf16,fp8]`` on a CUDA host (the H200: torch 2.11,
Triton 3.6; nothing on this path imports SGLang). In one run it

1. measures the ceilings (device-to-device copy bandwidth, a bf16 8192^3 product;
   :mod:`kernels.attention_indexer`'s);
2. for V4-Flash and V4-Pro dims (``sglang_dsv4/configs``), each layer kind (window only,
   ratio 4, ratio 128), batch 1, 8, 64, 256 and contexts 8K and 128K (bf16 KV, and with
   ``--kv-dtypes bf16,fp8`` FP8 pools in the same run; every request
   at the context's last position, distinct rows per request), builds the layer's pools and
   request tables, and captures the served decode step in a ``torch.cuda.CUDAGraph``: the
   decode index built on the device (:class:`~sglang_dsv4.attention_backend.batched.DecodeGraphIndex`),
   then :func:`~sglang_dsv4.attention_backend.batched.attend` and the output projection;
3. replays it on new inputs (other hidden states) and checks the output and every row it wrote
   bitwise equal to the same step run eagerly from the same pool state;
4. times, each as a replayed graph: the whole step; the decode index build alone (with the forward's rope
   tables; once per forward in serving, shared by every layer); the layer's step without it (what each layer
   adds to a forward); the projections alone (query, KV, output, compressor and indexer
   projections) against their weight-bytes floor; the attention core alone (the indexer's
   top-k and the sparse softmax over window, entries and sink, on selections staged from the
   step) against its KV-bytes floor;
5. side by side, the versions the batched core chose between: the layer's compressors (and its
   indexer's) through the Triton decode kernel and through the batched torch pools it replaced;
   for ratio-4 layers, the step's top-k (``indexer.exact_top_k``) and ``torch.topk`` on scores of the step's width;
6. at batch 64 and 8K, times the per-request path in the same run: the network's
   ``Attention`` request by request on per-request state (what the reference backend runs,
   without its pool gathers, so an upper bound on its speed).

7. composes each model's whole step from its layer kinds (43 V4-Flash layers, 61 V4-Pro layers, one index
   build; :func:`composed_steps`), with and without the projections, and budgets *ours* by layer kind and part
   (compressors, scoring, top-k, attention; :func:`budgets`);
8. with ``--verify-drafts 1,3``, a speculative verify step of ``1 + k`` tokens per request (the MTP layer's
   ``k`` drafts and the token they follow) through the batched core's extend path and the output projection,
   over an index built once, against the decode step's own layer step (``verify{k}_vs_decode``).

Bytes are counted as distinct requests move them: window 128 rows (staged), ratio-4 layers ``index_topk``
selected entries and all ``context / 4`` indexer keys, ratio-128 layers all ``context / 128`` entries, every row
as the pools store it (bf16 values, or FP8 rows: 584 B a window row or entry and 144 B a key at V4's dims).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from dataclasses import dataclass
from functools import partial
from itertools import product
from pathlib import Path

import torch

from sglang_dsv4.attention_backend import batched
from sglang_dsv4.config import DeepseekV4Config, named_config
from sglang_dsv4.kernels import topk
from sglang_dsv4.kernels.dispatch import sparse_attention
from sglang_dsv4.kernels.indexer import exact_top_k
from sglang_dsv4.kernels.kv_format import PoolFormats
from sglang_dsv4.kernels.selection import KVSelection
from sglang_dsv4.memory_pool.layout import STATE_DTYPE, PoolLayout
from sglang_dsv4.memory_pool.ledger import KV_DTYPES
from sglang_dsv4.model.attention import Attention
from sglang_dsv4.model.rope import ForwardRope, Rotary

sys.path.insert(0, str(Path(__file__).parent / "kernels"))  # the kernel benchmarks' timer and ceilings
from attention_indexer import Timer, floor_us, measure_ceilings

DEVICE = torch.device("cuda")
DTYPE = torch.bfloat16
KINDS = {"window": 0, "csa": 4, "hca": 128}
BATCHES = (1, 8, 64, 256)
CONTEXTS = (8192, 131072)


@dataclass
class LayerPools:
    """One layer's pool tensors and request tables, in the attributes the batched core reads."""

    window: list[torch.Tensor]
    compressed: dict[tuple[int, str], torch.Tensor]
    state: dict[tuple[int, str], torch.Tensor]
    previous_state: dict[tuple[int, str], torch.Tensor]
    checkpoint_state: dict[tuple[int, str], torch.Tensor]
    window_table: torch.Tensor
    entry_table: dict[int, torch.Tensor]
    formats: PoolFormats  # how the window, entry and indexer-key rows are stored

    def records(self) -> list[torch.Tensor]:
        return [*self.state.values(), *self.previous_state.values(), *self.checkpoint_state.values()]

    def written(self) -> list[torch.Tensor]:
        """Every tensor a step writes."""
        return [*self.records(), *self.compressed.values(), self.window[-1]]


def build_attention(config: DeepseekV4Config, kind: str) -> tuple[int, Attention]:
    layer = next(i for i in range(config.num_layers) if config.layer_kind(i) == kind)
    plain = Rotary(config.rope_head_dim, config.rope_theta, None)
    compress = Rotary(config.rope_head_dim, config.compress_rope_theta, config.yarn)
    torch.manual_seed(layer)
    attention = Attention(config, layer, plain, compress).to(DEVICE, DTYPE)
    with torch.no_grad():
        for parameter in attention.parameters():
            parameter.normal_(0, parameter.shape[-1] ** -0.5 if parameter.dim() > 1 else 0.1)
    return layer, attention


def build_pools(
    config: DeepseekV4Config, layer: int, batch: int, context: int, kv_dtype: torch.dtype = DTYPE
) -> LayerPools:
    """Request row ``i + 1`` (row 0 is the padding row) at ``context - 1`` tokens, with its own rows, stored
    as ``kv_dtype`` stores them (bf16 values, or FP8 rows: ``sglang_dsv4/kernels/kv_format.py``)."""
    rows, window = batch + 1, config.sliding_window
    layout = PoolLayout(config, kv_dtype)
    formats = layout.formats
    window_table = torch.zeros(rows, context + 1, dtype=torch.int64, device=DEVICE)
    held = torch.arange(context - window - 1, context, device=DEVICE)
    window_table[1:, held] = 1 + torch.arange(batch * len(held), device=DEVICE).view(batch, -1)
    window_rows = formats.entries.encode(torch.randn(1 + batch * len(held), config.head_dim, device=DEVICE))
    # Every ratio's table (the tables are the whole model's); the rows of this layer's ratio only.
    ratios = (config.csa_rate, config.hca_rate)
    entry_table = {r: torch.zeros(rows, context // r + 1, dtype=torch.int64, device=DEVICE) for r in ratios}
    compressed = {}
    for buffer in layout.compressed_buffers():
        if buffer.layer != layer:
            continue
        blocks = context // buffer.ratio
        entry_table[buffer.ratio][1:, :blocks] = 1 + torch.arange(batch * blocks, device=DEVICE).view(batch, blocks)
        values = torch.randn(1 + batch * blocks, buffer.dim, device=DEVICE)
        compressed[(layer, buffer.kind)] = layout.format_of(buffer).encode(values.to(DTYPE))
    records = {
        (b.layer, b.kind): torch.zeros(rows, b.pools, 3, b.dim, dtype=STATE_DTYPE, device=DEVICE)
        for b in layout.state_buffers()
        if b.layer == layer
    }
    return LayerPools(
        [window_rows] * (layer + 1),
        compressed,
        records,
        {k: v.clone() for k, v in records.items()},
        {k: v.clone() for k, v in records.items()},
        window_table,
        entry_table,
        layout.formats,
    )


class DecodeStep:
    """The served decode step of one layer, from static inputs, capturable."""

    def __init__(self, config: DeepseekV4Config, attention: Attention, layer: int, pools: LayerPools, batch: int):
        self.attention, self.layer, self.pools = attention, layer, pools
        self.graph_index = batched.DecodeGraphIndex(batch, pools, config, DEVICE)
        self.graph_index.stage_checkpoints({})
        self.rows = torch.arange(1, batch + 1, device=DEVICE)
        self.seq_lens = torch.full((batch,), pools.window_table.shape[1] - 1, device=DEVICE)
        self.x = torch.randn(batch, config.hidden_size, device=DEVICE, dtype=DTYPE)

    def __call__(self) -> torch.Tensor:
        return self.layer_step(self.graph_index.build(self.rows, self.seq_lens))

    def layer_step(self, index: batched.ForwardIndex) -> torch.Tensor:
        """The step's part each layer runs: attention and the output projection, over a built index."""
        return self.attention.project_out(batched.attend(self.attention, self.layer, self.x, index, self.pools))


class VerifyStep:
    """A speculative verify step of one layer: the last ``1 + drafts`` tokens of every request (the
    verified token and the MTP layer's drafts) through the batched core's extend path, over an index
    built once before it (as each forward builds one for every layer), then the output projection."""

    def __init__(self, step: DecodeStep, config: DeepseekV4Config, drafts: int):
        batch, context, tokens = len(step.rows), step.pools.window_table.shape[1] - 1, 1 + drafts
        plan = batched.BatchPlan(step.rows.tolist(), [context - tokens] * batch, [tokens] * batch)
        self.step, self.index = step, batched.build_index(plan, step.pools, config, DEVICE)
        self.x = torch.randn(batch * tokens, config.hidden_size, device=DEVICE, dtype=DTYPE)

    def __call__(self) -> torch.Tensor:
        step = self.step
        return step.attention.project_out(batched.attend(step.attention, step.layer, self.x, self.index, step.pools))


class Compressors:
    """The step's compressor advances alone (the layer's and its indexer's), through ``advance``:
    ``batched._advance_one_token_each`` (the Triton decode kernel, on CUDA) or ``batched._advance_pooled`` (torch);
    the copy of each record one step back that ``batched._advance`` makes first is not in either."""

    def __init__(self, step: DecodeStep, advance):
        self.step, self.advance = step, advance
        self.index = step.graph_index.build(step.rows, step.seq_lens)
        attention, layer = step.attention, step.layer
        pools = step.pools
        entries = batched._Rows(pools.compressed[(layer, "entries")], pools.formats.entries)
        self.jobs = [(attention.compressor, entries, (layer, "compressor"))]
        if attention.indexer is not None:
            keys = batched._Rows(pools.compressed[(layer, "indexer_keys")], pools.formats.indexer_keys)
            self.jobs.append((attention.indexer.compressor, keys, (layer, "indexer")))

    def __call__(self) -> None:
        for compressor, rows, records in self.jobs:
            self.advance(compressor, self.step.x, self.index, rows, batched._records(self.step.pools, records))


def top_k_pair_us(config: DeepseekV4Config, step: DecodeStep, context: int, timer: Timer) -> tuple[float, float]:
    """The step's top-k (``indexer.exact_top_k``, the kernel its shapes choose) and ``torch.topk``
    (``topk.top_k_reference``) on random scores of the step's shape: one row per request, the ratio-4 table's
    width, ``context / 4`` of them visible."""
    width = step.pools.entry_table[config.csa_rate].shape[1]
    scores = torch.randn(step.rows.shape[0], width, device=DEVICE)
    lengths = torch.full((step.rows.shape[0],), context // config.csa_rate, dtype=torch.int32, device=DEVICE)
    k = config.index_topk
    return (
        timer.graph_us(partial(exact_top_k, scores, lengths, k)),
        timer.graph_us(partial(topk.top_k_reference, scores, lengths, k)),
    )


def capture(run) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run.output = run()
    return graph


def replay_equals_eager(step: DecodeStep, graph: torch.cuda.CUDAGraph, output: torch.Tensor) -> dict[str, bool]:
    """Replay on new hidden states against the eager step from the same pool state: the output, and
    every row the step wrote but the padding rows 0 (where every request of a decode step parks the
    writes it discards, in an order that is not fixed)."""
    before = [t.clone() for t in step.pools.records()]
    step.x.copy_(torch.randn_like(step.x))
    eager = step()
    written = [t[1:].clone() for t in step.pools.written()]
    for record, saved in zip(step.pools.records(), before, strict=True):
        record.copy_(saved)
    graph.replay()
    same_writes = all(torch.equal(a[1:], b) for a, b in zip(step.pools.written(), written, strict=True))
    return {"output_bitwise": torch.equal(output, eager), "writes_bitwise": same_writes}


class Projections:
    """The step's projections alone: query, KV, compressor and indexer, output (roped at tables ``rope`` computed
    before, as a forward's index computes them once for every layer)."""

    def __init__(self, step: DecodeStep, rope: ForwardRope):
        self.step, self.rope = step, rope

    def __call__(self) -> torch.Tensor:
        attention, x = self.step.attention, self.step.x
        q_residual, q, _, _, _ = attention.project(x, self.rope)
        if attention.compressor is not None:
            attention.compressor.wkv(x), attention.compressor.wgate(x)
        if attention.indexer is not None:
            attention.indexer.queries(x, q_residual, self.rope)
            attention.indexer.compressor.wkv(x), attention.indexer.compressor.wgate(x)
        return attention.project_out(q)


class AttentionCore:
    """The step's attention core on selections staged from it: the indexer's top-k, then the softmax."""

    def __init__(self, step: DecodeStep, config: DeepseekV4Config):
        attention, pools = step.attention, step.pools
        index = step.graph_index.build(step.rows, step.seq_lens)
        q_residual, self.q, kv, self.cos, self.sin = attention.project(step.x, index.rope)
        formats = pools.formats
        staged = torch.cat([formats.entries.encode(kv), pools.window[step.layer][index.window.previous_slots]])
        self.window = KVSelection(staged, index.window.indices, index.window.lengths, formats.entries)
        no_entries = index.window.indices[:, :0], torch.zeros_like(index.window.lengths)
        self.compressed = KVSelection(staged, *no_entries, formats.entries)
        self.select = None
        if attention.compressor is not None:
            reads = index.entries[attention.compressor.ratio]
            entries = pools.compressed[(step.layer, "entries")]
            if attention.indexer is None:
                self.compressed = KVSelection(entries, reads.per_token, reads.visible, formats.entries)
            else:
                keys = pools.compressed[(step.layer, "indexer_keys")]
                self.entries, self.reads, self.index = entries, reads, index

                def select() -> KVSelection:
                    rows, counts = batched.select_entries(
                        attention.indexer, step.x, q_residual, index, keys, formats.indexer_keys
                    )
                    return KVSelection(entries, rows, counts, formats.entries)

                self.select = select
        self.sink = attention.attn_sink.float()
        self.scale = attention.head_dim**-0.5

    def __call__(self) -> torch.Tensor:
        compressed = self.select() if self.select is not None else self.compressed
        return sparse_attention(self.q, self.window, compressed, self.sink, self.cos, self.sin, scale=self.scale)


def core_bytes(config: DeepseekV4Config, kind: str, batch: int, context: int, formats: PoolFormats) -> float:
    """What the core reads: the staged window, entries and indexer keys as the pools store them."""
    entry, key = formats.entries.row_bytes, formats.indexer_keys.row_bytes
    per_request = config.sliding_window * entry
    if kind == "csa":
        per_request += config.index_topk * entry + context // 4 * key
    elif kind == "hca":
        per_request += context // 128 * entry
    return per_request * batch


def core_flops(config: DeepseekV4Config, kind: str, batch: int, context: int) -> float:
    entries = config.sliding_window + {"window": 0, "csa": config.index_topk, "hca": context // 128}[kind]
    flops = 4 * batch * config.num_heads * entries * config.head_dim
    if kind == "csa":
        flops += 2 * batch * config.index_n_heads * (context // 4) * config.index_head_dim
    return flops


def per_request_us(config: DeepseekV4Config, attention: Attention, batch: int, context: int) -> float:
    """The network's ``Attention`` request by request at position ``context - 1``, eagerly."""
    start = context - 1
    states = []
    for _ in range(batch):
        state = attention.new_state(DTYPE, DEVICE)
        state.window = torch.randn(config.sliding_window, config.head_dim, device=DEVICE, dtype=DTYPE)
        if state.compressor is not None:
            ratio = attention.compressor.ratio
            state.compressor.entries = torch.randn(start // ratio, config.head_dim, device=DEVICE, dtype=DTYPE)
        if state.indexer is not None:
            state.indexer.entries = torch.randn(start // 4, config.index_head_dim, device=DEVICE, dtype=DTYPE)
        states.append(state)
    x = torch.randn(batch, 1, config.hidden_size, device=DEVICE, dtype=DTYPE)

    def run() -> None:
        for i, state in enumerate(states):
            attention(x[i], start, state.clone())

    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(3):
        began = time.perf_counter()
        run()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    return 1e6 * sorted(times)[1]


def weight_bytes(attention: Attention) -> int:
    return sum(p.numel() * p.element_size() for p in attention.parameters())


@torch.no_grad()
def bench(
    model: str,
    kind: str,
    batch: int,
    context: int,
    timer: Timer,
    ceilings: dict,
    kv_dtype: torch.dtype = DTYPE,
    verify_drafts: tuple[int, ...] = (),
) -> dict:
    config = named_config(model)
    layer, attention = build_attention(config, kind)
    pools = build_pools(config, layer, batch, context, kv_dtype)
    step = DecodeStep(config, attention, layer, pools, batch)
    graph = capture(step)
    row = {"model": model, "kind": kind, "batch": batch, "context": context, "kv": str(kv_dtype).removeprefix("torch.")}
    row.update(replay_equals_eager(step, graph, step.output))
    row["step_us"] = timer.median_us(graph.replay)
    del graph
    # Once per forward in serving (every layer reads the same index); here inside each layer's step.
    row["index_us"] = timer.graph_us(partial(step.graph_index.build, step.rows, step.seq_lens))
    row["layer_us"] = timer.graph_us(partial(step.layer_step, step.graph_index.build(step.rows, step.seq_lens)))
    if attention.compressor is not None:
        row["compressors_us"] = timer.graph_us(Compressors(step, batched._advance_one_token_each))
        row["compressors_torch_us"] = timer.graph_us(Compressors(step, batched._advance_pooled))
    if attention.indexer is not None:
        row["topk_step_us"], row["topk_torch_us"] = top_k_pair_us(config, step, context, timer)
    positions = torch.full((batch,), context - 1, device=DEVICE)
    row["projections_us"] = timer.graph_us(Projections(step, ForwardRope.of_model(positions, config)))
    row["projections_floor_us"], row["projections_bound"] = floor_us(
        weight_bytes(attention), 2 * batch * weight_bytes(attention) / DTYPE.itemsize, ceilings
    )
    core = AttentionCore(step, config)
    row["core_us"] = timer.graph_us(core)
    if core.select is not None:
        row["selection_us"] = timer.graph_us(core.select)  # the indexer's scoring and top-k
    row["core_floor_us"], row["core_bound"] = floor_us(
        core_bytes(config, kind, batch, context, pools.formats), core_flops(config, kind, batch, context), ceilings
    )
    row["core_of_floor"] = row["core_floor_us"] / row["core_us"]
    for drafts in verify_drafts:
        # Against the decode step's own layer step (row["layer_us"]), graphed alike; eager if it will not capture.
        verify = VerifyStep(step, config, drafts)
        try:
            row[f"verify{drafts}_layer_us"] = timer.graph_us(verify)
        except Exception as error:  # noqa: BLE001 - a host sync in the extend path: time it eagerly instead
            torch.cuda.synchronize()
            row[f"verify{drafts}_layer_us"] = timer.median_us(verify)
            row[f"verify{drafts}_eager_because"] = repr(error)[:120]
        row[f"verify{drafts}_vs_decode"] = row[f"verify{drafts}_layer_us"] / row["layer_us"]
    row["projections_of_floor"] = row["projections_floor_us"] / row["projections_us"]
    if batch == 64 and context == 8192:
        row["per_request_us"] = per_request_us(config, attention, batch, context)
        row["step_vs_per_request"] = row["per_request_us"] / row["step_us"]
    del step, pools
    torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="batch 8 and 64 at 8K only")
    parser.add_argument("--models", default="flash,pro")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--tag", default="", help="a suffix of the JSON file's name")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    parser.add_argument(
        "--kv-dtypes", default="bf16", help="pools to build, in turn: bf16, fp8 (DeepSeek's FP8 rows), or both"
    )
    parser.add_argument("--verify-drafts", default="", help="also time verify steps of 1 + k tokens, e.g. 1,3")
    args = parser.parse_args()
    verify_drafts = tuple(int(k) for k in args.verify_drafts.split(",") if k)
    kv_dtypes = [KV_DTYPES[name] for name in args.kv_dtypes.split(",")]
    timer = Timer(budget_ms=150)
    ceilings = measure_ceilings(timer)
    print(json.dumps(ceilings), flush=True)
    batches, contexts = [int(b) for b in args.batches.split(",")], [int(c) for c in args.contexts.split(",")]
    if args.quick:
        batches, contexts = (8, 64), (8192,)
    rows = []
    for model in args.models.split(","):
        for context in contexts:
            for batch in batches:
                for kind, kv_dtype in product(kinds_of(named_config(model), args.kinds.split(",")), kv_dtypes):
                    rows.append(guarded(model, kind, batch, context, timer, ceilings, kv_dtype, verify_drafts))
                    print(json.dumps(rows[-1]), flush=True)
                    if args.out:  # as it goes: a run cut short keeps what it measured
                        args.out.mkdir(parents=True, exist_ok=True)
                        result = {"ceilings": ceilings, "rows": rows, "composed": composed_steps(rows)}
                        result["budgets"] = budgets(rows)
                        (args.out / f"engine_step{args.tag}.json").write_text(json.dumps(result, indent=1))


def budgets(rows: list[dict]) -> list[dict]:
    """*Ours* of each composed step (:func:`composed_steps`) by layer kind and part, µs summed over the model's layers
    of each kind: the compressors (each layer's and its indexer's decode kernels), the indexer's scoring (its
    selection less the step's top-k timed alone) and top-k, the attention (the core less the selection), each timed
    alone as its own replayed graph; ``hidden_us``, their sum less *ours* (the layer step less its projections): what
    of them runs beside the projections, less the rest of ours (norms and rope, the window row's write); and the
    index build, once a step."""
    budgets = []
    keys = {(r["model"], r["batch"], r["context"], r["kv"]) for r in rows if "error" not in r}
    for model, batch, context, kv in sorted(keys):
        config = named_config(model)
        counts = Counter(config.layer_kind(i) for i in range(config.num_layers))
        found = {r["kind"]: r for r in rows if (r["model"], r["batch"], r["context"], r["kv"]) == (model, batch, context, kv)}
        if not all(kind in found and "error" not in found[kind] for kind in counts):
            continue
        budget = {"model": model, "batch": batch, "context": context, "kv": kv, "index_us": found[next(iter(counts))]["index_us"]}
        for kind, layers in counts.items():
            row = found[kind]
            parts = {"compressors": row.get("compressors_us", 0.0)}
            if "selection_us" in row:
                parts["scoring"] = row["selection_us"] - row["topk_step_us"]
                parts["top_k"] = row["topk_step_us"]
            parts["attention"] = row["core_us"] - row.get("selection_us", 0.0)
            ours = row["layer_us"] - row["projections_us"]
            parts["hidden"] = sum(parts.values()) - ours
            budget[kind] = {"layers": layers, "ours_us": layers * ours}
            budget[kind] |= {f"{part}_us": layers * us for part, us in parts.items()}
        budgets.append(budget)
    return budgets


def composed_steps(rows: list[dict]) -> list[dict]:
    """Each model's whole decode step composed from its layer rows, per batch and context: every layer of the
    config (V4-Flash 43, V4-Pro 61) at its kind's layer step, plus one index build. ``ours_us``: the layer steps
    without their projections timed alone (the part this package writes; the compressors and the indexer run beside
    the query and KV projections, so this is what our part adds to the step, less than its kernels' own time);
    ``with_projections_us``: the layer steps whole.
    Sums of separately replayed graphs, not one graph of the whole step."""
    composed = []
    keys = {(r["model"], r["batch"], r["context"], r["kv"]) for r in rows if "error" not in r}
    for model, batch, context, kv in sorted(keys):
        config = named_config(model)
        layers = [config.layer_kind(i) for i in range(config.num_layers)]
        found = {r["kind"]: r for r in rows if (r["model"], r["batch"], r["context"], r["kv"]) == (model, batch, context, kv)}
        if not all(kind in found and "error" not in found[kind] for kind in set(layers)):
            continue
        index = found[layers[-1]]["index_us"]
        composed.append(
            {
                "model": model, "batch": batch, "context": context, "kv": kv, "layers": len(layers),
                "ours_us": index + sum(found[k]["layer_us"] - found[k]["projections_us"] for k in layers),
                "with_projections_us": index + sum(found[k]["layer_us"] for k in layers),
            }
        )  # fmt: skip
    return composed


def kinds_of(config: DeepseekV4Config, asked: list[str]) -> list[str]:
    """The asked layer kinds the config has (V4-Pro has no window-only layer)."""
    return [kind for kind in asked if any(config.layer_kind(i) == kind for i in range(config.num_layers))]


def guarded(
    model: str,
    kind: str,
    batch: int,
    context: int,
    timer: Timer,
    ceilings: dict,
    kv_dtype: torch.dtype = DTYPE,
    verify_drafts: tuple[int, ...] = (),
) -> dict:
    """One configuration's row, or the error that stopped it (the others still run)."""
    try:
        return bench(model, kind, batch, context, timer, ceilings, kv_dtype, verify_drafts)
    except Exception as error:  # noqa: BLE001 - a benchmark row reports its failure and the run goes on
        torch.cuda.empty_cache()
        row = {"model": model, "kind": kind, "batch": batch, "context": context, "kv": str(kv_dtype)}
        return {**row, "error": repr(error)[:300]}


if __name__ == "__main__":
    main()
