"""Expert placement for expert parallelism: which ranks hold which experts, and the planner.

A placement is SGLang's ``physical_to_logical_map`` (``sglang/srt/eplb/expert_location.py``):
per MoE layer, ``num_experts + redundant`` physical slots, each holding one logical expert;
slot ``s`` lives on EP rank ``s // slots_per_rank``. A logical expert may sit in several slots
(replicas); SGLang's dispatch spreads its tokens evenly over them, so a replica carries
``load / replicas``.

The planner minimises the largest rank load of each layer given expected expert loads:

1. replicas: each redundant slot goes to the expert whose per-replica load is largest
   (water-filling; an expert gets at most one replica per rank, since two replicas on one
   rank carry the same load as one);
2. packing: replicas, heaviest first, onto the least loaded rank with a free slot that does
   not already hold that expert (longest-processing-time under a per-rank slot capacity);
3. refinement: swap a replica of the heaviest rank with one of another rank while that lowers
   the pair's larger load below the heaviest rank's; stop when no swap helps.

Steps 1-2 are what DeepSeek's EPLB (SGLang's ``deepseek`` algorithm) does; step 3 and the
one-replica-per-rank rule are where this planner gains, most with few slots per rank.
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


def plan_placement(
    layer_loads: Sequence[torch.Tensor | None], num_experts: int, ep_size: int, redundant_experts: int = 0
) -> Placement:
    """Plan every layer; a layer whose expected loads are ``None`` gets the trivial layout."""
    num_slots = _check_shape(num_experts, ep_size, redundant_experts)
    rows = [
        trivial_layer(num_experts, num_slots) if loads is None else plan_layer(loads, ep_size, num_slots // ep_size)
        for loads in layer_loads
    ]
    return Placement(torch.stack(rows), ep_size, num_experts)


def plan_layer(expert_loads: torch.Tensor, ep_size: int, slots_per_rank: int) -> torch.Tensor:
    """One layer's slots (``[ep_size * slots_per_rank]`` logical expert ids) for expected ``expert_loads [E]``."""
    loads = expert_loads.double()
    num_experts = loads.numel()
    if loads.dim() != 1 or bool((loads < 0).any()) or not bool(torch.isfinite(loads).all()):
        raise ExpertPlanError(f"expert loads must be a 1-D tensor of finite non-negative values, got {expert_loads}")
    _check_shape(num_experts, ep_size, ep_size * slots_per_rank - num_experts)
    replicas = _replica_counts(loads, ep_size * slots_per_rank, max_replicas=ep_size)
    slot_experts = _pack(loads / replicas, replicas, ep_size, slots_per_rank)
    _refine(slot_experts, loads / replicas)
    return slot_experts.flatten()


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
    min_gain = _MIN_GAIN * float(replica_loads.sum()) / ep_size
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
