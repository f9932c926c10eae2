"""Expert load of the hash-routed MoE layers, known from token ids before the forward.

A hash layer sends token ``t`` to experts ``tid2eid[t]`` whatever the hidden state, so a
batch's per-expert token counts are a bincount over its token ids: exact, vectorised, one
gather and one bincount for all hash layers at once, cheap enough for every step. Given a
:class:`~.placement.Placement`, the same counts land on slots and ranks, which is what an
expert-parallel dispatcher needs to size its send and receive buffers early. (The router's
weights still come from the forward; only the choice of experts is fixed.)

Over traffic, the expected load of expert ``e`` is ``sum_t histogram[t] * #{e in tid2eid[t]}``
(:func:`expected_hash_loads`), the input the placement planner uses for hash layers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..config import DeepseekV4Config
from .placement import ExpertPlanError, Placement


class HashLoadPredictor:
    """Exact per-expert, per-slot and per-rank token counts of the hash layers for a batch of token ids."""

    def __init__(self, config: DeepseekV4Config, tables: Sequence[torch.Tensor] | torch.Tensor):
        """``tables``: one ``tid2eid [vocab_size, num_experts_per_tok]`` per hash layer, in layer order."""
        self.config = config
        self.tables = check_hash_tables(config, tables)  # [hash layers, vocab, top_k]
        self.num_experts = config.n_routed_experts
        # Flat bin of (layer, expert) so one bincount counts every layer.
        offsets = torch.arange(self.num_layers, device=self.tables.device) * self.num_experts
        self._flat_tables = self.tables + offsets[:, None, None]
        self._last_placement: tuple[Placement, tuple[torch.Tensor, torch.Tensor]] | None = None

    @property
    def num_layers(self) -> int:
        return self.tables.shape[0]

    def expert_counts(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``[hash layers, num_experts]`` int64: how many tokens of the batch each expert receives."""
        ids = check_token_ids(token_ids, self.config.vocab_size).to(self.tables.device)
        bins = self._flat_tables.index_select(1, ids).flatten()
        return torch.bincount(bins, minlength=self.num_layers * self.num_experts).view(self.num_layers, -1)

    def slots(self, token_ids: torch.Tensor, placement: Placement) -> torch.Tensor:
        """``[hash layers, tokens, top_k]`` int64: the physical slot each token's choice goes to.

        Without replicas a choice has one slot. A replicated expert's tokens are split as
        SGLang's rank-invariant ``dynamic`` dispatch splits them (``--ep-dispatch-algorithm
        dynamic`` without an all-to-all backend): token row ``i`` goes to the expert's replica
        ``i % replicas``, replicas in slot order. Other dispatch rules split the same total evenly
        on average.
        """
        replica_slots, replicas = self._replica_table(placement)
        ids = check_token_ids(token_ids, self.config.vocab_size).to(self.tables.device)
        experts = self.tables.index_select(1, ids)  # [layers, T, top_k]
        layer = torch.arange(self.num_layers, device=ids.device)[:, None, None]
        row = torch.arange(ids.numel(), device=ids.device)[None, :, None]
        return replica_slots[layer, experts, row % replicas[layer, experts]]

    def slot_counts(self, token_ids: torch.Tensor, placement: Placement) -> torch.Tensor:
        """``[hash layers, num_slots]`` int64: tokens each physical slot receives under ``placement`` (:meth:`slots`)."""
        layer = torch.arange(self.num_layers, device=self.tables.device)[:, None, None]
        slots = self.slots(token_ids, placement) + layer * placement.num_slots
        return torch.bincount(slots.flatten(), minlength=self.num_layers * placement.num_slots).view(
            self.num_layers, -1
        )

    def rank_counts(self, token_ids: torch.Tensor, placement: Placement) -> torch.Tensor:
        """``[hash layers, ep_size]`` int64: tokens each EP rank receives (see :meth:`slot_counts`)."""
        slots = self.slot_counts(token_ids, placement)
        return slots.view(self.num_layers, placement.ep_size, placement.slots_per_rank).sum(-1)

    def _replica_table(self, placement: Placement) -> tuple[torch.Tensor, torch.Tensor]:
        """``(replica_slots [layers, experts, max replicas], replicas [layers, experts])`` of the hash layers.

        ``replica_slots[l, e, j]`` is the slot of expert ``e``'s ``j``-th replica in slot order.
        Kept for the last placement seen, since a server keeps one placement for many steps.
        """
        if self._last_placement is not None and self._last_placement[0] is placement:
            return self._last_placement[1]
        if placement.num_experts != self.num_experts or placement.num_layers < self.num_layers:
            raise ExpertPlanError(
                f"placement covers {placement.num_layers} layers of {placement.num_experts} experts; "
                f"the hash layers need {self.num_layers} layers of {self.num_experts}"
            )
        device = self.tables.device
        p2l = placement.physical_to_logical[: self.num_layers].long().to(device)
        replicas = placement.replica_counts()[: self.num_layers].to(device)
        replica_slots = torch.full((self.num_layers, self.num_experts, int(replicas.max())), -1, device=device)
        layer = torch.arange(self.num_layers, device=device)[:, None]
        replica_slots[layer, p2l, _rank_among_equal(p2l)] = torch.arange(placement.num_slots, device=device)
        self._last_placement = (placement, (replica_slots, replicas))
        return replica_slots, replicas


def expected_hash_loads(
    config: DeepseekV4Config, tables: Sequence[torch.Tensor] | torch.Tensor, token_histogram: torch.Tensor
) -> torch.Tensor:
    """``[hash layers, num_experts]`` float64: expert loads over traffic with token frequencies ``token_histogram``."""
    stacked = check_hash_tables(config, tables)
    histogram = torch.as_tensor(token_histogram).double().flatten()
    if histogram.numel() != config.vocab_size:
        raise ExpertPlanError(
            f"token histogram has {histogram.numel()} entries; the config's vocabulary has {config.vocab_size}"
        )
    if bool((histogram < 0).any()):
        raise ExpertPlanError("token histogram has negative counts")
    per_slot = histogram.to(stacked.device).repeat_interleave(config.num_experts_per_tok)
    num_experts = config.n_routed_experts
    return torch.stack([torch.bincount(t.flatten(), weights=per_slot, minlength=num_experts) for t in stacked]).cpu()


def traffic_windows(
    documents: Sequence[torch.Tensor], window_tokens: int, span_tokens: int = 128, seed: int = 0
) -> list[torch.Tensor]:
    """Token ids of ``documents`` regrouped into windows of ``window_tokens``, like a server's batches.

    A batch mixes many requests, so a window is ``window_tokens // span_tokens`` spans of
    ``span_tokens`` consecutive tokens drawn from shuffled documents (seeded); a trailing
    partial span or window is left out.
    """
    if window_tokens < span_tokens or window_tokens % span_tokens:
        raise ExpertPlanError(f"window_tokens ({window_tokens}) must be a multiple of span_tokens ({span_tokens})")
    spans = [span for doc in documents for span in doc.flatten().split(span_tokens) if span.numel() == span_tokens]
    order = torch.randperm(len(spans), generator=torch.Generator().manual_seed(seed)).tolist()
    per_window = window_tokens // span_tokens
    return [
        torch.cat([spans[i] for i in order[start : start + per_window]])
        for start in range(0, len(order) - per_window + 1, per_window)
    ]


def token_histogram(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[vocab_size]`` int64 counts of ``token_ids`` (checked to be in range)."""
    return torch.bincount(check_token_ids(token_ids, vocab_size), minlength=vocab_size)


def random_hash_tables(config: DeepseekV4Config, seed: int = 0) -> torch.Tensor:
    """``[num_hash_layers, vocab, top_k]`` random tables shaped like the released ``tid2eid``.

    Each token gets ``top_k`` distinct experts, uniformly (rows with a repeat are redrawn),
    for benchmarks and tests until a checkpoint's real table is at hand.
    """
    gen = torch.Generator().manual_seed(seed)
    shape = (config.num_hash_layers, config.vocab_size, config.num_experts_per_tok)
    tables = torch.randint(config.n_routed_experts, shape, generator=gen)
    while True:
        ordered = tables.sort(-1).values
        repeats = (ordered[..., 1:] == ordered[..., :-1]).any(-1)
        if not bool(repeats.any()):
            return tables
        redraw = (int(repeats.sum()), config.num_experts_per_tok)
        tables[repeats] = torch.randint(config.n_routed_experts, redraw, generator=gen)


def check_hash_tables(config: DeepseekV4Config, tables: Sequence[torch.Tensor] | torch.Tensor) -> torch.Tensor:
    """Stack per-layer ``tid2eid`` tables into ``[num_hash_layers, vocab, top_k]`` int64, or say what is wrong."""
    stacked = tables if isinstance(tables, torch.Tensor) else torch.stack([torch.as_tensor(t) for t in tables])
    expected = (config.num_hash_layers, config.vocab_size, config.num_experts_per_tok)
    if tuple(stacked.shape) != expected:
        raise ExpertPlanError(
            f"tid2eid tables have shape {tuple(stacked.shape)}; the config needs {list(expected)} "
            "(num_hash_layers, vocab_size, num_experts_per_tok)"
        )
    if stacked.dtype.is_floating_point or stacked.dtype == torch.bool:
        raise ExpertPlanError(f"tid2eid must hold integer expert ids, got dtype {stacked.dtype}")
    stacked = stacked.long()
    if stacked.numel() and (int(stacked.min()) < 0 or int(stacked.max()) >= config.n_routed_experts):
        raise ExpertPlanError(
            f"tid2eid holds expert ids in [{int(stacked.min())}, {int(stacked.max())}]; "
            f"allowed [0, {config.n_routed_experts})"
        )
    return stacked


def check_token_ids(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``token_ids`` as a flat int64 tensor, or an error naming the offending id and the vocabulary."""
    ids = torch.as_tensor(token_ids)
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ExpertPlanError(f"token ids must be integers, got dtype {ids.dtype}")
    ids = ids.flatten().long()
    if ids.numel():
        low, high = (int(v) for v in torch.aminmax(ids))
        if low < 0 or high >= vocab_size:
            raise ExpertPlanError(f"token ids must be in [0, {vocab_size}); got min {low}, max {high}")
    return ids


def _rank_among_equal(values: torch.Tensor) -> torch.Tensor:
    """For each row, ``out[i]`` = how many earlier entries of the row equal ``values[i]``."""
    same = values[:, :, None] == values[:, None, :]  # [rows, i, j]
    earlier = torch.ones(values.shape[1], values.shape[1], dtype=torch.bool, device=values.device).tril(-1)
    return (same & earlier).sum(-1)
