"""How many token slots and request rows fit a memory budget, from the pool layout.

SGLang's default configurator divides the budget by an MHA-shaped cell size and then
derives thousands of request rows from the token count. A V4 request holds fixed bytes
whatever its length (its window ring and compressor state) plus bytes per token of
context, so the budget is split with :class:`~.layout.PoolLayout`'s two numbers:
``tokens = (budget - rows x bytes_per_request) / bytes_per_token``. On a GPU each request row also
has its request tables' device twin (:meth:`~.layout.PoolLayout.request_table_bytes` at the served
context), counted among its fixed bytes. Where ranks share one memory (a CPU host's), each sizes its
pools from its ``memory_share`` of the budget SGLang measured for it.
"""

from __future__ import annotations

from sglang.srt.model_executor.pool_configurator import MemoryPoolConfig, MemoryPoolConfigurator

from .layout import PoolLayout

# Request rows when --max-running-requests is not given (upstream's V4 default too).
DEFAULT_MAX_RUNNING_REQUESTS = 256


class V4PoolConfigurator(MemoryPoolConfigurator):
    def __init__(
        self,
        layout: PoolLayout,
        max_running_requests: int | None,
        device_table_context: int,
        memory_share: float = 1.0,
    ):
        """``device_table_context``: the context of the request tables the device holds twins of
        (0 where the tables stay on the host, as on the CPU). ``memory_share``: the part of the measured
        budget that is this rank's own (:func:`sglang_dsv4.platform.host_memory_share`)."""
        self.layout = layout
        self.memory_share = memory_share
        self.request_rows = max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS
        self.bytes_per_row = layout.bytes_per_request + (
            layout.request_table_bytes(device_table_context) if device_table_context else 0
        )

    def calculate_pool_sizes(self, available_bytes: int, page_size: int) -> MemoryPoolConfig:
        available_bytes = int(available_bytes * self.memory_share)
        fixed = (self.request_rows + 1) * self.bytes_per_row + self.layout.padding_bytes
        tokens = int(max(available_bytes - fixed, 0) // self.layout.bytes_per_token)
        if tokens < page_size:
            raise ValueError(
                f"the KV budget ({available_bytes / 2**30:.2f} GiB) holds no token after the fixed bytes of "
                f"{self.request_rows} request rows ({fixed / 2**30:.2f} GiB): lower --max-running-requests "
                "or raise --mem-fraction-static"
            )
        return MemoryPoolConfig(max_total_num_tokens=tokens // page_size * page_size)

    def calculate_pool_sizes_from_max_tokens(self, max_total_num_tokens: int, page_size: int) -> MemoryPoolConfig:
        return MemoryPoolConfig(max_total_num_tokens=max_total_num_tokens // page_size * page_size)

    def finalize_with_max_running_requests(self, config: MemoryPoolConfig) -> MemoryPoolConfig:
        """Never more request rows than the budget set aside for."""
        if config.max_running_requests is None or config.max_running_requests > self.request_rows:
            config.max_running_requests = self.request_rows
        return config
