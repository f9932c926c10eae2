"""How many token slots and request rows fit a memory budget, from the pool layout.

SGLang's default configurator divides the budget by an MHA-shaped cell size and then
derives thousands of request rows from the token count. A V4 request holds fixed bytes
whatever its length (its window ring and compressor state) plus bytes per token of
context, so the budget is split with :class:`~.layout.PoolLayout`'s two numbers:
``tokens = (budget - rows x bytes_per_request) / bytes_per_token``. What indexes the pools
lives in the same memory and is counted with them: SGLang's token allocator, the rows'
bookkeeping (:attr:`~.layout.PoolLayout.bookkeeping_bytes_per_token`) and each request
row's tables at the served context (:meth:`~.layout.PoolLayout.request_table_bytes`: the
tables themselves on the CPU, their device twins on a GPU; the rows' bookkeeping is host
memory on a GPU, counted all the same: a few bytes per token against thousands). So is
what SGLang sizes by the token count besides its allocator: each model runner's eager
input buffers, which hold a prefill as long as the whole pool (:data:`EAGER_INPUT_BYTES_PER_TOKEN`;
with V4's small bytes per token, half again the pool on the tiny model, and uncounted they
had an EAGLE server on a 24 GB host killed for memory at start).

Where ranks share one memory (the ranks of a launch on one CPU host), SGLang measures the
whole of it for each: :class:`HostSharing` says how this rank's budget is cut from it.
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang.srt.model_executor.pool_configurator import MemoryPoolConfig, MemoryPoolConfigurator

from .layout import PoolLayout

# Request rows when --max-running-requests is not given (upstream's V4 default too).
DEFAULT_MAX_RUNNING_REQUESTS = 256
TOKEN_ALLOCATOR_BYTES = 2 * 8
"""SGLang's token allocator per token slot: its free slots and the slots freed since its last merge, int64 each."""
EAGER_INPUT_BYTES_PER_TOKEN = 6 * 8
"""SGLang's eager runner's input buffers per token slot of the pool (its prefill ceiling is the pool's token count):
input ids, positions, output slots and three rows of mrope positions, int64 each. One set per model runner: the
target's, and the EAGLE draft worker's."""


@dataclass(frozen=True)
class HostSharing:
    """``ranks`` processes like this one draw on the memory SGLang measured for this rank, each holding about
    ``resident_bytes`` besides its pools: each takes an equal share of what is left once the others' are."""

    ranks: int = 1
    resident_bytes: int = 0

    def budget(self, available_bytes: int) -> int:
        return max(available_bytes - (self.ranks - 1) * self.resident_bytes, 0) // self.ranks


class V4PoolConfigurator(MemoryPoolConfigurator):
    def __init__(
        self,
        layout: PoolLayout,
        max_running_requests: int | None,
        table_context: int,
        sharing: HostSharing = HostSharing(),
    ):
        """``table_context``: the context of the request tables held in the budget's memory."""
        self.layout = layout
        self.sharing = sharing
        self.request_rows = max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS
        model_runners = 2 if layout.verify_tokens else 1  # speculation: the draft worker's runner too
        self.bytes_per_token = (
            layout.bytes_per_token
            + layout.bookkeeping_bytes_per_token
            + TOKEN_ALLOCATOR_BYTES
            + model_runners * EAGER_INPUT_BYTES_PER_TOKEN
        )
        self.bytes_per_row = (
            layout.bytes_per_request + layout.bookkeeping_bytes_per_request + layout.request_table_bytes(table_context)
        )

    def calculate_pool_sizes(self, available_bytes: int, page_size: int) -> MemoryPoolConfig:
        budget = self.sharing.budget(available_bytes)
        fixed = (self.request_rows + 1) * self.bytes_per_row + self.layout.padding_bytes
        tokens = int(max(budget - fixed, 0) // self.bytes_per_token)
        if tokens < page_size:
            raise ValueError(
                f"the KV budget ({budget / 2**30:.2f} GiB) holds no token after the fixed bytes of "
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
