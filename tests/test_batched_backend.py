"""The batched attention core against the per-request torch reference backend, on one pool configuration.

Two pools of one configuration go through the same operations (binding rows, reserving,
checkpoints, resumes); one forward runs the network with the reference backend on the first,
the batched core on the second. The logits must agree (float32, 1e-5 of their scale), and so
must every row the forward wrote: window slots, compressed entries, indexer keys, state
records, the records one step back and the checkpoint records. Over FP8 pools (``--kv-cache-dtype
fp8_e4m3``) both sides round the same values to FP8, and agree within one rounding (:func:`assert_same`).
"""

from __future__ import annotations

import ast
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from conftest import assert_close_to_scale, random_ids
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from test_pool import with_device_twins

from sglang_dsv4.attention_backend import batched
from sglang_dsv4.attention_backend.batched_backend import BatchedBackend
from sglang_dsv4.attention_backend.torch_reference import RequestSpan, TorchReferenceBackend
from sglang_dsv4.kernels import sparse_torch
from sglang_dsv4.kernels.selection import KVSelection
from sglang_dsv4.kernels.sparse_torch import sparse_attention, sparse_decode_attention_reference, streamed_top_k
from sglang_dsv4.kv_cache import V4KVPool
from sglang_dsv4.model.network import run_blocks
from sglang_dsv4.model.rope import ForwardRope

ROWS, CONTEXT, TOKENS = 9, 2048, 8192


class TwoBackends:
    """The reference backend on one pool, the batched core on another, driven alike."""

    def __init__(
        self,
        model,
        snapshot_interval: int = 0,
        snapshot_before_extend_end: bool = False,
        kv_dtype: torch.dtype = torch.float32,
    ):
        self.model = model
        self.fp8 = kv_dtype == torch.float8_e4m3fn
        # The float32 state records, from hidden states that read FP8 rows one side rounded differently
        # (:func:`assert_same`): within 1.4e-3 measured (decode through the graph hooks).
        self.record_tolerance = 1e-2 if self.fp8 else 1e-5
        self.pools = []
        for _ in range(2):
            pool = V4KVPool(TOKENS, 1, model.config, kv_dtype, ROWS - 1, CONTEXT, "cpu")
            pool.checkpoints.interval = snapshot_interval
            pool.checkpoints.before_extend_end = snapshot_before_extend_end
            self.pools.append(pool)
        runner = types.SimpleNamespace(token_to_kv_pool=self.pools[0], req_to_token_pool=None)
        self.reference = TorchReferenceBackend(runner)
        self.filled = 0  # checkpoints filled in forwards (and compared)
        self.sequences = {row: random_ids(CONTEXT, model.config.vocab_size, seed=100 + row) for row in range(ROWS)}

    def each_pool(self, operation) -> list:
        return [operation(pool) for pool in self.pools]

    def forward(
        self, rows: list[int], lengths: list[int], decode_graph: DecodeGraphRunner | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ``lengths[i]`` more tokens of row ``rows[i]`` in one forward on both; both logits.

        With ``decode_graph`` the batched side is a decode batch replayed through the backend's
        CUDA-graph hooks, padded to the graph's size (the padded rows' logits are dropped)."""
        reference_pool, batched_pool = self.pools
        spans, offset = [], 0
        for row, length in zip(rows, lengths, strict=True):
            self.each_pool(lambda pool: pool.storage.tables.bound[row] or pool.storage.tables.bind(row))
            start = reference_pool.storage.tables.position[row]
            self.each_pool(lambda pool: pool.manager.reserve(row, start + length))
            spans.append(RequestSpan(row, start, length, offset))
            offset += length
        ids = torch.cat([self.sequences[s.row][s.start : s.start + s.length] for s in spans])
        self.reference.plan_forward(spans)
        snapshots = [
            batched.Snapshot(i, c.position, c.record)
            for i, s in enumerate(spans)
            for c in batched_pool.checkpoints.between(s.row, s.start, s.start + s.length)
        ]
        plan = batched.BatchPlan(rows, [s.start for s in spans], lengths, snapshots)
        batched_ids = ids
        if decode_graph is None:
            # Over FP8 pools a forward of more than one token a request reads its rows decoded once, as served.
            tables, config = batched_pool.storage.tables, self.model.config
            index = batched.build_index(plan, tables, config, "cpu", staged=self.fp8)
        else:
            index = decode_graph.replay(rows, [s.start + 1 for s in spans])
            batched_ids = torch.cat([ids, torch.zeros(index.tokens - len(ids), dtype=ids.dtype)])
        expected = self._run(ids, lambda layer, block, x: self.reference.attend(block.attn, layer, x, None))
        actual = self._run(
            batched_ids,
            lambda layer, block, x: block.attn.project_out(
                batched.attend(block.attn, layer, x, index, batched_pool.storage)
            ),
        )[: len(ids)]
        for row, span in zip(rows, spans, strict=True):  # the tree would take the filled checkpoints now
            taken = self.each_pool(lambda pool: pool.checkpoints.take(row, span.start + span.length))
            self.filled += len(taken[0])
            for reference_checkpoint, checkpoint in zip(*taken, strict=True):
                for key, records in reference_pool.storage.checkpoint_state.items():
                    torch.testing.assert_close(
                        batched_pool.storage.checkpoint_state[key][checkpoint.record],
                        records[reference_checkpoint.record],
                        rtol=self.record_tolerance,
                        atol=self.record_tolerance,
                        msg=f"checkpoint at {checkpoint.position} of row {row}, {key}",
                    )
                reference_pool.checkpoints.release(reference_checkpoint)
                batched_pool.checkpoints.release(checkpoint)
        return expected, actual

    @torch.no_grad()
    def _run(self, ids: torch.Tensor, attend) -> torch.Tensor:
        model = self.model
        streams = model.embed(ids).unsqueeze(1).expand(-1, model.config.hc_mult, -1).contiguous()
        streams = run_blocks(model.layers, streams, attend, lambda layer, block, x: block.ffn(x, ids))
        return model.head(model.norm(model.hc_head(streams))).float()

    def assert_same_pools(self) -> None:
        """Every row but the padding row 0 (where the batched core parks the writes it discards).

        The record one step back is compared only for rows whose last forward ran one token:
        only then is it read (:meth:`~sglang_dsv4.prefix_cache.checkpoints.Checkpoints.make`).
        FP8 rows are compared as values, within one FP8 rounding (:func:`assert_fp8_rows_within_a_rounding`),
        the state records within ``record_tolerance``.
        """
        reference, other = self.pools
        one_step = torch.tensor(
            [r for r in range(ROWS) if reference.storage.tables.last_step[r] == 1], dtype=torch.int64
        )
        for name in ("window", "compressed", "state", "previous_state", "checkpoint_state"):
            expected, actual = getattr(reference.storage, name), getattr(other.storage, name)
            keys = range(len(expected)) if isinstance(expected, list) else expected.keys()
            rows = one_step if name == "previous_state" else slice(1, None)
            for key in keys:
                if self.fp8 and name in ("window", "compressed"):
                    formats = reference.storage
                    row_format = formats.formats.entries if name == "window" else formats.row_formats[key]
                    assert_fp8_rows_within_a_rounding(expected[key][rows], actual[key][rows], row_format)
                    continue
                tolerance = self.record_tolerance
                torch.testing.assert_close(
                    actual[key][rows], expected[key][rows], rtol=tolerance, atol=tolerance, msg=f"{name} {key}"
                )

    def checkpoint(self, row: int, position: int, slots: torch.Tensor):
        """Both pools: the tree commits the row's first ``position`` token slots and checkpoints it there."""
        self.each_pool(lambda pool: pool.entry_ownership.commit(row, slots, 0, position))
        return self.each_pool(lambda pool: pool.checkpoints.make(row, position))

    def resume(self, row: int, checkpoints, slots: torch.Tensor) -> None:
        for pool, checkpoint in zip(self.pools, checkpoints, strict=True):
            pool.checkpoints.resume(row, checkpoint, slots)


def assert_same(logits: tuple[torch.Tensor, torch.Tensor], kv_dtype: torch.dtype = torch.float32) -> None:
    """Within 1e-5 of the logits' scale; 1e-3 over FP8 pools, where the two sides round the same values to FP8 and
    so differ where float32 noise flips a rounding (measured: 4-23 window rows of 3,466 per layer, logits 5e-5 of
    their scale)."""
    expected, actual = logits
    assert_close_to_scale(actual, expected, rel=1e-3 if kv_dtype == torch.float8_e4m3fn else 1e-5)


def assert_fp8_rows_within_a_rounding(expected_rows: torch.Tensor, actual_rows: torch.Tensor, row_format) -> None:
    """FP8 rows of the two sides: each row's values within one FP8 step, fewer than 2% of rows different at all."""
    expected, actual = (row_format.decode(rows, torch.float32) for rows in (expected_rows, actual_rows))
    assert ((actual - expected).norm(dim=1) <= 0.125 * expected.norm(dim=1)).all()  # one FP8 step at most
    assert (actual != expected).any(dim=1).float().mean() < 0.02


def test_prefill_of_requests_of_different_lengths_in_one_forward(tiny_model):
    pair = TwoBackends(tiny_model)
    assert_same(pair.forward([1, 2, 3, 4], [300, 1, 129, 5]))
    pair.assert_same_pools()


def test_requests_too_short_to_complete_any_block(tiny_model):
    pair = TwoBackends(tiny_model)
    assert_same(pair.forward([1, 2], [3, 2]))
    assert_same(pair.forward([1, 2], [1, 1]))
    pair.assert_same_pools()


def test_chunked_prefill_with_chunk_ends_inside_blocks_next_to_new_requests(tiny_model):
    pair = TwoBackends(tiny_model)
    assert_same(pair.forward([1, 2], [130, 67]))  # 130: inside a ratio-4 and a ratio-128 block
    assert_same(pair.forward([1, 3, 2], [127, 3, 190]))  # 257, 257: one past a ratio-128 block
    assert_same(pair.forward([2, 1, 4], [2, 1, 255]))
    pair.assert_same_pools()


def test_decode_batch_at_every_position_modulo_4_and_128_with_snapshots(tiny_model):
    # Eight requests 16 positions apart decode 17 steps: every position modulo 128 (and so
    # modulo 4) is some request's, each step completes blocks for some and none for others,
    # and checkpoints every 12 tokens land on decode steps of different requests.
    pair = TwoBackends(tiny_model)
    rows = list(range(1, 9))
    assert_same(pair.forward(rows, [130 + 16 * i for i in range(8)]))
    pair.each_pool(lambda pool: setattr(pool.checkpoints, "interval", 12))
    for _ in range(17):
        assert_same(pair.forward(rows, [1] * 8))
    pair.assert_same_pools()
    assert pair.filled == 8 + 3  # one or two per request


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn], ids=["float32", "fp8"])
def test_requests_resumed_from_checkpoints_next_to_cold_ones(tiny_model, kv_dtype):
    pair = TwoBackends(tiny_model, kv_dtype=kv_dtype)
    pair.forward([1], [130])
    pair.forward([1], [67])  # 197: inside a ratio-4 and a ratio-128 block
    slots = torch.arange(1, 198)  # the token slots a prefix cache would hold for them
    checkpoints = pair.checkpoint(1, 197, slots)
    pair.each_pool(lambda pool: pool.storage.tables.free(1))
    pair.resume(2, checkpoints, slots)
    assert_same(pair.forward([3, 2], [150, 60]), kv_dtype)  # a cold prefill beside the resumed request
    assert_same(pair.forward([2, 3], [1, 1]), kv_dtype)
    pair.assert_same_pools()


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn], ids=["float32", "fp8"])
def test_snapshots_inside_a_forward_fill_the_checkpoint_records(tiny_model, kv_dtype):
    pair = TwoBackends(tiny_model, snapshot_interval=50, snapshot_before_extend_end=True, kv_dtype=kv_dtype)
    assert_same(pair.forward([1, 2], [300, 131]), kv_dtype)  # 50, 100, ..., and one before each prompt's end
    assert pair.filled == 6 + 1 + 2 + 1
    assert_same(pair.forward([2, 1], [129, 64]), kv_dtype)  # 150, 200, 250, 259; 350, 363
    assert pair.filled == 10 + 4 + 2
    pair.assert_same_pools()


def test_fp8_pools_read_and_written_as_the_reference_backend_does(tiny_model):
    pair = TwoBackends(tiny_model, kv_dtype=torch.float8_e4m3fn)
    for rows, lengths in (([1, 2], [130, 67]), ([1, 3, 2], [127, 3, 190]), ([1, 2, 3], [1, 1, 1])):
        assert_same(pair.forward(rows, lengths), torch.float8_e4m3fn)
    pair.assert_same_pools()
    stored = [*pair.pools[0].storage.window, *pair.pools[0].storage.compressed.values()]
    assert all(rows.dtype == torch.uint8 and (rows[1:] != 0).any() for rows in stored)  # FP8 rows, written


class DecodeGraphRunner:
    """Drives :class:`BatchedBackend`'s CUDA-graph hooks as SGLang 0.5.23's decode graph runner does.

    ``init_cuda_graph_state(max_bs, ...)`` once; static input buffers of ``max_bs`` rows
    (``req_pool_indices`` 0, ``seq_lens`` the backend's fill value); each size captured largest
    first: ``init_forward_metadata_out_graph(in_capture=True)``, then the in-graph step (and the
    warm-up forward, which :meth:`capture` runs through every layer). A replay copies the real
    rows into the buffers' first rows, pads the rest, runs the out-of-graph step on the padded
    view, then the in-graph step (what ``graph.replay()`` re-executes), and checks that the
    index lies at the addresses captured for that size.
    """

    def __init__(self, pool: V4KVPool, model, sizes: list[int]):
        self.pool, self.model, self.sizes = pool, model, sorted(sizes)
        runner = types.SimpleNamespace(token_to_kv_pool=pool, req_to_token_pool=None)
        self.backend = BatchedBackend(runner)
        max_bs = self.sizes[-1]
        self.backend.init_cuda_graph_state(max_bs, max_bs)
        self.fill = self.backend.get_cuda_graph_seq_len_fill_value()
        self.req_pool_indices = torch.zeros(max_bs, dtype=torch.int64)
        self.seq_lens = torch.full((max_bs,), self.fill, dtype=torch.int64)
        self.addresses: dict[int, dict[str, int]] = {}

    def _view(self, size: int) -> types.SimpleNamespace:
        return types.SimpleNamespace(
            batch_size=size,
            forward_mode=ForwardMode.DECODE,
            req_pool_indices=self.req_pool_indices[:size],
            seq_lens=self.seq_lens[:size],
        )

    def capture(self) -> None:
        for size in reversed(self.sizes):
            view = self._view(size)
            self.backend.init_forward_metadata_out_graph(view, in_capture=True)
            self.backend.init_forward_metadata_in_graph(view)
            index = self.backend.index
            self.addresses[size] = tensor_addresses(index)
            x = torch.randn(size, self.model.config.hidden_size)
            with torch.no_grad():
                for layer, block in enumerate(self.model.layers):
                    batched.attend(block.attn, layer, x, index, self.pool.storage)

    def replay(self, rows: list[int], seq_lens: list[int]) -> batched.ForwardIndex:
        size = min(s for s in self.sizes if s >= len(rows))
        self.req_pool_indices[: len(rows)] = torch.tensor(rows)
        self.req_pool_indices[len(rows) : size] = 0
        self.seq_lens[: len(rows)] = torch.tensor(seq_lens)
        self.seq_lens[len(rows) : size] = self.fill
        view = self._view(size)
        self.backend.init_forward_metadata_out_graph(view)
        self.backend.init_forward_metadata_in_graph(view)
        index = self.backend.index
        assert tensor_addresses(index) == self.addresses[size], f"the index of size {size} moved"
        padded = slice(len(rows), size)
        for name, targets in padding_writes(index, len(rows)).items():
            assert (targets[padded] == 0).all(), f"a padded row writes {name} outside the padding rows"
        return index


def tensor_addresses(value, path: str = "index") -> dict[str, int]:
    """``data_ptr`` of every tensor in an index, by its path."""
    if isinstance(value, torch.Tensor):
        return {path: value.data_ptr()}
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in tensor_addresses(item, f"{path}[{key}]").items()}
    if hasattr(value, "__dataclass_fields__"):
        fields = value.__dataclass_fields__
        return {k: v for name in fields for k, v in tensor_addresses(getattr(value, name), f"{path}.{name}").items()}
    return {}


def padding_writes(index: batched.ForwardIndex, requests: int) -> dict[str, torch.Tensor]:
    """Per decode request, the rows it writes: window slot, state record, entry rows, checkpoint records."""
    writes = {"window slots": index.window.write_slots, "state records": index.rows}
    for ratio, targets in index.compressors.items():
        writes[f"ratio-{ratio} entry rows"] = targets.entry_rows
        writes[f"ratio-{ratio} checkpoint records"] = targets.snapshot_records
    return writes


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn], ids=["float32", "fp8"])
def test_decode_replayed_through_the_graph_hooks_equals_the_reference_and_pads_into_padding_rows(
    tiny_model, kv_dtype
):
    # Five requests at different positions modulo 4 and 128 decode 14 steps through graphs of sizes
    # 4 and 8 (3 real rows padded to 4, or 5 to 8), with checkpoints every 12 tokens landing on
    # decode steps; the capture's warm-up forwards (all padding) come first, on the same pool.
    pair = TwoBackends(tiny_model, kv_dtype=kv_dtype)
    rows = [1, 2, 3, 4, 5]
    assert_same(pair.forward(rows, [125, 130, 255, 3, 62]), kv_dtype)
    with_device_twins(pair.pools[1].storage.tables)  # the graph reads what the hooks flushed, as on a GPU
    graph = DecodeGraphRunner(pair.pools[1], tiny_model, sizes=[1, 4, 8])
    graph.capture()
    pair.assert_same_pools()  # the warm-up forwards wrote padding rows only
    pair.each_pool(lambda pool: setattr(pool.checkpoints, "interval", 12))
    for step in range(14):
        batch = rows[:3] if step % 2 else rows
        assert_same(pair.forward(batch, [1] * len(batch), decode_graph=graph), kv_dtype)
    pair.assert_same_pools()
    assert pair.filled == 4  # at 132 (rows 1 and 2), 144 (row 2) and 264 (row 3), in graphs of both sizes


DATA_SIZED_OPS = frozenset({torch.ops.aten.nonzero.default, torch.ops.aten.masked_select.default})


class HostSyncProbe(torch.utils._python_dispatch.TorchDispatchMode):
    """Fails on every torch operation that reads a tensor's values on the host or sizes its output
    by them (a device-to-host synchronisation on CUDA, impossible inside a CUDA graph)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reads_host = func is torch.ops.aten._local_scalar_dense.default
        data_sized = func in DATA_SIZED_OPS or (
            func is torch.ops.aten.repeat_interleave.Tensor and kwargs.get("output_size") is None
        )
        masked = func is torch.ops.aten.index.Tensor and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]
        )
        if reads_host or data_sized or masked:
            raise AssertionError(f"host synchronisation: {func}")
        return func(*args, **kwargs)


def test_the_in_graph_decode_step_does_no_host_synchronisation(tiny_model, monkeypatch):
    pair = TwoBackends(tiny_model)
    assert_same(pair.forward([1, 2, 3], [130, 7, 300]))
    pool = pair.pools[1]
    for row in (1, 2, 3):
        pool.manager.reserve(row, pool.storage.tables.position[row] + 1)
    graph = DecodeGraphRunner(pool, tiny_model, sizes=[4])
    graph.req_pool_indices[:3] = torch.tensor([1, 2, 3])
    graph.seq_lens[:3] = torch.tensor([131, 8, 301])
    view = graph._view(4)
    graph.backend.init_forward_metadata_out_graph(view)  # host work belongs here
    for name in ("tolist", "item", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, lambda *a, _name=name, **k: pytest.fail(f"host read: {_name}"))
    x = torch.randn(4, tiny_model.config.hidden_size)
    with HostSyncProbe(), torch.no_grad():
        graph.backend.init_forward_metadata_in_graph(view)
        for layer, block in enumerate(tiny_model.layers):
            batched.attend(block.attn, layer, x, graph.backend.index, pool.storage)


VERIFY_TOKENS = 4  # a chain of three drafts, as the served chain (speculation.SPECULATION)


class VerifyGraphRunner:
    """Drives :class:`BatchedBackend`'s CUDA-graph hooks as SGLang 0.5.23's decode graph runner does under
    speculation (``DecodeCudaGraphRunner``, capture mode ``TARGET_VERIFY``, ``captured_req_width`` the verify's
    tokens per request): ``init_cuda_graph_state(max_bs, max_bs * tokens)`` once; static buffers
    (``req_pool_indices`` 0, ``seq_lens`` the fill value, ``positions`` 0 past the real rows); each size
    captured largest first with ``init_forward_metadata_out_graph(in_capture=True)``, the in-graph step and
    a warm-up forward of every layer; a replay fills the buffers' first rows, pads the rest, runs the
    out-of-graph step on the padded view (``build_replay_fb_view``), then the in-graph step, and checks that
    the index lies at the addresses captured for that size."""

    def __init__(self, pool: V4KVPool, model, sizes: list[int], tokens: int):
        self.pool, self.model, self.sizes, self.tokens = pool, model, sorted(sizes), tokens
        self.backend = BatchedBackend(types.SimpleNamespace(token_to_kv_pool=pool, req_to_token_pool=None))
        max_bs = self.sizes[-1]
        self.backend.init_cuda_graph_state(max_bs, max_bs * tokens)
        self.fill = self.backend.get_cuda_graph_seq_len_fill_value()
        self.req_pool_indices = torch.zeros(max_bs, dtype=torch.int64)
        self.seq_lens = torch.full((max_bs,), self.fill, dtype=torch.int64)
        self.positions = torch.zeros(max_bs * tokens, dtype=torch.int64)
        self.addresses: dict[int, dict[str, int]] = {}

    def view(self, size: int) -> types.SimpleNamespace:
        return types.SimpleNamespace(
            batch_size=size,
            forward_mode=ForwardMode.TARGET_VERIFY,
            req_pool_indices=self.req_pool_indices[:size],
            seq_lens=self.seq_lens[:size],
            positions=self.positions[: size * self.tokens],
        )

    def capture(self) -> None:
        for size in reversed(self.sizes):
            view = self.view(size)
            self.backend.init_forward_metadata_out_graph(view, in_capture=True)
            self.backend.init_forward_metadata_in_graph(view)
            self.addresses[size] = tensor_addresses(self.backend.index)
            x = torch.randn(size * self.tokens, self.model.config.hidden_size)
            with torch.no_grad():
                for layer, block in enumerate(self.model.layers):
                    self.backend.attend(block.attn, layer, x, view)

    def replay(self, rows: list[int], seq_lens: list[int]) -> types.SimpleNamespace:
        """The padded batch's view, its index built by the hooks (``self.backend.index``)."""
        size = min(s for s in self.sizes if s >= len(rows))
        real = len(rows) * self.tokens
        self.req_pool_indices[: len(rows)] = torch.tensor(rows)
        self.req_pool_indices[len(rows) : size] = 0
        self.seq_lens[: len(rows)] = torch.tensor(seq_lens)
        self.seq_lens[len(rows) : size] = self.fill
        self.positions[:real] = (torch.tensor(seq_lens)[:, None] + torch.arange(self.tokens)).flatten()
        self.positions[real : size * self.tokens] = 0
        view = self.view(size)
        self.backend.init_forward_metadata_out_graph(view)
        self.backend.init_forward_metadata_in_graph(view)
        assert tensor_addresses(self.backend.index) == self.addresses[size], f"the index of size {size} moved"
        return view


class EagerAndGraphVerify:
    """Two pools of one configuration under speculation: verify forwards run eagerly
    (``init_forward_metadata``) on the first and through the graph hooks on the second, then both roll back
    as SGLang's EAGLE verify has them (``clear_unaccepted_c128_draft_states``)."""

    def __init__(self, model, sizes: list[int], snapshot_interval: int, kv_dtype: torch.dtype = torch.float32):
        self.model = model
        self.pools = [
            V4KVPool(TOKENS, 1, model.config, kv_dtype, ROWS - 1, CONTEXT, "cpu", verify_tokens=VERIFY_TOKENS)
            for _ in range(2)
        ]
        runner = types.SimpleNamespace(token_to_kv_pool=self.pools[0], req_to_token_pool=None)
        self.eager = BatchedBackend(runner)
        self.sequences = {row: random_ids(CONTEXT, model.config.vocab_size, seed=200 + row) for row in range(ROWS)}
        self.snapshot_interval, self.filled = snapshot_interval, 0
        with_device_twins(self.pools[1].storage.tables)  # the graph reads what the hooks flushed, as on a GPU
        self.graph = VerifyGraphRunner(self.pools[1], model, sizes, VERIFY_TOKENS)

    def each_pool(self, operation) -> list:
        return [operation(pool) for pool in self.pools]

    def prefill(self, rows: list[int], lengths: list[int]) -> None:
        """The same prefill on both pools, by the batched core."""
        for row, length in zip(rows, lengths, strict=True):
            self.each_pool(lambda pool: (pool.storage.tables.bind(row), pool.manager.reserve(row, length)))
        ids = torch.cat([self.sequences[row][:length] for row, length in zip(rows, lengths, strict=True)])
        plan = batched.BatchPlan(rows, [0] * len(rows), lengths)
        for pool in self.pools:
            index = batched.build_index(plan, pool.storage.tables, self.model.config, "cpu")
            self._run(ids, lambda layer, block, x, index=index, pool=pool: block.attn.project_out(
                batched.attend(block.attn, layer, x, index, pool.storage)
            ))  # fmt: skip
        self.each_pool(lambda pool: setattr(pool.checkpoints, "interval", self.snapshot_interval))

    def verify(self, rows: list[int], accepted: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """A verify of every row's next ``VERIFY_TOKENS`` tokens (reserved as
        :func:`sglang_dsv4.speculation._reserve_for_verify` reserves them), as the graph runner pads it: through
        the graph hooks on one pool, ``init_forward_metadata`` on the other; then each row keeps ``accepted`` of
        them. Both logits of the real rows."""
        starts = [self.pools[0].storage.tables.position[row] for row in rows]
        for row, start in zip(rows, starts, strict=True):
            self.each_pool(lambda pool: pool.manager.reserve(row, start + VERIFY_TOKENS))
        ids = torch.cat([self.sequences[row][s : s + VERIFY_TOKENS] for row, s in zip(rows, starts, strict=True)])
        view = self.graph.replay(rows, starts)
        padded = torch.cat([ids, torch.zeros(view.positions.shape[0] - len(ids), dtype=ids.dtype)])
        graph = self.graph.backend
        actual = self._run(padded, lambda layer, block, x: graph.attend(block.attn, layer, x, view), len(ids))
        batch = types.SimpleNamespace(**{k: v.clone() if torch.is_tensor(v) else v for k, v in vars(view).items()})
        self.eager.init_forward_metadata(batch)
        expected = self._run(padded, lambda layer, block, x: self.eager.attend(block.attn, layer, x, batch), len(ids))
        self.assert_same_pools()
        verified = [torch.tensor(v) for v in (rows, starts, accepted)]
        self.each_pool(lambda pool: pool.clear_unaccepted_c128_draft_states(*verified, VERIFY_TOKENS))
        for row, start, kept in zip(rows, starts, accepted, strict=True):  # the tree takes the filled checkpoints
            taken = self.each_pool(lambda pool: pool.checkpoints.take(row, start + kept))
            self.filled += len(taken[0])
            for eager_checkpoint, checkpoint in zip(*taken, strict=True):
                assert (eager_checkpoint.position, eager_checkpoint.record) == (checkpoint.position, checkpoint.record)
                self.each_pool(lambda pool, c=checkpoint: pool.checkpoints.release(c))
        self.assert_same_pools()
        return expected[: len(ids)], actual[: len(ids)]

    @torch.no_grad()
    def _run(self, ids: torch.Tensor, attend, real: int | None = None) -> torch.Tensor:
        """The network's logits with ``attend`` as its attention. Only the ``real`` rows of a padded batch go
        through the MoE: which experts the padded rows reach depends on what they attended to, which the
        two paths make differently (padding rows), and the experts' products round by how many rows they
        take."""
        model, real = self.model, real or len(ids)

        def ffn(layer, block, x):
            out = torch.zeros_like(x)
            out[:real] = block.ffn(x[:real], ids[:real])
            return out

        streams = model.embed(ids).unsqueeze(1).expand(-1, model.config.hc_mult, -1).contiguous()
        streams = run_blocks(model.layers, streams, attend, ffn)
        return model.head(model.norm(model.hc_head(streams))).float()

    def assert_same_pools(self) -> None:
        """Every tensor of the two pools equal, bitwise, but what the padded rows write (request row 0's rows
        and records, and the padding record 0, where the graph's index sends its rollback records), and the
        request tables."""
        eager, graph = (pool.storage for pool in self.pools)
        padding_records = [0] + [eager.rollback_record(0, offset) for offset in range(VERIFY_TOKENS)]
        records = torch.ones(next(iter(eager.checkpoint_state.values())).shape[0], dtype=torch.bool)
        records[padding_records] = False
        for name in ("window", "compressed", "state", "previous_state", "checkpoint_state"):
            expected, actual = getattr(eager, name), getattr(graph, name)
            rows = records if name == "checkpoint_state" else slice(1, None)
            for key in range(len(expected)) if isinstance(expected, list) else expected.keys():
                assert torch.equal(actual[key][rows], expected[key][rows]), f"{name} {key}"
        assert eager.tables.position == graph.tables.position
        assert torch.equal(eager.tables.window_table, graph.tables.window_table)
        for ratio, table in eager.tables.entry_table.items():
            assert torch.equal(graph.tables.entry_table[ratio], table)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn], ids=["float32", "fp8"])
def test_verify_replayed_through_the_graph_hooks_equals_the_eager_verify_and_rolls_back_alike(tiny_model, kv_dtype):
    # Five requests verify chains of three drafts through graphs of sizes 2, 4 and 8 (5 rows padded to 8, 3 to
    # 4, 4 unpadded): windows across ratio-4 and ratio-128 block ends (from 126, 254), every count of accepted
    # tokens, and checkpoints every 6 tokens landing inside the windows, before and after the accepted position.
    pair = EagerAndGraphVerify(tiny_model, sizes=[2, 4, 8], snapshot_interval=6, kv_dtype=kv_dtype)
    rows = [1, 2, 3, 4, 5]
    pair.prefill(rows, [126, 131, 254, 3, 62])
    pair.graph.capture()
    pair.assert_same_pools()  # the warm-up forwards wrote padding rows only
    for step in range(6):
        batch = rows[: (5, 3, 4)[step % 3]]
        accepted = [(step + i) % VERIFY_TOKENS + 1 for i in range(len(batch))]
        expected, actual = pair.verify(batch, accepted)
        assert torch.equal(actual, expected)
    assert pair.filled >= 5


def test_the_in_graph_verify_step_does_no_host_synchronisation(tiny_model, monkeypatch):
    pair = EagerAndGraphVerify(tiny_model, sizes=[4], snapshot_interval=0)
    pair.prefill([1, 2, 3], [130, 7, 300])
    pool, graph = pair.pools[1], pair.graph
    for row in (1, 2, 3):
        pool.manager.reserve(row, pool.storage.tables.position[row] + VERIFY_TOKENS)
    graph.req_pool_indices[:3] = torch.tensor([1, 2, 3])
    graph.seq_lens[:3] = torch.tensor([130, 7, 300])
    view = graph.view(4)
    graph.backend.init_forward_metadata_out_graph(view)  # host work belongs here
    for name in ("tolist", "item", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, lambda *a, _name=name, **k: pytest.fail(f"host read: {_name}"))
    x = torch.randn(4 * VERIFY_TOKENS, tiny_model.config.hidden_size)
    with HostSyncProbe(), torch.no_grad():
        graph.backend.init_forward_metadata_in_graph(view)
        for layer, block in enumerate(tiny_model.layers):
            batched.attend(block.attn, layer, x, graph.backend.index, pool.storage)


def test_indexer_selections_equal_the_reference(tiny_model):
    pair = TwoBackends(tiny_model)
    pair.forward([1, 2], [400, 90])
    pool = pair.pools[1]
    layer = tiny_model.config.compress_ratios.index(4)
    attention = tiny_model.layers[layer].attn
    starts, lengths = [400, 90], [37, 1]
    plan = batched.BatchPlan([1, 2], starts, lengths)
    for row, start, length in zip([1, 2], starts, lengths, strict=True):
        pool.manager.reserve(row, start + length)
    index = batched.build_index(plan, pool.storage.tables, tiny_model.config, "cpu")
    x = torch.randn(sum(lengths), tiny_model.config.hidden_size)
    q_residual, *_ = attention.project(x, index.rope)
    # The keys the reference selects from: the pool's, advanced by the same tokens.
    expected, offset = [], 0
    for row, start, length in zip([1, 2], starts, lengths, strict=True):
        state = pool.storage.load(layer, row, start, torch.float32)
        rows = slice(offset, offset + length)
        positions = torch.arange(start, start + length)
        attention.indexer.compressor.advance(x[rows], start, state.indexer)
        visible = torch.arange(state.indexer.entries.shape[0])[None, :] < ((positions + 1) // 4)[:, None]
        rope = ForwardRope.at(positions, (attention.indexer.rotary,))
        expected.append(attention.indexer.select(x[rows], q_residual[rows], rope, state.indexer, visible))
        offset += length
    records = batched._records(pool.storage, (layer, "indexer"))
    keys = batched._Rows(pool.storage.compressed[(layer, "indexer_keys")], pool.storage.formats.indexer_keys)
    batched._advance(attention.indexer.compressor, x, index, keys, records)
    rows, counts = batched.select_entries(attention.indexer, x, q_residual, index, keys.rows, keys.row_format)
    table = index.entries[4].table
    masks = [mask for request in expected for mask in request]
    for token, mask in enumerate(masks):
        expected_rows = table[index.token_request[token], mask.nonzero().flatten()]
        assert int(counts[token]) == len(expected_rows), f"token {token}"
        assert sorted(rows[token, : int(counts[token])].tolist()) == sorted(expected_rows.tolist()), f"token {token}"
    assert (counts == attention.indexer.topk).any()  # some tokens see more entries than the top-k keeps


@pytest.mark.parametrize("ratio", [0, 4, 128], ids=["window", "ratio4", "ratio128"])
def test_a_prefill_over_fp8_pools_reading_its_rows_decoded_once_computes_what_reading_them_in_place_does(
    tiny_model, ratio
):
    """Staged (:class:`~sglang_dsv4.attention_backend.batched.StagedEntries`): the same values, so the same floats,
    and the same pools; over requests with and without complete blocks, a cold chunk and resumed ones."""
    config = tiny_model.config
    layer = config.compress_ratios.index(ratio)
    attention = tiny_model.layers[layer].attn
    pools = [V4KVPool(TOKENS, 1, config, torch.float8_e4m3fn, ROWS - 1, CONTEXT, "cpu") for _ in range(2)]
    generator = torch.Generator().manual_seed(ratio)
    for rows, starts, lengths in (([1, 2], [0, 0], [300, 150]), ([2, 1, 3], [150, 300, 0], [40, 1, 9])):
        plan = batched.BatchPlan(rows, starts, lengths)
        x = torch.randn(sum(lengths), config.hidden_size, generator=generator)
        outputs = []
        for pool, staged in zip(pools, [False, True], strict=True):
            for row, start, length in zip(rows, starts, lengths, strict=True):
                pool.storage.tables.bound[row] or pool.storage.tables.bind(row)
                pool.manager.reserve(row, start + length)
            index = batched.build_index(plan, pool.storage.tables, config, "cpu", staged=staged)
            assert all((reads.staged is not None) == staged for reads in index.entries.values())
            outputs.append(batched.attend(attention, layer, x, index, pool.storage))
        assert torch.equal(*outputs)
    for name in ("window", "compressed", "state", "checkpoint_state"):
        stored = [getattr(pool.storage, name) for pool in pools]
        keys = range(len(stored[0])) if isinstance(stored[0], list) else stored[0].keys()
        assert all(torch.equal(stored[0][key], stored[1][key]) for key in keys), name


def test_a_forward_staging_more_rows_than_the_limit_reads_them_in_place(tiny_model, monkeypatch):
    config = tiny_model.config
    pool = V4KVPool(TOKENS, 1, config, torch.float8_e4m3fn, ROWS - 1, CONTEXT, "cpu")
    pool.storage.tables.bind(1)
    pool.manager.reserve(1, 300)
    plan = batched.BatchPlan([1], [0], [300])
    rows = 1 + 300 // 4 + 1 + 300 // 128  # each ratio's padding row and complete blocks
    for limit, staged in ((rows, True), (rows - 1, False)):
        monkeypatch.setattr(batched, "MAX_STAGED_ROWS", limit)
        index = batched.build_index(plan, pool.storage.tables, config, "cpu", staged=True)
        assert index.staged == staged
        assert all((reads.staged is not None) == staged for reads in index.entries.values())


def test_a_subset_of_query_heads_gives_those_heads_of_the_output(tiny_model):
    pools = [V4KVPool(TOKENS, 1, tiny_model.config, torch.float32, 2, CONTEXT, "cpu") for _ in range(2)]
    plan = batched.BatchPlan([1], [0], [200])
    layer = tiny_model.config.compress_ratios.index(128)
    attention = tiny_model.layers[layer].attn
    x = torch.randn(200, tiny_model.config.hidden_size)
    outputs = []
    for pool, heads in zip(pools, [slice(None), slice(1, 3)], strict=True):
        pool.storage.tables.bind(1)
        pool.manager.reserve(1, 200)
        index = batched.build_index(plan, pool.storage.tables, tiny_model.config, "cpu")
        outputs.append(batched.attend(attention, layer, x, index, pool.storage, heads))
    assert outputs[1].shape[1] == 2
    torch.testing.assert_close(outputs[1], outputs[0][:, 1:3], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tiles", [(64, 512), (3, 5)])
def test_tiled_sparse_attention_equals_the_kernels_reference(tiles, monkeypatch):
    monkeypatch.setattr(sparse_torch, "ROW_TILE", tiles[0])
    monkeypatch.setattr(sparse_torch, "ENTRY_TILE", tiles[1])
    rows, heads, dim = 11, 4, 64
    window_pool, entry_pool = torch.randn(40, dim), torch.randn(90, dim)
    window = KVSelection(window_pool, torch.randint(0, 40, (rows, 8)).int(), torch.randint(1, 9, (rows,)).int())
    lengths = torch.tensor([0, 1, 17, 30, 2, 0, 29, 30, 5, 13, 30]).int()  # empty, odd and full rows
    compressed = KVSelection(entry_pool, torch.randint(0, 90, (rows, 30)).int(), lengths)
    q, sink = torch.randn(rows, heads, dim), torch.randn(heads)
    angles = torch.rand(rows, 8) * 6
    args = (q, window, compressed, sink, angles.cos(), angles.sin())
    expected = sparse_decode_attention_reference(*args, scale=0.125)
    torch.testing.assert_close(sparse_attention(*args, scale=0.125), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("key_tile", [1024, 7])
def test_streamed_top_k_equals_top_k_of_all_scores(key_tile, monkeypatch):
    from sglang_dsv4.kernels.indexer import index_scores_reference
    from sglang_dsv4.kernels.topk import top_k_reference

    monkeypatch.setattr(sparse_torch, "KEY_TILE", key_tile)
    rows, heads, dim, k = 9, 8, 32, 6
    keys, table = torch.randn(100, dim), torch.randperm(100)[:60].view(2, 30)
    table_row = torch.tensor([0, 0, 0, 1, 1, 1, 1, 0, 1])
    lengths = torch.tensor([0, 3, 6, 7, 30, 29, 12, 1, 25]).int()  # rows shorter than k, empty, full
    q, weights = torch.randn(rows, heads, dim), torch.rand(rows, heads)
    chosen = streamed_top_k(q, weights, keys, table, table_row, lengths, k, scale=0.2)
    scores = index_scores_reference(q, weights, keys, lengths, scale=0.2, table=table[table_row].int())
    expected = top_k_reference(scores, lengths, k)
    for mine, theirs in zip(chosen, expected, strict=True):
        assert sorted(mine.tolist()) == sorted(theirs.tolist())


@pytest.mark.parametrize("key_tile", [1024, 7])
def test_streamed_top_k_takes_the_earliest_of_tied_keys_whatever_the_batch(key_tile, monkeypatch):
    """Keys whose every head's dot is negative score exactly 0 (ReLU); when the k-th place is among them, a
    request's choice is its earliest such keys alone, beside a longer request (a wider table) or in a tile of
    other requests' rows. (``torch.topk`` took a different set of the ties at another width: served under
    concurrency, the shipped checkpoint's 513-token prompt chose other blocks at layer 3 and its greedy output
    changed at its 13th token.)"""
    monkeypatch.setattr(sparse_torch, "KEY_TILE", key_tile)
    heads, dim, k, length = 4, 16, 16, 131
    generator = torch.Generator().manual_seed(1)
    q = (torch.rand(dim, generator=generator) + 0.1).expand(1, heads, dim)
    keys = -(torch.rand(length, dim, generator=generator) + 0.1)  # every dot negative: score 0
    scoring = torch.tensor([5, 40, 77, 120])
    keys[scoring] = -keys[scoring]
    expected = sorted([*scoring.tolist(), *[slot for slot in range(16) if slot != 5][: k - len(scoring)]])
    weights = torch.rand(1, heads, generator=generator) + 0.1
    for width, others in ((length, 0), (206, 0), (length, 1), (256, 3)):
        pool = torch.cat([keys, torch.randn(width, dim, generator=generator)])
        table = torch.cat([torch.arange(length), torch.zeros(width - length, dtype=torch.long)])[None]
        table = torch.cat([table, (length + torch.arange(width)).expand(others, width)])
        lengths = torch.tensor([length] + [width] * others).int()
        batch_q = torch.cat([q, torch.randn(others, heads, dim, generator=generator)])
        batch_weights = torch.cat([weights, torch.rand(others, heads, generator=generator)])
        table_row = torch.arange(1 + others)
        chosen = streamed_top_k(batch_q, batch_weights, pool, table, table_row, lengths, k, scale=0.2)
        assert sorted(chosen[0].tolist()) == expected, (width, others)


class LargestTensor(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the largest tensor any torch operation returns while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in torch.utils._pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self.largest = max(self.largest, tensor.numel())
        return out


def test_a_2k_token_extend_at_64k_context_holds_no_tokens_by_context_tensor(tiny_model):
    config = tiny_model.config
    context, tokens = 64 * 1024, 2048
    pool = V4KVPool(context + tokens, 1, config, torch.float32, 1, context + tokens, "cpu")
    pool.storage.tables.bind(1)
    pool.manager.reserve(1, context)  # the rows a 64K-token prefix holds (their values do not matter here)
    pool.manager.reserve(1, context + tokens)
    plan = batched.BatchPlan([1], [context], [tokens])
    x = torch.randn(tokens, config.hidden_size)
    bound = tokens * (config.sliding_window + config.index_topk) * max(config.num_heads, config.head_dim)
    for kind in ("csa", "hca"):
        layer = config.compress_ratios.index(4 if kind == "csa" else 128)
        with LargestTensor() as probe, torch.no_grad():
            index = batched.build_index(plan, pool.storage.tables, config, "cpu")
            batched.attend(tiny_model.layers[layer].attn, layer, x, index, pool.storage)
        # A dense [tokens x context / 4] score matrix alone would be 33.5M elements, the bound 18.9M.
        assert probe.largest <= bound, f"{kind}: a tensor of {probe.largest} elements, above {bound}"


def test_the_batched_core_and_the_pools_rows_and_checkpoints_import_neither_sglang_nor_triton():
    # The hot path must run where SGLang cannot be installed (the H200 host) and on CPU hosts without Triton.
    code = (
        "import sys, sglang_dsv4.attention_backend.batched, sglang_dsv4.memory_pool.storage, "
        "sglang_dsv4.prefix_cache.checkpoints; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'sglang', 'triton'}))"
    )
    reply = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert reply.stdout.strip() == "[]"


def test_kernels_import_nothing_above_them_and_no_model_or_kernel_file_checks_a_device():
    # The layering of the hot path: kernels/ takes tensors only; the one device choice is kernels/dispatch.py's.
    package = Path(batched.__file__).parents[1]
    for path in sorted((package / "kernels").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.level <= 1 and not (node.module or "").startswith("sglang"), f"{path.name} imports above"
            if isinstance(node, ast.Import):
                assert not any(alias.name.startswith("sglang") for alias in node.names), f"{path.name} imports above"
    for path in [*(package / "kernels").glob("*.py"), *(package / "model").glob("*.py")]:
        if path.name != "dispatch.py":
            assert "is_cuda" not in path.read_text(), f"{path.parent.name}/{path.name} checks the device"
