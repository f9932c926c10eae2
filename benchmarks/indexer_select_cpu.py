"""The CPU indexer's selection against its scoring, for a resumed turn: before and after in one run.

``PYTHONPATH=<checkout> python benchmarks/indexer_select_cpu.py [--repeats N] [--out PATH]`` (no GPU, no server).
A resumed turn's extend of 16 new tokens over a history of 2K, 16K, 64K and 128K tokens: one request's ratio-4
indexer keys (history / 4 entries, float32 rows of a shuffled pool), 16 query rows sharing its table row, each seeing
the blocks complete at its position (``lengths[i] = (history + i + 1) // 4``), as
:func:`~sglang_dsv4.kernels.sparse_torch.streamed_top_k` gets them on the CPU path. Timed, side by side in each
repeat, on the same precomputed tiles of scores:

- scoring alone: :func:`~sglang_dsv4.kernels.sparse_torch.tile_scores` (key gather, the two einsums, ReLU, mask);
- the old selection: every tile's running top-k by a full stable ``argsort`` (the code before this change, kept here
  as :func:`stable_sort_top_k_of_tiles`);
- the new selection: :func:`~sglang_dsv4.kernels.sparse_torch.top_k_of_tiles` (``torch.topk`` for the k-th value,
  the earliest ties by a running count, one sort of the final k);

and ``streamed_top_k`` whole, old and new. Beside them, a candidate not shipped: the scoring with its weighted sum
over heads as a ``bmm`` (:func:`bmm_tile_scores`; checked bitwise equal to the shipped scores), against which the
new selection is set too. Configs: the tiny config's indexer (32 heads x 32 dims) with its own
``index_topk`` 16 (the issue's served measurement) and with V4-Flash's 512; V4-Flash's indexer (64 x 128, 512).
Times are this thread's CPU time (``time.thread_time_ns``; the host is shared, so waiting for a core is not counted),
one torch thread, the minimum over the repeats. Both selections are checked equal before timing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from sglang_dsv4.config import DEFAULTS
from sglang_dsv4.kernels import sparse_torch
from sglang_dsv4.kernels.selection import read_rows
from sglang_dsv4.tiny import TINY_CONFIG

HISTORIES = (2_048, 16_384, 65_536, 131_072)
NEW_TOKENS = 16
RATIO = 4
TINY_INDEXER = (TINY_CONFIG["index_n_heads"], TINY_CONFIG["index_head_dim"])
CONFIGS = {  # (index_n_heads, index_head_dim, index_topk)
    "tiny indexer, tiny top-k": (*TINY_INDEXER, TINY_CONFIG["index_topk"]),
    "tiny indexer, V4-Flash top-k": (*TINY_INDEXER, DEFAULTS["index_topk"]),
    "V4-Flash indexer": (DEFAULTS["index_n_heads"], DEFAULTS["index_head_dim"], DEFAULTS["index_topk"]),
}
OUT = Path(__file__).parent / "results" / "indexer_select_cpu.json"


def stable_sort_top_k_of_tiles(tiles, k: int) -> torch.Tensor:
    """Before: the running top-k of every tile re-sorted whole (stable, so the earliest of equal scores first)."""
    best = best_slots = None
    for slots, scores in tiles:
        if best is None:
            best, best_slots = scores[:, :0], slots[None, :0].expand(scores.shape[0], 0)
        best = torch.cat([best, scores], dim=1)
        best_slots = torch.cat([best_slots, slots.expand(best.shape[0], -1)], dim=1)
        order = best.argsort(dim=-1, descending=True, stable=True)[..., :k]
        best, best_slots = best.gather(1, order), best_slots.gather(1, order)
    return torch.where(best > float("-inf"), best_slots, -1)


def old_streamed_top_k(q, head_weights, keys, table, table_row, lengths, k, *, scale, tile_owners):
    """Before: ``streamed_top_k`` as it was (one table row per tile here), for the whole call side by side."""
    chosen = torch.full((q.shape[0], k), -1, dtype=torch.int64)
    owner = tile_owners[0]
    tiles = sparse_torch.tile_scores(q, head_weights, keys, table, table_row, lengths, scale=scale, owner=owner)
    found = stable_sort_top_k_of_tiles(tiles, k)
    chosen[:, : found.shape[1]] = found
    return chosen


def bmm_tile_scores(q, head_weights, keys, table, lengths, *, scale, owner):
    """:func:`~sglang_dsv4.kernels.sparse_torch.tile_scores` for a tile of rows sharing table row ``owner``, the
    dots one ``mm`` and ``sum_h w_rh * dots_rhj`` one ``bmm`` (where the shipped code has two ``einsum``)."""
    rows, heads, dim = q.shape
    for key_first in range(0, table.shape[1], sparse_torch.KEY_TILE):
        slots = torch.arange(key_first, min(key_first + sparse_torch.KEY_TILE, table.shape[1]))
        shared_keys = read_rows(keys, table[owner, slots], None, q.dtype)
        dots = (q.reshape(rows * heads, dim) @ shared_keys.T).view(rows, heads, -1)
        scores = torch.bmm(head_weights[:, None, :], dots.relu() * scale)[:, 0]
        yield slots, scores.masked_fill(slots[None, :] >= lengths[:, None], float("-inf"))


def resumed_turn(history: int, heads: int, dim: int, seed: int = 0) -> dict:
    """The indexer's inputs for 16 new tokens after ``history`` tokens of one request."""
    generator = torch.Generator().manual_seed(seed)
    entries = (history + NEW_TOKENS) // RATIO
    return dict(
        q=torch.randn(NEW_TOKENS, heads, dim, generator=generator),
        head_weights=torch.randn(NEW_TOKENS, heads, generator=generator) * heads**-0.5,
        keys=torch.randn(entries + 64, dim, generator=generator),
        table=torch.randperm(entries + 64, generator=generator)[:entries][None],
        table_row=torch.zeros(NEW_TOKENS, dtype=torch.long),
        lengths=((history + torch.arange(NEW_TOKENS) + 1) // RATIO).int(),
        scale=dim**-0.5,
    )


def cpu_ms(work) -> float:
    start = time.thread_time_ns()
    work()
    return (time.thread_time_ns() - start) / 1e6


def measure(history: int, heads: int, dim: int, k: int, repeats: int) -> dict:
    inputs = resumed_turn(history, heads, dim)
    scoring_args = {name: inputs[name] for name in ("q", "head_weights", "keys", "table", "table_row", "lengths")}
    tiles = list(sparse_torch.tile_scores(**scoring_args, scale=inputs["scale"], owner=0))
    old, new = stable_sort_top_k_of_tiles(tiles, k), sparse_torch.top_k_of_tiles(tiles, k)
    assert torch.equal(old, new), "the selections differ"
    bmm_args = {name: inputs[name] for name in ("q", "head_weights", "keys", "table", "lengths")}
    for (_, shipped), (_, candidate) in zip(tiles, bmm_tile_scores(**bmm_args, scale=inputs["scale"], owner=0)):
        assert torch.equal(shipped, candidate), "the bmm scoring differs"
    call = dict(**scoring_args, k=k, scale=inputs["scale"], tile_owners=[0])
    assert torch.equal(old_streamed_top_k(**call), sparse_torch.streamed_top_k(**call))
    runs = {
        "scoring": lambda: list(sparse_torch.tile_scores(**scoring_args, scale=inputs["scale"], owner=0)),
        "scoring by bmm (candidate)": lambda: list(bmm_tile_scores(**bmm_args, scale=inputs["scale"], owner=0)),
        "old selection": lambda: stable_sort_top_k_of_tiles(tiles, k),
        "new selection": lambda: sparse_torch.top_k_of_tiles(tiles, k),
        "old streamed_top_k": lambda: old_streamed_top_k(**call),
        "new streamed_top_k": lambda: sparse_torch.streamed_top_k(**call),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, work in runs.items():
            times[name].append(cpu_ms(work))
    best = {name: min(values) for name, values in times.items()}
    return {
        "history": history,
        "entries": (history + NEW_TOKENS) // RATIO,
        "ms_min": best,
        "ms_median": {name: statistics.median(values) for name, values in times.items()},
        "old selection / scoring": best["old selection"] / best["scoring"],
        "new selection / scoring": best["new selection"] / best["scoring"],
        "old / new selection": best["old selection"] / best["new selection"],
        "old selection / scoring by bmm": best["old selection"] / best["scoring by bmm (candidate)"],
        "new selection / scoring by bmm": best["new selection"] / best["scoring by bmm (candidate)"],
        "scoring / scoring by bmm": best["scoring"] / best["scoring by bmm (candidate)"],
        "old / new streamed_top_k": best["old streamed_top_k"] / best["new streamed_top_k"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = []
    for config, (heads, dim, k) in CONFIGS.items():
        for history in HISTORIES:
            row = {"config": config, "index_n_heads": heads, "index_head_dim": dim, "index_topk": k}
            row |= measure(history, heads, dim, k, args.repeats)
            results.append(row)
            ms = row["ms_min"]
            print(
                f"{config:30s} {history:>7,} history ({row['entries']:>6,} entries)  scoring {ms['scoring']:8.2f} ms"
                f"  selection old {ms['old selection']:7.2f} ({row['old selection / scoring']:.2f}x scoring)"
                f"  new {ms['new selection']:7.2f} ({row['new selection / scoring']:.2f}x)"
                f"  old/new {row['old / new selection']:.2f}x;"
                f" streamed_top_k old/new {row['old / new streamed_top_k']:.2f}x;"
                f" scoring by bmm {ms['scoring by bmm (candidate)']:.2f} ms ({row['scoring / scoring by bmm']:.2f}x"
                f" faster; selection old {row['old selection / scoring by bmm']:.2f}x of it,"
                f" new {row['new selection / scoring by bmm']:.2f}x)",
                flush=True,
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"threads": 1, "timer": "thread_time_ns, min over repeats", "repeats": args.repeats,
            "new_tokens": NEW_TOKENS, "ratio": RATIO, "torch": torch.__version__}  # fmt: skip
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
