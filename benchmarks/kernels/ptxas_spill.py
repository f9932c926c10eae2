"""Registers and spill of the decode kernels as ptxas builds them for the H200, on a host without a GPU (issue 46).

``python benchmarks/kernels/ptxas_spill.py`` (Triton with its NVIDIA backend; no GPU, no SGLang). Compiles, for
sm_90a at V4-Flash dims, the sparse attention over bf16 rows and over FP8 rows at the shipped tile and at
``--launch`` shapes, and the indexer's scoring over bf16 and FP8 keys, through the package's own wrappers (CPU
tensors; the launch compiled, not run), then runs Triton's ptxas with ``-v`` on each kernel's PTX. Prints one
JSON line a kernel: registers a thread, spill stores and loads in bytes a thread, shared memory, and, for each
loop of the kernel's SASS (``nvdisasm``), its instructions and the local-memory loads and stores among them (the
spill traffic of every iteration).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
from pathlib import Path

import torch
import triton

from sglang_dsv4.config import named_config
from sglang_dsv4.kernels.attention import LaunchShape, sparse_decode_attention
from sglang_dsv4.kernels.hopper_compile import CompiledForHopper
from sglang_dsv4.kernels.indexer import index_scores
from sglang_dsv4.kernels.kv_format import Fp8EntryRows, Fp8KeyRows
from sglang_dsv4.kernels.selection import KVSelection

TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")
LABEL = re.compile(r"^(\.L_x_\d+):")


def compiled_kernels(launch) -> list:
    """The kernels ``launch()`` compiles for sm_90 (compiled only: Triton's ``warmup``)."""
    with CompiledForHopper() as compiling:
        launch()
    return [kernel for _, kernel in compiling.compiled]


def loops_of(sass: str) -> list[dict]:
    """Each backward branch's loop in ``sass``: its instructions and local-memory loads and stores."""
    instructions, labels, label = [], {}, None
    for line in sass.splitlines():
        if found := LABEL.match(line.strip()):
            label = found.group(1)
        elif found := SASS_LINE.search(line):
            address = int(found.group(1), 16)
            instructions.append((address, found.group(2)))
            if label:
                labels[label], label = address, None
    loops = []
    for address, text in instructions:
        target = re.search(r"BRA.*`\((\.L_x_\d+)\)", text)
        if target and labels.get(target.group(1), address + 1) <= address:
            body = [t for a, t in instructions if labels[target.group(1)] <= a <= address]
            count = lambda op: sum(1 for t in body if re.search(op, t))  # noqa: E731
            if len(body) > 1:  # not the kernel's closing branch to itself
                loops.append({"instructions": len(body), "LDL": count(r"\bLDL\b"), "STL": count(r"\bSTL\b")})
    return loops


def ptxas_report(kernel) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        ptx, cubin = Path(folder) / "kernel.ptx", Path(folder) / "kernel.cubin"
        ptx.write_text(kernel.asm["ptx"])
        built = subprocess.run(
            [TOOLS / "ptxas", "-v", "--gpu-name", "sm_90a", ptx, "-o", cubin], capture_output=True, text=True,
            check=True,
        )  # fmt: skip
        sass = subprocess.run([TOOLS / "nvdisasm", "-c", cubin], capture_output=True, text=True, check=True).stdout
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", built.stderr)
    return {
        "registers": int(re.search(r"Used (\d+) registers", built.stderr).group(1)),
        "spill_stores": int(spill.group(1)),
        "spill_loads": int(spill.group(2)),
        "shared": kernel.metadata.shared,
        "loops": loops_of(sass),
    }


def attention_launch(fp8: bool, launch: LaunchShape):
    config = named_config("flash")
    heads, dim = config.num_heads, config.head_dim
    q = torch.zeros(2, heads, dim, dtype=torch.bfloat16)
    row_format = Fp8EntryRows(dim, config.rope_head_dim) if fp8 else None

    def selection() -> KVSelection:
        pool = row_format.empty(4, "cpu") if fp8 else torch.zeros(4, dim, dtype=torch.bfloat16)
        return KVSelection(pool, torch.zeros(2, 8, dtype=torch.int32), torch.ones(2, dtype=torch.int32), row_format)

    window, compressed = selection(), selection()  # two pools, as served
    cos = sin = torch.zeros(2, config.rope_head_dim // 2)
    return lambda: sparse_decode_attention(
        q, window, compressed, torch.zeros(heads), cos, sin, scale=0.1, splits=1, launch=launch
    )


def scoring_launch(fp8: bool):
    config = named_config("flash")
    q = torch.zeros(2, config.index_n_heads, config.index_head_dim, dtype=torch.bfloat16)
    keys_format = Fp8KeyRows(config.index_head_dim) if fp8 else None
    keys = keys_format.empty(8, "cpu") if fp8 else torch.zeros(8, config.index_head_dim, dtype=torch.bfloat16)
    lengths, table = torch.full((2,), 8, dtype=torch.int32), torch.zeros(3, 8, dtype=torch.int64)
    weights, table_row = torch.zeros(2, config.index_n_heads), torch.tensor([2, 0])
    return lambda: index_scores(
        q, weights, keys, lengths, scale=0.1, table=table, table_row=table_row, keys_format=keys_format
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--launch", action="append", default=[], help='more attention tiles, e.g. \'{"num_stages": 1}\'')
    args = parser.parse_args()
    shapes = [LaunchShape()] + [LaunchShape(**json.loads(text)) for text in args.launch]
    cases = [(f"attention, {'fp8' if fp8 else 'bf16'} rows, {shape}", attention_launch(fp8, shape))
             for shape in shapes for fp8 in (False, True)]  # fmt: skip
    cases += [(f"scoring, {'fp8' if fp8 else 'bf16'} keys", scoring_launch(fp8)) for fp8 in (False, True)]
    for name, launch in cases:
        for kernel in compiled_kernels(launch):
            print(json.dumps({"case": name, "kernel": kernel.name, **ptxas_report(kernel)}), flush=True)


if __name__ == "__main__":
    main()
