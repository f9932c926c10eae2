"""Where the indexer's scoring over FP8 keys spends its time, on the H200 (issue 46).

``python benchmarks/kernels/fp8_scoring.py --out DIR`` on a CUDA host (no SGLang); ``--ncu`` runs one launch of
each kernel only (for ``ncu --clock-control none``). At V4-Flash's indexer dims, 128K context (32,768 keys a
row), batch 64 and 256, keys read through a table of distinct rows (random values):

* the shipped :func:`sglang_dsv4.kernels.indexer._index_scores_kernel` over bf16 and over FP8 keys, at several
  pipeline depths (``num_stages``), tiles and warps; ``--operands``: FP8 keys against bf16 or fp16 operands;
  ``--padded``: FP8 key rows padded to 144 B (16-byte aligned codes; a layout not shipped);
* ``--fp8-queries``: the scoring with the queries quantized to E4M3 as well (:func:`fp8_queries`), both operands of
  the dot FP8, the keys' codes loaded straight into it (no conversion): its time, and its error and top-512 overlap
  against the torch scores of bf16 queries (what quantizing the queries costs the choice);
* ``--stages-dropped``: stage-dropping copies of its FP8 loop (``MODE``): the key bytes loaded and summed as
  integers (no conversion, no dot: the load path alone); loaded and converted to bf16 and summed (no dot); the dot
  on bf16 operands; the dot on the E4M3 values converted to fp16 with the queries cast to fp16 (unscaled).

Each timed alone (L2 flushed) against its bytes floor (every key row read once as stored, the scores written),
FP8 outputs checked against the shipped kernel. One JSON line a case.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from sglang_dsv4.config import named_config
from sglang_dsv4.kernels import indexer
from sglang_dsv4.kernels.fp8_rows import fp8_key_rows
from sglang_dsv4.kernels.kv_format import Fp8KeyRows

sys.path.insert(0, str(Path(__file__).parent))
from attention_indexer import Timer, measure_ceilings  # noqa: E402

DEVICE = torch.device("cuda")
CONTEXT = 131072


@triton.jit
def _stage_kernel(
    q_ptr, q_row_stride, q_head_stride, weights_ptr, weights_row_stride, keys_ptr, table_ptr, table_row_stride,
    lengths_ptr, scores_ptr, scores_row_stride, width, scale,
    HEADS: tl.constexpr, DIM: tl.constexpr, BLOCK_KEYS: tl.constexpr, TILES: tl.constexpr,
    SCALE_OFFSET: tl.constexpr, ROW_BYTES: tl.constexpr, MODE: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    heads = tl.arange(0, HEADS)
    channels = tl.arange(0, DIM)
    q = tl.load(q_ptr + row * q_row_stride + heads[:, None] * q_head_stride + channels[None, :])
    weights = tl.load(weights_ptr + row * weights_row_stride + heads) * scale
    length = tl.load(lengths_ptr + row)
    for tile in range(TILES):
        slots = (tl.program_id(1) * TILES + tile) * BLOCK_KEYS + tl.arange(0, BLOCK_KEYS)
        visible = slots < length
        key_rows = tl.load(table_ptr + row * table_row_stride + slots, mask=visible, other=0).to(tl.int64)
        if MODE == 0:  # the bytes alone
            row_bytes = keys_ptr + key_rows[:, None] * ROW_BYTES
            codes = tl.load(row_bytes + channels[None, :], mask=visible[:, None], other=0)
            scale_pointers = (keys_ptr + key_rows * ROW_BYTES + SCALE_OFFSET).to(tl.pointer_type(tl.float32))
            scales = tl.load(scale_pointers, mask=visible, other=0.0)
            scores = tl.sum(codes.to(tl.int32), 1).to(tl.float32) * scales
        elif MODE == 1:  # bytes and conversion
            k, key_scales = fp8_key_rows(keys_ptr, key_rows, visible, DIM, SCALE_OFFSET, ROW_BYTES, tl.bfloat16)
            scores = tl.sum(k.to(tl.float32), 1) * key_scales
        elif MODE == 2:  # the shipped loop
            k, key_scales = fp8_key_rows(keys_ptr, key_rows, visible, DIM, SCALE_OFFSET, ROW_BYTES, tl.bfloat16)
            dots = tl.dot(k, tl.trans(q)) * key_scales[:, None]
            scores = tl.sum(tl.maximum(dots, 0.0) * weights[None, :], 1)
        elif MODE == 3:  # fp16 operands
            k, key_scales = fp8_key_rows(keys_ptr, key_rows, visible, DIM, SCALE_OFFSET, ROW_BYTES, tl.float16)
            dots = tl.dot(k, tl.trans(q.to(tl.float16))) * key_scales[:, None]
            scores = tl.sum(tl.maximum(dots, 0.0) * weights[None, :], 1)
        else:  # FP8_QUERIES (q and weights as fp8_queries gives them) against the codes: both operands E4M3
            code_pointers = keys_ptr + key_rows[:, None] * ROW_BYTES + channels[None, :]
            k = tl.load(code_pointers.to(tl.pointer_type(tl.float8e4nv)), mask=visible[:, None], other=0.0)
            scale_pointers = (keys_ptr + key_rows * ROW_BYTES + SCALE_OFFSET).to(tl.pointer_type(tl.float32))
            key_scales = tl.load(scale_pointers, mask=visible, other=0.0)
            dots = tl.dot(k, tl.trans(q)) * key_scales[:, None]
            scores = tl.sum(tl.maximum(dots, 0.0) * weights[None, :], 1)
        scores = tl.where(visible, scores, float("-inf"))
        tl.store(scores_ptr + row * scores_row_stride + slots, scores, mask=slots < width)


def inputs(batch: int, fp8: bool, row_bytes: int = 132, sequential: bool = False):
    config = named_config("flash")
    heads, dim, width = config.index_n_heads, config.index_head_dim, CONTEXT // 4
    generator = torch.Generator(device=DEVICE).manual_seed(batch)
    q = torch.randn(batch, heads, dim, device=DEVICE, generator=generator).to(torch.bfloat16)
    weights = torch.randn(batch, heads, device=DEVICE, generator=generator)
    values = torch.randn(1 + batch * width, dim, device=DEVICE, generator=generator)
    row_format = Fp8KeyRows(dim)
    keys = row_format.encode(values) if fp8 else values.to(torch.bfloat16)
    if fp8 and row_bytes > keys.shape[1]:  # rows padded to a 16-byte multiple (a layout not shipped)
        keys = torch.nn.functional.pad(keys, (0, row_bytes - keys.shape[1])).contiguous()
    order = torch.randperm(batch * width, device=DEVICE, generator=generator)
    if sequential:  # a request's keys in pool order (as pages hold them), not scattered
        order = torch.arange(batch * width, device=DEVICE)
    table = (1 + order.int()).view(batch, width)
    lengths = torch.full((batch,), width, dtype=torch.int32, device=DEVICE)
    return q, weights, keys, table, lengths, row_format


def shipped(
    batch: int,
    fp8: bool,
    stages: int | None,
    warps: int = 4,
    block_keys: int = 128,
    tiles: int = 4,
    row_bytes: int = 132,
    fp16: bool | None = None,
    sequential: bool = False,
    maxnreg: int | None = None,
):
    q, weights, keys, table, lengths, row_format = inputs(batch, fp8, row_bytes, sequential)
    width = table.shape[1]
    scores = torch.empty(batch, width, device=DEVICE)
    extra = {} if stages is None else {"num_stages": stages}
    if maxnreg:
        extra["maxnreg"] = maxnreg

    def run():
        indexer._index_scores_kernel[(batch, triton.cdiv(width, block_keys * tiles))](
            q, q.stride(0), q.stride(1), weights, weights.stride(0), keys, keys.stride(0),
            table, table.stride(0), lengths, lengths, scores, scores.stride(0), width, 0.1,
            HEADS=q.shape[1], BLOCK_HEADS=q.shape[1], DIM=q.shape[2], BLOCK_KEYS=block_keys, TILES=tiles,
            HAS_TABLE=True, TABLE_ROWS=False, KEYS_FP8=fp8, FP16_OPERANDS=fp8 if fp16 is None else fp16,
            SCALE_OFFSET=row_format.scale_offset, ROW_BYTES=keys.shape[1] if fp8 else 0,
            DOT_PRECISION="tf32", UPCAST_DOT=False, num_warps=warps, **extra,
        )  # fmt: skip
        return scores

    return run, batch * width * (keys.shape[1] * keys.element_size() + 8)


def torch_scores(batch: int) -> torch.Tensor:
    """:func:`indexer.index_scores_reference` over the decoded FP8 keys of :func:`inputs` (float32)."""
    q, weights, keys, table, lengths, row_format = inputs(batch, True)
    return indexer.index_scores_reference(q, weights, row_format.decode(keys, torch.float32), lengths, scale=0.1,
                                          table=table)  # fmt: skip


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    finite = torch.isfinite(expected)
    return ((out[finite] - expected[finite]).norm() / expected[finite].norm()).item()


def fp8_queries(q: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries in E4M3 with a float32 scale a (row, head), ``amax / 448`` (DeepSeek's reference indexer and upstream's
    FP8 indexer quantize them so), the scale folded into the head weights (``relu(s x) = s relu(x)``, ``s > 0``)."""
    scale = q.float().abs().amax(-1).clamp_min(1e-8) / 448.0
    return (q.float() / scale[..., None]).to(torch.float8_e4m3fn), weights * scale


FP8_QUERIES = 4  # the stage kernel's mode that scores E4M3 queries (fp8_queries) against the codes


def staged(batch: int, mode: int, stages: int | None = None, row_bytes: int = 132, sequential: bool = False):
    """``_stage_kernel`` in ``mode``, its queries quantized (:func:`fp8_queries`) in mode ``FP8_QUERIES``."""
    q, weights, keys, table, lengths, row_format = inputs(batch, True, row_bytes, sequential)
    if mode == FP8_QUERIES:
        q, weights = fp8_queries(q, weights)
    width = table.shape[1]
    scores = torch.empty(batch, width, device=DEVICE)
    extra = {} if stages is None else {"num_stages": stages}

    def run():
        _stage_kernel[(batch, triton.cdiv(width, 512))](
            q, q.stride(0), q.stride(1), weights, weights.stride(0), keys, table, table.stride(0), lengths,
            scores, scores.stride(0), width, 0.1, HEADS=q.shape[1], DIM=q.shape[2], BLOCK_KEYS=128, TILES=4,
            SCALE_OFFSET=row_format.scale_offset, ROW_BYTES=keys.shape[1], MODE=mode, num_warps=4, **extra,
        )  # fmt: skip
        return scores

    return run


def top_k_overlap(scores: torch.Tensor, expected: torch.Tensor, k: int = 512) -> float:
    """The mean share of each row's ``k`` best slots of ``expected`` that ``scores`` also puts among its ``k`` best."""
    chosen = torch.zeros_like(expected, dtype=torch.bool).scatter_(1, scores.topk(k).indices, True)
    return chosen.gather(1, expected.topk(k).indices).float().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--ncu", action="store_true", help="one launch of the shipped bf16 and FP8 kernels only")
    parser.add_argument("--stages-dropped", action="store_true", help="also the stage-dropping copies")
    parser.add_argument("--padded", action="store_true", help="only FP8 key rows padded to 144 B against 132 B")
    parser.add_argument("--operands", action="store_true", help="only FP8 keys against bf16 or fp16 operands")
    parser.add_argument("--tag", default="", help="which tree's kernel this is (--sweep)")
    parser.add_argument("--sweep", action="store_true", help="only the FP8 kernel's tiles, warps and register caps")
    parser.add_argument("--tables", action="store_true", help="only keys read through random against in-order tables")
    parser.add_argument("--fp8-queries", action="store_true", help="only FP8 queries against the FP8 keys' codes")
    args = parser.parse_args()
    if args.ncu:
        for fp8 in (False, True):  # as index_scores launches them
            run, _ = shipped(256, fp8, indexer.FP8_KEYS_LAUNCH["num_stages"] if fp8 else None)
            run()
        torch.cuda.synchronize()
        return
    timer = Timer(budget_ms=100)
    ceilings = measure_ceilings(timer)
    lines = [ceilings]
    print(json.dumps(ceilings), flush=True)

    def record(case: dict) -> None:
        lines.append(case)
        print(json.dumps(case), flush=True)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"fp8_scoring{args.tag}.json").write_text(json.dumps(lines, indent=1))

    if args.sweep:
        fp8_stages = indexer.FP8_KEYS_LAUNCH["num_stages"]
        for batch in (64, 256):
            reference, _ = shipped(batch, True, fp8_stages)
            expected = reference().clone()
            oracle = torch_scores(batch) if batch == 64 else None
            for fp8, warps, block_keys, tiles, maxnreg in [
                (False, 4, 128, 4, None), (True, 4, 128, 4, None), (True, 4, 128, 8, None), (True, 4, 64, 8, None),
                (True, 4, 64, 16, None), (True, 4, 128, 4, 168), (True, 8, 128, 4, None),
            ]:  # fmt: skip
                run, moved = shipped(batch, fp8, fp8_stages if fp8 else None, warps, block_keys, tiles, 144,
                                     maxnreg=maxnreg)  # fmt: skip
                floor = moved / ceilings["copy_tbps"] / 1e6
                try:
                    out = run()
                    error = ((out - expected).norm() / expected.norm()).item() if fp8 else None
                    us = timer.graph_us(run)
                except Exception as failure:  # noqa: BLE001 - a shape that does not compile reports why
                    record({"tag": args.tag, "batch": batch, "tiles": tiles, "error": repr(failure)[:200]})
                    continue
                record({"tag": args.tag, "batch": batch, "fp8": fp8, "warps": warps, "block_keys": block_keys,
                        "tiles": tiles, "maxnreg": maxnreg, "us": us, "floor_us": floor, "of_floor": floor / us,
                        "error_vs_shipped_shape": error,
                        "error_vs_torch": None if oracle is None or not fp8 else relative_error(out, oracle)})  # fmt: skip
        return
    if args.fp8_queries:
        for batch in (64, 256):
            oracle = torch_scores(batch)
            for kernel, stages, sequential in [
                ("bf16", None, False), ("fp8", 1, False), ("fp8_queries", None, False), ("fp8_queries", 2, False),
                ("fp8_queries", 3, False), ("fp8", 1, True), ("fp8_queries", None, True),
            ]:  # fmt: skip
                try:
                    if kernel == "fp8_queries":
                        run = staged(batch, FP8_QUERIES, stages, 144, sequential)
                        moved = batch * (CONTEXT // 4) * (144 + 8)
                    else:
                        run, moved = shipped(batch, kernel == "fp8", stages, sequential=sequential)
                    out = run().clone()
                    us = timer.graph_us(run)
                except Exception as failure:  # noqa: BLE001 - a variant that does not compile reports why
                    record({"kernel": kernel, "batch": batch, "stages": stages, "error": repr(failure)[:300]})
                    continue
                floor = moved / ceilings["copy_tbps"] / 1e6
                exact = kernel != "bf16" and not sequential
                record({"kernel": kernel, "batch": batch, "stages": stages,
                        "table": "in_order" if sequential else "random", "us": us, "floor_us": floor,
                        "of_floor": floor / us, "error_vs_torch": relative_error(out, oracle) if exact else None,
                        "top512_overlap": top_k_overlap(out, oracle) if exact else None})  # fmt: skip
        return
    if args.tables:
        for batch in (64, 256):
            for kernel, sequential in itertools.product(("bf16", "fp8", "fp8_stages2", "bytes"), (False, True)):
                if kernel == "bytes":
                    run, moved = staged(batch, 0, 1, sequential=sequential), None
                    moved = batch * (CONTEXT // 4) * (Fp8KeyRows(128).row_bytes + 8)
                else:
                    stages = {"fp8": indexer.FP8_KEYS_LAUNCH["num_stages"], "fp8_stages2": 2}.get(kernel)
                    run, moved = shipped(batch, kernel != "bf16", stages, sequential=sequential)
                floor = moved / ceilings["copy_tbps"] / 1e6
                run()
                us = timer.graph_us(run)
                record({"kernel": kernel, "batch": batch, "table": "in_order" if sequential else "random", "us": us,
                        "floor_us": floor, "of_floor": floor / us})  # fmt: skip
        return
    if args.operands:
        for batch in (64, 256):
            reference, _ = shipped(batch, True, 1, fp16=False)
            expected = reference().clone()
            for fp8, stages, fp16 in [(False, None, False), (True, None, False), (True, 1, False), (True, 1, True),
                                      (True, None, True)]:  # fmt: skip
                run, moved = shipped(batch, fp8, stages, fp16=fp16)
                floor = moved / ceilings["copy_tbps"] / 1e6
                out = run()
                error = ((out - expected).norm() / expected.norm()).item() if fp8 else None
                us = timer.graph_us(run)
                record({"kernel": "shipped", "batch": batch, "fp8": fp8, "stages": stages, "fp16_operands": fp16,
                        "us": us, "floor_us": floor, "of_floor": floor / us,
                        "error_vs_bf16_operands": error})  # fmt: skip
        return
    if args.padded:
        for batch in (64, 256):
            reference, _ = shipped(batch, True, 1)
            expected = reference().clone()
            for row_bytes, kernel, stages in [
                (132, "shipped", 1), (144, "shipped", 1), (144, "shipped", None), (144, "shipped", 2),
                (132, "bytes", 1), (144, "bytes", 1), (144, "bytes", None), (144, "fp16_dot", 1),
                (144, "fp16_dot", None),
            ]:  # fmt: skip
                if kernel == "shipped":
                    run, _ = shipped(batch, True, stages, row_bytes=row_bytes)
                else:
                    run = staged(batch, 0 if kernel == "bytes" else 3, stages, row_bytes)
                floor = batch * (CONTEXT // 4) * (row_bytes + 8) / ceilings["copy_tbps"] / 1e6
                out = run()
                error = ((out - expected).norm() / expected.norm()).item() if kernel != "bytes" else None
                us = timer.graph_us(run)
                record({"kernel": kernel, "batch": batch, "row_bytes": row_bytes, "stages": stages, "us": us,
                        "floor_us": floor, "of_floor": floor / us, "of_132_floor": floor * 140 / (row_bytes + 8) / us,
                        "error_vs_shipped": error})  # fmt: skip
        return
    for batch in (64, 256):
        reference, _ = shipped(batch, True, None)
        expected = reference().clone()
        for fp8, stages, warps, block_keys, tiles in [
            (False, None, 4, 128, 4), (True, None, 4, 128, 4), (True, 1, 4, 128, 4), (True, 2, 4, 128, 4),
            (True, 4, 4, 128, 4), (True, 1, 8, 128, 4), (True, 1, 4, 64, 8), (True, 2, 4, 64, 8), (True, 1, 8, 256, 2),
        ]:  # fmt: skip
            run, moved = shipped(batch, fp8, stages, warps, block_keys, tiles)
            floor = moved / ceilings["copy_tbps"] / 1e6
            out = run()
            error = ((out - expected).norm() / expected.norm()).item() if fp8 else None
            us = timer.graph_us(run)
            record({"kernel": "shipped", "batch": batch, "fp8": fp8, "stages": stages, "warps": warps,
                    "block_keys": block_keys, "tiles": tiles, "us": us, "floor_us": floor, "of_floor": floor / us,
                    "error_vs_default": error})  # fmt: skip
        if not args.stages_dropped:
            continue
        floor = batch * (CONTEXT // 4) * (132 + 8) / ceilings["copy_tbps"] / 1e6
        for mode, name in enumerate(["bytes", "bytes_convert", "shipped_copy", "fp16_dot"]):
            for stages in (None, 1):
                try:
                    run = staged(batch, mode, stages)
                    out = run()
                    error = ((out - expected).norm() / expected.norm()).item() if mode >= 2 else None
                    us = timer.graph_us(run)
                    record({"kernel": name, "batch": batch, "stages": stages, "us": us, "floor_us": floor,
                            "of_floor": floor / us, "error_vs_shipped": error})  # fmt: skip
                except Exception as error:  # noqa: BLE001
                    record({"kernel": name, "batch": batch, "stages": stages, "error": repr(error)[:200]})


if __name__ == "__main__":
    main()
