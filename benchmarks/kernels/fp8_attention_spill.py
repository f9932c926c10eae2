"""The sparse attention over FP8 rows with its output channels in one program or split over two (issue 46).

``python benchmarks/kernels/fp8_attention_spill.py [--out DIR]`` on a CUDA host (no SGLang). At V4-Flash dims and
128K context, a ratio-128 layer's reads (128 window rows and all 1,024 entries a row, distinct rows per request),
batch 64 and 256: bf16 rows at the shipped tile; FP8 rows with ``attention.FP8_CHANNEL_GROUPS`` 1 (a program
accumulates all 512 output channels) and 2 (half each, the logits computed by both), at 64 and 32 entries a
tile. Each timed alone (L2 flushed, :mod:`fp8_core_shapes`) against its bytes floor (the interpreter tests check
the outputs). Prints a JSON line a case, then the channel groups that were fastest at batch 256.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from attention_indexer import Timer, measure_ceilings  # noqa: E402
from fp8_core_shapes import attention_us  # noqa: E402

from sglang_dsv4.kernels import attention  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    timer = Timer(budget_ms=100)
    ceilings = measure_ceilings(timer)
    lines: list[dict] = [ceilings]
    print(json.dumps(ceilings), flush=True)
    fastest: dict[int, float] = {}
    shapes = [attention.LaunchShape(block_entries=entries) for entries in (64, 32)]
    for batch in (64, 256):
        for fp8, groups, launch in [(False, 1, shapes[0])] + [(True, g, s) for g in (1, 2) for s in shapes]:
            attention.FP8_CHANNEL_GROUPS = groups
            us, moved = attention_us(timer, batch, fp8, launch)
            floor = moved / ceilings["copy_tbps"] / 1e6
            case = {"batch": batch, "fp8": fp8, "channel_groups": groups, "launch": repr(launch), "us": us,
                    "floor_us": floor, "of_floor": floor / us}  # fmt: skip
            lines.append(case)
            print(json.dumps(case), flush=True)
            if fp8 and batch == 256:
                fastest[groups] = min(fastest.get(groups, float("inf")), us)
    attention.FP8_CHANNEL_GROUPS = 2
    lines.append({"fastest_at_256": fastest})
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "fp8_attention_spill.json").write_text(json.dumps(lines, indent=1))
    print(f"BEST_GROUPS={min(fastest, key=fastest.get)}")


if __name__ == "__main__":
    main()
