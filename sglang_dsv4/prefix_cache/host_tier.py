"""The prefix cache's host tier: what the tree keeps of the cached prefixes it evicted from the device.

When SGLang's LRU eviction drops a cached node's token slots and a host tier is present, the tree
(:class:`~.tree.V4RadixCache`) writes the node back instead: the node stays in the tree, host-only (its
``value``, the token slots, is ``None``, SGLang's ``evicted``), and here it keeps

* per ratio, the entry row of each block whose last token it holds (what :class:`~.entry_ownership.EntryOwnership`
  owned for its slots: compressed entries and indexer keys), copied to a host entry row;
* its checkpoint, if it had one: the window rows and the compressor-state record, copied to host rows
  (a :class:`~sglang_dsv4.memory_pool.checkpoint.Checkpoint` whose ``window`` and ``record`` are host rows).

Token slots are not copied: they are handles, not KV. Host rows are never shared: each node holds its own.
Host-only nodes sit below the device nodes of every path (only leaves go, and a load brings back a whole path from
its device part down).

When the entries are copied is the write policy's (:class:`WritePolicy`, SGLang's ``--hicache-write-policy``):
under ``write_back`` when the node is evicted, and loading it back (:meth:`HostTier.load_back`) gives its host
rows back, so a node's entries are on one tier at a time; under ``write_through`` when the tree caches the node,
``write_through_selective`` once it has been cached twice (SGLang's thresholds), and a node loaded back keeps its
host copy, so evicting a node backed up copies nothing but its checkpoint. A block's entry never changes while it
is cached, so a copy taken when the node is cached stays true. Checkpoints move only when their node is evicted:
on the device one can still be made, superseded, trimmed or evicted alone.

The host rows are :class:`~sglang_dsv4.memory_pool.host_pools.HostPools`; this tier takes them only after
:meth:`HostTier.has_room` (making room, by dropping the least recently used host-only leaves, is the tree's).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from sglang.srt.mem_cache.radix_cache import TreeNode

from ..memory_pool.checkpoint import Checkpoint
from ..memory_pool.host_pools import HostPools, HostRowKind
from ..memory_pool.storage import V4PoolStorage
from .entry_ownership import EntryOwnership


@dataclass(frozen=True)
class WritePolicy:
    """When a cached node's entries are copied to the host (SGLang's ``--hicache-write-policy``)."""

    name: str
    # Times the tree caches a node before its entries are copied (SGLang's write_through_threshold); None: only
    # when it is evicted.
    caches_before_backup: int | None

    @property
    def backs_up(self) -> bool:
        """Whether device nodes keep a host copy of their entries (written through, kept when loaded back)."""
        return self.caches_before_backup is not None

    def due(self, node: TreeNode) -> bool:
        """Whether the cached ``node`` should be backed up now."""
        return self.backs_up and node.hit_count >= self.caches_before_backup


WRITE_POLICIES = {
    p.name: p
    for p in (
        WritePolicy("write_back", None),
        WritePolicy("write_through", 1),
        WritePolicy("write_through_selective", 2),
    )
}


class HostTier:
    """Host rows (``rows[kind]`` of each kind, :func:`~sglang_dsv4.memory_pool.host_pools.host_rows_for_bytes`)
    for the device pool ``storage``'s cached prefixes, written per ``policy``, and which tree node holds which."""

    def __init__(
        self, storage: V4PoolStorage, rows: dict[str, int], policy: WritePolicy = WRITE_POLICIES["write_back"]
    ):
        self.pools = HostPools(storage, rows)
        self.policy = policy
        # Per node on the host (host-only, or a device node backed up), per ratio: the host entry row of each of
        # its tokens that ends a block (0: none).
        self.entries: dict[TreeNode, dict[int, torch.Tensor]] = {}
        self.checkpoints: dict[TreeNode, Checkpoint] = {}
        self.pinned: set[TreeNode] = set()  # host-only nodes being loaded back: never dropped meanwhile
        # What moved between the tiers (checkpoints_dropped: host checkpoints gone other than loaded back;
        # write_backs_skipped: evicted nodes the host could not take, dropped as without a host tier;
        # write_throughs_skipped: backups the host had no room for, written back when evicted instead;
        # backups_dropped: device nodes' host copies dropped to make room).
        self.moves: Counter[str] = Counter(
            {
                "nodes_written_back": 0,
                "write_backs_skipped": 0,
                "nodes_written_through": 0,
                "write_throughs_skipped": 0,
                "backups_dropped": 0,
                "checkpoints_written_back": 0,
                "checkpoints_dropped": 0,
                "checkpoints_loaded_back": 0,
                "tokens_loaded_back": 0,
                "bytes_to_host": 0,
                "bytes_to_device": 0,
            }
        )

    # --- writing back --------------------------------------------------------------------------

    def needs(
        self, node: TreeNode, slots: torch.Tensor, checkpoint: Checkpoint | None, ownership: EntryOwnership
    ) -> Counter:
        """Host rows of each kind that writing ``node`` (token slots ``slots``) and ``checkpoint`` back takes:
        its entries unless backed up already."""
        needs: Counter[HostRowKind] = Counter()
        if node not in self.entries:
            for ratio, of_slot in ownership.of_slot.items():
                needs[self.pools.entries[ratio]] = int((of_slot[slots.long()] > 0).sum())
        if checkpoint is not None:
            needs[self.pools.window] = len(checkpoint.window)
            needs[self.pools.records] = 1
        return needs

    def could_hold(self, needs: Counter) -> bool:
        """Whether the host could hold ``needs`` if it held nothing else."""
        return all(kind.rows.capacity >= count for kind, count in needs.items())

    def has_room(self, needs: Counter) -> bool:
        return all(kind.rows.free >= count for kind, count in needs.items())

    def back_up(self, node: TreeNode, slots: torch.Tensor, ownership: EntryOwnership) -> None:
        """Copy the entries the device ``node``'s token slots ``slots`` own to host rows (room for them is there:
        :meth:`has_room`); the node keeps its device rows."""
        self.entries[node] = self._save_entries(slots, ownership)
        self.moves["nodes_written_through"] += 1

    def drop_backup(self, node: TreeNode) -> None:
        """The device ``node``'s host copy goes (its host rows back); the node stays on the device."""
        self.drop(node)
        self.moves["backups_dropped"] += 1

    def write_back(
        self, node: TreeNode, slots: torch.Tensor, checkpoint: Checkpoint | None, ownership: EntryOwnership
    ) -> None:
        """Copy the entries ``node``'s token slots ``slots`` own (unless backed up already) and its
        ``checkpoint`` to host rows (room for them is there: :meth:`has_room`). The device rows stay the
        caller's to release."""
        if node not in self.entries:
            self.entries[node] = self._save_entries(slots, ownership)
        self.moves["nodes_written_back"] += 1
        if checkpoint is not None:
            window = self._save(self.pools.window, checkpoint.window)
            record = int(self._save(self.pools.records, torch.tensor([checkpoint.record]))[0])
            self.checkpoints[node] = Checkpoint(checkpoint.position, window, record, superseded=checkpoint.superseded)
            self.moves["checkpoints_written_back"] += 1

    def _save_entries(self, slots: torch.Tensor, ownership: EntryOwnership) -> dict[int, torch.Tensor]:
        """Per ratio, a host copy of the entry row each of token slots ``slots`` owns (0: none)."""
        held = {}
        for ratio, of_slot in ownership.of_slot.items():
            device_rows = of_slot[slots.long()]
            kept = device_rows > 0
            host_rows = torch.zeros_like(device_rows)
            host_rows[kept] = self._save(self.pools.entries[ratio], device_rows[kept])
            held[ratio] = host_rows
        return held

    def _save(self, kind: HostRowKind, device_rows: torch.Tensor) -> torch.Tensor:
        host_rows = kind.save(device_rows)
        if host_rows is None:
            raise AssertionError(f"{kind.rows.name}: written back without room")
        self.moves["bytes_to_host"] += len(device_rows) * kind.row_bytes
        return host_rows

    # --- loading back ---------------------------------------------------------------------------

    def entry_counts(self, path: list[TreeNode]) -> dict[int, int]:
        """Per ratio, the device entry rows loading the host-only nodes ``path`` back takes."""
        return {r: sum(int((self.entries[n][r] > 0).sum()) for n in path) for r in self.pools.entries}

    def load_back(
        self, path: list[TreeNode], entry_rows: dict[int, torch.Tensor], ownership: EntryOwnership
    ) -> None:
        """Copy the entries of the host-only nodes ``path``, whose token slots (``value``) are device slots
        again, into the device rows ``entry_rows`` (per ratio, in token order along the path), owned from
        now on by those slots; their host entry rows go back, unless the policy keeps backups."""
        taken = dict.fromkeys(entry_rows, 0)
        for node in path:
            held = self.entries[node] if self.policy.backs_up else self.entries.pop(node)
            for ratio, host_rows in held.items():
                kept = host_rows > 0
                count = int(kept.sum())
                device_rows = entry_rows[ratio][taken[ratio] : taken[ratio] + count]
                taken[ratio] += count
                self._restore(self.pools.entries[ratio], host_rows[kept], device_rows)
                ownership.of_slot[ratio][node.value[kept].long()] = device_rows
                if not self.policy.backs_up:
                    self.pools.entries[ratio].rows.release(host_rows)

    def load_checkpoint_back(self, node: TreeNode, window: torch.Tensor, record: int) -> Checkpoint:
        """The host checkpoint at ``node`` copied into device window slots ``window`` and record ``record``;
        its host rows go back."""
        held = self.checkpoints.pop(node)
        self._restore(self.pools.window, held.window, window)
        self._restore(self.pools.records, torch.tensor([held.record]), torch.tensor([record]))
        self._release_checkpoint(held)
        self.moves["checkpoints_loaded_back"] += 1
        return Checkpoint(held.position, window, record, superseded=held.superseded)

    def _restore(self, kind: HostRowKind, host_rows: torch.Tensor, device_rows: torch.Tensor) -> None:
        kind.restore(host_rows, device_rows)
        self.moves["bytes_to_device"] += len(host_rows) * kind.row_bytes

    # --- dropping and splitting -----------------------------------------------------------------

    def drop(self, node: TreeNode) -> Checkpoint | None:
        """``node``'s host rows go back (a host-only node leaving the tree, or a device node's backup); its host
        checkpoint, if it had one."""
        for ratio, host_rows in self.entries.pop(node).items():
            self.pools.entries[ratio].rows.release(host_rows)
        return self.drop_checkpoint(node)

    def drop_checkpoint(self, node: TreeNode) -> Checkpoint | None:
        """The host checkpoint at ``node``, if any, goes (its rows back); it, or None."""
        held = self.checkpoints.pop(node, None)
        if held is not None:
            self._release_checkpoint(held)
            self.moves["checkpoints_dropped"] += 1
        return held

    def _release_checkpoint(self, held: Checkpoint) -> None:
        self.pools.window.rows.release(held.window)
        self.pools.records.rows.release(torch.tensor([held.record]))

    def split(self, upper: TreeNode, lower: TreeNode, length: int) -> None:
        """The node ``lower``, on the host, was split after its first ``length`` tokens, which are now
        ``upper``'s."""
        held = self.entries.pop(lower)
        self.entries[upper] = {r: rows[:length].clone() for r, rows in held.items()}
        self.entries[lower] = {r: rows[length:].clone() for r, rows in held.items()}

    # --- what the tree reports -------------------------------------------------------------------

    def audit(self) -> dict[str, int]:
        """Host rows whose reference count differs from what the host-only nodes hold, per kind of row
        (all zero when nothing leaked or was freed twice)."""
        none = torch.zeros(0, dtype=torch.int64)
        held = {
            self.pools.window: [c.window for c in self.checkpoints.values()],
            self.pools.records: [torch.tensor([c.record]) for c in self.checkpoints.values()],
            **{kind: [e[r] for e in self.entries.values()] for r, kind in self.pools.entries.items()},
        }
        kinds = self.pools.kinds().items()
        return {f"host_{name}": kind.rows.miscounted(torch.cat([none, *held[kind]])) for name, kind in kinds}

    def report(self) -> dict[str, object]:
        """Host-only nodes, device nodes backed up, checkpoints held, rows per kind, and what moved between the
        tiers."""
        host_only = sum(node.evicted for node in self.entries)
        return {
            "write_policy": self.policy.name,
            "host_nodes": host_only,
            "backed_up_nodes": len(self.entries) - host_only,
            "host_checkpoints": len(self.checkpoints),
            "host_rows": self.pools.usage(),
            "host_bytes": self.pools.allocated_bytes,
            "host_bytes_held": self.pools.held_bytes,
            **self.moves,
        }


class HostTokens:
    """The host tier counted in tokens, as SGLang's HiCache gauges read a host pool (``logical_size``,
    ``available_size()``): by the entry rows of the smallest compression ratio, one a block of ``ratio`` tokens."""

    def __init__(self, pools: HostPools):
        self.ratio = min(pools.entries)
        self.rows = pools.entries[self.ratio].rows

    @property
    def logical_size(self) -> int:
        return self.ratio * self.rows.capacity

    def available_size(self) -> int:
        return self.ratio * self.rows.free
