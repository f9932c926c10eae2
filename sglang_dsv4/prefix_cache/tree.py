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
asks for the checkpoint worth least back (:meth:`V4RadixCache.evict_one_checkpoint`, :mod:`.retention`)
before any persistent KV goes (under ``per_request`` those a request resumes past go as it
resumes); SGLang evicts token slots (and the checkpoints of the leaves
it drops) only when it needs tokens. A checkpoint that cannot be had even then is skipped
(the manager counts it); a request whose own window slots cannot be had waits or is
retracted (:mod:`.admission`).

Every checkpoint attached and released is told to the tree's :attr:`V4RadixCache.reports` (by the
request that made it and its position), and so is each request leaving and a reset: under cache-aware
DP routing the DP controller's router listens (``sglang_dsv4.routing.rank_reports``); otherwise nobody
does (:class:`Unreported`).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Sequence
from typing import Protocol

from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams, MatchResult
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey, TreeNode

from ..memory_pool.checkpoint import Checkpoint
from . import CHECKPOINT_RETENTIONS, PREFIX_HITS, WINDOW_POLICIES
from .manager import CacheManager
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
    ):
        self.manager = manager
        self.checkpoints: dict[TreeNode, Checkpoint] = {}
        self.made_by: dict[TreeNode, str] = {}  # the request each checkpoint was made for
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
        self.reports.flushed()
        # Checkpoints evicted since, by why they went first (.retention), or with their tokens; and
        # those released when a request resumed past them (per_request).
        self.evictions: Counter[str] = Counter(
            {"superseded": 0, "shallower": 0, "deepest": 0, "with_tokens": 0, "superseded_at_resume": 0}
        )
        if hasattr(self, "root_node") and self.root_node.children:  # not on the first reset, from __init__
            self.manager.entry_ownership.release_slots(self.all_values_flatten())
        super().reset()

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        """The longest cached prefix of the key that ends at a usable checkpoint."""
        key = params.key
        if self.disable or len(key) == 0:
            return self._empty_match_result
        _, node = self._match_prefix_helper(self.root_node, key)
        while node is not self.root_node and not self._resumable(node):
            node = node.parent
        if node is not self.root_node:
            self.checkpoints[node].touch()
        length = self._depth(node)
        return MatchResult(device_prefix_len=length, last_device_node=node, last_host_node=node, best_match_node=node)

    def checkpoint(self, req, *, up_to: int) -> None:
        """Insert the request's tokens up to ``up_to`` and attach its checkpoints to the tree."""
        if self.disable:
            return
        row, protected = req.kv.req_pool_idx, req.kv.cache_protected_len
        radix_key, _, existing = self._insert_cache(req, req.full_untruncated_fill_ids[:up_to], split_prompt=True)
        _, node = self._match_prefix_helper(self.root_node, radix_key)
        tree_slots = self.path_device_indices(node)
        # The row now reads the tree's slots; its own copies of them were freed by the insert,
        # and so go its entries of blocks the tree already had.
        self.req_to_token_pool.write((row, slice(protected, len(tree_slots))), tree_slots[protected:])
        self.manager.entry_ownership.adopt(row, tree_slots, protected, max(existing, protected))
        self.manager.entry_ownership.commit(row, tree_slots, max(existing, protected), len(tree_slots))
        req.kv.cache_protected_len = len(tree_slots)
        self.unlock(req.lock)
        req.lock = self.lock(node)
        req.last_node = node

        made = [self._attach(radix_key, snapshot, req.rid) for snapshot in self.manager.checkpoints.take(row, up_to)]
        # A checkpoint at ``up_to`` itself: resumable in exact mode. A finished request's, under
        # all_committed, also keeps every window slot the request held (in aligned mode, unless at
        # a page boundary, that is all it does: the tree holds them until evicted).
        commit_all = req.finished() and self.manager.window_policy.commits_every_slot
        if self.prefix_hits.checkpoints_at_calls or commit_all:
            live = self.manager.make_checkpoint(row, up_to, commit_all)
            if live is not None:
                made.append(self._attach(radix_key, live, req.rid))
        self._report_made(req, [node for node in made if node is not None])

    def _report_made(self, req, nodes: list[TreeNode]) -> None:
        """The checkpoints this call made that are still held (making a later one may have evicted an earlier)."""
        positions = sorted(self.checkpoints[n].position for n in nodes if self.made_by.get(n) == req.rid)
        if positions:
            prompt = len(req.origin_input_ids)
            self.reports.made(req.rid, positions, req.full_untruncated_fill_ids[prompt : positions[-1]].tolist())

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
            checkpoint = self.checkpoints.get(req.last_node)
            if checkpoint is None or checkpoint.position != req.prefix_len:
                raise AssertionError(f"request {req.rid} matched {req.prefix_len} tokens without a checkpoint there")
            resume = (checkpoint, self.req_to_token_pool.req_to_token[row, : req.prefix_len])
            if self.retention.marks_superseded:
                self._supersede_above(req.last_node)
        self.manager.start(row, req.kv.kv_allocated_len, resume)

    def window_slots_for_forward(self, tokens: int) -> int:
        """Window slots of its own a forward of ``tokens`` new tokens takes (reserving it takes as many)."""
        return self.manager.window_slots_for_forward(tokens)

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

    def evict_one_checkpoint(self, for_snapshot: bool = False) -> bool:
        """Release the checkpoint worth least (:mod:`.retention`; under ``lru`` the least recently used)
        that no request holds its lock on; ``for_snapshot``: to make room for what a forward plans, which
        no session's deepest checkpoint is traded for (under ``worth``)."""
        standings = self._standings()
        retention = self.retention
        candidates = [
            (retention.order(standings[n]), id(n), n)
            for n in self.checkpoints
            if not _anchored(n) and (not for_snapshot or retention.may_go_for_snapshot(standings[n]))
        ]
        if not candidates:
            return False
        _, _, node = min(candidates)
        self.evictions[standings[node].reason] += 1
        self._release(node)
        return True

    def _standings(self) -> dict[TreeNode, Standing]:
        """Every checkpoint's standing: one walk down the tree (the nearest checkpoint above each node),
        and back up (whether a checkpoint, or a request's lock, lies below: a checkpoint a request has
        resumed from and run past is not its session's deepest, though the request's own is not made yet)."""
        visited, shallower, stack = [], {}, [(self.root_node, 0)]
        while stack:
            node, above = stack.pop()
            visited.append(node)
            shallower[node] = above
            here = self.checkpoints.get(node)
            for child in node.children.values():
                stack.append((child, above if here is None else here.position))
        below: dict[TreeNode, bool] = {}
        for node in reversed(visited):  # every node after all of its descendants
            below[node] = any(below[c] or c in self.checkpoints or c.lock_ref > 0 for c in node.children.values())
        slot_bytes, record_bytes = self.manager.window_slot_bytes, self.manager.record_bytes
        return {
            node: standing(checkpoint, shallower[node], not below[node], slot_bytes, record_bytes)
            for node, checkpoint in self.checkpoints.items()
        }

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
        if node in self.checkpoints:
            self.evictions["with_tokens"] += 1
            self._release(node)
        self.manager.entry_ownership.release_slots(node.value)
        super()._delete_leaf(node)

    def evict_some_tokens(self) -> bool:
        """Entry rows ran short: evict least recently used cached tokens (a page's worth)."""
        return self.evict(EvictParams(num_tokens=ALIGNED_PAGE)).num_tokens_evicted > 0

    # --- helpers ------------------------------------------------------------------------------

    def _resumable(self, node: TreeNode) -> bool:
        checkpoint = self.checkpoints.get(node)
        if checkpoint is None:
            return False
        return self.prefix_hits.resumable(checkpoint.position)

    def _depth(self, node: TreeNode) -> int:
        length = 0
        while node is not self.root_node:
            length += len(node.key)
            node = node.parent
        return length

    def _attach(self, radix_key: RadixKey, checkpoint: Checkpoint, rid: str) -> TreeNode | None:
        """Hang ``checkpoint``, made for request ``rid``, on the node ending at its position (splitting one if
        needed): that node, or None when the position was covered already (or is not in the tree)."""
        _, node = self._match_prefix_helper(self.root_node, radix_key[: checkpoint.position])
        if node is self.root_node or self._depth(node) != checkpoint.position or node in self.checkpoints:
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
                digest.update(repr((key, child.key.token_ids, child.value.tolist())).encode())
                nodes.append(child)
        for checkpoint in sorted(self.checkpoints.values(), key=lambda c: (c.position, c.record)):
            digest.update(repr((checkpoint.position, checkpoint.record, checkpoint.window.tolist())).encode())
        digest.update(self.manager.reference_counts())
        return digest.hexdigest()

    def audit(self) -> dict[str, int]:
        """Rows whose reference count differs from what holds them, per kind of row (all zero when
        nothing leaked or was freed twice; :meth:`CacheManager.audit`)."""
        return self.manager.audit(list(self.checkpoints.values()))


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
