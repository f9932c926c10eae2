"""One decode step of the whole tiny network at batch 1 and 8 (requests at position 256), in-process, no
server: the torch reference backend vs the batched core on twin pools, interleaved, best of 6, one thread.

    PYTHONPATH=. python benchmarks/decode_step_backends.py
"""

import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_batched_backend import TwoBackends  # noqa: E402  (the twin pools the equality tests drive)

from sglang_dsv4 import load_model  # noqa: E402
from sglang_dsv4.attention_backend import batched  # noqa: E402
from sglang_dsv4.attention_backend.torch_reference import RequestSpan  # noqa: E402
from sglang_dsv4.tiny import build_checkpoint  # noqa: E402

torch.set_num_threads(1)
model = load_model(build_checkpoint(Path(tempfile.mkdtemp()) / "tiny"))
for batch in (1, 8):
    pair = TwoBackends(model)
    rows = list(range(1, batch + 1))
    pair.forward(rows, [256] * batch)
    best = {"reference": 1e9, "batched": 1e9}
    for step in range(6):
        ref_pool, bat_pool = pair.pools
        start = ref_pool.storage.tables.position[1]
        for r in rows:
            for p in pair.pools:
                p.manager.reserve(r, start + 1)
        ids = torch.randint(0, 1024, (batch,))
        spans = [RequestSpan(r, start, 1, i) for i, r in enumerate(rows)]
        t = time.perf_counter()
        pair.reference.plan_forward(spans)
        pair._run(ids, lambda l, b, x: pair.reference.attend(b.attn, l, x, None))
        best["reference"] = min(best["reference"], time.perf_counter() - t)
        t = time.perf_counter()
        index = batched.build_index(
            batched.BatchPlan(rows, [start] * batch, [1] * batch), bat_pool.storage.tables, model.config, "cpu"
        )
        pair._run(ids, lambda l, b, x: b.attn.project_out(batched.attend(b.attn, l, x, index, bat_pool.storage)))
        best["batched"] = min(best["batched"], time.perf_counter() - t)
    print(
        f"batch {batch}: reference {best['reference'] * 1e3:.1f} ms, batched {best['batched'] * 1e3:.1f} ms, ratio {best['reference'] / best['batched']:.2f}x",
        flush=True,
    )
