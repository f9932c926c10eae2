"""The MTP layer's draft steps through SGLang's CUDA-graph hooks against the eager chain, on the CPU.

Requests whose MTP-layer state sits in the pool (written by the torch reference backend, as a draft extend
leaves it) draft a chain of tokens twice from the same streams: eagerly (:class:`DraftDecodeBackend` on
per-request copies of the state loaded from the pool) and as SGLang 0.5.23's draft graph runner drives the
graph hooks (:class:`DraftGraphRunner`: the batched core on the chain's scratch rows). The drafted tokens must
be the same and the logits agree (float32, 1e-5 of their scale), and neither may write the pool.
"""

from __future__ import annotations

import types

import pytest
import torch
from conftest import assert_close_to_scale, random_ids
from test_batched_backend import HostSyncProbe, tensor_addresses

from sglang_dsv4.attention_backend.draft_decode import DraftDecodeBackend
from sglang_dsv4.attention_backend.torch_reference import RequestSpan, TorchReferenceBackend
from sglang_dsv4.kv_cache import V4KVPool
from sglang_dsv4.model.network import run_blocks

ROWS, CONTEXT, TOKENS = 9, 1024, 4096


def mtp_forward(model, streams: torch.Tensor, ids: torch.Tensor, attend) -> tuple[torch.Tensor, torch.Tensor]:
    """What SGLang's draft model computes (:class:`~sglang_dsv4.model.sglang_draft.DeepseekV4ForCausalLMNextN`):
    the MTP layer's ``(logits, streams')`` from the streams of the tokens before ``ids``, its attention ``attend``."""
    mtp = model.mtp[0]
    mixed = mtp.h_proj(mtp.hnorm(streams)) + mtp.e_proj(mtp.enorm(model.embed(ids))).unsqueeze(1)
    out = run_blocks(
        [mtp],
        mixed.contiguous(),
        lambda layer, block, x: attend(block.attn, x),
        lambda layer, block, x: block.ffn(x, ids),
    )
    return model.head(mtp.hidden(out)).float(), out


@torch.no_grad()
def draft_chain(model, backend: DraftDecodeBackend, streams: torch.Tensor, tokens: torch.Tensor, batch):
    """SGLang's ``draft_forward`` (topk 1): step ``i`` runs ``attn_backends[i]`` on the previous step's streams and
    greedy tokens, then moves the batch's ``positions`` on by one; the drafted tokens ``[n, steps]`` and each step's
    logits."""
    layer, drafted, logits = model.config.num_layers, [], []
    for step in backend.attn_backends:
        step_logits, streams = mtp_forward(
            model, streams, tokens, lambda attention, x, step=step: step.attend(attention, layer, x, batch)
        )
        tokens = step_logits.argmax(-1)
        batch.positions.add_(1)
        drafted.append(tokens)
        logits.append(step_logits)
    return torch.stack(drafted, dim=1), torch.stack(logits, dim=1)


def step_addresses(backend: DraftDecodeBackend) -> dict[str, int]:
    """``data_ptr`` of every tensor of every step's index, by its path."""
    addresses = {}
    for step, index in enumerate(backend.step_indexes):
        addresses |= tensor_addresses(index, f"step {step}")
    assert addresses
    return addresses


class DraftGraphRunner:
    """Drives :class:`DraftDecodeBackend`'s CUDA-graph hooks as SGLang 0.5.23's ``EAGLEDraftCudaGraphRunner`` does.

    ``init_cuda_graph_state(max_bs, max_bs)`` once (topk 1: one token per request); static buffers of ``max_bs``
    rows (``req_pool_indices`` and ``positions`` 0, ``seq_lens`` the fill value of ``attn_backends[0]``); each size
    captured largest first: ``init_forward_metadata_out_graph(in_capture=True)``, then what the graph records, the
    chain's ``init_forward_metadata_in_graph`` and the steps (the capture's warm-up run). A replay copies the real
    rows into the buffers' first rows, pads the rest as the runner does, runs the out-of-graph step, then what
    ``graph.replay()`` re-executes, and checks that every step's index lies where it was captured.
    """

    def __init__(self, model, backend: DraftDecodeBackend, sizes: list[int]):
        self.model, self.backend, self.sizes = model, backend, sorted(sizes)
        max_bs, config = self.sizes[-1], model.config
        backend.init_cuda_graph_state(max_bs, max_bs)
        self.fill = backend.attn_backends[0].get_cuda_graph_seq_len_fill_value()
        self.req_pool_indices = torch.zeros(max_bs, dtype=torch.int64)
        self.positions = torch.zeros(max_bs, dtype=torch.int64)
        self.seq_lens = torch.full((max_bs,), self.fill, dtype=torch.int64)
        self.streams = torch.zeros(max_bs, config.hc_mult, config.hidden_size)
        self.tokens = torch.zeros(max_bs, dtype=torch.int64)
        self.addresses: dict[int, dict[str, int]] = {}

    def _view(self, size: int) -> types.SimpleNamespace:
        return types.SimpleNamespace(
            batch_size=size,
            req_pool_indices=self.req_pool_indices[:size],
            positions=self.positions[:size],
            seq_lens=self.seq_lens[:size],
        )

    def _run_graph(self, size: int):
        view = self._view(size)
        self.backend.init_forward_metadata_in_graph(view)
        drafted = draft_chain(self.model, self.backend, self.streams[:size], self.tokens[:size], view)
        view.positions.sub_(len(self.backend.attn_backends))  # the runner's graph sets them back
        return drafted

    def capture(self) -> None:
        for size in reversed(self.sizes):
            self.backend.init_forward_metadata_out_graph(self._view(size), in_capture=True)
            self._run_graph(size)
            self.addresses[size] = step_addresses(self.backend)

    def replay(
        self,
        rows: list[int],
        positions: list[int],
        streams: torch.Tensor,
        tokens: torch.Tensor,
        size: int | None = None,
    ):
        """The drafted tokens and logits of the real rows, in the graph of ``size`` (the smallest that fits)."""
        real = len(rows)
        size = size or min(s for s in self.sizes if s >= real)
        for buffer, values, padding in (
            (self.req_pool_indices, torch.tensor(rows), 0),
            (self.positions, torch.tensor(positions), 0),
            (self.seq_lens, torch.tensor(positions) + 1, self.fill),
            (self.streams, streams, 0),
            (self.tokens, tokens, 0),
        ):
            buffer[:real] = values
            buffer[real:size] = padding
        self.backend.init_forward_metadata_out_graph(self._view(size))
        drafted, logits = self._run_graph(size)
        assert step_addresses(self.backend) == self.addresses[size], f"size {size} moved"
        return drafted[:real], logits[:real]


class Drafting:
    """One pool (holding the MTP layer's rows: a speculative server's) whose requests' MTP-layer state is at
    their positions ``P``, and the eager and graph chains over it."""

    def __init__(self, model, steps: int, sizes: list[int]):
        self.model, self.steps = model, steps
        config = model.config
        self.pool = V4KVPool(TOKENS, 1, config, torch.float32, ROWS - 1, CONTEXT, "cpu", verify_tokens=steps + 1)
        runner = types.SimpleNamespace(token_to_kv_pool=self.pool, req_to_token_pool=None)
        self.reference = TorchReferenceBackend(runner)
        self.eager = DraftDecodeBackend(runner, steps)
        self.graph = DraftGraphRunner(model, DraftDecodeBackend(runner, steps), sizes)
        self.positions: dict[int, int] = {}

    @torch.no_grad()
    def extend(self, row: int, length: int) -> None:
        """The draft extend of ``length`` tokens of ``row`` from position 0: its MTP rows written to the pool."""
        tables = self.pool.storage.tables
        tables.bound[row] or tables.bind(row)
        self.pool.manager.reserve(row, length)
        self.reference.plan_forward([RequestSpan(row, 0, length, 0)])
        config, layer = self.model.config, self.model.config.num_layers
        streams = torch.randn(length, config.hc_mult, config.hidden_size, generator=torch.Generator().manual_seed(row))
        mtp_forward(
            self.model,
            streams,
            random_ids(length, config.vocab_size, seed=row),
            lambda attention, x: self.reference.attend(attention, layer, x, None),
        )
        tables.begin_forward()
        self.positions[row] = length

    def pool_tensors(self) -> dict[str, torch.Tensor]:
        storage = self.pool.storage
        tensors = {f"window {layer}": rows for layer, rows in enumerate(storage.window)}
        for name in ("compressed", "state", "previous_state", "checkpoint_state"):
            tensors |= {f"{name} {key}": rows for key, rows in getattr(storage, name).items()}
        return {name: rows.clone() for name, rows in tensors.items()}

    def inputs(self, rows: list[int], seed: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """The rows' positions, and streams and first drafts (what the draft extend hands the steps)."""
        config = self.model.config
        generator = torch.Generator().manual_seed(seed)
        streams = torch.randn(len(rows), config.hc_mult, config.hidden_size, generator=generator)
        tokens = torch.randint(0, config.vocab_size, (len(rows),), generator=generator)
        return [self.positions[row] for row in rows], streams, tokens

    def both(self, rows: list[int], seed: int):
        """The eager chain's and the graph's ``(drafted tokens, logits)`` of ``rows`` from the same streams."""
        positions, streams, tokens = self.inputs(rows, seed)
        batch = types.SimpleNamespace(req_pool_indices=torch.tensor(rows), positions=torch.tensor(positions))
        self.eager.init_forward_metadata(batch)
        expected = draft_chain(self.model, self.eager, streams, tokens, batch)
        return expected, self.graph.replay(rows, positions, streams, tokens)


@pytest.mark.parametrize("steps", [3, 5])
def test_draft_steps_replayed_through_the_graph_hooks_equal_the_eager_chain_and_leave_the_pool(tiny_model, steps):
    # Requests at positions inside the first window, at its end and past it (the window is 128 tokens), in graphs
    # of sizes 2, 4 and 8: 3 real rows padded to 4, 5 to 8, 2 and 4 unpadded; captured after the pool is filled.
    drafting = Drafting(tiny_model, steps, sizes=[2, 4, 8])
    lengths = {1: 5, 2: 127, 3: 128, 4: 200, 5: 131, 6: 2, 7: 300}
    for row, length in lengths.items():
        drafting.extend(row, length)
    before = drafting.pool_tensors()
    drafting.graph.capture()
    for seed, rows in enumerate([[1, 2, 3], [4, 5, 6, 7, 1], [2, 7], [3, 4, 5, 6], [6]]):
        (tokens, logits), (graph_tokens, graph_logits) = drafting.both(rows, seed)
        assert tokens.shape == (len(rows), steps - 1)
        assert torch.equal(graph_tokens, tokens), f"rows {rows}: drafts {graph_tokens.tolist()} != {tokens.tolist()}"
        assert_close_to_scale(graph_logits, logits, rel=1e-5)
    # The same batch in every graph it fits: padded by 0, 2 and 6 rows.
    (tokens, logits), _ = drafting.both([7, 2], seed=9)
    for size in (2, 4, 8):
        graph_tokens, graph_logits = drafting.graph.replay([7, 2], *drafting.inputs([7, 2], seed=9), size=size)
        assert torch.equal(graph_tokens, tokens)
        assert_close_to_scale(graph_logits, logits, rel=1e-5)
    for name, rows in drafting.pool_tensors().items():
        assert torch.equal(rows, before[name]), f"the draft steps wrote the pool's {name}"


def test_the_in_graph_draft_steps_do_no_host_synchronisation(tiny_model, monkeypatch):
    drafting = Drafting(tiny_model, steps=3, sizes=[4])
    for row, length in {1: 130, 2: 7, 3: 300}.items():
        drafting.extend(row, length)
    graph = drafting.graph
    graph.req_pool_indices[:3] = torch.tensor([1, 2, 3])
    graph.positions[:3] = torch.tensor([130, 7, 300])
    graph.backend.init_forward_metadata_out_graph(graph._view(4))  # host work belongs here
    for name in ("tolist", "item", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, lambda *a, _name=name, **k: pytest.fail(f"host read: {_name}"))
    x = torch.randn(4, tiny_model.config.hidden_size)
    attention, layer = tiny_model.mtp[0].attn, tiny_model.config.num_layers
    with HostSyncProbe(), torch.no_grad():  # the hook and every step's attention (the MoE is not this backend's)
        graph.backend.init_forward_metadata_in_graph(graph._view(4))
        for step in graph.backend.attn_backends:
            step.attend(attention, layer, x, None)


def test_graphs_of_a_compressed_mtp_layers_draft_steps_are_refused(tiny_model, monkeypatch):
    pool = V4KVPool(TOKENS, 1, tiny_model.config, torch.float32, ROWS - 1, CONTEXT, "cpu", verify_tokens=3)
    backend = DraftDecodeBackend(types.SimpleNamespace(token_to_kv_pool=pool, req_to_token_pool=None), 3)
    monkeypatch.setattr(type(tiny_model.config), "layer_kind", lambda config, layer: "hca")
    with pytest.raises(ValueError, match="hca MTP layer"):
        backend.init_cuda_graph_state(4, 4)
