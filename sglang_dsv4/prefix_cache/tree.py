"""The V4 radix cache: SGLang's radix tree of token slots, with checkpoints at token positions.

SGLang's :class:`RadixCache` keeps the token slots of every cached prefix and is driven
by the scheduler as usual (match, lock, checkpoint, evict). A V4 request cannot resume
from token slots alone: it needs the window and compressor state at the resume point.
So nodes carry :class:`~sglang_dsv4.memory_pool.checkpoint.Checkpoint` s at their ends,
and a match is cut back to the deepest node that has one; the request then resumes
there exactly and prefills the rest.

Where checkpoints come from (``prefix_hits``, :mod:`.prefix_hits`):

* ``exact`` (default): at every ``checkpoint`` call SGLang makes — the end of each
  prefill chunk, of the prompt, and of the finished request (prompt and output, which
  the next agentic turn begins with) — one token before the end of each prefill (a
  retry of the same prompt matches all but its last token), and every
  ``checkpoint_interval`` tokens inside forwards;
* ``aligned``: only every 256 tokens, the whole pages upstream SGLang reuses.

Checkpoints share their rows with requests by reference count, so evicting one never
breaks a running request; one on a locked node (a request between its match and its
allocation) is never evicted. The tree reaches the pool only through the cache manager
(:class:`~.manager.CacheManager`), which is bound to it: under row pressure the manager
asks for the checkpoints worth least back (:meth:`V4RadixCache.evict_checkpoints_while`, :mod:`.retention`)
before any persistent KV goes (under ``per_request`` those a request resumes past go as it
resumes); SGLang evicts token slots (and the checkpoints of the leaves
it drops) only when it needs tokens. A checkpoint that cannot be had even then is skipped
(the manager counts it); a request whose own window slots cannot be had waits or is
retracted (:mod:`.admission`).

With a host tier (:mod:`.host_tier`, SGLang's ``--enable-hierarchical-cache``) the tokens SGLang evicts are
written back instead of dropped: the node stays in the tree, host-only, its entries and checkpoint copied to
host rows (under ``write_through`` its entries were copied when it was cached), and the host's least recently
used host-only leaves and backups go when it is full. A match whose deepest
checkpoint is on the host reports the host part (``host_hit_length``), which SGLang's admission loads back
(:meth:`V4RadixCache.init_load_back`; on CUDA the copies run on a stream of their own, ordered before the next
forward: :class:`~sglang_dsv4.memory_pool.host_pools.DeviceLoads`) before the request resumes there; a request that
computes tokens held on the host again loads them back when it inserts them (:meth:`V4RadixCache.insert`).

Every checkpoint attached and released is told to the tree's :attr:`V4RadixCache.reports` (by the
request that made it and its position; one written back to the host tier is still held, dropped only when it
leaves the host), and so is each request leaving and a reset: under cache-aware
DP routing the DP controller's router listens (``sglang_dsv4.routing.rank_reports``); otherwise nobody
does (:class:`Unreported`).
"""

from __future__ import annotations

import ctypes
import hashlib
import heapq
import time
from array import array
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple, Protocol

import numpy as np
import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    DecLockRefParams,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    InitLoadBackParams,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
    TreeLock,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey, TreeNode

from ..memory_pool.checkpoint import Checkpoint
from ..settings import PREFIX_HITS, WINDOW_POLICIES
from . import CHECKPOINT_RETENTIONS
from .entry_ownership import EntryOwnership
from .host_tier import HostTier, HostTokens
from .manager import CacheManager, Resume
from .prefix_hits import ALIGNED_PAGE, PREFIX_HITS_OF
from .retention import BY_WORTH, RETENTION_OF, Standing, standing
from .window_policy import WINDOW_POLICY_OF


class CheckpointReports(Protocol):
    """Who hears what the tree holds: checkpoints made (per ``checkpoint`` call, by position, with the
    request's tokens past its prompt up to the last) and dropped, requests leaving, the tree reset."""

    def made(self, rid: str, positions: Sequence[int], tokens_past_prompt: Sequence[int]) -> None: ...
    def dropped(self, rid: str, position: int) -> None: ...
    def released(self, rid: str) -> None: ...
    def flushed(self) -> None: ...


class Unreported:
    """Nobody listens."""

    def made(self, rid: str, positions: Sequence[int], tokens_past_prompt: Sequence[int]) -> None:
        pass

    def dropped(self, rid: str, position: int) -> None:
        pass

    def released(self, rid: str) -> None:
        pass

    def flushed(self) -> None:
        pass


class V4RadixCache(RadixCache):
    def __init__(
        self,
        params: CacheInitParams,
        manager: CacheManager,
        *,
        prefix_hits: str,
        window_policy: str,
        checkpoint_interval: int,
        host_tier: HostTier | None = None,
        unmatched_prompt_tail: int = 0,
    ):
        """``host_tier``: where evicted prefixes go instead of being dropped (None: they are dropped).
        ``unmatched_prompt_tail``: tokens at a key's end a match never covers (SGLang's decode instance of a
        prefill/decode pair leaves the prompt's last one to the prefill instance)."""
        self.manager = manager
        self.unmatched_prompt_tail = unmatched_prompt_tail
        self.host = host_tier
        self.checkpoints: dict[TreeNode, Checkpoint] = {}
        self.made_by: dict[TreeNode, str] = {}  # the request each checkpoint was made for
        # Where recent finished requests ended, with their tokens up to there (:meth:`_match_node`).
        self.session_ends: OrderedDict[TreeNode, SessionEnd] = OrderedDict()
        self.reports: CheckpointReports = Unreported()
        self.checkpoint_interval = checkpoint_interval
        # Requests held back because their window slots did not fit (see .admission).
        self.held_back: Counter[str] = Counter({"admissions_deferred": 0, "decode_retractions": 0})
        self.retention = BY_WORTH
        super().__init__(params)
        self.set_modes(prefix_hits=prefix_hits, window_policy=window_policy)
        manager.bind_tree(self)

    # --- modes ------------------------------------------------------------------------------

    def set_modes(
        self,
        *,
        prefix_hits: str | None = None,
        window_policy: str | None = None,
        checkpoint_retention: str | None = None,
    ) -> None:
        """Switch where hits may land, what finished requests keep and which checkpoint goes first
        (takes effect at once)."""
        check_modes(prefix_hits=prefix_hits, window_policy=window_policy, checkpoint_retention=checkpoint_retention)
        if checkpoint_retention is not None:
            self.retention = RETENTION_OF[checkpoint_retention]
        if prefix_hits is not None:
            self.prefix_hits = PREFIX_HITS_OF[prefix_hits]
        if window_policy is not None:
            self.manager.window_policy = WINDOW_POLICY_OF[window_policy]
        checkpoints = self.manager.checkpoints
        checkpoints.interval = 0 if self.disable else self.prefix_hits.snapshot_interval(self.checkpoint_interval)
        checkpoints.before_extend_end = self.prefix_hits.checkpoints_at_calls and not self.disable

    def modes(self) -> dict[str, object]:
        return {
            "prefix_hits": self.prefix_hits.name,
            "window_policy": self.manager.window_policy.name,
            "checkpoint_retention": self.retention.name,
            "checkpoint_interval": self.manager.checkpoints.interval,
        }

    # --- SGLang's calls -----------------------------------------------------------------------

    def reset(self) -> None:
        for checkpoint in self.checkpoints.values():
            self.manager.checkpoints.release(checkpoint)
        self.checkpoints.clear()
        self.made_by.clear()
        self.session_ends.clear()
        self.reports.flushed()
        # Checkpoints evicted since, by why they went first (.retention), or with their tokens; and
        # those released when a request resumed past them (per_request).
        self.evictions: Counter[str] = Counter(
            {"superseded": 0, "shallower": 0, "deepest": 0, "with_tokens": 0, "superseded_at_resume": 0}
        )
        if hasattr(self, "root_node") and self.root_node.children:  # not on the first reset, from __init__
            self.manager.entry_ownership.release_slots(self._device_slots())
            if self.host is not None:
                for node in list(self.host.entries):
                    self.host.drop(node)
        super().reset()

    def _device_slots(self) -> torch.Tensor:
        """Every device token slot the tree holds (host-only nodes hold none)."""
        values, nodes = [self._empty_device_indices], list(self.root_node.children.values())
        while nodes:
            node = nodes.pop()
            if not node.evicted:
                values.append(node.value)
            nodes.extend(node.children.values())
        return torch.cat(values)

    def swa_reprefill_tail_tokens(self, req=None) -> int:
        """SGLang caps every match this many tokens short of the key's end."""
        return self.unmatched_prompt_tail

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        """The longest cached prefix of the key that ends at a usable checkpoint."""
        key = params.key
        if self.disable or len(key) == 0:
            return self._empty_match_result
        node = self._match_node(key)
        while node is not self.root_node and not self._resumable(node):
            node = node.parent
        if node is not self.root_node:
            self._checkpoint_at(node).touch()
        if not node.evicted:
            length = self._depth(node)
            return MatchResult(
                device_prefix_len=length, last_device_node=node, last_host_node=node, best_match_node=node
            )
        # A checkpoint on the host: the scheduler loads the nodes from the device part down to it back
        # (init_load_back) before the request resumes there.
        device = node
        while device.evicted:
            device = device.parent
        length = self._depth(device)
        return MatchResult(
            device_prefix_len=length,
            last_device_node=device,
            last_host_node=node,
            best_match_node=node,
            host_hit_length=self._depth(node) - length,
        )

    def checkpoint(self, req, *, up_to: int) -> None:
        """Insert the request's tokens up to ``up_to`` and attach its checkpoints to the tree.

        The walk starts where the request's row already reads the tree (``req.last_node``, at
        ``cache_protected_len``: its match, or its previous checkpoint), so a turn looks at its new tokens
        only, whatever its history; the nodes above are refreshed as SGLang's insert from the root would
        (:meth:`_refresh_path`)."""
        if self.disable:
            return
        row, protected = req.kv.req_pool_idx, req.kv.cache_protected_len
        start = req.last_node if req.last_node is not None else self.root_node
        if self._end(start) != protected:
            start, protected_in_tree = self.root_node, 0
        else:
            protected_in_tree = protected
        key = RadixKey(req.full_untruncated_fill_ids, req.extra_key, cache_salt=req.cache_salt, limit=up_to)
        row_slots = self.req_to_token_pool.req_to_token[row, protected_in_tree:up_to].to(torch.int64)
        new_key = key[protected_in_tree:]
        if self.host is not None:  # what the request computed again that is on the host comes back (insert)
            self._load_path_back(start, new_key)
        priority, inserted = req.priority or 0, req.kv.cache_inserted_len
        cached, node = self._insert_helper(start, new_key, row_slots, priority, max(0, inserted - protected_in_tree))
        existing = protected_in_tree + cached
        prompt = len(req.origin_input_ids)
        if 0 < prompt < up_to:  # eviction may drop the output without the prompt (SGLang's split at the prompt)
            self._node_ending_at(node, prompt)
        else:
            prompt = 0
        self._refresh_path(node, start, priority, prompt_end=prompt, hits_past=inserted)
        req.kv.cache_inserted_len = max(inserted, up_to)
        # The row's own copies of tokens the tree had already go back.
        duplicates = self.req_to_token_pool.req_to_token[row, protected:existing]
        self.token_to_kv_pool_allocator.free_segment(duplicates, start_pos=protected)
        tree_slots = self._slots_between(start, node)
        # The row now reads the tree's slots, and so go its entries of blocks the tree already had.
        new = tree_slots[protected - protected_in_tree :]
        self.req_to_token_pool.write((row, slice(protected, up_to)), new)
        ownership = self.manager.entry_ownership
        ownership.adopt(row, tree_slots, protected, max(existing, protected), offset=protected_in_tree)
        ownership.commit(row, tree_slots, max(existing, protected), up_to, offset=protected_in_tree)
        self._write_through(node)
        req.kv.cache_protected_len = up_to
        req.lock = self._lock_deeper(req.lock, node)
        req.last_node = node
        if req.finished():
            self._remember_session_end(node, key, row)

        made = [self._attach(node, snapshot, req.rid) for snapshot in self.manager.checkpoints.take(row, up_to)]
        # A checkpoint at ``up_to`` itself: resumable in exact mode. A finished request's, under
        # all_committed, also keeps every window slot the request held (in aligned mode, unless at
        # a page boundary, that is all it does: the tree holds them until evicted).
        commit_all = req.finished() and self.manager.window_policy.commits_every_slot
        if self.prefix_hits.checkpoints_at_calls or commit_all:
            live = self.manager.make_checkpoint(row, up_to, commit_all)
            if live is not None:
                made.append(self._attach(node, live, req.rid))
        self._report_made(req, [node for node in made if node is not None])

    def _report_made(self, req, nodes: list[TreeNode]) -> None:
        """The checkpoints this call made that are still held (making a later one may have evicted an earlier)."""
        positions = sorted(self.checkpoints[n].position for n in nodes if self.made_by.get(n) == req.rid)
        if positions:
            prompt = len(req.origin_input_ids)
            self.reports.made(req.rid, positions, req.full_untruncated_fill_ids[prompt : positions[-1]].tolist())

    def inc_lock_ref(self, node: TreeNode) -> IncLockRefResult:
        """SGLang's, a node's leaf status looked at only where its count leaves 0 (a locked node is no evictable
        leaf, whatever its count): a flat cost a node of the path, not a look at its children."""
        if self.disable:
            return IncLockRefResult(delta=0)
        delta, root = 0, self.root_node
        while node is not root:
            delta += self._lock_one(node)
            node = node.parent
        return IncLockRefResult(delta=delta)

    def dec_lock_ref(self, node: TreeNode, params: DecLockRefParams | None = None) -> DecLockRefResult:
        """SGLang's, a node's leaf status looked at only where its count reaches 0 (as :meth:`inc_lock_ref`)."""
        if self.disable:
            return DecLockRefResult(delta=0)
        delta, root = 0, self.root_node
        while node is not root:
            delta += self._unlock_one(node)
            if node.parent is None:
                raise AssertionError("This request holds the node from another tree")
            node = node.parent
        return DecLockRefResult(delta=delta)

    def _lock_one(self, node: TreeNode) -> int:
        """``node``'s lock count up one; the change in evictable tokens (its tokens, negated, where it was 0)."""
        if node.lock_ref != 0:
            node.lock_ref += 1
            return 0
        size = len(node.key)
        self.evictable_size_ -= size
        self.protected_size_ += size
        node.lock_ref = 1
        self._update_leaf_status(node)
        return -size

    def _unlock_one(self, node: TreeNode) -> int:
        """``node``'s lock count down one; the change in evictable tokens (its tokens where it reaches 0)."""
        if node.lock_ref != 1:
            node.lock_ref -= 1
            return 0
        size = len(node.key)
        self.evictable_size_ += size
        self.protected_size_ -= size
        node.lock_ref = 0
        self._update_leaf_status(node)
        return size

    def on_release(self, req, *, checkpointed: bool) -> None:
        super().on_release(req, checkpointed=checkpointed)
        self.reports.released(req.rid)

    def maybe_hand_to_session(self, req) -> None:
        """Right after SGLang gives a request its row: bind the row, resuming at the match."""
        row = req.kv.req_pool_idx
        if self.manager.is_bound(row):
            return  # a later chunk of a running request
        resume = None
        if req.prefix_len > 0:
            node, length = req.last_node, req.prefix_len
            checkpoint = self.checkpoints.get(node)
            if checkpoint is None or checkpoint.position != length:
                raise AssertionError(f"request {req.rid} matched {length} tokens without a checkpoint there")
            ended = self.session_ends.get(node)
            entries = None if ended is None or ended.entries is None else ended.entries.of_prefix(length)
            resume = Resume(checkpoint, self.req_to_token_pool.req_to_token[row, :length], entries)
            if self.retention.marks_superseded:
                self._supersede_above(req.last_node)
        self.manager.start(row, req.kv.kv_allocated_len, resume)

    def window_slots_for_forward(self, tokens: int) -> int:
        """Window slots of its own a forward of ``tokens`` new tokens takes (reserving it takes as many)."""
        return self.manager.window_slots_for_forward(tokens)

    def window_slots_for_decode(self, rows: list[int], tokens: int) -> int:
        """Window slots of their own the next forward of the decoding ``rows`` takes (:class:`CacheManager`)."""
        return self.manager.window_slots_for_decode(rows, tokens)

    def room_for_windows(self, count: int, keep: TreeNode | None = None) -> bool:
        """Whether ``count`` window slots can be had, evicting checkpoints but the one at ``keep``
        (the match of the request asking, not locked yet)."""
        if keep is None or keep is self.root_node:
            return self.manager.room_for_windows(count)
        self.inc_lock_ref(keep)
        try:
            return self.manager.room_for_windows(count)
        finally:
            self.dec_lock_ref(keep)

    def note_held_back(self, reason: str) -> None:
        self.held_back[reason] += 1

    def evict_checkpoints_while(self, short: Callable[[], bool], for_snapshot: bool = False) -> bool:
        """While ``short()``, release the checkpoint worth least (:mod:`.retention`; under ``lru`` the least recently
        used) that no request holds its lock on; ``for_snapshot``: to make room for what a forward plans, which no
        session's deepest checkpoint is traded for (under ``worth``). Whether any went. The standings are worked
        out in one walk of the tree and brought up to date after each release (:class:`Standings`)."""
        standings, retention, released = None, self.retention, False
        while short():
            standings = standings or Standings(self)
            candidates = [
                (retention.order(standings.of[n]), id(n), n)
                for n in self.checkpoints
                if not _anchored(n) and (not for_snapshot or retention.may_go_for_snapshot(standings.of[n]))
            ]
            if not candidates:
                break
            _, _, node = min(candidates)
            self.evictions[standings.of[node].reason] += 1
            self._release(node)
            standings.released(node)
            released = True
        return released

    def evict_one_checkpoint(self, for_snapshot: bool = False) -> bool:
        """Release the checkpoint worth least, as :meth:`evict_checkpoints_while` does; whether one went."""
        asked = iter((True,))
        return self.evict_checkpoints_while(lambda: next(asked, False), for_snapshot)

    def _supersede_above(self, node: TreeNode) -> None:
        """A request resumes from the checkpoint at ``node``: those above it on its path, up to the
        nearest branch (above it the path is other prefixes' too), are superseded; released at once
        unless the window policy keeps them, or a request holds its lock on one. The one a token short
        of ``node`` stays live: a request that sends the same tokens again (a retry, a regeneration, a
        fork) resumes there, since a hit must leave it a token to run."""
        release = not self.manager.window_policy.keeps_superseded
        one_short = self._depth(node) - 1
        node = node.parent
        while node is not self.root_node and len(node.children) == 1:
            checkpoint = self.checkpoints.get(node)
            if checkpoint is not None and self._depth(node) != one_short:
                checkpoint.superseded = True
                if release and not _anchored(node):
                    self.evictions["superseded_at_resume"] += 1
                    self._release(node)
            node = node.parent

    def keep_only_resumed_windows(self) -> bool:
        """Under window-slot pressure every checkpoint, locked ones too, keeps only the window a request
        resumed from it reads (all_committed's committed windows fall back to what per_request keeps);
        whether any held more."""
        trimmed = [self.manager.checkpoints.trim_to_resumed_window(c) for c in self.checkpoints.values()]
        return any(trimmed)

    def _delete_leaf(self, node: TreeNode) -> None:
        for child in list(node.children.values()):  # host-only: their prefix goes
            self._drop_host_subtree(child)
        if self.host is not None and node in self.host.entries:
            self.host.drop_backup(node)
        if node in self.checkpoints:
            self.evictions["with_tokens"] += 1
            self._release(node)
        self.session_ends.pop(node, None)
        self.manager.entry_ownership.release_slots(node.value)
        super()._delete_leaf(node)

    def evict_some_tokens(self) -> bool:
        """Entry rows ran short: evict least recently used cached tokens (a page's worth)."""
        return self.evict(EvictParams(num_tokens=ALIGNED_PAGE)).num_tokens_evicted > 0

    # --- the host tier (.host_tier) ---------------------------------------------------------------

    def evict(self, params: EvictParams) -> EvictResult:
        """SGLang's LRU eviction of token slots; with a host tier each leaf is written back to it (and stays
        in the tree, host-only) when the host has room or can make it, else dropped as without one."""
        if self.host is None or self.disable:
            return super().evict(params)
        start_time = time.perf_counter()
        heap = [(self.eviction_strategy.get_priority(node), node) for node in self.evictable_leaves]
        heapq.heapify(heap)
        evicted = 0
        while evicted < params.num_tokens and heap:
            _, node = heapq.heappop(heap)
            parent = node.parent
            evicted += len(node.value)
            if not self._write_back(node):
                self.token_to_kv_pool_allocator.free_segment(node.value, start_pos=0)
                self._delete_leaf(node)
            if parent in self.evictable_leaves:
                heapq.heappush(heap, (self.eviction_strategy.get_priority(parent), parent))
            self.kv_events.record_remove(node)
        self.update_eviction_metrics(evicted, start_time)
        return EvictResult(num_tokens_evicted=evicted)

    def _write_back(self, node: TreeNode) -> bool:
        """Move the device leaf ``node`` to the host: its entries and checkpoint copied there, its device
        rows and token slots freed; whether it went (else nothing changed)."""
        ownership, checkpoint = self.manager.entry_ownership, self.checkpoints.get(node)
        needs = self.host.needs(node, node.value, checkpoint, ownership)
        if not self._room_on_host(needs, keep=node):
            self.host.moves["write_backs_skipped"] += 1
            return False
        self.host.write_back(node, node.value, checkpoint, ownership)
        ended = self.session_ends.get(node)
        if ended is not None:  # its entry rows go (loaded back, the path has others); its tokens stay true
            self.session_ends[node] = ended._replace(entries=None)
        if checkpoint is not None:
            self.manager.checkpoints.release(self.checkpoints.pop(node))
        ownership.release_slots(node.value)
        self.token_to_kv_pool_allocator.free_segment(node.value, start_pos=0)
        node.value = None
        self.evictable_size_ -= len(node.key)
        self._update_leaf_status(node)
        self._update_leaf_status(node.parent)
        return True

    def _write_through(self, node: TreeNode) -> None:
        """Back up the device nodes from ``node``, just cached, up to the root that the write policy says are due
        (their entries copied to the host, kept on the device), each when the host has room or can make it."""
        host = self.host
        if host is None or not host.policy.backs_up:
            return
        while node is not self.root_node:
            if node not in host.entries and host.policy.due(node):
                ownership = self.manager.entry_ownership
                if self._room_on_host(host.needs(node, node.value, None, ownership), keep=node):
                    host.back_up(node, node.value, ownership)
                else:
                    host.moves["write_throughs_skipped"] += 1
            node = node.parent

    def _room_on_host(self, needs, keep: TreeNode | None = None) -> bool:
        """Whether the host has room for ``needs``, dropping until it does, least recently used first, its
        host-only leaves (none being loaded back) and device nodes' backups (but ``keep``'s)."""
        host = self.host
        if not host.could_hold(needs):
            return False
        while not host.has_room(needs):
            droppable = [
                n for n in host.entries if n is not keep and n not in host.pinned and not (n.evicted and n.children)
            ]
            if not droppable:
                return False
            dropped = min(droppable, key=lambda n: n.last_access_time)
            if dropped.evicted:
                self._drop_host_leaf(dropped)
            else:
                host.drop_backup(dropped)
        return True

    def _drop_host_leaf(self, node: TreeNode) -> None:
        """The host-only leaf ``node`` leaves the tree, its host rows with it."""
        self._report_dropped(node, self.host.drop(node))
        self.session_ends.pop(node, None)
        node.parent.children.pop(node.key.child_key(self.page_size))
        self._update_leaf_status(node.parent)

    def _drop_host_subtree(self, node: TreeNode) -> None:
        for child in list(node.children.values()):
            self._drop_host_subtree(child)
        self._drop_host_leaf(node)

    def _report_dropped(self, node: TreeNode, checkpoint: Checkpoint | None) -> None:
        if checkpoint is not None:
            self.reports.dropped(self.made_by.pop(node), checkpoint.position)

    def _split_node(self, key: RadixKey, child: TreeNode, split_len: int) -> TreeNode:
        """SGLang's split; a node's host entries (host-only, or its backup) split with it."""
        if not child.evicted:
            upper = super()._split_node(key, child, split_len)
            if self.host is not None and child in self.host.entries:
                self.host.split(upper, child, split_len)
            return upper
        child.value = torch.zeros(len(child.key), dtype=torch.int64)  # stands in for the slots it has not
        upper = super()._split_node(key, child, split_len)
        upper.value = child.value = None
        self.host.split(upper, child, split_len)
        return upper

    def insert(self, params: InsertParams) -> InsertResult:
        """SGLang's insert. Host-only nodes on the key's path, which the inserting request computed again,
        are loaded back first (:meth:`_load_path_back`), so that the request's copies of them are duplicates
        as of any cached prefix: a cached block's entry never changes while it is cached, on either tier."""
        if self.host is not None and not self.disable:
            self._load_path_back(self.root_node, params.key)
        return super().insert(params)

    def _load_path_back(self, start: TreeNode, key: RadixKey) -> None:
        """Load the host-only nodes on ``key``'s path below ``start`` back (their entries; their checkpoints go:
        the request makes its own); if that cannot be had, the host-only part of the path goes, with all below
        it."""
        _, node = self._match_prefix_helper(start, key)
        path = []
        while node.evicted:
            path.append(node)
            node = node.parent
        if path and not self._load_back_locked(path[::-1], with_checkpoint=False):
            self._drop_host_subtree(path[-1])

    def init_load_back(self, params: InitLoadBackParams) -> tuple[int, TreeNode] | None:
        """SGLang's admission, for a match whose checkpoint is on the host (``best_match_node``): load the
        host-only nodes from the device part of the path down to it back, taking token slots (evicting the
        least recently used as SGLang does), entry rows, window slots and a record (the cache manager makes
        room as for a forward's own), and hang the checkpoint there on the device. Returns the tokens
        loaded (``host_hit_length``, all of them) and the checkpoint's node, or ``None`` when any of those
        could not be had or the tree changed since the match (nothing loaded: the request is matched again).
        Nothing is left for the scheduler to wait on: on CUDA the copies are in flight, ordered before whatever
        its stream runs next (:class:`~sglang_dsv4.memory_pool.host_pools.DeviceLoads`)."""
        node = params.best_match_node
        if self.host is None or node not in self.host.checkpoints or not self._attached(node):
            return None
        path = [node]
        while path[-1].parent.evicted:
            path.append(path[-1].parent)
        path.reverse()
        tokens = sum(len(n.key) for n in path)
        if tokens != params.host_hit_length or not self._load_back_locked(path, with_checkpoint=True):
            return None
        self.host.moves["tokens_loaded_back"] += tokens
        return tokens, node

    def _load_back_locked(self, path: list[TreeNode], with_checkpoint: bool) -> bool:
        """:meth:`_load_back`, the device node above ``path`` locked and ``path`` kept on the host meanwhile
        (making room evicts on both tiers)."""
        above = path[0].parent
        self.inc_lock_ref(above)
        self.host.pinned.update(path)
        try:
            return self._load_back(path, with_checkpoint)
        finally:
            self.host.pinned.difference_update(path)
            self.dec_lock_ref(above)

    def _load_back(self, path: list[TreeNode], with_checkpoint: bool) -> bool:
        """Device token slots and rows for the host-only ``path`` (top first), its rows copied in; with
        ``with_checkpoint`` its last node's checkpoint hung on the device, every other host checkpoint on it
        dropped (a request resumes below them). Whether it was loaded (else nothing changed but what was
        evicted to make room)."""
        allocator, tokens = self.token_to_kv_pool_allocator, sum(len(n.key) for n in path)
        if allocator.available_size() < tokens:
            self.evict(EvictParams(num_tokens=tokens - allocator.available_size()))
        slots = allocator.alloc(tokens)
        if slots is None:
            return False
        node = path[-1]
        window = len(self.host.checkpoints[node].window) if with_checkpoint else None
        rows = self.manager.rows_for_load_back(self.host.entry_counts(path), window)
        if rows is None:
            allocator.free(slots)
            return False
        start = 0
        for loaded in path:
            loaded.value = slots[start : start + len(loaded.key)].to(torch.int64)
            start += len(loaded.key)
            self.evictable_size_ += len(loaded.key)
        self.host.load_back(path, rows.entries, self.manager.entry_ownership)
        if with_checkpoint:
            self.checkpoints[node] = self.host.load_checkpoint_back(node, rows.window, rows.record)
        for loaded in path:
            self._report_dropped(loaded, self.host.drop_checkpoint(loaded))
            self._update_leaf_status(loaded)
            self._update_leaf_status(loaded.parent)
        return True

    def _attached(self, node: TreeNode) -> bool:
        """Whether ``node`` is still in the tree (not dropped since it was matched)."""
        while node is not self.root_node:
            if node.parent is None or node.parent.children.get(node.key.child_key(self.page_size)) is not node:
                return False
            node = node.parent
        return True

    def load_back_is_cache_owned(self) -> bool:
        """The token slots :meth:`init_load_back` loads are the tree's (the request holds them by its lock)."""
        return True

    def ready_to_load_host_cache(self) -> int:
        """Before a prefill batch's forward: no load for SGLang's layer counter to wait on (the loads issued in
        :meth:`init_load_back` are ordered before the forward by the streams)."""
        return -1

    def check_hicache_events(self) -> None:
        """Each scheduler step: nothing is in flight between the tiers."""

    @property
    def ongoing_write_through(self) -> dict:
        """Copies to the host in flight: none (they are synchronous, when a node is cached or evicted)."""
        return {}

    @property
    def ongoing_load_back(self) -> dict:
        """Loads SGLang's scheduler tracks: none (those issued in :meth:`init_load_back` are ordered before the
        next forward by the streams)."""
        return {}

    @property
    def token_to_kv_pool_host(self) -> HostTokens | None:
        """The host tier in tokens, for SGLang's HiCache gauges (``--enable-metrics``)."""
        return None if self.host is None else HostTokens(self.host.pools)

    enable_storage = False  # no storage tier below the host

    def clear_storage_backend(self) -> bool:
        """There is no storage tier to clear."""
        return False

    # --- helpers ------------------------------------------------------------------------------

    def _resumable(self, node: TreeNode) -> bool:
        checkpoint = self._checkpoint_at(node)
        if checkpoint is None:
            return False
        return self.prefix_hits.resumable(checkpoint.position)

    def _checkpoint_at(self, node: TreeNode) -> Checkpoint | None:
        """The checkpoint at ``node`` on either tier."""
        if node.evicted:
            return self.host.checkpoints.get(node)
        return self.checkpoints.get(node)

    def _end(self, node: TreeNode) -> int:
        """The position ``node``'s key ends at (its depth in tokens). Fixed for the node's life: a split puts the
        new node above the one it splits, ending where the new node's key does; so it is worked out once."""
        unknown = []
        while getattr(node, "end", None) is None and node is not self.root_node:
            unknown.append(node)
            node = node.parent
        end = getattr(node, "end", 0)
        for node in reversed(unknown):
            end += len(node.key)
            node.end = end
        return end

    _depth = _end

    def _match_node(self, key: RadixKey) -> TreeNode:
        """The node SGLang's walk from the root along ``key`` ends at (splitting the node it ends inside), access
        times set as that walk sets them; started, when ``key`` begins with the tokens a recent finished request
        ended with (:meth:`_session_end_of`), from the node it ended at: the nodes above are not walked, only
        their access times set."""
        start = self._session_end_of(key)
        if start is None:
            return self._match_prefix_helper(self.root_node, key)[1]
        access_time, above = time.monotonic(), start
        while above is not None:
            above.last_access_time = access_time
            above = above.parent
        node = start
        for node, _ in self._walk(start, key, self._end(start), access_time):
            pass
        return node

    def _session_end_of(self, key: RadixKey) -> TreeNode | None:
        """The deepest remembered end (:meth:`_remember_session_end`) whose tokens ``key`` begins with: a cheap
        filter (the last token, the namespace), then one compare of the tokens at memory speed. The path from the
        root to that node holds exactly those tokens: it was inserted with them, and a node's path never changes
        while it is in the tree (a split keeps the lower part as the node; the nodes that leave drop their end)."""
        tokens = key.token_ids
        if key.is_bigram or not _int64_tokens(tokens) or not self.session_ends:
            return None
        length, namespace, candidates = len(key), key_namespace(key), []
        for node, ended in self.session_ends.items():
            position = ended.position
            if position <= length and ended.last_token == tokens[position - 1] and ended.namespace == namespace:
                candidates.append((position, id(node), node, ended.tokens))
        for position, _, node, ended_with in sorted(candidates, reverse=True):
            if _same_words(ended_with, tokens, position):
                self.session_ends.move_to_end(node)
                return node
        return None

    def _remember_session_end(self, node: TreeNode, key: RadixKey, row: int) -> None:
        """A finished request's tokens (``key``) end at ``node``, and its row ``row`` reads the tree's token slots up
        to there: its session's next turn resends them, so its match starts there (:meth:`_match_node`), and it
        resumes from there with the entry rows of the path (:meth:`maybe_hand_to_session`). The tokens are copied
        (SGLang's sessions cut and extend a finished request's token array in place) into the buffer of the deepest
        end remembered on ``node``'s path, which the session moved past: the path's tokens up to that end are in it
        already (the tree holds the same tokens on the same path), so a turn copies its new tokens only, the buffer
        grown by a quarter when full; and so are the path's entry rows (:class:`PathEntries`). The ends above
        ``node`` go (one a path), and the ``SESSION_ENDS`` most recent are kept."""
        if key.is_bigram or not _int64_tokens(key.token_ids):
            return
        position = len(key)
        if position == 0:
            return
        buffer, kept, entries, above = None, 0, None, node
        while above is not None:
            ended = self.session_ends.pop(above, None)
            if ended is not None and buffer is None:
                buffer, kept, entries = ended.tokens, ended.position, ended.entries
            above = above.parent
        tokens = np.frombuffer(key.token_ids, np.int64, position)
        if buffer is None or len(buffer) < position:
            grown = np.empty(position + position // 4 + 1024, np.int64)
            if buffer is not None:
                grown[:kept] = buffer[:kept]
            buffer = grown
        buffer[kept:position] = tokens[kept:]
        entries = PathEntries.extended(
            entries, self.manager.entry_ownership, self.req_to_token_pool.req_to_token[row], position, len(buffer)
        )
        self.session_ends[node] = SessionEnd(position, int(tokens[-1]), key_namespace(key), buffer, entries)
        if len(self.session_ends) > SESSION_ENDS:
            self.session_ends.popitem(last=False)

    def _match_prefix_helper(self, node: TreeNode, key: RadixKey) -> tuple[list[torch.Tensor], TreeNode]:
        """SGLang's walk down from ``node`` along ``key`` (splitting the node it ends inside), by :meth:`_walk`."""
        values = []
        for node, _ in self._walk(node, key):
            values.append(node.value)
        return values, node

    def _insert_helper(
        self, node: TreeNode, key: RadixKey, value: torch.Tensor, priority: int = 0, inserted_len: int = 0
    ) -> tuple[int, TreeNode]:
        """SGLang's insert below ``node`` (access times, priorities and hit counts as its own), by :meth:`_walk`:
        the tokens of ``key`` already below ``node`` and the node that ends ``key``."""
        node.priority = max(node.priority, priority)
        offset = 0
        for node, offset in self._walk(node, key):
            node.priority = max(node.priority, priority)
            if offset > inserted_len:  # nodes this request inserted before were counted then
                self._inc_hit_count(node)
        if offset < len(key):
            new_node = TreeNode(priority=priority)
            new_node.parent, new_node.key, new_node.value = node, key[offset:], value[offset:].clone()
            if len(key) > inserted_len:
                self._inc_hit_count(new_node)
            node.children[key.child_key_at(offset)] = new_node
            self.evictable_size_ += len(new_node.key)
            self._update_leaf_status(node)
            self._update_leaf_status(new_node)
            self.kv_events.record_store(new_node)
            node = new_node
        return offset, node

    def _walk(
        self, node: TreeNode, key: RadixKey, offset: int = 0, access_time: float | None = None
    ) -> Iterator[tuple[TreeNode, int]]:
        """The nodes below ``node`` (which ends at ``key``'s ``offset``) that ``key`` runs through, each with the
        tokens of ``key`` it ends at; one ``key`` ends inside is split there first. Access times set as SGLang's walks
        set them. ``key`` is read at an offset and compared by :func:`_tokens_matched`: SGLang's walks slice the
        key's rest at every node."""
        access_time = time.monotonic() if access_time is None else access_time
        node.last_access_time = access_time
        while offset < len(key):
            child = node.children.get(key.child_key_at(offset))
            if child is None:
                return
            child.last_access_time = access_time
            matched = _tokens_matched(child.key, key, offset)
            if matched < len(child.key):
                child = self._split_node(child.key, child, matched)
            node, offset = child, offset + matched
            yield node, offset

    def _refresh_path(self, node: TreeNode, start: TreeNode, priority: int, prompt_end: int, hits_past: int) -> None:
        """What SGLang's inserts from the root (the request's tokens, then its prompt) do to the nodes from ``node``
        up, where :meth:`_insert_helper` started at ``start``: access time now, priority at least ``priority`` (one
        more up to ``prompt_end``), a hit on each node from ``start`` up that ends past ``hits_past``."""
        access_time, below_start = time.monotonic(), node is not start
        while node is not self.root_node:
            node.last_access_time = access_time
            end = self._end(node)
            node.priority = max(node.priority, priority + 1 if end <= prompt_end else priority)
            below_start = below_start and node is not start
            if not below_start and end > hits_past:
                self._inc_hit_count(node)
            node = node.parent

    def _lock_deeper(self, lock: TreeLock | None, node: TreeNode) -> TreeLock:
        """A request's ``lock`` moved down to ``node`` on its path: as SGLang's lock on ``node`` and unlock of
        ``lock``, walking only the nodes between (a count above them goes up one and down one)."""
        if lock is None or lock.node is node:
            return lock if lock is not None else self.lock(node)
        delta, above = 0, node
        while above is not lock.node and above is not self.root_node:
            above = above.parent
        if above is not lock.node:  # not on the path below it: SGLang's own
            self.unlock(lock)
            return self.lock(node)
        below = node
        while below is not lock.node:
            delta += self._lock_one(below)
            below = below.parent
        return TreeLock(node, IncLockRefResult(delta=delta).to_dec_params())

    def _node_ending_at(self, node: TreeNode, position: int) -> TreeNode:
        """The node on ``node``'s path (``node`` ending at or past ``position``) that ends at ``position``, splitting
        the one it lies inside."""
        while node is not self.root_node and self._end(node.parent) >= position:
            node = node.parent
        if self._end(node) == position:
            return node
        return self._split_node(node.key, node, position - self._end(node.parent))

    def _slots_between(self, top: TreeNode, node: TreeNode) -> torch.Tensor:
        """The token slots of the nodes below ``top`` down to ``node`` (on its path), in order."""
        values = []
        while node is not top:
            values.append(node.value)
            node = node.parent
        return torch.cat(values[::-1]) if values else self._empty_device_indices

    def _attach(self, node: TreeNode, checkpoint: Checkpoint, rid: str) -> TreeNode | None:
        """Hang ``checkpoint``, made for request ``rid``, on the node ending at its position on ``node``'s path
        (splitting one if needed): that node, or None when the position was covered already (or is 0)."""
        if checkpoint.position > 0:
            node = self._node_ending_at(node, checkpoint.position)
        if checkpoint.position == 0 or node in self.checkpoints:
            self.manager.checkpoints.release(checkpoint)
            if node in self.checkpoints:
                self.checkpoints[node].touch()
            return None
        self.checkpoints[node] = checkpoint
        self.made_by[node] = rid
        return node

    def _release(self, node: TreeNode) -> None:
        """The checkpoint at ``node`` goes."""
        checkpoint = self.checkpoints.pop(node)
        self.manager.checkpoints.release(checkpoint)
        self.reports.dropped(self.made_by.pop(node), checkpoint.position)

    def checkpoint_report(self) -> dict[str, int]:
        """Checkpoints held and the window bytes they keep (slots shared between them counted once)."""
        states: dict[str, list[Checkpoint]] = {"live": [], "superseded": [], "locked": []}
        for node, checkpoint in self.checkpoints.items():
            state = "locked" if _anchored(node) else "superseded" if checkpoint.superseded else "live"
            states[state].append(checkpoint)
        return {
            "checkpoints": len(self.checkpoints),
            "checkpoint_window_bytes": self.manager.checkpoint_window_bytes(list(self.checkpoints.values())),
            "checkpoints_by_state": {
                state: {"count": len(held), "window_bytes": self.manager.checkpoint_window_bytes(held)}
                for state, held in states.items()
            },
            "checkpoint_evictions": dict(self.evictions),
            "checkpoints_skipped": dict(self.manager.checkpoints.skipped),
            "requests_held_back": dict(self.held_back),
            **({} if self.host is None else {"host_tier": self.host.report()}),
        }

    def digest(self) -> str:
        """A hash of the tree (keys and token slots), its checkpoints and every pool row's count.

        Tensor-parallel ranks run the same scheduler decisions on the same pools, so their
        digests are equal unless the ranks' caches have diverged.
        """
        digest = hashlib.sha256()
        nodes = [self.root_node]
        while nodes:
            node = nodes.pop()
            for key in sorted(node.children):
                child = node.children[key]
                slots = None if child.evicted else child.value.tolist()  # host-only: none
                digest.update(repr((key, child.key.token_ids, slots)).encode())
                nodes.append(child)
        held = [*self.checkpoints.values(), *(self.host.checkpoints.values() if self.host else ())]
        for checkpoint in sorted(held, key=lambda c: (c.position, c.record)):
            digest.update(repr((checkpoint.position, checkpoint.record, checkpoint.window.tolist())).encode())
        digest.update(self.manager.reference_counts())
        return digest.hexdigest()

    def audit(self) -> dict[str, int]:
        """Rows whose reference count differs from what holds them, per kind of row on each tier (all zero
        when nothing leaked or was freed twice; :meth:`CacheManager.audit`, :meth:`HostTier.audit`)."""
        device = self.manager.audit(list(self.checkpoints.values()))
        return device if self.host is None else {**device, **self.host.audit()}


SESSION_ENDS = 64
"""Finished requests' ends remembered for the next turns' matches and binds, at most one on a path; each holds its
tokens (8 bytes a token) and its path's entry rows (8 bytes a block of each ratio), a quarter more of room, so
together at most ~1.25x the tokens and entries of 64 of the tree's paths."""


class PathEntries:
    """The entry rows of a cached path's complete blocks, per ratio in block order (a buffer whose first
    ``position // ratio`` values are the rows of the path up to ``position``): a session's end keeps them so that a
    turn resumed there reads them as one contiguous run, not gathered by the prefix's token slots.

    They stay true while the path's nodes are on the device: a block's entry row is the tree's for as long as the
    tree holds the slot of its last token (:class:`EntryOwnership`), and nodes above a device node are on the device
    (SGLang evicts leaves first). The end's node written back to the host, its entries are forgotten."""

    def __init__(self, rows: dict[int, torch.Tensor], position: int):
        self.rows, self.position = rows, position

    @classmethod
    def extended(
        cls, kept: PathEntries | None, ownership: EntryOwnership, slots: torch.Tensor, position: int, room: int
    ) -> PathEntries:
        """The entries of a path up to ``position`` whose token slots are ``slots`` (from position 0): those of
        ``kept`` (its upper part, or none) and the blocks after it, gathered from ``ownership``; kept's buffers when
        they have room, else new ones with room for ``room`` tokens."""
        first = 0 if kept is None else kept.position
        new = ownership.of_positions(slots[first:position], first, position)
        rows = {}
        for ratio, added in new.items():
            have = first // ratio
            buffer = None if kept is None else kept.rows[ratio]
            if buffer is None or len(buffer) < position // ratio:
                grown = torch.empty(room // ratio + 1, dtype=added.dtype)
                if buffer is not None:
                    grown[:have] = buffer[:have]
                buffer = grown
            buffer[have : have + len(added)] = added
            rows[ratio] = buffer
        return cls(rows, position)

    def of_prefix(self, position: int) -> dict[int, torch.Tensor]:
        """Per ratio, the entry rows of the path's complete blocks up to ``position`` (at most the path's)."""
        return {ratio: rows[: position // ratio] for ratio, rows in self.rows.items()}


class SessionEnd(NamedTuple):
    """Where a finished request's tokens ended in the tree: the position, the last token, the key's namespace
    (extra key, cache salt), a buffer whose first ``position`` values are the tokens up to there, and the path's
    entry rows (``None`` once the node went to the host)."""

    position: int
    last_token: int
    namespace: tuple[str | None, str | None]
    tokens: np.ndarray
    entries: PathEntries | None


def key_namespace(key: RadixKey) -> tuple[str | None, str | None]:
    return key.extra_key, key.cache_salt


class Standings:
    """Every device checkpoint's standing (:func:`.retention.standing`) while checkpoints are released one by one:
    worked out in one walk down the tree (the nearest checkpoint above each node) and back up (whether a
    checkpoint, or a request's lock, lies below: a checkpoint a request has resumed from and run past is not its
    session's deepest, though the request's own is not made yet), then after each release only where it changed.

    A release at ``X`` changes two things only: the checkpoints whose nearest shallower one was ``X`` (the first on
    each path below it) now reach to ``X``'s own nearest shallower one; and above ``X``, whether anything lies below
    a node, up to the first node for which that stays as it was. Nothing else a standing reads changes while
    checkpoints are only released."""

    def __init__(self, tree: V4RadixCache):
        self.tree = tree
        self.slot_bytes, self.record_bytes = tree.manager.window_slot_bytes, tree.manager.record_bytes
        checkpoints, root = tree.checkpoints, tree.root_node
        visited, self.shallower, stack = [], {}, [(root, 0)]
        while stack:
            node, above = stack.pop()
            visited.append(node)
            self.shallower[node] = above
            if node.children:
                here = checkpoints.get(node)
                below_here = above if here is None else here.position
                stack.extend((child, below_here) for child in node.children.values())
        # Each node, after all of its descendants, tells its parent whether it holds anything (one look a node).
        self.below: dict[TreeNode, bool] = dict.fromkeys(visited, False)
        below = self.below
        for node in reversed(visited[1:]):
            if node.lock_ref > 0 or below[node] or tree._checkpoint_at(node) is not None:
                below[node.parent] = True
        self.of = {node: self._standing(node) for node in checkpoints}

    def released(self, node: TreeNode) -> None:
        """The checkpoint at ``node`` was released: bring the standings it changed up to date."""
        tree = self.tree
        del self.of[node]
        stack, above = list(node.children.values()), self.shallower[node]
        while stack:
            child = stack.pop()
            self.shallower[child] = above
            if child in tree.checkpoints:
                self.of[child] = self._standing(child)
            else:
                stack.extend(child.children.values())
        while node is not tree.root_node:
            node = node.parent
            anything = self._anything_below(node)
            if anything == self.below[node]:
                break
            self.below[node] = anything
            if node in tree.checkpoints:
                self.of[node] = self._standing(node)

    def _anything_below(self, node: TreeNode) -> bool:
        tree = self.tree
        return any(
            self.below[c] or tree._checkpoint_at(c) is not None or c.lock_ref > 0 for c in node.children.values()
        )

    def _standing(self, node: TreeNode) -> Standing:
        checkpoint = self.tree.checkpoints[node]
        return standing(checkpoint, self.shallower[node], not self.below[node], self.slot_bytes, self.record_bytes)


def check_modes(
    *, prefix_hits: str | None = None, window_policy: str | None = None, checkpoint_retention: str | None = None
) -> None:
    """Raise ``ValueError`` naming the mode and what is allowed, for a value that is not one."""
    for name, value, allowed in (
        ("prefix_hits", prefix_hits, PREFIX_HITS),
        ("window_policy", window_policy, WINDOW_POLICIES),
        ("checkpoint_retention", checkpoint_retention, CHECKPOINT_RETENTIONS),
    ):
        if value is not None and value not in allowed:
            raise ValueError(f"{name} is {value!r}; allowed: {', '.join(allowed)}")


def _anchored(node: TreeNode) -> bool:
    """Whether a request holds its lock on this very node (not only through a descendant):
    one admitted to resume here and not yet bound, or one that checkpointed here."""
    return node.lock_ref > sum(child.lock_ref for child in node.children.values())


VECTORIZED_FROM = 1024
"""Tokens from which one numpy compare is cheaper than ``match_at``'s slice copies (measured on this host)."""


def _tokens_matched(node_key: RadixKey, key: RadixKey, offset: int) -> int:
    """How many of ``node_key``'s tokens ``key`` has from ``offset`` on: SGLang's ``RadixKey.match_at`` as one
    vectorized compare of the two token buffers, at memory speed (``match_at`` compares slice copies). Keys of
    ``array('q')``, which SGLang's scheduler builds, and at least ``VECTORIZED_FROM`` tokens to compare; any other
    (a bigram view, a list, a short node, where numpy's fixed cost is more than the copies) goes to ``match_at``."""
    ours, theirs = node_key.token_ids, key.token_ids
    count = min(len(node_key), len(key) - offset)
    if count < VECTORIZED_FROM or node_key.is_bigram or key.is_bigram:
        return node_key.match_at(key, offset)
    if not (_int64_tokens(ours) and _int64_tokens(theirs)):
        return node_key.match_at(key, offset)
    differ = np.frombuffer(ours, np.int64, count) != np.frombuffer(theirs, np.int64, count, offset * 8)
    return int(differ.argmax()) if differ.any() else count


def _memcmp() -> Callable[[int, int, int], int] | None:
    try:
        compare = ctypes.CDLL(None).memcmp
    except (AttributeError, OSError):
        return None
    compare.restype, compare.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return compare


_MEMCMP = _memcmp()


def _same_words(buffer: np.ndarray, tokens: array, count: int) -> bool:
    """Whether the first ``count`` int64 tokens of ``buffer`` and of ``tokens`` (``array('q')``) are equal: one pass
    over both at memory speed, by the C library's ``memcmp`` (numpy's compare writes a mask and reads it back, about
    a quarter slower over a cold history), or numpy's where there is none."""
    if _MEMCMP is None:
        return np.array_equal(buffer[:count], np.frombuffer(tokens, np.int64, count))
    return _MEMCMP(buffer.ctypes.data, tokens.buffer_info()[0], 8 * count) == 0


def _int64_tokens(tokens: object) -> bool:
    return isinstance(tokens, array) and tokens.typecode == "q"
