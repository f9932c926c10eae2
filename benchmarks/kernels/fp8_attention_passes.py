"""The sparse attention alone over bf16 and FP8 rows, for timing one tree's kernel beside another's (issue 46).

``PYTHONPATH=TREE python benchmarks/kernels/fp8_attention_passes.py --tag NAME [--out DIR]`` on a CUDA host (no
SGLang), once a tree (the kernel is the one ``sglang_dsv4`` on the path holds). At V4-Flash dims and 128K context,
a ratio-128 layer's reads (128 window rows and all 1,024 entries a row from two pools, distinct rows per request,
:func:`fp8_core_shapes.attention_us`), batch 64 and 256, over bf16 rows and FP8 rows at the shipped tile and at
one stage, each launch timed alone (L2 flushed) against its bytes floor. Prints one JSON line a case; ``--out DIR``
writes them to ``DIR/fp8_attention_passes_NAME.json``.
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

BATCHES = (64, 256)
TILES = (attention.LaunchShape(), attention.LaunchShape(num_stages=1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tag", required=True, help="which tree's kernel this is")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    timer = Timer(budget_ms=100)
    ceilings = measure_ceilings(timer)
    lines: list[dict] = [{"tag": args.tag, **ceilings}]
    print(json.dumps(lines[0]), flush=True)
    for batch in BATCHES:
        for fp8 in (False, True):
            for launch in TILES:
                us, moved = attention_us(timer, batch, fp8, launch)
                floor = moved / ceilings["copy_tbps"] / 1e6
                case = {"tag": args.tag, "batch": batch, "fp8": fp8, "launch": repr(launch), "us": us,
                        "floor_us": floor, "of_floor": floor / us}  # fmt: skip
                lines.append(case)
                print(json.dumps(case), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"fp8_attention_passes_{args.tag}.json").write_text(json.dumps(lines, indent=1))


if __name__ == "__main__":
    main()
