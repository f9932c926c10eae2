"""Expert placement for expert parallelism: which ranks hold which experts, and the planner.

A placement is SGLang's ``physical_to_logical_map`` (``sglang/srt/eplb/expert_location.py``):
per MoE layer, ``num_experts + redundant`` physical slots, each holding one logical expert;
slot ``s`` lives on EP rank ``s // slots_per_rank``. A logical expert may sit in several slots
(replicas); SGLang's dispatch spreads its tokens evenly over them, so a replica carries
``load / replicas``.

The planner minimises the largest rank load of each layer:

1. replicas: each redundant slot goes to the expert whose per-replica expected load is
   largest (water-filling; an expert gets at most one replica per rank, since two replicas
   on one rank carry the same load as one);
2. packing: replicas, heaviest first, onto the least loaded rank with a free slot that does
   not already hold that expert (longest-processing-time under a per-rank slot capacity);
3. refinement: swap a replica of the heaviest rank with one of another rank while that lowers
   the pair's larger load below the heaviest rank's;
4. given loads of separate windows of traffic (steps), swaps that lower the mean over windows
   of the busiest rank's share. Expected loads alone cannot tell which experts get busy
   together (a hash layer sends a hot token's burst to the same six experts); windows can,
   and a plan that keeps such experts apart is less uneven step by step.

Steps 1-2 are what DeepSeek's EPLB (SGLang's ``deepseek`` algorithm) does; steps 3-4 and the
one-replica-per-rank rule are where this planner gains.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# A swap must lower the heaviest rank's load by more than this fraction of the mean rank
# load: it keeps float noise from cycling the refinement.
_MIN_GAIN = 1e-9


class ExpertPlanError(ValueError):
    """Input to expert load prediction or placement that does not fit; names the thing and the limit."""


@dataclass(frozen=True)
class Placement:
    """Slots of every MoE layer: ``physical_to_logical[layer, slot]`` is the logical expert in it."""

    physical_to_logical: torch.Tensor  # [layers, ep_size * slots_per_rank], int64
    ep_size: int
    num_experts: int

    def __post_init__(self) -> None:
        table = self.physical_to_logical
        if table.dim() != 2:
            raise ExpertPlanError(f"physical_to_logical must be [layers, slots], got shape {tuple(table.shape)}")
        if self.ep_size < 1 or table.shape[1] % self.ep_size:
            raise ExpertPlanError(f"{table.shape[1]} slots do not divide over ep_size {self.ep_size}")
        if table.numel() and (int(table.min()) < 0 or int(table.max()) >= self.num_experts):
            raise ExpertPlanError(
                f"physical_to_logical holds experts in [{int(table.min())}, {int(table.max())}]; "
                f"allowed [0, {self.num_experts})"
            )
        unplaced = (self.replica_counts() == 0).nonzero()
        if unplaced.numel():
            layer, expert = unplaced[0].tolist()
            raise ExpertPlanError(f"layer {layer}: expert {expert} has no slot ({len(unplaced)} unplaced in all)")

    @property
    def num_layers(self) -> int:
        return self.physical_to_logical.shape[0]

    @property
    def num_slots(self) -> int:
        return self.physical_to_logical.shape[1]

    @property
    def slots_per_rank(self) -> int:
        return self.num_slots // self.ep_size

    def replica_counts(self) -> torch.Tensor:
        """``[layers, num_experts]``: how many slots hold each logical expert."""
        counts = torch.zeros(self.num_layers, self.num_experts, dtype=torch.long)
        return counts.scatter_add_(1, self.physical_to_logical.long(), torch.ones_like(self.physical_to_logical).long())

    def rank_loads(self, expert_loads: torch.Tensor) -> torch.Tensor:
        """``[layers, ep_size]`` loads of each rank when each expert's load is split evenly over its replicas."""
        if expert_loads.shape != (self.num_layers, self.num_experts):
            raise ExpertPlanError(
                f"expert loads have shape {tuple(expert_loads.shape)}; "
                f"this placement needs [{self.num_layers}, {self.num_experts}]"
            )
        per_replica = expert_loads.double() / self.replica_counts()
        slot_loads = per_replica.gather(1, self.physical_to_logical.long())
        return slot_loads.view(self.num_layers, self.ep_size, self.slots_per_rank).sum(-1)


def trivial_layer(num_experts: int, num_slots: int) -> torch.Tensor:
    """SGLang's layout without planning: slot ``s`` holds expert ``s % num_experts``."""
    return torch.arange(num_slots) % num_experts


@dataclass(frozen=True)
class LayerLoads:
    """What the planner knows of one layer's traffic (any scale: only ratios matter)."""

    expected: torch.Tensor  # [experts]: expected load of each expert
    windows: torch.Tensor | None = None  # [windows, experts]: loads in separate windows (steps) of traffic


def plan_placement(
    layers: Sequence[LayerLoads | None], num_experts: int, ep_size: int, redundant_experts: int = 0
) -> Placement:
    """Plan every layer; a layer without loads (``None``) gets the trivial layout."""
    num_slots = _check_shape(num_experts, ep_size, redundant_experts)
    for layer, loads in enumerate(layers):
        if loads is not None and loads.expected.numel() != num_experts:
            raise ExpertPlanError(
                f"layer {layer}: loads of {loads.expected.numel()} experts; the model has {num_experts}"
            )
    rows = [
        trivial_layer(num_experts, num_slots) if loads is None else plan_layer(loads, ep_size, num_slots // ep_size)
        for loads in layers
    ]
    return Placement(torch.stack(rows), ep_size, num_experts)


def plan_layer(loads: LayerLoads, ep_size: int, slots_per_rank: int) -> torch.Tensor:
    """One layer's slots (``[ep_size * slots_per_rank]`` logical expert ids)."""
    expected = _check_loads(loads.expected, "expected loads", dim=1)
    num_experts = expected.numel()
    _check_shape(num_experts, ep_size, ep_size * slots_per_rank - num_experts)
    replicas = _replica_counts(expected, ep_size * slots_per_rank, max_replicas=ep_size)
    slots = _pack(expected / replicas, replicas, ep_size, slots_per_rank)
    _refine(slots, expected / replicas)
    if loads.windows is not None and ep_size > 1:
        windows = _check_loads(loads.windows, "window loads", dim=2)
        if windows.shape[1] != num_experts:
            raise ExpertPlanError(f"window loads cover {windows.shape[1]} experts; expected loads {num_experts}")
        windows = windows[windows.sum(-1) > 0]
        if windows.shape[0] > 1:
            shares = windows / windows.sum(-1, keepdim=True)
            _refine_windows(slots, (shares / replicas).float())
    return slots.flatten()


def _check_loads(loads: torch.Tensor, what: str, dim: int) -> torch.Tensor:
    loads = torch.as_tensor(loads).double()
    if loads.dim() != dim or bool((loads < 0).any()) or not bool(torch.isfinite(loads).all()):
        raise ExpertPlanError(
            f"{what} must be a {dim}-D tensor of finite non-negative values, got shape {tuple(loads.shape)}"
        )
    return loads


def _check_shape(num_experts: int, ep_size: int, redundant_experts: int) -> int:
    if ep_size < 1:
        raise ExpertPlanError(f"ep_size must be at least 1, got {ep_size}")
    if redundant_experts < 0:
        raise ExpertPlanError(f"redundant experts must be at least 0, got {redundant_experts}")
    num_slots = num_experts + redundant_experts
    if num_slots % ep_size:
        raise ExpertPlanError(
            f"{num_experts} experts + {redundant_experts} redundant slots = {num_slots} slots, "
            f"not divisible by ep_size {ep_size}"
        )
    if redundant_experts > num_experts * (ep_size - 1):
        raise ExpertPlanError(
            f"{redundant_experts} redundant slots exceed one replica per rank for each of "
            f"{num_experts} experts on {ep_size} ranks"
        )
    return num_slots


def _replica_counts(loads: torch.Tensor, num_slots: int, max_replicas: int) -> torch.Tensor:
    """Water-filling: each extra slot to the expert with the largest per-replica load (ties: lowest id)."""
    counts = torch.ones_like(loads)
    for _ in range(num_slots - loads.numel()):
        per_replica = torch.where(counts < max_replicas, loads / counts, -1.0)
        counts[int(per_replica.argmax())] += 1
    return counts


def _pack(replica_loads: torch.Tensor, replicas: torch.Tensor, ep_size: int, slots_per_rank: int) -> torch.Tensor:
    """``[ep_size, slots_per_rank]`` expert ids: heaviest replicas first onto the least loaded open rank."""
    order = sorted(range(replica_loads.numel()), key=lambda e: (-float(replica_loads[e]), e))
    rank_load = [0.0] * ep_size
    filled = [0] * ep_size
    held: list[set[int]] = [set() for _ in range(ep_size)]
    slots = torch.empty(ep_size, slots_per_rank, dtype=torch.long)
    for expert in order:
        load = float(replica_loads[expert])
        for _ in range(int(replicas[expert])):
            open_ranks = [r for r in range(ep_size) if filled[r] < slots_per_rank]
            rank = min(open_ranks, key=lambda r: (expert in held[r], rank_load[r], r))
            slots[rank, filled[rank]] = expert
            filled[rank] += 1
            held[rank].add(expert)
            rank_load[rank] += load
    return slots


def _refine(slots: torch.Tensor, replica_loads: torch.Tensor) -> None:
    """Pairwise swaps off the heaviest rank while they lower it (in place on ``slots [ep_size, S]``)."""
    ep_size = slots.shape[0]
    if ep_size == 1:
        return
    min_gain = _MIN_GAIN * float(replica_loads[slots].sum()) / ep_size
    for _ in range(8 * slots.numel()):
        weights = replica_loads[slots]  # [N, S]
        loads = weights.sum(-1)
        heavy = int(loads.argmax())
        holds = torch.zeros(ep_size, replica_loads.numel(), dtype=torch.bool)
        holds[torch.arange(ep_size)[:, None], slots] = True
        delta = weights[heavy][:, None, None] - weights[None]  # [S_heavy, N, S]: load moved off `heavy`
        new_max = torch.maximum(loads[heavy] - delta, loads[None, :, None] + delta)
        allowed = (
            (delta > 0)
            & ~holds.T[slots[heavy]][:, :, None]  # the heavy rank's expert is not on the other rank yet
            & ~holds[heavy][slots][None]  # the other rank's expert is not on the heavy rank yet
        )
        allowed[:, heavy] = False
        new_max = torch.where(allowed, new_max, torch.inf)
        best = int(new_max.argmin())
        if float(new_max.flatten()[best]) >= float(loads[heavy]) - min_gain:
            return
        mine, other, theirs = (int(i) for i in torch.unravel_index(torch.tensor(best), new_max.shape))
        slots[heavy, mine], slots[other, theirs] = slots[other, theirs].clone(), slots[heavy, mine].clone()


def _refine_windows(slots: torch.Tensor, replica_shares: torch.Tensor) -> None:
    """Swaps that lower the mean over windows of the largest rank share (in place on ``slots``).

    ``replica_shares [windows, E]``: each replica's share of its window's load. Candidate swaps
    take a replica off a rank that is the busiest in some window and trade it with one of another
    rank; the pair's two new loads and the busiest untouched rank (from each window's top three)
    give every candidate's objective. The best swap is made while it improves the objective.
    """
    ep_size = slots.shape[0]
    ranks = torch.arange(ep_size)
    for _ in range(8 * slots.numel()):
        items = replica_shares[:, slots]  # [W, N, S]
        loads = items.sum(-1)  # [W, N]
        objective = float(loads.max(-1).values.mean())
        heavy = loads.argmax(-1).unique()  # [H]
        delta = items[:, heavy, :, None, None] - items[:, None, None]  # [W, H, S, N, S]: moved off the heavy rank
        new_max = torch.maximum(loads[:, heavy, None, None, None] - delta, loads[:, None, None, :, None] + delta)
        top_loads, top_ranks = loads.topk(min(3, ep_size), dim=-1)
        untouched = torch.zeros(())
        for j in reversed(range(top_loads.shape[1])):
            rank = top_ranks[:, j, None, None, None, None]
            spared = (rank != heavy[None, :, None, None, None]) & (rank != ranks[None, None, None, :, None])
            untouched = torch.where(spared, top_loads[:, j, None, None, None, None], untouched)
        candidate = torch.maximum(new_max, untouched).mean(0)  # [H, S, N, S]
        holds = torch.zeros(ep_size, replica_shares.shape[1], dtype=torch.bool)
        holds[ranks[:, None], slots] = True
        blocked = (
            holds.T[slots[heavy]][:, :, :, None]  # the moved expert is on the other rank already
            | holds[heavy][:, slots][:, None]  # the returned expert is on the heavy rank already
            | (heavy[:, None, None, None] == ranks[None, None, :, None])
        )
        candidate = torch.where(blocked, torch.inf, candidate)
        best = int(candidate.argmin())
        if float(candidate.flatten()[best]) >= objective * (1 - 1e-6):
            return
        which, mine, other, theirs = (int(i) for i in torch.unravel_index(torch.tensor(best), candidate.shape))
        heavy_rank = int(heavy[which])
        slots[heavy_rank, mine], slots[other, theirs] = slots[other, theirs].clone(), slots[heavy_rank, mine].clone()
