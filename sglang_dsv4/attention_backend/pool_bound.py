"""What both V4 attention backends share: SGLang's pools as the V4 pool, or a refusal naming the backend."""

from __future__ import annotations

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from ..kv_cache import V4KVPool


class V4PoolBackend(AttentionBackend):
    """An attention backend over the V4 pool; SGLang's forward context reads the pools from here."""

    name = ""

    def __init__(self, model_runner):
        super().__init__()
        self.token_to_kv_pool: V4KVPool = model_runner.token_to_kv_pool
        self.req_to_token_pool = model_runner.req_to_token_pool
        if not isinstance(self.token_to_kv_pool, V4KVPool):
            raise TypeError(f"{self.name} needs the V4 KV pool, got {type(self.token_to_kv_pool).__name__}")

    def get_cpu_graph_seq_len_fill_value(self) -> int:
        """The length SGLang gives the rows it pads a DP rank's batch with (on the CPU platform; its
        CUDA twin on a GPU): they decode position 0 of request row 0, the padding row, so every
        row they write is a padding row."""
        return 1
