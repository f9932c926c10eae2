"""Our host work per resumed agent turn, against the session's history: the prefix cache's calls alone.

    python benchmarks/host_work.py [--histories 2000,16000,64000,131072,1048576] [--before REV]

A resumed turn costs the scheduler, in our code: the match of the resent prompt (:meth:`V4RadixCache.match_prefix`),
binding the row to the checkpoint it resumes from (``maybe_hand_to_session``), the checkpoints at the prompt's end
and at the request's end (``checkpoint``: the insert, the row's slots, entry ownership, the checkpoints attached),
and releasing the request (its lock, its row's window slots and entry rows: ``release_row``); and the request
tables' flush to their device twins as the prefill forward begins (``table_flush``: the bind's writes and the last
release's; the tables are given twins of their own, as on a GPU, copied host to host here). Beside them, SGLang's
own write of the prefix's token slots into the request's row (``sglang_prefix_row``: its ``prefix_device_indices``
and the ``req_to_token`` write, O(history) in SGLang), not counted as ours. This times each of them, driven as
SGLang's scheduler drives them (the order of ``tests/test_prefix_tree.py``'s scheduler), with no forward: what the
tree, pools and tables do is what a served turn does; the rows hold whatever they held (nothing reads them here).

The long histories are built without a forward (a cold 1M-token prefill takes hours on this host): a benchmark-only
fixture runs a session of ``--seed-turns`` turns that grow it to the history, each through the same calls, so the
session's path holds the nodes a real one does (a prompt-end, a one-short and a request-end checkpoint a turn).
Then ``--turns`` turns of ``--new-tokens`` new prompt tokens and one output token are timed (medians of
wall time: ``time.thread_time`` costs milliseconds a call in this host's sandbox).

``--before REV``: the same measurement over the package as it was at git revision ``REV`` (extracted to a temporary
folder and run in a subprocess), printed beside, with the ratios; each history and session count is measured over
both versions in turn. Writes ``benchmarks/results/host_work.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from array import array
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("match", "hand_to_session", "table_flush", "prompt_checkpoint", "request_checkpoint", "release_row")
# SGLang's own, timed beside ours: its row's token slots of the prefix gathered from the tree's nodes and written.
SGLANG_PHASES = ("sglang_prefix_row",)


def measure(
    history: int, seed_turns: int, turns: int, new_tokens: int, sessions: int, foreign: int = 0
) -> dict[str, float]:
    """Median milliseconds of each of our calls in a resumed turn of ``sessions`` interleaved sessions whose
    histories add up to ``history`` tokens (one session: ``history`` tokens; more: they share a system prompt and
    take turns round robin, the token pool holding 3/4 of their tokens, so that SGLang evicts). ``foreign``: before
    each timed turn, the Python work SGLang's scheduler does on receiving a prompt of that many tokens (the
    unpickled list; at the match and at the request's end, the request's list with its output and the radix key's
    array of it), none of it ours."""
    import torch
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from sglang_dsv4.config import parse_config
    from sglang_dsv4.kv_cache import V4KVPool
    from sglang_dsv4.prefix_cache.tree import V4RadixCache
    from sglang_dsv4.tiny import TINY_CONFIG

    torch.set_num_threads(1)
    each = history // sessions
    config = parse_config({**TINY_CONFIG, "max_position_embeddings": 2 * each + 4096})
    context = each + (turns + 2) * (new_tokens + 2) + 16
    tokens = (history + sessions * (turns + 2) * (new_tokens + 2)) * (3 if sessions == 1 else 3 / 4)
    tokens, rows = int(tokens) + 4096, 4
    pool = V4KVPool(tokens, 1, config, torch.float32, max_requests=rows, max_context=context, device="cpu")
    tables = pool.storage.tables
    for mirror in (tables._window, *tables._entries.values()):  # twins of their own, as on a GPU
        mirror.device = mirror.host.clone()
    row_pool = ReqToTokenPool(rows, context, "cpu", enable_memory_saver=False)
    row_pool.attach_aux_cache(pool.manager)
    slots = TokenToKVPoolAllocator(tokens, torch.float32, "cpu", pool, need_sort=False)
    params = CacheInitParams(
        disable=False, req_to_token_pool=row_pool, token_to_kv_pool_allocator=slots, page_size=1
    )
    tree = V4RadixCache(
        params, pool.manager, prefix_hits="exact", window_policy="per_request", checkpoint_interval=0
    )
    rng = random.Random(0)
    times: dict[str, list[float]] = {phase: [] for phase in PHASES + SGLANG_PHASES}

    def timed(phase: str, call, *args, **kwargs):
        started = time.perf_counter()
        result = call(*args, **kwargs)
        times[phase].append((time.perf_counter() - started) * 1000)
        return result

    def take_slots(count: int) -> torch.Tensor:
        if slots.available_size() < count:  # SGLang evicts least recently used tokens first
            tree.evict(EvictParams(num_tokens=count - slots.available_size()))
        return slots.alloc(count)

    def release(req: Request, row: int, length: int) -> None:
        """SGLang's release of a request after its checkpoint: its own token slots, its lock, its row."""
        slots.free(row_pool.req_to_token[row][req.kv.cache_protected_len : length].to(torch.int64))
        tree.unlock(req.lock)
        row_pool.free_rows([row])

    def write_prefix_row(row: int, req: Request) -> None:
        """SGLang's write of the prefix's token slots into the request's row (``alloc_for_extend``'s)."""
        row_pool.req_to_token[row, : req.prefix_len] = tree.prefix_device_indices(req).to(torch.int32)

    def turn(sequence: list[int], new: int, number: int) -> list[int]:
        """One turn as SGLang runs it: match, row, bind, prompt checkpoint, one decode step, request checkpoint,
        release."""
        if foreign_prompt is not None:  # SGLang's lists and keys of a long prompt, beside a short history's calls
            received = foreign_prompt.tolist()  # the unpickled request
            keys = [array("q", received + [0]) for _ in range(2)]  # the fill ids and key at the match, at the end
            del received, keys
        prompt = sequence + [rng.randrange(1024) for _ in range(new)]
        match = timed("match", tree.match_prefix, MatchPrefixParams(key=RadixKey(array("q", prompt[:-1]))))
        req = Request(number, array("q", prompt + [0]), array("q", prompt), match.device_prefix_len)
        req.last_node, req.lock = match.last_device_node, tree.lock(match.last_device_node)
        row = row_pool.alloc_rows(1)[0]
        req.kv.req_pool_idx = row
        timed("sglang_prefix_row", write_prefix_row, row, req)
        row_pool.req_to_token[row, req.prefix_len : len(prompt)] = take_slots(len(prompt) - req.prefix_len).to(
            torch.int32
        )
        req.kv.cache_protected_len, req.kv.kv_allocated_len = req.prefix_len, len(prompt)
        timed("hand_to_session", tree.maybe_hand_to_session, req)
        timed("table_flush", tables.begin_forward)  # the prefill's: the bind's writes and the last release's
        timed("prompt_checkpoint", tree.checkpoint, req, up_to=len(prompt))
        length = req.kv.kv_allocated_len
        row_pool.req_to_token[row, length] = int(take_slots(1)[0])
        row_pool.alloc_aux_to_lengths(
            req_pool_indices_cpu=torch.tensor([row]), target_seq_lens_cpu=torch.tensor([length + 1])
        )
        tables.begin_forward()  # the decode step's (a few cells: decode_step_host.py times these)
        req.kv.kv_allocated_len = length + 1
        req.full_untruncated_fill_ids.append(rng.randrange(1024))
        req.done = True
        timed("request_checkpoint", tree.checkpoint, req, up_to=length + 1)
        timed("release_row", release, req, row, length + 1)
        return list(req.full_untruncated_fill_ids[: length + 1])

    system, foreign_prompt = [rng.randrange(1024) for _ in range(min(2000, each // 2))], None
    histories = [list(system) for _ in range(sessions)]
    number = 0
    for step in range(seed_turns):
        for session in range(sessions):
            grow = max(2, (each - len(histories[session])) // (seed_turns - step) - 1)
            histories[session] = turn(histories[session], grow, number)
            number += 1
    for times_of_phase in times.values():
        times_of_phase.clear()
    if foreign:
        foreign_prompt = array("q", (rng.randrange(1024) for _ in range(foreign)))
    for step in range(turns):
        session = step % sessions
        histories[session] = turn(histories[session], new_tokens, number)
        number += 1
    result = {phase: statistics.median(values) for phase, values in times.items()}
    result["ours"] = sum(result[phase] for phase in PHASES)
    result["history"] = sum(len(h) for h in histories)
    result["sessions"], result["foreign"] = sessions, foreign
    result["path_nodes"] = path_nodes(tree)
    return result


class RowRecord:
    """The part of SGLang's per-request KV record the tree reads and writes."""

    def __init__(self) -> None:
        self.req_pool_idx = self.cache_protected_len = self.cache_inserted_len = self.kv_allocated_len = 0


class Request:
    """The fields of SGLang's ``Req`` the tree uses."""

    def __init__(self, rid: int, fill: array, prompt: array, prefix_len: int) -> None:
        self.rid, self.full_untruncated_fill_ids, self.origin_input_ids = str(rid), fill, prompt
        self.prefix_len, self.last_node, self.lock = prefix_len, None, None
        self.extra_key = self.cache_salt = None
        self.priority, self.kv, self.done = 0, RowRecord(), False

    def finished(self) -> bool:
        return self.done


def path_nodes(tree) -> int:
    """Nodes on the deepest path of the tree (the session's)."""
    deepest, stack = 0, [(tree.root_node, 0)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in node.children.values())
    return deepest


def run_over(package_root: Path, arguments: list[str]) -> list[dict[str, float]]:
    """This script's measurement over the package at ``package_root``, in a subprocess."""
    env = {**os.environ, "PYTHONPATH": str(package_root)}
    command = [sys.executable, __file__, "--child", *arguments]
    output = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(output.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--histories", default="2000,16000,64000,131072,1048576")
    parser.add_argument("--seed-turns", type=int, default=64)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--sessions", default="1,32", help="interleaved sessions, each count a measurement")
    parser.add_argument("--before", help="a git revision to measure beside the working tree")
    parser.add_argument(
        "--foreign", default="",
        help="prompt lengths: for each, one session at the first history with SGLang's receipt of a prompt that long "
        "before each turn (what the cache of a long history's turn loses to work not ours)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "host_work.json")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    histories = [int(h) for h in args.histories.split(",")]
    foreign = [int(f) for f in args.foreign.split(",") if f]
    if args.child:
        counts = [int(c) for c in args.sessions.split(",") if c]
        measured = [measure(h, args.seed_turns, args.turns, args.new_tokens, c) for c in counts for h in histories]
        measured += [measure(histories[0], args.seed_turns, args.turns, args.new_tokens, 1, f) for f in foreign]
        print(json.dumps(measured))
        return
    with tempfile.TemporaryDirectory() as scratch:
        packages = {"now": ROOT}
        if args.before:
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.before, "sglang_dsv4"],
                                     check=True, capture_output=True).stdout  # fmt: skip
            subprocess.run(["tar", "-x", "-C", scratch], input=archive, check=True)
            packages = {"before": Path(scratch), **packages}
        # Each measurement over every version in turn, so that a host whose load drifts loads them alike.
        versions: dict[str, list[dict[str, float]]] = {name: [] for name in packages}
        for count in args.sessions.split(","):
            for history in histories:
                passed = ["--histories", str(history), "--seed-turns", str(args.seed_turns), "--turns",
                          str(args.turns), "--new-tokens", str(args.new_tokens), "--sessions", count]  # fmt: skip
                for name, package in packages.items():
                    versions[name] += run_over(package, passed)
        for tokens in foreign:
            passed = ["--histories", str(histories[0]), "--seed-turns", str(args.seed_turns), "--turns",
                      str(args.turns), "--new-tokens", str(args.new_tokens), "--sessions", "", "--foreign",
                      str(tokens)]  # fmt: skip
            for name, package in packages.items():
                versions[name] += run_over(package, passed)
    print(f"our calls per resumed turn (+{args.new_tokens} tokens, 1 output), median wall ms; SGLang's own after ours")
    shown = (*PHASES, "ours", *SGLANG_PHASES)
    header = f"{'sessions':>8} {'history':>9} {'nodes':>6} {'foreign':>8} " + " ".join(f"{p:>18}" for p in shown)
    for name, rows in versions.items():
        print(f"\n{name}\n{header}")
        for row in rows:
            cells = " ".join(f"{row[p]:18.3f}" for p in shown)
            print(f"{row['sessions']:8d} {row['history']:9d} {row['path_nodes']:6d} {row['foreign']:8d} {cells}")
    if args.before:
        print("\nours, now / before: " + ", ".join(
            f"{n['sessions']}x{n['history']}: {n['ours'] / b['ours']:.2f}x"
            for b, n in zip(versions["before"], versions["now"], strict=True)))
    now = [r for r in versions["now"] if not r["foreign"]]
    for count in sorted({r["sessions"] for r in now}):
        rows = [r for r in now if r["sessions"] == count]
        print(f"{count} session(s), ours at each history / at the first: "
              + ", ".join(f"{r['history']}: {r['ours'] / rows[0]['ours']:.2f}x" for r in rows))  # fmt: skip
    for row in (r for r in versions["now"] if r["foreign"]):
        print(f"at {row['history']} with a {row['foreign']}-token prompt received before each turn: ours "
              f"{row['ours'] / now[0]['ours']:.2f}x the first history's")
    record = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M"), "versions": versions}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
