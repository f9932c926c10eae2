"""On several GPUs: mHC fused with the communicator, and expert dispatch under placement plans, in one run.

Two steps, because SGLang (and so its EPLB) cannot be installed on the GPU hosts::

    python benchmarks/multigpu.py prepare --out DIR              # on this CPU host
    python benchmarks/multigpu.py run --inputs DIR [--out DIR]   # on the GPU host: NCCL, one process a GPU

``prepare`` writes ``DIR/multigpu_inputs.pt``: V4-Flash's hash tables (random ``tid2eid``, seeded,
until a released table is at hand), token batches of the held-out part of the planning corpus
(``benchmarks/ep_planning.py``'s: licences, the standard library, the shared agent sessions) and,
for EP 2, 4 and 8 with and without one redundant slot per rank, the hash layers' placements from
SGLang's trivial layout, SGLang's ``deepseek`` EPLB and ``sglang_dsv4.moe.placement`` (both
planned from the planning part's token histogram).

``run`` starts one process per GPU (``--ranks``, default all; ``--backend gloo`` runs it on the
CPU, where ``--quick`` shrinks the shapes) and, for every TP / EP size the host has:

1. mHC with the communicator (``sglang_dsv4/model/mhc_communicator.py``), V4-Flash (hidden 4096)
   and V4-Pro (7168), decode batch 1, 64, 256, 1024: reduce-scatter of the sublayer's partial sums
   -> fused post + next pre + RMSNorm on the rank's token shard -> all-gather of the normed input,
   against all-reduce -> the fused pass on the whole batch on every rank; and, as the link's floor,
   the all-reduce alone and the reduce-scatter + all-gather alone of the same size;
2. expert dispatch of the three hash layers on the shipped token batches (each rank holds
   ``step tokens / ep`` of them): the (token, choice) pairs to the ranks of their slots with
   ``all_to_all_single``, the grouped expert GEMM over the rank's slots
   (:func:`sglang_dsv4.model.experts.grouped_experts`), the results back and combined; step time and
   the busiest rank's share of the pairs under each placement.

Times are medians over repetitions of the slowest rank, each repetition after a barrier, CUDA
events around the operation. Results: a table on stdout, ``DIR/multigpu.json`` with ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sglang_dsv4.config import named_config
from sglang_dsv4.model.experts import grouped_experts
from sglang_dsv4.moe.load import HashLoadPredictor, expected_hash_loads, random_hash_tables, token_histogram
from sglang_dsv4.moe.placement import Placement

INPUTS = "multigpu_inputs.pt"
HIDDEN = {"flash": 4096, "pro": 7168}
MHC_BATCHES = (1, 64, 256, 1024)
EP_SIZES = (2, 4, 8)
PLANS = ("SGLang trivial", "SGLang deepseek", "ours")
STEP_TOKENS, STEPS = 8192, 4


# --- prepare (CPU host, SGLang installed) -------------------------------------------------------


def prepare(out: Path, seed: int) -> Path:
    sys.path.insert(0, str(Path(__file__).parent))
    import ep_planning  # the corpus, its split and SGLang's EPLB, as that benchmark plans them

    parts: dict[str, list[str]] = {part: [] for part in ep_planning.PARTS}
    for name, text in ep_planning.documents():
        parts[ep_planning.part_of(name)].append(text)
    tokenizer = ep_planning.train_tokenizer(parts["tokenizer"])
    planning = torch.cat(ep_planning.tokenize(tokenizer, parts["planning"]))
    held_out = ep_planning.tokenize(tokenizer, parts["held-out"])
    steps = ep_planning.traffic_windows(held_out, STEP_TOKENS, seed=seed)[:STEPS]

    config = named_config("flash")
    tables = random_hash_tables(config, seed=seed)
    expected = expected_hash_loads(config, tables, token_histogram(planning, config.vocab_size))
    planners = {
        "SGLang trivial": ep_planning.unplanned,
        "SGLang deepseek": ep_planning.PLANNERS["SGLang deepseek"],
        "ours": ep_planning.PLANNERS["ours, histogram"],
    }
    plans = {
        f"ep{ep}.r{redundant}.{name}": plan(expected, expected[None], ep, redundant).physical_to_logical
        for ep in EP_SIZES
        for redundant in (0, ep)
        for name, plan in planners.items()
    }
    out.mkdir(parents=True, exist_ok=True)
    path = out / INPUTS
    torch.save({"tables": tables.to(torch.uint8), "steps": torch.stack(steps).int(), "plans": plans}, path)
    print(f"{path}: {len(plans)} placements, {len(steps)} steps of {STEP_TOKENS} tokens, tid2eid seed {seed}")
    return path


# --- timing ---------------------------------------------------------------------------------------


class Timer:
    def __init__(self, device: torch.device, repetitions: int):
        self.device, self.repetitions = device, repetitions

    def median_ms(self, call: Callable[[], object], group: dist.ProcessGroup) -> float:
        """The slowest rank's median milliseconds per call (two warm-up calls first)."""
        for _ in range(2):
            call()
        times = []
        for _ in range(self.repetitions):
            dist.barrier(group=group)
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                call()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                started = time.perf_counter()
                call()
                times.append((time.perf_counter() - started) * 1e3)
        slowest = torch.tensor([statistics.median(times)], dtype=torch.float64, device=self.device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
        return float(slowest)


# --- 1. mHC with the communicator -----------------------------------------------------------------


def time_mhc(tp: int, group: dist.ProcessGroup, timer: Timer, quick: bool) -> list[dict]:
    from sglang_dsv4.config import parse_config
    from sglang_dsv4.model.mhc import HyperConnection
    from sglang_dsv4.model.mhc_communicator import TokenShards, replicated_post_pre, sharded_post_pre
    from sglang_dsv4.model.norms import RMSNorm
    from sglang_dsv4.tiny import TINY_CONFIG

    device, rank = timer.device, dist.get_rank(group)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for model, hidden in HIDDEN.items():
        config = parse_config({**TINY_CONFIG, "hidden_size": hidden})
        torch.manual_seed(0)  # the same mixing weights and streams on every rank
        hc, norm = HyperConnection(config).to(device), RMSNorm(hidden, config.rms_norm_eps).to(device)
        with torch.no_grad():
            hc.fn.normal_(0, hidden**-0.5)
            hc.base.normal_()
        hc, norm = hc.to(dtype), norm.to(dtype)
        for batch in MHC_BATCHES[:2] if quick else MHC_BATCHES:
            streams = torch.randn(batch, config.hc_mult, hidden, device=device, dtype=dtype)
            _, post, comb = hc.pre(streams)
            partial = torch.randn(batch, hidden, device=device, dtype=dtype) * (rank + 1)
            shards = TokenShards(batch, tp, rank)
            shard = tuple(shards.take(t) for t in (streams, post, comb))
            reduced, gathered = partial.new_empty(shards.per_rank, hidden), partial.new_empty(shards.padded, hidden)

            def scatter_gather() -> None:
                dist.reduce_scatter_tensor(reduced, shards.pad(partial), group=group)
                dist.all_gather_into_tensor(gathered, reduced, group=group)

            with torch.no_grad():
                _, x_all, _, _ = replicated_post_pre(partial, streams, post, comb, hc, norm, group)
                _, x_sharded, _, _ = sharded_post_pre(partial, *shard, hc, norm, shards, group)
                x_error = float((x_sharded.float() - x_all.float()).norm() / x_all.float().norm())
                unfused = timer.median_ms(
                    lambda: replicated_post_pre(partial, streams, post, comb, hc, norm, group), group
                )
                fused = timer.median_ms(lambda: sharded_post_pre(partial, *shard, hc, norm, shards, group), group)
                all_reduce = timer.median_ms(lambda: dist.all_reduce(partial.clone(), group=group), group)
                rs_ag = timer.median_ms(scatter_gather, group)
            moved = 2 * (tp - 1) / tp * batch * hidden * partial.element_size()
            rows.append({
                "model": model, "tp": tp, "batch": batch, "all_reduce_then_full_us": unfused * 1e3,
                "sharded_us": fused * 1e3, "full_over_sharded": unfused / fused, "all_reduce_alone_us": all_reduce * 1e3,
                "rs_ag_alone_us": rs_ag * 1e3, "bytes_per_rank": moved, "link_GBps": moved / (all_reduce * 1e6),
                "x_rel_error": x_error,
            })  # fmt: skip
    return rows


# --- 2. expert dispatch under placements ----------------------------------------------------------


def dispatch_step(
    x: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    expert_weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    slots_per_rank: int,
    group: dist.ProcessGroup,
) -> tuple[torch.Tensor, int]:
    """One MoE layer's routed experts over EP: ``x [T, H]`` of this rank, ``slots, weights [T, k]``.

    Returns the combined output ``[T, H]`` and how many pairs this rank's experts ran.
    """
    ranks = dist.get_world_size(group)
    top_k = slots.shape[1]
    destination = (slots // slots_per_rank).flatten()
    order = torch.argsort(destination, stable=True)
    send_counts = torch.bincount(destination, minlength=ranks)
    receive_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(receive_counts, send_counts, group=group)
    send, receive = send_counts.tolist(), receive_counts.tolist()
    rows = x[order // top_k]
    local_slot = (slots.flatten() % slots_per_rank)[order]
    received = rows.new_empty(sum(receive), x.shape[1])
    received_slot = local_slot.new_empty(sum(receive))
    dist.all_to_all_single(received, rows, receive, send, group=group)
    dist.all_to_all_single(received_slot, local_slot, receive, send, group=group)
    ones = torch.ones(received.shape[0], 1, device=x.device)
    computed = grouped_experts(received, ones, received_slot[:, None], *expert_weights, limit=10.0)
    returned = rows.new_empty(rows.shape)
    dist.all_to_all_single(returned, computed, send, receive, group=group)
    scaled = returned * weights.flatten()[order, None].to(returned.dtype)
    return torch.zeros_like(x).index_add_(0, order // top_k, scaled), sum(receive)


def check_dispatch(ep: int, group: dist.ProcessGroup, device: torch.device, inputs: dict) -> float:
    """Relative error of :func:`dispatch_step` against the same pairs run locally over every slot.

    Small shapes (hidden 256, intermediate 128, float32), every slot's weights drawn from one seed
    on every rank, the hash layers' routing of the first shipped step under ``ours`` with
    redundant slots.
    """
    rank, config, hidden, inner = dist.get_rank(group), named_config("flash"), 256, 128
    placement = Placement(inputs["plans"][f"ep{ep}.r{ep}.ours"], ep, config.n_routed_experts)
    generator = torch.Generator().manual_seed(7)
    every_slot = [
        (torch.randn(placement.num_slots, *shape, generator=generator) * hidden**-0.5).to(device)
        for shape in ((inner, hidden), (hidden, inner), (inner, hidden))
    ]
    per_rank = 512 // ep
    step = inputs["steps"][0, : per_rank * ep].long()
    slots = HashLoadPredictor(config, inputs["tables"].long()).slots(step, placement)[0, rank * per_rank :][:per_rank]
    slots = slots.to(device)
    x = torch.randn(per_rank, hidden, generator=torch.Generator().manual_seed(rank)).to(device)
    weights = torch.rand(per_rank, config.num_experts_per_tok, generator=torch.Generator().manual_seed(rank))
    weights = weights.to(device)
    mine = slice(rank * placement.slots_per_rank, (rank + 1) * placement.slots_per_rank)
    local_weights = tuple(w[mine].contiguous() for w in every_slot)
    dispatched, _ = dispatch_step(x, slots, weights, local_weights, placement.slots_per_rank, group)
    expected = grouped_experts(x, weights, slots, *every_slot, limit=10.0)
    error = torch.tensor([float((dispatched - expected).norm() / expected.norm())], device=device)
    dist.all_reduce(error, op=dist.ReduceOp.MAX, group=group)
    return float(error)


def time_dispatch(ep: int, group: dist.ProcessGroup, timer: Timer, inputs: dict, quick: bool) -> list[dict]:
    device, rank = timer.device, dist.get_rank(group)
    config = named_config("flash")
    predictor = HashLoadPredictor(config, inputs["tables"].long())
    steps = inputs["steps"].long()
    hidden, inner = (256, 128) if quick else (config.hidden_size, config.moe_intermediate_size)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    step_tokens = steps.shape[1] // (8 if quick else 1)
    per_rank = step_tokens // ep
    rows = []
    for redundant in (0, ep):
        slots_per_rank = (config.n_routed_experts + redundant) // ep
        torch.manual_seed(rank)
        expert_weights = tuple(
            torch.randn(slots_per_rank, *shape, device=device, dtype=dtype) * hidden**-0.5
            for shape in ((inner, hidden), (hidden, inner), (inner, hidden))
        )
        for plan in PLANS:
            placement = Placement(inputs["plans"][f"ep{ep}.r{redundant}.{plan}"], ep, config.n_routed_experts)
            times, shares = [], []
            for step in steps[: 1 if quick else len(steps)]:
                step = step[:step_tokens]
                mine = slice(rank * per_rank, (rank + 1) * per_rank)
                layer_slots = predictor.slots(step, placement)[:, mine].to(device)  # [hash layers, T, k]
                x = torch.randn(per_rank, hidden, device=device, dtype=dtype)
                weights = torch.rand(per_rank, config.num_experts_per_tok, device=device)
                received = torch.zeros(ep, dtype=torch.long, device=device)

                def three_layers() -> None:
                    for slots in layer_slots:
                        dispatch_step(x, slots, weights, expert_weights, slots_per_rank, group)

                times.append(timer.median_ms(three_layers, group))
                for slots in layer_slots:
                    received[rank] += dispatch_step(x, slots, weights, expert_weights, slots_per_rank, group)[1]
                dist.all_reduce(received, group=group)
                shares.append(float(received.max() / received.double().mean()))
            rows.append({
                "ep": ep, "redundant": redundant, "placement": plan, "step_tokens": step_tokens,
                "three_layers_ms": statistics.mean(times), "busiest_over_mean_pairs": statistics.mean(shares),
            })  # fmt: skip
    return rows


# --- run ------------------------------------------------------------------------------------------


def run_rank(rank: int, ranks: int, port: int, backend: str, inputs_path: str, out: str | None, quick: bool) -> None:
    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks)
    try:
        inputs = torch.load(inputs_path)
        timer = Timer(device, repetitions=5 if quick else 20)
        sizes = [n for n in (2, 4, 8) if n <= ranks]
        groups = {n: dist.new_group(list(range(n))) for n in sizes}  # every rank creates every group
        results: dict = {"ranks": ranks, "backend": backend, "mhc": [], "dispatch": []}
        for n in sizes:
            if rank < n:
                results["mhc"] += time_mhc(n, groups[n], timer, quick)
                if n in EP_SIZES:
                    results.setdefault("check_dispatch_rel_error", {})[n] = check_dispatch(n, groups[n], device, inputs)
                    results["dispatch"] += time_dispatch(n, groups[n], timer, inputs, quick)
            dist.barrier()
        if rank == 0:
            report(results, Path(out) if out else None)
    finally:
        dist.destroy_process_group()


def report(results: dict, out: Path | None) -> None:
    print(f"\n{results['ranks']} ranks, {results['backend']}")
    print("mHC: all-reduce + full pass vs reduce-scatter + shard pass + all-gather (us)")
    print(
        f"{'model':5} {'tp':>3} {'batch':>5} {'AR+full':>9} {'sharded':>9} {'ratio':>6} {'AR alone':>9} {'RS+AG':>9}"
        " x rel error"
    )
    for r in results["mhc"]:
        print(
            f"{r['model']:5} {r['tp']:>3} {r['batch']:>5} {r['all_reduce_then_full_us']:9.1f} {r['sharded_us']:9.1f}"
            f" {r['full_over_sharded']:6.2f} {r['all_reduce_alone_us']:9.1f} {r['rs_ag_alone_us']:9.1f}"
            f" {r['x_rel_error']:.1e}"
        )
    print(
        f"\nexpert dispatch against the pairs run locally, relative error by EP: {results['check_dispatch_rel_error']}"
    )
    print("expert dispatch, three hash layers per step (ms) and the busiest rank's pairs over the mean")
    for r in results["dispatch"]:
        print(
            f"ep {r['ep']} +{r['redundant']:<2} {r['placement']:16} {r['three_layers_ms']:9.2f} ms"
            f"  busiest/mean {r['busiest_over_mean_pairs']:.3f}"
        )
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "multigpu.json").write_text(json.dumps(results, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    steps = parser.add_subparsers(dest="step", required=True)
    prepare_args = steps.add_parser("prepare", help="placements and token batches, on a host with SGLang")
    prepare_args.add_argument("--out", type=Path, required=True)
    prepare_args.add_argument("--seed", type=int, default=0, help="seed of tid2eid and of the held-out shuffle")
    run_args = steps.add_parser("run", help="the measurements, one process per GPU")
    run_args.add_argument("--inputs", type=Path, required=True, help=f"the folder holding {INPUTS}")
    run_args.add_argument("--out", type=Path, default=None)
    run_args.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    run_args.add_argument("--ranks", type=int, default=None, help="processes (default: every GPU)")
    run_args.add_argument("--quick", action="store_true", help="small shapes, few repetitions (a CPU check)")
    args = parser.parse_args()
    if args.step == "prepare":
        prepare(args.out, args.seed)
        return
    ranks = args.ranks or torch.cuda.device_count()
    if ranks < 2:
        raise SystemExit(f"multigpu.py run needs at least 2 ranks, got {ranks}")
    from sglang_dsv4.launch import free_port

    mp.spawn(
        run_rank,
        args=(ranks, free_port(), args.backend, str(args.inputs / INPUTS), args.out and str(args.out), args.quick),
        nprocs=ranks,
    )


if __name__ == "__main__":
    main()
