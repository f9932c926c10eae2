"""The pools under emulation: the ledger's capacity on an H200, in rows of no width.

:class:`WidthlessPoolStorage` keeps every count, table and piece of bookkeeping of the real
:class:`~sglang_dsv4.memory_pool.storage.V4PoolStorage` (the rows a request takes, shares and gives back), but its
window slots, compressed entries and state records hold zero bytes each, so the millions of token slots of an
H200's pool fit in this host's memory. :class:`EmulatedPoolConfigurator` sizes them as the GPU would: the pool
bytes :class:`~sglang_dsv4.memory_pool.ledger.RankLedger` leaves on one H200 of the deployment at SGLang's
``--mem-fraction-static`` (FP8 dense and FP4 expert weights, as released), split by the pool layout, whatever
memory this host has. SGLang's request table (``req_to_token``: rows x context int32) is allocated whole.
"""

from __future__ import annotations

import torch
from sglang.srt.model_executor.pool_configurator import MemoryPoolConfig

from ..config import DeepseekV4Config
from ..kernels.kv_format import RowFormat
from ..memory_pool.layout import STATE_DTYPE, PoolLayout, StateBuffer
from ..memory_pool.ledger import RankLedger
from ..memory_pool.sizing import V4PoolConfigurator
from ..memory_pool.storage import V4PoolStorage
from ..model.weight_layout import Parallelism
from ..settings import settings


class WidthlessPoolStorage(V4PoolStorage):
    def _rows(self, row_format: RowFormat, rows: int) -> torch.Tensor:
        return torch.empty(rows, 0, dtype=torch.uint8, device=self.device)

    def _records(self, rows: int, buffer: StateBuffer) -> torch.Tensor:
        return torch.empty(rows, buffer.pools, 3, 0, dtype=STATE_DTYPE, device=self.device)


class EmulatedPoolConfigurator(V4PoolConfigurator):
    def __init__(
        self,
        layout: PoolLayout,
        max_running_requests: int | None,
        table_context: int,
        gpus: int,
        mem_fraction_static: float,
    ):
        super().__init__(layout, max_running_requests, table_context)
        attention_tp = settings().emulate_attention_tp
        self.rank = rank_ledger(layout.config, layout.kv_dtype, gpus, layout.verify_tokens, attention_tp)
        self.mem_fraction_static = mem_fraction_static

    def calculate_pool_sizes(self, available_bytes: int, page_size: int) -> MemoryPoolConfig:
        """The pools of one H200 (this host's ``available_bytes`` are not what bounds them)."""
        return super().calculate_pool_sizes(int(self.rank.pool_bytes(self.mem_fraction_static)), page_size)


def rank_ledger(
    config: DeepseekV4Config, kv_dtype: torch.dtype, gpus: int, verify_tokens: int = 0, attention_tp: int = 1
) -> RankLedger:
    """One GPU of ``gpus``, release (FP8/FP4) weights: one attention-DP rank a GPU and experts split over all
    (``attention_tp`` 1), or one tensor-parallel group of all of them (``attention_tp == gpus``)."""
    parallel = Parallelism(gpus, 1, 1) if attention_tp > 1 else Parallelism(gpus, gpus, gpus)
    return RankLedger(config, parallel, True, kv_dtype=kv_dtype, verify_tokens=verify_tokens)
