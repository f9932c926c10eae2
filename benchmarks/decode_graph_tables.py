"""The decode CUDA graph over the request tables' device twins: a check on the H200 (no SGLang).

Two V4 pools of the tiny config on the GPU (:class:`~sglang_dsv4.memory_pool.storage.V4PoolStorage`,
each with its checkpoint lifecycle, snapshots every 12 tokens) go through the same scheduling:
rows bound and prefilled by the batched core, then decode steps with requests joining (a new row
prefilled between steps) and leaving (a row freed), batches of 3 to 7 requests. Pool A decodes
eagerly, its index built each step as the backend's ``init_forward_metadata`` builds it. Pool B replays one ``torch.cuda.CUDAGraph``
of every layer's attention, captured once at batch 8 over a
:class:`~sglang_dsv4.attention_backend.batched.DecodeGraphIndex` on ``tables.on_device``, after
doing what the server's ``init_forward_metadata_out_graph`` does (flush the tables' changes to the
device, stage the pending checkpoints) and padding the batch as SGLang does (request row 0 at
length 1). Each step compares the two pools' outputs; the end compares every row of every pool
tensor but the padding rows, and the records of every checkpoint both filled.

    python benchmarks/decode_graph_tables.py --out results.json   # on the device machine
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from sglang_dsv4.attention_backend import batched
from sglang_dsv4.config import DeepseekV4Config, load_config
from sglang_dsv4.memory_pool.storage import V4PoolStorage
from sglang_dsv4.model.attention import Attention
from sglang_dsv4.model.rope import Rotary
from sglang_dsv4.prefix_cache.manager import CacheManager

DEVICE = torch.device("cuda")
TINY = Path(__file__).parents[1] / "sglang_dsv4" / "checkpoints" / "tiny"
MAX_BS, ROWS, CONTEXT, TOKENS = 8, 12, 2048, 16384
STEPS = 40


def attention_layers(config: DeepseekV4Config) -> list[Attention]:
    plain = Rotary(config.rope_head_dim, config.rope_theta, None)
    compress = Rotary(config.rope_head_dim, config.compress_rope_theta, config.yarn)
    torch.manual_seed(0)
    layers = [Attention(config, layer, plain, compress).to(DEVICE) for layer in range(config.num_layers)]
    with torch.no_grad():
        for parameter in (p for attention in layers for p in attention.parameters()):
            parameter.normal_(0, parameter.shape[-1] ** -0.5 if parameter.dim() > 1 else 0.1)
    return layers


class Pool:
    def __init__(self, config: DeepseekV4Config):
        self.storage = V4PoolStorage(
            config, torch.float32, num_tokens=TOKENS, max_requests=ROWS, max_context=CONTEXT, device=DEVICE
        )
        self.manager = CacheManager(self.storage)
        self.checkpoints = self.manager.checkpoints
        self.checkpoints.interval = 12

    def reserve(self, rows: list[int], lengths: list[int]) -> list[int]:
        """Reserve each row's forward; its start positions."""
        tables, starts = self.storage.tables, []
        for row, length in zip(rows, lengths, strict=True):
            if not tables.bound[row]:
                tables.bind(row)
            starts.append(tables.position[row])
            self.manager.reserve(row, tables.position[row] + length)
        return starts

    def tensors(self) -> dict[str, torch.Tensor]:
        s = self.storage
        named = {f"window[{i}]": t for i, t in enumerate(s.window)}
        for name in ("compressed", "state", "previous_state", "checkpoint_state"):
            named.update({f"{name}{key}": t for key, t in getattr(s, name).items()})
        return named


def relative_diff(expected: torch.Tensor, actual: torch.Tensor) -> float:
    """Largest difference over the largest finite magnitude (state records hold -inf for empty pools)."""
    if expected.numel() == 0:
        return 0.0
    difference = torch.where(expected == actual, 0.0, (expected - actual).abs())
    magnitude = torch.where(expected.isfinite(), expected.abs(), 0.0)
    return float(difference.max() / magnitude.max().clamp(min=1.0))


def run_layers(layers: list[Attention], x: torch.Tensor, index: batched.ForwardIndex, storage) -> torch.Tensor:
    return torch.stack(
        [
            attention.project_out(batched.attend(attention, i, x[i], index, storage))
            for i, attention in enumerate(layers)
        ]
    )


def eager(pool: Pool, layers, config, rows: list[int], lengths: list[int], x: torch.Tensor) -> torch.Tensor:
    starts = pool.reserve(rows, lengths)
    snapshots = [
        batched.Snapshot(i, c.position, c.record)
        for i, (row, start, length) in enumerate(zip(rows, starts, lengths, strict=True))
        for c in pool.checkpoints.between(row, start, start + length)
    ]
    tables = pool.storage.tables
    tables.begin_forward()  # as the backend's init_forward_metadata does
    index = batched.build_index(batched.BatchPlan(rows, starts, lengths, snapshots), tables.on_device, config, DEVICE)
    return run_layers(layers, x, index, pool.storage)


class DecodeGraph:
    """Every layer's decode attention over pool B, captured once at ``MAX_BS``."""

    def __init__(self, pool: Pool, layers: list[Attention], config: DeepseekV4Config):
        self.pool = pool
        self.index = batched.DecodeGraphIndex(MAX_BS, pool.storage.tables.on_device, config, DEVICE)
        self.rows = torch.zeros(MAX_BS, dtype=torch.int64, device=DEVICE)
        self.seq_lens = torch.ones(MAX_BS, dtype=torch.int64, device=DEVICE)
        self.x = torch.zeros(len(layers), MAX_BS, config.hidden_size, device=DEVICE)
        self._before_replay()

        def step() -> torch.Tensor:
            return run_layers(layers, self.x, self.index.build(self.rows, self.seq_lens), pool.storage)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # the warm-up: all padding
        torch.cuda.current_stream().wait_stream(side)
        self.step = step
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.output = step()

    def _before_replay(self) -> None:
        """What ``BatchedBackend.init_forward_metadata_out_graph`` does."""
        self.pool.storage.tables.begin_forward()
        self.index.stage_checkpoints(self.pool.checkpoints.pending)

    def replay(self, rows: list[int], x: torch.Tensor) -> torch.Tensor:
        self.pool.reserve(rows, [1] * len(rows))
        self._before_replay()
        n, tables = len(rows), self.pool.storage.tables
        self.rows.zero_()
        self.rows[:n] = torch.tensor(rows)
        self.seq_lens.fill_(1)
        self.seq_lens[:n] = torch.tensor([tables.position[row] for row in rows])
        self.x.zero_()
        self.x[:, :n] = x
        self.graph.replay()
        return self.output[:, :n]


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    config = load_config(TINY)
    layers = attention_layers(config)
    a, b = Pool(config), Pool(config)
    generator = torch.Generator(device=DEVICE).manual_seed(1)
    record_diffs = []

    def take_snapshots(rows: list[int]) -> None:
        """What the tree does after a forward: take the filled checkpoints (compared here, then released)."""
        for row in rows:
            up_to = a.storage.tables.position[row]
            taken = [pool.checkpoints.take(row, up_to) for pool in (a, b)]
            assert [c.position for c in taken[0]] == [c.position for c in taken[1]], "different checkpoints"
            for ca, cb in zip(*taken, strict=True):
                for key, records in a.storage.checkpoint_state.items():
                    record_diffs.append(relative_diff(records[ca.record], b.storage.checkpoint_state[key][cb.record]))
                a.checkpoints.release(ca)
                b.checkpoints.release(cb)

    def both_eager(rows: list[int], lengths: list[int]) -> float:
        x = torch.randn(len(layers), sum(lengths), config.hidden_size, device=DEVICE, generator=generator)
        outputs = [eager(pool, layers, config, rows, lengths, x) for pool in (a, b)]
        take_snapshots(rows)
        return relative_diff(outputs[0], outputs[1])

    running = [1, 2, 3, 4, 5, 6, 7]
    prefill_diff = both_eager(running, [125, 130, 255, 3, 62, 700, 1])
    graph = DecodeGraph(b, layers, config)
    step_diffs = []
    for step in range(STEPS):
        if step == 15:  # a request leaves: its rows go back, the graph must read their table cells cleared
            for pool in (a, b):
                pool.storage.tables.free(2)
            running.remove(2)
        if step == 20:  # a request joins between decode steps, prefilled eagerly on both pools
            prefill_diff = max(prefill_diff, both_eager([8], [301]))
            running.append(8)
        batch = running[: (3, 5, 7)[step % 3]]
        x = torch.randn(len(layers), len(batch), config.hidden_size, device=DEVICE, generator=generator)
        expected = eager(a, layers, config, batch, [1] * len(batch), x)
        actual = graph.replay(batch, x)
        step_diffs.append(relative_diff(expected, actual))
        take_snapshots(batch)
    torch.cuda.synchronize()
    pool_diffs = {name: relative_diff(t[1:], b.tensors()[name][1:]) for name, t in a.tensors().items()}
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "steps": STEPS,
        "checkpoints_compared": len(record_diffs) // max(1, len(a.storage.checkpoint_state)),
        "prefill_max_rel_diff": prefill_diff,
        "decode_step_max_rel_diff": max(step_diffs),
        "decode_steps_bitwise": sum(d == 0.0 for d in step_diffs),
        "pool_tensor_max_rel_diff": max(pool_diffs.values()),
        "worst_pool_tensor": max(pool_diffs, key=pool_diffs.get),
        "checkpoint_record_max_rel_diff": max(record_diffs, default=0.0),
    }
    report["equal_within_1e-5"] = all(value <= 1e-5 for key, value in report.items() if key.endswith("diff"))
    print(json.dumps(report, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2))
    if not report["equal_within_1e-5"]:
        raise SystemExit("the graph over the device tables differs from eager decode")


if __name__ == "__main__":
    main()
