"""The decode core's two kernels alone over FP8 rows on the H200, beside bf16 rows, across tile shapes (issue 30).

``python benchmarks/kernels/fp8_core_shapes.py`` on a CUDA host (no SGLang). At V4-Flash dims and 128K context, for
batch 64 and 256 (a row per request, distinct rows per request, random values):

* the indexer's scoring of all ``context / 4`` keys (:func:`sglang_dsv4.kernels.indexer._index_scores_kernel`,
  launched here with other ``num_warps`` / keys per tile / tiles per program than its wrapper's 4 / 128 / 4);
* the sparse attention over a ratio-128 layer's reads, 128 window rows and all 1,024 entries
  (:func:`sglang_dsv4.kernels.attention.sparse_decode_attention` with other :class:`LaunchShape` s),

each timed alone (L2 flushed) against its bytes floor (every key or row read once, as stored). Prints one JSON
line a case: where the FP8 core's time goes, and whether a tile shape other than bf16's suits FP8 rows. With
``--ncu``, one launch of the attention over bf16 and over FP8 rows at batch 256 (for ``ncu``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import triton

from sglang_dsv4.config import named_config
from sglang_dsv4.kernels import attention, indexer
from sglang_dsv4.kernels.kv_format import Fp8EntryRows, Fp8KeyRows
from sglang_dsv4.kernels.selection import KVSelection

sys.path.insert(0, str(Path(__file__).parent))
from attention_indexer import Timer, measure_ceilings  # noqa: E402

DEVICE = torch.device("cuda")
CONTEXT = 131072


def scores_us(timer: Timer, batch: int, fp8: bool, warps: int, block_keys: int, tiles: int) -> tuple[float, int]:
    config = named_config("flash")
    heads, dim, width = config.index_n_heads, config.index_head_dim, CONTEXT // 4
    q = torch.randn(batch, heads, dim, device=DEVICE, dtype=torch.bfloat16)
    weights = torch.randn(batch, heads, device=DEVICE)
    values = torch.randn(1 + batch * width, dim, device=DEVICE)
    row_format = Fp8KeyRows(dim)
    keys = row_format.encode(values) if fp8 else values.to(torch.bfloat16)
    table = (1 + torch.arange(batch * width, device=DEVICE, dtype=torch.int32)).view(batch, width)
    lengths = torch.full((batch,), width, dtype=torch.int32, device=DEVICE)
    scores = torch.empty(batch, width, device=DEVICE)

    def run() -> None:
        indexer._index_scores_kernel[(batch, triton.cdiv(width, block_keys * tiles))](
            q, q.stride(0), q.stride(1), weights, weights.stride(0), keys, keys.stride(0),
            table, table.stride(0), lengths, scores, scores.stride(0), width, 0.1,
            HEADS=heads, BLOCK_HEADS=heads, DIM=dim, BLOCK_KEYS=block_keys, TILES=tiles, HAS_TABLE=True,
            KEYS_FP8=fp8, SCALE_OFFSET=row_format.scale_offset, ROW_BYTES=row_format.row_bytes,
            DOT_PRECISION="tf32", UPCAST_DOT=False, num_warps=warps,
        )  # fmt: skip

    return timer.median_us(run), batch * width * keys.shape[1] * keys.element_size()


def attention_us(timer: Timer, batch: int, fp8: bool, launch: attention.LaunchShape) -> tuple[float, int]:
    config = named_config("flash")
    heads, dim = config.num_heads, config.head_dim
    window_width, entries = config.sliding_window, CONTEXT // 128
    row_format = Fp8EntryRows(dim, config.rope_head_dim) if fp8 else None

    def selection(width: int) -> KVSelection:
        values = torch.randn(1 + batch * width, dim, device=DEVICE)
        pool = row_format.encode(values) if fp8 else values.to(torch.bfloat16)
        indices = (1 + torch.arange(batch * width, device=DEVICE, dtype=torch.int32)).view(batch, width)
        return KVSelection(pool, indices, torch.full((batch,), width, dtype=torch.int32, device=DEVICE), row_format)

    window, compressed = selection(window_width), selection(entries)
    q = torch.randn(batch, heads, dim, device=DEVICE, dtype=torch.bfloat16)
    sink = torch.randn(heads, device=DEVICE)
    angles = torch.rand(batch, config.rope_head_dim // 2, device=DEVICE)
    cos, sin = angles.cos(), angles.sin()

    def run() -> None:
        attention.sparse_decode_attention(q, window, compressed, sink, cos, sin, scale=dim**-0.5, launch=launch)

    row_bytes = compressed.pool.shape[1] * compressed.pool.element_size()
    return timer.median_us(run), batch * (window_width + entries) * row_bytes


class _OneLaunch:
    """A timer that launches once and times nothing: for ``ncu``, which profiles each launch."""

    def median_us(self, run) -> float:
        run()
        torch.cuda.synchronize()
        return 0.0


def main() -> None:
    if "--ncu" in sys.argv:  # one launch of the attention over bf16 and FP8 rows at batch 256, for ncu
        for fp8 in (False, True):
            attention_us(_OneLaunch(), 256, fp8, attention.LaunchShape())
        return
    timer = Timer(budget_ms=100)
    ceilings = measure_ceilings(timer)
    print(json.dumps(ceilings), flush=True)
    for batch in (64, 256):
        for fp8, warps, block_keys, tiles in [
            (False, 4, 128, 4), (True, 4, 128, 4), (True, 8, 128, 4), (True, 4, 64, 8), (True, 8, 256, 2),
        ]:  # fmt: skip
            us, moved = scores_us(timer, batch, fp8, warps, block_keys, tiles)
            floor = moved / ceilings["copy_tbps"] / 1e6
            shape = {"warps": warps, "block_keys": block_keys, "tiles": tiles}
            case = {"kernel": "scores", "batch": batch, "fp8": fp8, **shape, "us": us, "of_floor": floor / us}
            print(json.dumps(case), flush=True)
        LS = attention.LaunchShape
        for fp8, launch in [
            (False, LS()), (True, LS()), (True, LS(block_entries=32)), (True, LS(num_stages=1)),
            (True, LS(num_warps=4)), (True, LS(block_heads=32, block_entries=64)),
            (True, LS(num_warps=4, num_stages=1)),
        ]:  # fmt: skip
            try:
                us, moved = attention_us(timer, batch, fp8, launch)
            except Exception as error:  # noqa: BLE001 - a shape that does not compile reports why
                failed = {"kernel": "attention", "batch": batch, "launch": repr(launch), "error": repr(error)[:200]}
                print(json.dumps(failed))
                continue
            floor = moved / ceilings["copy_tbps"] / 1e6
            case = {"kernel": "attention", "batch": batch, "fp8": fp8, "launch": repr(launch), "us": us}
            print(json.dumps({**case, "of_floor": floor / us}), flush=True)


if __name__ == "__main__":
    main()
