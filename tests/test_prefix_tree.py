"""The V4 radix cache alone, driven the way SGLang's scheduler drives it, randomized.

No forwards run: requests advance through the pool's tables (which is all the tree and
the reference counts see), so thousands of operations take seconds. After every step
the tree is checked against a plain model: reference counts exact (no row leaked or
freed twice), every checkpoint on a live node at its own depth, token slots adding up,
and every match equal to the brute-force longest checkpointed prefix.
"""

from __future__ import annotations

import random
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from unittest.mock import patch

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InitLoadBackParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixKey
from test_pool import make_scarce

from sglang_dsv4.kv_cache import V4KVPool
from sglang_dsv4.memory_pool.host_pools import device_kinds
from sglang_dsv4.memory_pool.storage import V4PoolStorage
from sglang_dsv4.prefix_cache import tree as tree_module
from sglang_dsv4.prefix_cache.host_tier import WRITE_POLICIES, HostTier
from sglang_dsv4.prefix_cache.prefix_hits import ALIGNED_PAGE
from sglang_dsv4.prefix_cache.tree import Standings, V4RadixCache, _anchored, _tokens_matched
from sglang_dsv4.routing.rank_reports import Dropped, Flushed, Made, Released
from sglang_dsv4.routing.router import CacheAwareRouter

TOKENS, ROWS, CONTEXT = 3000, 6, 1400


@dataclass
class RowRecord:
    """The part of SGLang's per-request KV record the tree reads and writes."""

    req_pool_idx: int = 0
    cache_protected_len: int = 0
    cache_inserted_len: int = 0
    kv_allocated_len: int = 0


@dataclass
class Request:
    """The fields of SGLang's ``Req`` the tree uses (the server tests run the real one)."""

    rid: int
    full_untruncated_fill_ids: array
    origin_input_ids: array
    prefix_len: int = 0
    last_node: object = None
    lock: object = None
    extra_key: str | None = None
    cache_salt: str | None = None
    priority: int = 0
    kv: RowRecord = field(default_factory=RowRecord)
    done: bool = False

    def finished(self) -> bool:
        return self.done


class Scheduler:
    """Admission, decode steps, finish and abort, in SGLang's order of tree calls."""

    def __init__(
        self,
        config,
        rng: random.Random,
        scarce: tuple[str, int] | None = None,
        host_share: float | None = None,
        tokens: int = TOKENS,
        write_policy: str = "write_back",
    ):
        """``host_share``: a host tier with that share of the device's rows of each kind (None: none), written
        per ``write_policy``; ``tokens``: token slots."""
        self.rng = rng
        self.tokens = tokens
        self.pool = V4KVPool(tokens, 1, config, torch.float32, max_requests=ROWS, max_context=CONTEXT, device="cpu")
        if scarce is not None:
            make_scarce(self.pool, *scarce)
        host = None
        if host_share is not None:
            kinds = device_kinds(self.pool.storage).items()
            rows = {name: int(rows.capacity * host_share) for name, (rows, _) in kinds}
            host = HostTier(self.pool.storage, rows, WRITE_POLICIES[write_policy])
        self.rows = ReqToTokenPool(ROWS, CONTEXT, "cpu", enable_memory_saver=False)
        self.rows.attach_aux_cache(self.pool.manager)
        self.slots = TokenToKVPoolAllocator(tokens, torch.float32, "cpu", self.pool, need_sort=False)
        params = CacheInitParams(
            disable=False, req_to_token_pool=self.rows, token_to_kv_pool_allocator=self.slots, page_size=1
        )
        self.tree = V4RadixCache(
            params,
            self.pool.manager,
            prefix_hits="exact",
            window_policy="per_request",
            checkpoint_interval=96,
            host_tier=host,
        )
        self.running: list[Request] = []
        self.sequences: list[list[int]] = [[]]
        self.count = 0
        self.matches_started_at_an_end = 0  # checked matches that started at a remembered session end
        self.resumes = {"device": 0, "host": 0}
        self.resumes_reading_path_entries = 0  # resumed at a session's end, its entries read in path order
        # What each cached checkpoint's resume reads, taken when it was made (rows hold random bytes that
        # forwards "wrote"), checked at every resume from either tier.
        self.resume_states = ResumeStates(self)
        self.tree.reports = self.resume_states
        self.bytes = torch.Generator().manual_seed(0)

    def admit(self) -> None:
        if not self.rows.available_size():
            return
        base = self.rng.choice(self.sequences)
        # A quarter are a session's next turn, resending its history whole; the others fork off a part of it.
        keep = len(base) if self.rng.random() < 0.25 else self.rng.randrange(len(base) + 1)
        tokens = base[:keep] + [self.rng.randrange(4) for _ in range(self.rng.randrange(2, 300))]
        tokens = tokens[: CONTEXT - 40]
        match = self.tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens[:-1]))))
        self.count += 1
        # The prompt and the token its prefill samples (which gets its KV in the next step).
        fill = array("q", tokens + [0])
        req = Request(self.count, fill, array("q", tokens), match.device_prefix_len, match.last_device_node)
        # SGLang's admission with the plugin's check: token slots, then the request's window slots.
        if not self.tree.room_for_windows(
            self.tree.window_slots_for_forward(len(tokens) - req.prefix_len), req.last_node
        ):
            return
        req.lock = self.tree.lock(req.last_node)
        if match.host_hit_length and not self._load_back(req, match):
            self.tree.unlock(req.lock)
            return
        if not self._make_room(len(tokens) - req.prefix_len):
            self.tree.unlock(req.lock)
            return
        row = self.rows.alloc_rows(1)[0]
        req.kv.req_pool_idx = row
        self.rows.req_to_token[row, : req.prefix_len] = self.tree.prefix_device_indices(req).to(torch.int32)
        self.rows.req_to_token[row, req.prefix_len : len(tokens)] = self.slots.alloc(len(tokens) - req.prefix_len).to(
            torch.int32
        )
        req.kv.cache_protected_len = req.prefix_len
        req.kv.kv_allocated_len = len(tokens)
        self.resume_states.requests[req.rid] = req
        ended = self.tree.session_ends.get(req.last_node)
        self.resumes_reading_path_entries += ended is not None and ended.entries is not None
        self.tree.maybe_hand_to_session(req)
        if req.prefix_len:
            self.resume_states.check(req)
            self.resumes["host" if match.host_hit_length else "device"] += 1
        fake_forward(self.pool, row, req.prefix_len, len(tokens), self.bytes)
        self.tree.checkpoint(req, up_to=len(tokens))  # the prompt's end
        self.running.append(req)

    def _load_back(self, req: Request, match) -> bool:
        """SGLang's admission of a host hit: the tree loads it back, all or nothing, and the request locks
        the checkpoint's node instead (the lock on its device part is let go)."""
        params = InitLoadBackParams(match.best_match_node, match.host_hit_length, req=req)
        loaded = self.tree.init_load_back(params)
        if loaded is None:
            return False
        tokens, node = loaded
        assert tokens == match.host_hit_length
        self.tree.unlock(req.lock)
        req.prefix_len += tokens
        req.last_node, req.lock = node, self.tree.lock(node)
        return True

    def decode(self) -> None:
        if not self.running:
            return
        req = self.rng.choice(self.running)
        if req.kv.kv_allocated_len >= CONTEXT - 1 or not self._make_room(1):
            return
        if not self.tree.room_for_windows(1):  # SGLang would retract a request: finish one unchecked
            self.finish(checkpoint=False)
            return
        row, length = req.kv.req_pool_idx, req.kv.kv_allocated_len
        self.rows.req_to_token[row, length] = int(self.slots.alloc(1)[0])
        self.rows.alloc_aux_to_lengths(
            req_pool_indices_cpu=torch.tensor([row]), target_seq_lens_cpu=torch.tensor([length + 1])
        )
        fake_forward(self.pool, row, length, length + 1, self.bytes)
        req.kv.kv_allocated_len = length + 1
        req.full_untruncated_fill_ids.append(self.rng.randrange(4))

    def finish(self, checkpoint: bool) -> None:
        if not self.running:
            return
        req = self.running.pop(self.rng.randrange(len(self.running)))
        owned = len(req.full_untruncated_fill_ids) - 1  # the last sampled token has no KV yet
        assert owned == req.kv.kv_allocated_len
        req.done = True
        if checkpoint:
            self.tree.checkpoint(req, up_to=owned)
            self.sequences.append(list(req.full_untruncated_fill_ids[:owned]))
        row = self.rows.req_to_token[req.kv.req_pool_idx]
        self.slots.free(row[req.kv.cache_protected_len : req.kv.kv_allocated_len].to(torch.int64))
        self.tree.unlock(req.lock)
        self.rows.free_rows([req.kv.req_pool_idx])

    def flush(self) -> None:
        """SGLang's flush_cache, which waits for the running requests: every row back, on both tiers."""
        while self.running:
            self.finish(checkpoint=self.rng.random() < 0.5)
        assert self.slots.available_size() + self.tree.evictable_size() == self.tokens
        self.tree.reset()
        self.slots.clear()
        usage = self.pool.storage.usage()
        if self.tree.host is not None:
            usage.update({f"host_{name}": rows for name, rows in self.tree.host.pools.usage().items()})
        assert all(kind["free"] == kind["total"] for kind in usage.values()), usage

    def _make_room(self, count: int) -> bool:
        if self.slots.available_size() < count:
            self.tree.evict(EvictParams(num_tokens=count - self.slots.available_size()))
        return self.slots.available_size() >= count


def fake_forward(pool: V4KVPool, row: int, start: int, end: int, generator: torch.Generator) -> None:
    """What a forward of the row's tokens ``start .. end - 1`` writes, as random bytes: the window rows and
    entry rows it took, its state records (the records of the snapshots planned in it too)."""
    storage = pool.storage
    tables = storage.tables
    slots = tables.window_table[row, start:end]
    _randomize(storage.window, slots[slots > 0], generator)
    for key, buffer in storage.compressed.items():
        ratio = storage.ratio[key]
        _randomize([buffer], tables.entry_table[ratio][row, start // ratio : end // ratio], generator)
    _randomize([*storage.state.values(), *storage.previous_state.values()], torch.tensor([row]), generator)
    for checkpoint in pool.checkpoints.between(row, start, end):
        _randomize(list(storage.checkpoint_state.values()), torch.tensor([checkpoint.record]), generator)


def _randomize(buffers: list[torch.Tensor], rows: torch.Tensor, generator: torch.Generator) -> None:
    for buffer in buffers:
        raw = buffer[rows].view(torch.uint8)
        buffer[rows] = torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator).view(buffer.dtype)


def resume_state(storage: V4PoolStorage, row: int, position: int) -> list[torch.Tensor]:
    """What a request row resumed at ``position`` reads, as bytes: its state records, its window rows before
    ``position``, the entry rows of its complete blocks there (its first forward reserved, not run)."""
    tables = storage.tables
    window = tables.window_table[row, tables.held_from[row] : position]
    state = [records[row].view(torch.uint8) for records in storage.state.values()]
    state += [buffer[window].view(torch.uint8) for buffer in storage.window]
    for key, buffer in storage.compressed.items():
        ratio = storage.ratio[key]
        state.append(buffer[tables.entry_table[ratio][row, : position // ratio]].view(torch.uint8))
    return [t.clone() for t in state]


def checkpoint_resume_state(tree: V4RadixCache, node) -> list[torch.Tensor]:
    """:func:`resume_state` of a row resumed from the device checkpoint at ``node``, read off the checkpoint."""
    storage, checkpoint = tree.manager.storage, tree.checkpoints[node]
    window = checkpoint.window[-storage.config.sliding_window :]
    state = [records[checkpoint.record].view(torch.uint8) for records in storage.checkpoint_state.values()]
    state += [buffer[window].view(torch.uint8) for buffer in storage.window]
    entries = tree.manager.entry_ownership.of_prefix(tree.path_device_indices(node), checkpoint.position)
    for key, buffer in storage.compressed.items():
        state.append(buffer[entries[storage.ratio[key]]].view(torch.uint8))
    return [t.clone() for t in state]


class ResumeStates:
    """The tree's reports, heard by the test: what a row resumed from each cached checkpoint reads, taken
    when the checkpoint is made (on the device) and forgotten when it is dropped (a checkpoint moved to the
    host and back is neither); every resume, from either tier, must read exactly that."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.requests: dict[int, Request] = {}  # those the scheduler admitted, by rid
        self.states: dict[tuple[int, ...], list[torch.Tensor]] = {}

    def made(self, rid, positions, tokens_past_prompt) -> None:
        req = self.requests.get(rid)
        if req is None:
            return
        prefixes = checkpoint_prefixes(self.scheduler.tree)
        for position in positions:
            prefix = tuple(req.full_untruncated_fill_ids[:position])
            self.states[prefix] = checkpoint_resume_state(self.scheduler.tree, prefixes[prefix])

    def dropped(self, rid, position) -> None:
        req = self.requests.get(rid)
        if req is not None:  # (a checkpoint its own call made and dropped again was never reported made)
            self.states.pop(tuple(req.full_untruncated_fill_ids[:position]), None)

    def released(self, rid) -> None:
        pass

    def flushed(self) -> None:
        self.states.clear()

    def check(self, req: Request) -> None:
        expected = self.states[tuple(req.full_untruncated_fill_ids[: req.prefix_len])]
        actual = resume_state(self.scheduler.pool.storage, req.kv.req_pool_idx, req.prefix_len)
        assert len(actual) == len(expected)
        for index, (read, stored) in enumerate(zip(actual, expected, strict=True)):
            assert torch.equal(read, stored), f"request {req.rid} resumed at {req.prefix_len}: part {index} differs"


def checkpoint_prefixes(tree: V4RadixCache) -> dict[tuple[int, ...], object]:
    """Every checkpoint's token prefix (on either tier), read off the tree's nodes."""
    prefixes, stack = {}, [(tree.root_node, ())]
    while stack:
        node, prefix = stack.pop()
        if tree._checkpoint_at(node) is not None:
            prefixes[prefix] = node
        for child in node.children.values():
            stack.append((child, prefix + tuple(child.key.token_ids[: len(child.key)])))
    return prefixes


def check(scheduler: Scheduler) -> None:
    tree, slots = scheduler.tree, scheduler.slots
    assert set(tree.audit().values()) == {0}
    prefixes = checkpoint_prefixes(tree)
    on_host = len(tree.host.checkpoints) if tree.host else 0
    assert len(prefixes) == len(tree.checkpoints) + on_host  # no checkpoint on a detached node
    for prefix, node in prefixes.items():
        assert tree._checkpoint_at(node).position == len(prefix)
    owned = sum(r.kv.kv_allocated_len - r.kv.cache_protected_len for r in scheduler.running)
    assert slots.available_size() + tree.evictable_size() + tree.protected_size() + owned == scheduler.tokens
    query = scheduler.rng.choice(scheduler.sequences)[: scheduler.rng.randrange(1, CONTEXT)]
    aligned = tree.modes()["prefix_hits"] == "aligned"
    usable = [len(p) for p in prefixes if len(p) <= len(query) and (not aligned or len(p) % ALIGNED_PAGE == 0)]
    expected = max([n for n in usable if tuple(query[:n]) in prefixes] + [0])
    started_at_an_end = tree._session_end_of(RadixKey(array("q", query))) is not None
    match = tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", query))))
    assert match.device_prefix_len + match.host_hit_length == expected
    assert fields(match) == fields(match_from_the_root(tree, query))
    scheduler.matches_started_at_an_end += started_at_an_end
    check_session_ends(tree)
    check_evictable_leaves(tree)
    check_tiers(tree)


def fields(match) -> tuple:
    return match.device_prefix_len, match.host_hit_length, match.last_device_node, match.best_match_node


def match_from_the_root(tree: V4RadixCache, query: list[int]):
    """The tree's match of ``query`` walked from the root, no remembered session end used."""
    ends, tree.session_ends = tree.session_ends, OrderedDict()
    try:
        return tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", query))))
    finally:
        tree.session_ends = ends


def check_evictable_leaves(tree: V4RadixCache) -> None:
    """SGLang's set of evictable leaves is what its definition says: device nodes no request locks whose
    children are all host-only (or none)."""
    expected, stack = set(), list(tree.root_node.children.values())
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        if not node.evicted and node.lock_ref == 0 and all(c.evicted for c in node.children.values()):
            expected.add(node)
    assert tree.evictable_leaves == expected


def check_session_ends(tree: V4RadixCache) -> None:
    """Every remembered session end is a node in the tree whose path holds exactly the tokens remembered, one on
    a path, and (on the device) exactly the entry rows remembered."""
    assert len(tree.session_ends) <= tree_module.SESSION_ENDS
    for node, ended in tree.session_ends.items():
        assert tree._attached(node)
        keys, above = [], node
        while above is not tree.root_node:
            keys.append(above.key.token_ids[: len(above.key)])
            above = above.parent
            assert above not in tree.session_ends
        path = sum(reversed(keys), array("q"))
        assert path.tolist() == ended.tokens[: ended.position].tolist()
        assert ended.position == len(path) == tree._end(node)
        if node.evicted:
            assert ended.entries is None  # written back to the host: the path's entries are others when loaded back
        if ended.entries is not None:  # the path's entry rows in block order, as gathered by its token slots
            assert ended.entries.position == ended.position
            gathered = tree.manager.entry_ownership.of_prefix(tree.path_device_indices(node), ended.position)
            for ratio, rows in ended.entries.of_prefix(ended.position).items():
                assert torch.equal(rows, gathered[ratio])


def check_tiers(tree: V4RadixCache) -> None:
    """Host-only nodes lie below every device node of their paths, hold no token slots and their host
    checkpoints; device nodes hold their device checkpoints, and a device node backed up (write-through
    policies only) has a host row for each block whose entry it owns."""
    host = tree.host
    for node in tree.checkpoints:
        assert not node.evicted
    if host is None:
        return
    assert set(host.checkpoints) <= set(host.entries)
    of_slot = tree.manager.entry_ownership.of_slot
    stack = [tree.root_node]
    while stack:
        node = stack.pop()
        if node.evicted:
            assert node in host.entries
        elif node in host.entries:
            assert host.policy.backs_up and node not in host.checkpoints
            for ratio, host_rows in host.entries[node].items():
                assert torch.equal(host_rows > 0, of_slot[ratio][node.value.long()] > 0)
        for child in node.children.values():
            assert child.evicted or not node.evicted, "a device node below a host-only one"
            stack.append(child)


# Scarce kinds: three checkpoint records; window slots for about three running requests.
SCARCE = {"records": ("records", 3), "window_slots": ("window_slots", 3 * 129 + 200)}


# A host tier: twice the device's rows of each kind, or a third of them (its LRU drops what it cannot hold), and
# its write policy.
HOSTS = {
    None: (None, "write_back"),
    "host": (2.0, "write_back"),
    "small_host": (0.3, "write_back"),
    "host_write_through": (2.0, "write_through"),
    "small_host_write_through_selective": (0.3, "write_through_selective"),
}


@pytest.mark.parametrize(
    ("seed", "scarce", "host"),
    [
        (0, None, None),
        (1, "records", None),
        (2, "window_slots", None),
        (3, None, "host"),
        (4, "records", "host"),
        (2, "window_slots", "host"),  # (scarce window slots leave few checkpoints to resume from: seed 5 none)
        (6, None, "small_host"),
        (7, None, "host_write_through"),
        (8, None, "small_host_write_through_selective"),
    ],
)
def test_ten_thousand_random_operations_keep_the_tree_and_the_pools_consistent(tiny_model, seed, scarce, host):
    """With a host tier, also: every resume (from either tier) reads the bytes its checkpoint was made with,
    the host's rows audit exact, and flushes give every row back on both tiers; under write-through policies
    resumes read the entries backed up when their nodes were cached."""
    rng = random.Random(seed)
    host_share, write_policy = HOSTS[host]
    scheduler = Scheduler(tiny_model.config, rng, SCARCE.get(scarce), host_share, write_policy=write_policy)
    flushes = [(scheduler.flush, 0.1)] if host else []
    operations = flushes + [
        (scheduler.admit, 6),
        (scheduler.decode, 30),
        (lambda: scheduler.finish(checkpoint=True), 5),
        (lambda: scheduler.finish(checkpoint=False), 1),  # an abort: nothing goes into the tree
        (lambda: scheduler.tree.evict(EvictParams(num_tokens=rng.randrange(1, 400))), 2),
        (scheduler.tree.evict_one_checkpoint, 2),
        (lambda: scheduler.tree.set_modes(prefix_hits=rng.choice(["exact", "aligned"])), 1),
        (lambda: scheduler.tree.set_modes(window_policy=rng.choice(["per_request", "all_committed"])), 1),
        (lambda: scheduler.tree.set_modes(checkpoint_retention=rng.choice(["worth", "lru"])), 1),
    ]
    actions, weights = zip(*operations, strict=True)
    for _ in range(5000):
        rng.choices(actions, weights)[0]()
        check(scheduler)
    assert not prefix_cache_objects_held_by(scheduler.pool.storage)
    moves = scheduler.tree.host.moves if host else {}
    scheduler.flush()
    skipped = scheduler.pool.checkpoints.skipped
    if scarce is not None:  # the scarce kind ran out and was skipped, never raised
        assert skipped[scarce] > 0, skipped
    if scarce != "records":  # (three records rarely outlive the requests that make them)
        assert scheduler.resumes["device"] > 0, scheduler.resumes
        assert scheduler.resumes_reading_path_entries > 0  # a session's next turn bound with its end's entries
    if host:  # prefixes went to the host, and requests resumed from there
        assert scheduler.resumes["host"] > 0 and moves["checkpoints_loaded_back"] > 0, (scheduler.resumes, moves)
    if host == "small_host":
        assert moves["checkpoints_dropped"] > 0 and moves["write_backs_skipped"] > 0, moves
    if write_policy != "write_back":  # nodes were backed up when cached, and evicted without copying their entries
        assert moves["nodes_written_through"] > 0, moves
    assert scheduler.matches_started_at_an_end > 0


def prefix_cache_objects_held_by(root: object) -> list[str]:
    """What the pool's objects, reached attribute by attribute from ``root``, hold of ``prefix_cache/``:
    its objects, its functions and methods bound to them (a callback up into the tree or the planner)."""
    found, seen, stack = [], set(), [("storage", root)]
    while stack:
        path, value = stack.pop()
        if id(value) in seen or isinstance(value, (torch.Tensor, str, bytes, int, float, type(None))):
            continue
        seen.add(id(value))
        owner = getattr(value, "__self__", value)  # a bound method's object
        modules = (getattr(value, "__module__", None) or "", type(owner).__module__)
        if any(module.startswith("sglang_dsv4.prefix_cache") for module in modules):
            found.append(path)
            continue
        if isinstance(value, dict):
            stack.extend((f"{path}[{key!r}]", item) for key, item in value.items())
        elif isinstance(value, (list, tuple, set, frozenset)):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(value))
        elif type(value).__module__.startswith("sglang_dsv4"):
            members = vars(value) if hasattr(value, "__dict__") else {}
            slots = [name for name in getattr(type(value), "__slots__", ()) if hasattr(value, name)]
            members |= {name: getattr(value, name) for name in slots}
            stack.extend((f"{path}.{name}", item) for name, item in members.items())
    return found


def run_turn(scheduler: Scheduler, tokens: list[int], new_tokens: int) -> tuple[int, list[int]]:
    """One agentic turn as SGLang runs it: match (a host hit loaded back), prefill, a checkpoint at the
    prompt's end, decode, a checkpoint at the request's end, release. The tokens it resumed at (checked
    bit for bit against what its checkpoint was made with), and its whole sequence."""
    tree, rows, slots = scheduler.tree, scheduler.rows, scheduler.slots
    match = tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens[:-1]))))
    scheduler.count += 1
    req = Request(scheduler.count, array("q", tokens + [0]), array("q", tokens), match.device_prefix_len)
    req.last_node, req.lock = match.last_device_node, tree.lock(match.last_device_node)
    if match.host_hit_length:
        assert scheduler._load_back(req, match), "the host hit could not be loaded back"
    row = rows.alloc_rows(1)[0]
    req.kv.req_pool_idx = row
    rows.req_to_token[row, : req.prefix_len] = tree.prefix_device_indices(req).to(torch.int32)
    rows.req_to_token[row, req.prefix_len : len(tokens)] = slots.alloc(len(tokens) - req.prefix_len).to(torch.int32)
    req.kv.cache_protected_len, req.kv.kv_allocated_len = req.prefix_len, len(tokens)
    scheduler.resume_states.requests[req.rid] = req
    tree.maybe_hand_to_session(req)
    if req.prefix_len:
        scheduler.resume_states.check(req)
    fake_forward(scheduler.pool, row, req.prefix_len, len(tokens), scheduler.bytes)
    tree.checkpoint(req, up_to=len(tokens))
    for _ in range(new_tokens):
        length = req.kv.kv_allocated_len
        rows.req_to_token[row, length] = int(slots.alloc(1)[0])
        rows.alloc_aux_to_lengths(
            req_pool_indices_cpu=torch.tensor([row]), target_seq_lens_cpu=torch.tensor([length + 1])
        )
        fake_forward(scheduler.pool, row, length, length + 1, scheduler.bytes)
        req.kv.kv_allocated_len = length + 1
        req.full_untruncated_fill_ids.append(scheduler.rng.randrange(4))
    req.done = True
    owned = req.kv.kv_allocated_len
    tree.checkpoint(req, up_to=owned)
    slots.free(rows.req_to_token[row][req.kv.cache_protected_len : owned].to(torch.int64))
    tree.unlock(req.lock)
    rows.free_rows([row])
    return req.prefix_len, list(req.full_untruncated_fill_ids[:owned])


SESSIONS = 8


def sessions_take_turns(tiny_model, window_policy: str, spare_records: int, turns: int = 4) -> Scheduler:
    """``SESSIONS`` sessions take ``turns`` turns each, round robin, with checkpoint records for one
    checkpoint a session and ``spare_records`` more; every turn must resume at its session's last end."""
    rng = random.Random(29)
    scheduler = Scheduler(tiny_model.config, rng, ("records", SESSIONS + spare_records))
    scheduler.tree.manager.checkpoints.interval = 0
    scheduler.tree.set_modes(window_policy=window_policy)
    histories: list[list[int]] = [[] for _ in range(SESSIONS)]
    for _ in range(turns):
        for session in range(SESSIONS):
            prompt = histories[session] + [rng.randrange(1024) for _ in range(rng.randrange(20, 60))]
            matched, sequence = run_turn(scheduler, prompt, new_tokens=3)
            assert matched == len(histories[session]), f"session {session} lost its deepest checkpoint"
            histories[session] = sequence
            check(scheduler)
    return scheduler


@pytest.mark.parametrize("window_policy", ["per_request", "all_committed"])
def test_every_sessions_next_turn_finds_its_deepest_checkpoint_with_records_for_one_per_session(
    tiny_model, window_policy
):
    """Issue 29: eight sessions take turns with checkpoint records for one each and two more. Every turn
    leaves checkpoints at its prompt's end, a token before it and its request's end; under plain LRU the
    session idle longest loses its only live one to the newer checkpoints of the others. per_request
    releases the checkpoints a turn resumes past at once; all_committed keeps them, to be evicted first."""
    scheduler = sessions_take_turns(tiny_model, window_policy, spare_records=2)
    evictions = scheduler.tree.checkpoint_report()["checkpoint_evictions"]
    superseded = "superseded_at_resume" if window_policy == "per_request" else "superseded"
    assert evictions[superseded] > 0, evictions
    assert evictions["deepest"] == 0, evictions


@pytest.mark.parametrize("window_policy", ["per_request", "all_committed"])
def test_a_turns_snapshots_are_skipped_rather_than_take_another_sessions_deepest_checkpoint(
    tiny_model, window_policy
):
    """Issue 29: with records for one checkpoint a session and one more, the prompt-end snapshots a turn
    plans find only other sessions' request ends to evict once the shallower ones are gone. They are
    skipped instead (the turn's own end is worth more than they are, and takes the spare record), so every
    session's next turn still resumes at its last request's end."""
    scheduler = sessions_take_turns(tiny_model, window_policy, spare_records=1)
    assert scheduler.tree.checkpoint_report()["checkpoint_evictions"]["deepest"] == 0
    assert scheduler.pool.checkpoints.skipped["records"] > 0


def test_per_request_keeps_a_sessions_last_turn_and_releases_what_its_turns_resumed_past(tiny_model):
    """Issue 29: once a turn resumes from a checkpoint, those above it on its path are released
    (per_request), up to the nearest point where another prefix branches off: above it they serve
    that prefix too."""
    rng = random.Random(7)
    scheduler = Scheduler(tiny_model.config, rng)
    tree = scheduler.tree
    tree.manager.checkpoints.interval = 0
    shared = [rng.randrange(1024) for _ in range(40)]
    run_turn(scheduler, shared, new_tokens=2)  # another session: checkpoints at 39, 40 and 42
    history = shared
    for _ in range(5):
        prompt = history + [rng.randrange(1024) for _ in range(rng.randrange(20, 40))]
        matched, sequence = run_turn(scheduler, prompt, new_tokens=3)
        assert matched == len(history), "a turn resumes where the last one ended"
        history = sequence
        check(scheduler)
    # Kept: the other session's 39, 40 (where this one branched off: 39 is where a resend of that prompt
    # resumes) and 42; this session's last prompt end, a token before it, its request end, and the end
    # that turn resumed from.
    positions = sorted(c.position for c in tree.checkpoints.values())
    assert len(positions) == 7 and positions[:3] == [39, 40, 42], positions
    # Released: the second turn's two (the branch stops it), then three a turn.
    assert tree.checkpoint_report()["checkpoint_evictions"]["superseded_at_resume"] == 2 + 3 * 3


class ReportsToRouter:
    """A rank's reports handed straight to a router of one rank (the DP controller's, without the channel)."""

    def __init__(self, router: CacheAwareRouter, also: ResumeStates):
        self.router, self.also = router, also

    def made(self, rid, positions, tokens_past_prompt) -> None:
        self.router.apply(Made(0, rid, tuple(positions), tuple(tokens_past_prompt)))
        self.also.made(rid, positions, tokens_past_prompt)

    def dropped(self, rid, position) -> None:
        self.router.apply(Dropped(0, rid, position))
        self.also.dropped(rid, position)

    def released(self, rid) -> None:
        self.router.apply(Released(0, rid))

    def flushed(self) -> None:
        self.router.apply(Flushed(0))
        self.also.flushed()


def test_the_routers_index_from_the_trees_reports_holds_exactly_the_trees_checkpoints(tiny_model):
    # Random admissions, decodes, finishes, aborts and evictions with scarce checkpoint records (so checkpoints
    # are skipped, evicted and superseded); after every step the router's index of the rank is the tree's.
    rng = random.Random(3)
    scheduler = Scheduler(tiny_model.config, rng, SCARCE["records"])
    router = CacheAwareRouter(ranks=1)
    scheduler.tree.reports = ReportsToRouter(router, scheduler.resume_states)
    checkpoint = scheduler.tree.checkpoint

    def sent_then_checkpointed(req, *, up_to):  # the controller sends a prompt before its rank checkpoints it
        if req.rid not in router._prompts:
            router.sent(0, req.rid, list(req.origin_input_ids), when=0.0)
        checkpoint(req, up_to=up_to)

    scheduler.tree.checkpoint = sent_then_checkpointed
    operations = [
        (scheduler.admit, 6),
        (scheduler.decode, 30),
        (lambda: scheduler.finish(checkpoint=True), 5),
        (lambda: scheduler.finish(checkpoint=False), 1),
        (lambda: scheduler.tree.evict(EvictParams(num_tokens=rng.randrange(1, 400))), 2),
        (scheduler.tree.evict_one_checkpoint, 2),
    ]
    actions, weights = zip(*operations, strict=True)
    for _ in range(1500):
        rng.choices(actions, weights)[0]()
        prefixes = checkpoint_prefixes(scheduler.tree)
        assert len(router.indexes[0]) == len(prefixes)
        for prefix in prefixes:
            assert router.indexes[0].longest_checkpointed_prefix(prefix) == len(prefix)
    assert scheduler.tree.evictions.total() > 0 and len(prefixes) > 0
    scheduler.tree.reset()
    assert len(router.indexes[0]) == 0


@dataclass
class Turn:
    session: int
    req: Request
    new_tokens: int  # tokens it decodes


class ConcurrentSessions:
    """Sessions whose turns run side by side, driven in SGLang's order of calls each scheduling step: a
    prefill batch admitted (each request matched, checked for window slots, locked, given token slots, in
    turn), its rows reserved and handed to their sessions, its prompts checkpointed; a decode step of every
    running request; the requests done checkpointed at their ends and released. A session's next turn is
    queued once its last one ended. Every turn must resume at its session's last request's end."""

    def __init__(self, scheduler: Scheduler, sessions: int, turns: int):
        self.scheduler, self.tree, self.rng = scheduler, scheduler.tree, scheduler.rng
        self.histories: list[list[int]] = [[] for _ in range(sessions)]
        self.turns_left = [turns] * sessions
        self.waiting = list(range(sessions))
        self.running: list[Turn] = []
        self.lost: list[tuple[int, int, int]] = []  # (session, matched, its last end) of each turn that lost it

    def run(self) -> None:
        while self.waiting or self.running:
            self.prefill_batch()
            self.decode_step()
            for turn in [t for t in self.running if len(t.req.full_untruncated_fill_ids) > t.new_tokens
                         + len(t.req.origin_input_ids)]:  # fmt: skip
                self.finish(turn)
            self.scheduler.running = [t.req for t in self.running]  # what check() counts as held by requests
            check(self.scheduler)

    def prefill_batch(self) -> None:
        scheduler, tree = self.scheduler, self.tree
        batch: list[Turn] = []
        for session in list(self.waiting)[: scheduler.rows.available_size()]:
            prompt = self.histories[session] + [self.rng.randrange(1024) for _ in range(self.rng.randrange(10, 40))]
            match = tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", prompt[:-1]))))
            scheduler.count += 1
            req = Request(scheduler.count, array("q", prompt + [0]), array("q", prompt), match.device_prefix_len)
            req.last_node = match.last_device_node
            need = sum(tree.window_slots_for_forward(len(t.req.origin_input_ids) - t.req.prefix_len) for t in batch)
            need += tree.window_slots_for_forward(len(prompt) - req.prefix_len)
            if not tree.room_for_windows(need, req.last_node) or not scheduler._make_room(len(prompt) - req.prefix_len):
                break
            req.lock = tree.lock(req.last_node)
            req.kv.req_pool_idx = scheduler.rows.alloc_rows(1)[0]
            batch.append(Turn(session, req, self.rng.randrange(1, 6)))
            self.waiting.remove(session)
            if match.device_prefix_len != len(self.histories[session]):
                self.lost.append((session, match.device_prefix_len, len(self.histories[session])))
        rows, slots = scheduler.rows, scheduler.slots
        for turn in batch:
            req, prompt = turn.req, len(turn.req.origin_input_ids)
            row = req.kv.req_pool_idx
            rows.req_to_token[row, : req.prefix_len] = tree.prefix_device_indices(req).to(torch.int32)
            rows.req_to_token[row, req.prefix_len : prompt] = slots.alloc(prompt - req.prefix_len).to(torch.int32)
            req.kv.cache_protected_len, req.kv.kv_allocated_len = req.prefix_len, prompt
        for turn in batch:
            tree.maybe_hand_to_session(turn.req)
        for turn in batch:
            tree.checkpoint(turn.req, up_to=len(turn.req.origin_input_ids))
        self.running += batch

    def decode_step(self) -> None:
        scheduler, rows = self.scheduler, self.scheduler.rows
        decoding = [t for t in self.running if t.req.kv.kv_allocated_len < len(t.req.full_untruncated_fill_ids)]
        if not decoding:
            return
        assert scheduler._make_room(len(decoding)) and self.tree.room_for_windows(len(decoding))
        for turn in decoding:
            req = turn.req
            rows.req_to_token[req.kv.req_pool_idx, req.kv.kv_allocated_len] = int(scheduler.slots.alloc(1)[0])
        rows.alloc_aux_to_lengths(
            req_pool_indices_cpu=torch.tensor([t.req.kv.req_pool_idx for t in decoding]),
            target_seq_lens_cpu=torch.tensor([t.req.kv.kv_allocated_len + 1 for t in decoding]),
        )
        for turn in decoding:
            turn.req.kv.kv_allocated_len += 1
            turn.req.full_untruncated_fill_ids.append(self.rng.randrange(1024))

    def finish(self, turn: Turn) -> None:
        scheduler, req = self.scheduler, turn.req
        self.running.remove(turn)
        req.done = True
        owned = req.kv.kv_allocated_len
        self.tree.checkpoint(req, up_to=owned)
        row = req.kv.req_pool_idx
        scheduler.slots.free(scheduler.rows.req_to_token[row][req.kv.cache_protected_len : owned].to(torch.int64))
        self.tree.unlock(req.lock)
        scheduler.rows.free_rows([row])
        self.histories[turn.session] = list(req.full_untruncated_fill_ids[:owned])
        self.turns_left[turn.session] -= 1
        if self.turns_left[turn.session]:
            self.waiting.append(turn.session)


CONCURRENT_SESSIONS = 16


def concurrent_sessions(tiny_model, retention: str, window_policy: str) -> ConcurrentSessions:
    """``CONCURRENT_SESSIONS`` sessions, ``ROWS`` of them running at a time, taking 4 turns each with
    checkpoint records for one checkpoint a session and one more."""
    scheduler = Scheduler(tiny_model.config, random.Random(31), ("records", CONCURRENT_SESSIONS + 1))
    scheduler.tree.set_modes(window_policy=window_policy, checkpoint_retention=retention)
    sessions = ConcurrentSessions(scheduler, CONCURRENT_SESSIONS, turns=4)
    sessions.run()
    return sessions


@pytest.mark.parametrize("window_policy", ["per_request", "all_committed"])
def test_many_concurrent_sessions_each_resume_at_their_last_end_with_records_for_one_checkpoint_a_session(
    tiny_model, window_policy
):
    """Issue 29: sixteen sessions, six running at a time (admitted in batches, so requests hold their locks
    on the checkpoints they resume from while others in the batch are handed their rows), with checkpoint
    records for one checkpoint a session and one more. By worth every turn resumes at its session's last
    request's end: what goes is the prompt ends and the snapshots before them, and the end a running request
    resumed from once it has run past it. Plain LRU, on the same pool, loses resume points."""
    by_worth = concurrent_sessions(tiny_model, "worth", window_policy)
    assert by_worth.lost == []
    assert by_worth.tree.checkpoint_report()["checkpoint_evictions"]["deepest"] == 0
    assert concurrent_sessions(tiny_model, "lru", window_policy).lost  # the pool is short enough to lose them


@pytest.mark.parametrize("retention", ["worth", "lru"])
def test_a_checkpoint_a_request_holds_its_lock_on_is_never_evicted(tiny_model, retention):
    """Issue 29: a request admitted to resume at a checkpoint (matched and locked, its row not handed to it
    yet: the rest of its batch is reserved and checked for window slots first) finds it there whatever else
    goes; ``/server_info`` counts it as locked. Once unlocked it may go."""
    rng = random.Random(5)
    scheduler = Scheduler(tiny_model.config, rng)
    tree = scheduler.tree
    tree.set_modes(checkpoint_retention=retention)
    ends = [run_turn(scheduler, [rng.randrange(1024) for _ in range(50)], new_tokens=3)[1] for _ in range(3)]
    match = tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", ends[0] + [1, 2]))))
    assert match.device_prefix_len == len(ends[0])
    lock = tree.lock(match.last_device_node)
    while tree.evict_one_checkpoint():
        pass
    assert list(tree.checkpoints) == [match.last_device_node]
    window_bytes = len(ends[0]) * tree.manager.window_slot_bytes  # its window: the whole sequence, 53 tokens
    assert tree.checkpoint_report()["checkpoints_by_state"]["locked"] == {"count": 1, "window_bytes": window_bytes}
    tree.unlock(lock)
    assert tree.evict_one_checkpoint() and not tree.checkpoints


@pytest.mark.parametrize("window_policy", ["per_request", "all_committed"])
def test_the_report_counts_checkpoints_by_state_with_the_window_bytes_they_hold(tiny_model, window_policy):
    """Issue 29, what ``/server_info`` serves (``dsv4_prefix_cache``): the checkpoints each turn resumed past
    are superseded; per_request releases them as it resumes (counted by why they went), all_committed keeps
    them, to go first, and reports them with their window bytes. No request holds one once every turn ended."""
    rng = random.Random(11)
    scheduler = Scheduler(tiny_model.config, rng)
    tree = scheduler.tree
    tree.set_modes(window_policy=window_policy)
    history: list[int] = []
    for _ in range(3):
        _, history = run_turn(scheduler, history + [rng.randrange(1024) for _ in range(30)], new_tokens=3)
    report = tree.checkpoint_report()
    by_state, released = report["checkpoints_by_state"], report["checkpoint_evictions"]["superseded_at_resume"]
    assert sum(state["count"] for state in by_state.values()) == report["checkpoints"]
    assert by_state["locked"] == {"count": 0, "window_bytes": 0} and by_state["live"]["window_bytes"] > 0
    if window_policy == "per_request":
        assert by_state["superseded"] == {"count": 0, "window_bytes": 0} and released > 0
    else:
        assert by_state["superseded"]["count"] > 0 and by_state["superseded"]["window_bytes"] > 0 and released == 0


@pytest.mark.parametrize("window_policy", ["per_request", "all_committed"])
def test_standings_brought_up_to_date_after_each_release_equal_a_fresh_walk(tiny_model, window_policy):
    """Issue 43: making room releases checkpoints one by one, the standings worked out once and updated after each
    release; after every release they equal the standings a fresh walk of the tree gives (the oracle: the walk
    the eviction made before every single release)."""
    scheduler = sessions_take_turns(tiny_model, window_policy, spare_records=24)
    tree = scheduler.tree
    # Shared prefixes too: a fork of a session's history, resumed mid-path.
    deepest = sorted(checkpoint_prefixes(tree), key=len)[-3:]
    for fork in [list(prefix[: len(prefix) // 2]) for prefix in deepest]:
        run_turn(scheduler, fork + [7, 8, 9], new_tokens=2)
    standings, released = Standings(tree), 0
    while tree.checkpoints:
        candidates = [n for n in tree.checkpoints if not _anchored(n)]
        if not candidates:
            break
        # The worth-least one, as eviction takes, or (every other release) the worth-most: a session's deepest
        # going first leaves the checkpoints above it with nothing below.
        choose = max if released % 2 else min
        node = choose(candidates, key=lambda n: (tree.retention.order(standings.of[n]), id(n)))
        tree._release(node)
        standings.released(node)
        released += 1
        assert standings.of == Standings(tree).of, f"after {released} releases"
    assert released >= 20


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 3), min_size=1, max_size=40),
    st.lists(st.integers(0, 3), min_size=1, max_size=60),
    st.integers(0, 60),
    st.one_of(st.none(), st.integers(0, 60)),
    st.booleans(),
)
def test_the_vectorized_token_compare_matches_sglangs_match_at(node_tokens, tokens, offset, limit, as_list):
    """The tree's walks compare keys with ``_tokens_matched``: SGLang's ``match_at`` on every key it reads (arrays
    with and without a limit, compared by numpy from any length here; lists, which go to ``match_at`` itself)."""
    kind = list if as_list else (lambda t: array("q", t))
    node_key, key = RadixKey(kind(node_tokens)), RadixKey(kind(tokens), limit=limit)
    offset = min(offset, len(key))
    with patch.object(tree_module, "VECTORIZED_FROM", 0):
        assert _tokens_matched(node_key, key, offset) == node_key.match_at(key, offset)


@pytest.mark.parametrize("by", ["memcmp", "numpy"])
def test_a_session_ends_tokens_compare_equal_only_where_every_token_is(monkeypatch, by):
    """The compare a match starts from a remembered end with (C's ``memcmp``, or numpy's where there is none): equal
    up to ``count`` tokens however long the buffer, unequal for a token changed anywhere before ``count``."""
    import numpy as np

    if by == "numpy":
        monkeypatch.setattr(tree_module, "_MEMCMP", None)
    tokens, buffer = array("q", range(5000)), np.arange(6000, dtype=np.int64)
    assert tree_module._same_words(buffer, tokens, 5000)
    for at in (0, 1, 2047, 4999):
        changed = array("q", tokens)
        changed[at] += 1 << 40
        assert not tree_module._same_words(buffer, changed, 5000), at
        assert tree_module._same_words(buffer, changed, at), at
