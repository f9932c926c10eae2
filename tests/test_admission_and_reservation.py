"""Admission and reservation agree: no forward's rows ever run short, randomized, in SGLang's overlap order.

A model of SGLang's overlap scheduler drives the V4 pool and radix cache with no forwards run (a
forward only advances the request tables, which is all the pools and reference counts see). Each
step builds the next batch — a prefill batch (the chunked request's next chunk first, then queued
requests as the plugin's admission hook lets them in, up to the chunk budget) or a decode batch of
every running request (retracting the newest while the plugin's decode check says no) — reserves
its rows, launches it (the attention backend's ``begin_forward``) and only then processes the
results of the batch launched before it: snapshots are taken, prompts and finished requests
checkpointed, finished rows freed. Requests are long prompts, forks of earlier ones and retries,
with outputs of a few tokens; some are aborted mid-output (finished early) or dropped (freed with
nothing inserted); hit modes and window policies switch at random. Request rows, token slots and
checkpoint records are scarce in turn; the window slots are what the pool's layout gives the rows.

No ``PoolExhausted`` may escape a reservation (a forward's own rows are never optional), the
reference counts stay exact after every step, and every row is free after a flush.
"""

from __future__ import annotations

import random
from array import array
from dataclasses import dataclass, field

import pytest
import torch
from sglang.srt.managers.schedule_policy import AddReqResult
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixKey
from test_pool import make_scarce
from test_prefix_tree import Request

from sglang_dsv4.kv_cache import V4KVPool
from sglang_dsv4.prefix_cache.admission import _admit_within_window_slots, _decode_within_window_slots
from sglang_dsv4.prefix_cache.tree import V4RadixCache

CONTEXT, CHUNK, LONGEST_PROMPT = 2400, 512, 1500


@dataclass(eq=False)
class Served(Request):
    """A request with what the overlap loop tracks: its output budget and where its prefill is
    (compared by identity, as SGLang's requests are)."""

    __eq__ = object.__eq__
    __hash__ = object.__hash__

    prompt_len: int = 0
    max_new_tokens: int = 1
    outputs: int = 0  # sampled tokens processed so far
    prefilled: int = 0  # prompt tokens whose KV a launched forward writes
    retracted: bool = False


@dataclass
class Batch:
    """A launched forward's requests that sample a token: prompts it completes, and decodes."""

    extend: list[Served] = field(default_factory=list)
    decode: list[Served] = field(default_factory=list)


@dataclass
class Adder:
    """The fields of SGLang's ``PrefillAdder`` the plugin's admission hook reads."""

    tree_cache: V4RadixCache
    can_run_list: list[Served]


@dataclass
class DecodeBatch:
    """The fields of SGLang's ``ScheduleBatch`` the plugin's decode check reads."""

    tree_cache: V4RadixCache
    reqs: list[Served]


class OverlapLoop:
    def __init__(self, config, rng: random.Random, rows: int, tokens: int, records: int | None):
        self.rng = rng
        self.pool = V4KVPool(tokens, 1, config, torch.float32, max_requests=rows, max_context=CONTEXT, device="cpu")
        if records is not None:
            make_scarce(self.pool, "records", records)
        self.rows = ReqToTokenPool(rows, CONTEXT, "cpu", enable_memory_saver=False)
        self.rows.attach_aux_cache(self.pool.manager)
        self.slots = TokenToKVPoolAllocator(tokens, torch.float32, "cpu", self.pool, need_sort=False)
        params = CacheInitParams(
            disable=False, req_to_token_pool=self.rows, token_to_kv_pool_allocator=self.slots, page_size=1
        )
        self.tree = V4RadixCache(
            params, self.pool.manager, prefix_hits="exact", window_policy="per_request", checkpoint_interval=96
        )
        self.tokens = tokens
        self.waiting: list[Served] = []
        self.running: list[Served] = []  # prompts fully prefilled (in launched forwards)
        self.chunked: Served | None = None
        self.launched: Batch | None = None
        self.sequences: list[list[int]] = [[]]
        self.count = 0

    # --- requests arriving -----------------------------------------------------------------

    def submit(self) -> None:
        base = self.rng.choice(self.sequences)
        keep = self.rng.randrange(len(base) + 1)
        suffix = [self.rng.randrange(4) for _ in range(self.rng.randrange(1, LONGEST_PROMPT))]
        tokens = (base[:keep] + suffix)[:LONGEST_PROMPT]
        self.count += 1
        request = Served(self.count, array("q", tokens), array("q", tokens))
        request.prompt_len, request.max_new_tokens = len(tokens), self.rng.randrange(1, 12)
        self.waiting.append(request)

    # --- one iteration of the overlap loop ---------------------------------------------------

    def step(self) -> None:
        batch = self._prefill_batch() or self._decode_batch()
        if batch is not None:
            self.pool.storage.tables.begin_forward()  # the attention backend, as the forward begins
        previous, self.launched = self.launched, batch
        if previous is not None:
            self._process(previous)

    def _prefill_batch(self) -> Batch | None:
        adder, budget, placed = Adder(self.tree, []), CHUNK, 0
        continuing = self.chunked
        if continuing is not None:
            if not self._token_slots(min(budget, continuing.prompt_len - continuing.prefilled)):
                return None  # SGLang leaves the next chunk for later; the running requests decode
            # SGLang caches the chunk it ran before scheduling the next one.
            self.tree.checkpoint(continuing, up_to=continuing.prefilled)
            continuing.prefix_len = continuing.prefilled
            adder.can_run_list.append(continuing)
            placed = min(budget, continuing.prompt_len - continuing.prefilled)
            budget -= placed
        admitted = []
        for request in list(self.waiting):
            if budget <= 0 or len(admitted) + 1 > self.rows.available_size():
                break
            key = RadixKey(array("q", request.full_untruncated_fill_ids[:-1]))
            match = self.tree.match_prefix(MatchPrefixParams(key=key))
            request.prefix_len, request.last_node = match.device_prefix_len, match.last_device_node
            extend = min(budget, len(request.full_untruncated_fill_ids) - request.prefix_len)
            if _admit_within_window_slots(lambda _adder, _req: None, adder, request) == AddReqResult.NO_TOKEN:
                break
            request.lock = self.tree.lock(request.last_node)
            if not self._token_slots(placed + extend):
                self.tree.unlock(request.lock)
                break
            placed += extend
            self.waiting.remove(request)
            adder.can_run_list.append(request)
            admitted.append((request, extend))
            budget -= extend
        if not adder.can_run_list:
            return None
        return self._reserve_extend(continuing, admitted)

    def _reserve_extend(self, continuing: Served | None, admitted: list[tuple[Served, int]]) -> Batch:
        """SGLang's ``alloc_for_extend``: token slots and rows, the bound rows' tables, then the new rows'."""
        batch = Batch()
        self.chunked = None
        if continuing is not None:
            extend = min(CHUNK, continuing.prompt_len - continuing.prefilled)
            assert self._token_slots(extend)
            self._place(continuing, continuing.prefilled, continuing.prefilled + extend)
            self.rows.alloc_aux_to_lengths(
                req_pool_indices_cpu=torch.tensor([continuing.kv.req_pool_idx]),
                target_seq_lens_cpu=torch.tensor([continuing.kv.kv_allocated_len]),
            )
            self._advance_prefill(continuing, extend, batch)
        for request, extend in admitted:
            row = self.rows.alloc_rows(1)[0]
            request.kv.req_pool_idx = row
            self.rows.req_to_token[row, : request.prefix_len] = self.tree.prefix_device_indices(request).to(
                torch.int32
            )
            request.kv.cache_protected_len = request.prefix_len
            self._place(request, request.prefix_len, request.prefix_len + extend)
            self.tree.maybe_hand_to_session(request)
            request.prefilled = request.prefix_len
            self._advance_prefill(request, extend, batch)
        return batch

    def _advance_prefill(self, request: Served, extend: int, batch: Batch) -> None:
        request.prefilled += extend
        if request.prefilled < len(request.full_untruncated_fill_ids):
            self.chunked = request
        else:
            batch.extend.append(request)
            self.running.append(request)  # SGLang merges the prefill batch into the running one at once

    def _decode_batch(self) -> Batch | None:
        while self.running and not (
            self._token_slots(len(self.running))
            and _decode_within_window_slots(lambda _batch, _selected: True, DecodeBatch(self.tree, self.running))
        ):
            self._retract(self.running[-1])
        if not self.running:
            return None
        rows, lengths = [], []
        for request in self.running:
            # The token sampled by the forward in flight gets its KV in this one.
            self._place(request, request.kv.kv_allocated_len, request.kv.kv_allocated_len + 1)
            rows.append(request.kv.req_pool_idx)
            lengths.append(request.kv.kv_allocated_len)
        self.rows.alloc_aux_to_lengths(
            req_pool_indices_cpu=torch.tensor(rows), target_seq_lens_cpu=torch.tensor(lengths)
        )
        return Batch(decode=list(self.running))

    # --- results, one batch late ------------------------------------------------------------

    def _process(self, batch: Batch) -> None:
        for request in batch.extend + batch.decode:
            if request.retracted or request.done:
                continue
            if request.outputs == 0:
                self.tree.checkpoint(request, up_to=request.prompt_len)  # the prompt's end
            request.full_untruncated_fill_ids.append(self.rng.randrange(4))
            request.outputs += 1
            roll = self.rng.random()
            if request.outputs >= request.max_new_tokens or roll < 0.05:  # done, or aborted
                self._finish(request, insert=True)
            elif roll < 0.07:
                self._finish(request, insert=False)

    def _finish(self, request: Served, insert: bool) -> None:
        request.done = True
        self.running.remove(request)
        owned = len(request.full_untruncated_fill_ids) - 1  # the last sampled token has no KV yet
        if insert:
            self.tree.checkpoint(request, up_to=owned)
            self.sequences.append(list(request.full_untruncated_fill_ids[:owned]))
        self._release(request)

    def _retract(self, request: Served) -> None:
        """SGLang frees a retracted request's row with nothing inserted and queues it again."""
        self.running.remove(request)
        self._release(request)
        request.retracted = True
        again = Served(request.rid, array("q", request.full_untruncated_fill_ids), request.origin_input_ids)
        again.prompt_len = len(again.full_untruncated_fill_ids)
        again.max_new_tokens = max(1, request.max_new_tokens - request.outputs)
        self.waiting.insert(0, again)

    def _release(self, request: Served) -> None:
        row = self.rows.req_to_token[request.kv.req_pool_idx]
        self.slots.free(row[request.kv.cache_protected_len : request.kv.kv_allocated_len].to(torch.int64))
        self.tree.unlock(request.lock)
        self.rows.free_rows([request.kv.req_pool_idx])

    # --- token slots -------------------------------------------------------------------------

    def _token_slots(self, count: int) -> bool:
        if self.slots.available_size() < count:
            self.tree.evict(EvictParams(num_tokens=count - self.slots.available_size()))
        return self.slots.available_size() >= count

    def _place(self, request: Served, start: int, end: int) -> None:
        row = request.kv.req_pool_idx
        self.rows.req_to_token[row, start:end] = self.slots.alloc(end - start).to(torch.int32)
        request.kv.kv_allocated_len = end

    def drain(self) -> None:
        """Run until nothing waits or runs, then once more to process the last batch."""
        for _ in range(10_000):
            if not (self.waiting or self.running or self.chunked or self.launched):
                return
            self.step()
        raise AssertionError("the loop never drained: a request waits for window slots nothing frees")


# (request rows, token slots, checkpoint records or None for the layout's): each scarce in turn.
SCARCE = {
    "rows": (1, 6000, None),
    "token_slots": (6, 2600, None),
    "records": (4, 8000, 3),
    "roomy": (8, 12000, None),
}


@pytest.mark.parametrize("scarce", sorted(SCARCE))
def test_no_forward_runs_short_of_its_rows_under_random_load_and_every_row_returns(tiny_model, scarce):
    rng = random.Random(scarce)
    loop = OverlapLoop(tiny_model.config, rng, *SCARCE[scarce])
    tables = loop.pool.storage.tables
    for _ in range(600):
        if rng.random() < 0.3 or not (loop.waiting or loop.running or loop.chunked):
            for _ in range(rng.randrange(1, 4)):
                loop.submit()
        if rng.random() < 0.05:
            loop.tree.set_modes(
                prefix_hits=rng.choice(["exact", "aligned"]),
                window_policy=rng.choice(["per_request", "all_committed"]),
            )
        loop.step()  # a PoolExhausted from any reservation fails the test here
        assert set(loop.tree.audit().values()) == {0}
    loop.drain()
    assert not any(tables.bound)
    assert loop.tree.protected_size() == 0
    assert loop.slots.available_size() + loop.tree.evictable_size() == loop.tokens
    loop.tree.reset()
    usage = loop.pool.storage.usage()
    assert all(kind["free"] == kind["total"] for kind in usage.values()), usage
