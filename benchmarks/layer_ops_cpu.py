"""Torch operations of one decode forward's index build and of each layer kind's batched step, counted on the CPU.

``PYTHONPATH=<checkout> python benchmarks/layer_ops_cpu.py`` from a checkout (run it at two versions to count what a
change removes; no GPU, no server). On the tiny model (window, ratio-4 and ratio-128 layers), after a prefill of two
requests, one decode step of both: every aten operation dispatched while the index is built and while each layer kind
runs :func:`~sglang_dsv4.attention_backend.batched.attend`, with the count of ``cos`` and ``sin`` among them. On CUDA
the step takes the Triton kernels where the CPU takes torch paths (the norms and ropes, the compressors' decode), so
the totals are the CPU's; a difference in an operation both devices run in torch (the rope tables) is a difference in
launches on both. Views count as operations here and launch nothing.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import sglang_dsv4
from sglang_dsv4.attention_backend import batched
from sglang_dsv4.tiny import TINY_CONFIG, random_model

sys.path.insert(0, str(Path(sglang_dsv4.__file__).parents[1] / "tests"))  # the checkout's own tests
from test_batched_backend import TwoBackends  # noqa: E402  - the tests' pools of the tiny model

COUNTED = ("aten.cos.default", "aten.sin.default")


class CountedOps(TorchDispatchMode):
    """Every aten operation dispatched inside, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))

    def summary(self) -> dict[str, int]:
        return {"ops": sum(self.ops.values()), **{name: self.ops[name] for name in COUNTED}}


@torch.no_grad()
def main() -> None:
    model = random_model(dict(TINY_CONFIG), seed=0)
    config = model.config
    pool = TwoBackends(model).pools[1]
    rows, prompts = [1, 2], [40, 300]
    for row, length in zip(rows, prompts, strict=True):
        pool.storage.tables.bind(row)
        pool.manager.reserve(row, length)
    index = batched.build_index(batched.BatchPlan(rows, [0, 0], prompts), pool.storage.tables, config, "cpu")
    x = torch.randn(sum(prompts), config.hidden_size)
    for layer, block in enumerate(model.layers):
        batched.attend(block.attn, layer, x, index, pool.storage)

    for row, length in zip(rows, prompts, strict=True):
        pool.manager.reserve(row, length + 1)
    with CountedOps() as build:
        index = batched.build_index(batched.BatchPlan(rows, prompts, [1, 1]), pool.storage.tables, config, "cpu")
    result = {"index_build": build.summary()}
    x = torch.randn(len(rows), config.hidden_size)
    for layer, block in enumerate(model.layers):
        with CountedOps() as step:
            batched.attend(block.attn, layer, x, index, pool.storage)
        result.setdefault(config.layer_kind(layer), step.summary())
    print(json.dumps(result))


if __name__ == "__main__":
    main()
