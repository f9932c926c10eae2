"""Attention-TP 2 x DP 2 (four ranks, gloo) without a server: the served model's forward equals one process.

Each of four processes is a scheduler rank of ``--tp 4 --attn-dp-size 2 --ep-size 4`` as SGLang
brings one up (its published topology, its parallel groups, its model loader on the tiny
checkpoint); ranks 0-1 are DP rank 0's attention-TP group, ranks 2-3 DP rank 1's. Each forward
is padded by SGLang's own ``prepare_mlp_sync_batch`` (token counts aligned to the attention-TP
size, the max-length padding of decode batches, an idle rank's rows) before the model runs. The
attention backend here keeps each request's V4 state in the process instead of a pool (the pools'
paths are the server tests'), so what is checked is the model's parallel layout: the attention
projections split over the attention-TP group, mHC token-sharded within it, the embedding whole,
the MoE over both DP ranks' gathered rows and token ids with the experts split by EP, the head over
the TP group. The same for the MTP layer as SGLang's EAGLE draft model (``DeepseekV4ForCausalLMNextN``) on
the same rows, reading the target's streams: its attention split over the attention-TP group, its residual
token-sharded, its MoE over both DP ranks' rows. The oracle is the torch reference network in one process
(its :meth:`~sglang_dsv4.model.network.DeepseekV4.draft` for the MTP layer): every rank's next-token
logits of every request equal it within 1e-5 of their scale (the largest logit's magnitude: float32
sums taken in another order differ by up to 7e-7 of it here).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.multiprocessing as mp

from sglang_dsv4 import load_model
from sglang_dsv4.launch import free_port

RANKS = 4
ATTENTION_TP = 2
TOLERANCE = 1e-5


@dataclass(frozen=True)
class Step:
    """One forward of the whole server: per DP rank, its requests' new tokens (request row, token ids)."""

    mode: str  # "extend" or "decode"
    per_dp_rank: tuple[tuple[tuple[int, tuple[int, ...]], ...], ...]


def _ids(seed: int, length: int) -> tuple[int, ...]:
    return tuple(torch.randint(2, 1024, (length,), generator=torch.Generator().manual_seed(seed)).tolist())


# Request rows are SGLang's req_pool_idx (row 0 is its padding row). DP rank 0 holds rows 1, 2 and 5;
# DP rank 1 holds rows 3 and 4 (each DP rank numbers its own rows: the overlap of row numbers is deliberate).
STEPS = (
    # Both ranks extend; 12 and 3 tokens (rank 1's padded to 4, a multiple of the attention-TP size).
    Step("extend", (((1, _ids(1, 7)), (2, _ids(2, 5))), ((3, _ids(3, 3)),))),
    # Both decode: 2 and 1 rows, each padded to the max (rank 1 gets one padding row).
    Step("decode", (((1, _ids(11, 1)), (2, _ids(12, 1))), ((3, _ids(13, 1)),))),
    # Rank 0 extends a new request past a ratio-4 block while rank 1 continues its own; then rank 1 is idle.
    Step("extend", (((5, _ids(5, 9)),), ((4, _ids(4, 6)), (3, _ids(14, 2))))),
    Step("extend", (((1, _ids(21, 3)),), ())),
    # Decode with rank 1 idle: its rows are all padding.
    Step("decode", (((1, _ids(31, 1)), (2, _ids(32, 1)), (5, _ids(33, 1))), ())),
)


def _histories() -> dict[tuple[int, int], list[tuple[int, ...]]]:
    """Each request's (dp rank, row) token chunks in step order."""
    histories: dict[tuple[int, int], list[tuple[int, ...]]] = {}
    for step in STEPS:
        for dp_rank, requests in enumerate(step.per_dp_rank):
            for row, ids in requests:
                histories.setdefault((dp_rank, row), []).append(ids)
    return histories


def draft_ids(ids: tuple[int, ...]) -> tuple[int, ...]:
    """The tokens the MTP layer reads beside a chunk's streams (in a server, each token's successor)."""
    return (*ids[1:], ids[0])


@dataclass(frozen=True)
class Expected:
    """Per step, each request's (dp rank, row) next-token logits, its draft logits, and the target streams of
    its new tokens (``[tokens, hc_mult * hidden]``: what SGLang hands the draft model)."""

    logits: list[dict[tuple[int, int], torch.Tensor]]
    draft_logits: list[dict[tuple[int, int], torch.Tensor]]
    streams: list[dict[tuple[int, int], torch.Tensor]]


@torch.no_grad()
def expected_outputs(path: Path) -> Expected:
    """What the torch reference gives in one process: the target over each request's history, and the MTP
    layer (:meth:`~sglang_dsv4.model.network.DeepseekV4.draft`) over its streams and :func:`draft_ids`."""
    network = load_model(path)
    chunks_of: dict[tuple[int, int], list[torch.Tensor]] = {}
    for request, chunks in _histories().items():
        state = network.new_state()
        streams = network.streams(torch.tensor(sum(chunks, ())), state)
        logits = network.head_logits(streams)
        next_ids = torch.tensor(sum((draft_ids(chunk) for chunk in chunks), ()))
        draft_logits, _ = network.draft(streams, next_ids, state.mtp)
        ends = torch.tensor([len(chunk) for chunk in chunks]).cumsum(0)
        starts = ends - torch.tensor([len(chunk) for chunk in chunks])
        chunks_of[request] = [
            (logits[end - 1], draft_logits[end - 1], streams[start:end].flatten(1))
            for start, end in zip(starts.tolist(), ends.tolist(), strict=True)
        ]
    expected = Expected([], [], [])
    for step in STEPS:
        now = [{}, {}, {}]
        for dp_rank, requests in enumerate(step.per_dp_rank):
            for row, _ in requests:
                for record, value in zip(now, chunks_of[(dp_rank, row)].pop(0), strict=True):
                    record[(dp_rank, row)] = value
        for record, values in zip((expected.logits, expected.draft_logits, expected.streams), now, strict=True):
            record.append(values)
    return expected


class StatesInProcess:
    """An attention backend holding each request's V4 state in this process (what a pool would hold).

    Rows of no request (SGLang's padding: request row 0, and the rows that align a rank's tokens to the
    attention-TP size) come out NaN, where a real backend leaves whatever its buffer held: a padding row
    that reached a request's row would show.
    """

    def __init__(self, new_state):
        self.new_state = new_state
        self.states: dict[int, object] = {}
        self.spans = []

    def get_cpu_graph_seq_len_fill_value(self) -> int:
        return 1

    def late_layer_num_tokens(self, forward_batch) -> None:
        return None

    def init_forward_metadata(self, forward_batch) -> None:
        from sglang_dsv4.attention_backend.torch_reference import request_spans

        self.spans = [span for span in request_spans(forward_batch) if span.row != 0]
        for span in self.spans:
            if span.row not in self.states:
                self.states[span.row] = self.new_state()

    def attend(self, attention, layer: int, x: torch.Tensor, forward_batch) -> torch.Tensor:
        """Layer ``layer``'s attention, or the MTP layer's at ``layer`` = the target's layer count (as the draft
        model numbers it in the pool)."""
        out = torch.full_like(x, float("nan"))
        for span in self.spans:
            state = self.states[span.row]
            layer_state = state.layers[layer] if layer < len(state.layers) else state.mtp.layers[0]
            rows = slice(span.offset, span.offset + span.length)
            out[rows] = attention(x[rows], span.start, layer_state)
        return out


class _Runner:
    """What ``prepare_mlp_sync_batch`` reads of SGLang's model runner."""

    def __init__(self, model_config, attn_backend):
        self.model_config = model_config
        self.attn_backend = attn_backend
        self.is_draft_worker = False

    def attn_tp_sequence_sharded(self, num_tokens: int) -> bool:
        return False


def _forward_batch(step: Step, dp_rank: int, seq_lens: dict[int, int], draft: bool = False):
    """This DP rank's forward batch as the scheduler hands it over (before SGLang's DP padding); the
    draft model's reads :func:`draft_ids` (and leaves ``seq_lens`` as they were)."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode

    requests = step.per_dp_rank[dp_rank]
    counts = [sum(len(ids) for _, ids in rank_requests) for rank_requests in step.per_dp_rank]
    extend = step.mode == "extend"
    rows = torch.tensor([row for row, _ in requests], dtype=torch.int64)
    prefix = [seq_lens.get(row, 0) for row, _ in requests]
    lengths = [len(ids) for _, ids in requests]
    total = [p + n for p, n in zip(prefix, lengths, strict=True)]
    positions = [p + i for p, n in zip(prefix, lengths, strict=True) for i in range(n)]
    mode = ForwardMode.IDLE if not requests else ForwardMode.EXTEND if extend else ForwardMode.DECODE
    # Without logprobs, one logits row per request (decode: per token, one each too).
    per_rank_logits = [len(rank_requests) for rank_requests in step.per_dp_rank]
    batch = ForwardBatch(
        forward_mode=mode,
        batch_size=len(requests),
        input_ids=torch.tensor([t for _, ids in requests for t in (draft_ids(ids) if draft else ids)]).long(),
        req_pool_indices=rows,
        seq_lens=torch.tensor(total, dtype=torch.int64),
        out_cache_loc=torch.zeros(sum(lengths), dtype=torch.int64),
        seq_lens_sum=sum(total),
        seq_lens_cpu=torch.tensor(total, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        global_num_tokens_cpu=counts,
        global_num_tokens_gpu=torch.tensor(counts, dtype=torch.int64),
        global_num_tokens_for_logprob_cpu=per_rank_logits,
        global_num_tokens_for_logprob_gpu=torch.tensor(per_rank_logits, dtype=torch.int64),
        is_extend_in_batch=extend,
        capture_hidden_mode=CaptureHiddenMode.NULL,
    )
    if extend and requests:
        batch.extend_num_tokens = sum(lengths)
        batch.extend_seq_lens = torch.tensor(lengths, dtype=torch.int32)
        batch.extend_prefix_lens = torch.tensor(prefix, dtype=torch.int32)
        batch.extend_start_loc = torch.tensor([0, *lengths[:-1]], dtype=torch.int32).cumsum(0).to(torch.int32)
        batch.extend_seq_lens_cpu = lengths
        batch.extend_prefix_lens_cpu = prefix
        batch.extend_logprob_start_lens_cpu = lengths
    if not draft:
        seq_lens.update(zip(rows.tolist(), total, strict=True))
    return batch


def assert_logits_equal(served: torch.Tensor, oracle: torch.Tensor, where: str) -> None:
    difference = (served - oracle).abs().max().item()
    bound = TOLERANCE * oracle.abs().max().item()
    assert difference <= bound, f"{where}: logits differ by {difference:.3g} > {bound:.3g}"


def forward_on_rank(rank: int, port: int, path: Path, expected: Expected) -> None:
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import bootstrap
    from sglang.srt.model_loader import get_model
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish
    from sglang.srt.server_args import ServerArgs

    from sglang_dsv4 import plugin

    torch.set_num_threads(1)
    plugin.register()
    HookRegistry.apply_hooks()
    args = ServerArgs(
        model_path=str(path), device="cpu", dtype="float32", tp_size=RANKS, attn_dp_size=RANKS // ATTENTION_TP,
        ep_size=RANKS,
    )  # fmt: skip
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=rank, gpu_id=0))
    model_config = ModelConfig.from_server_args(args)
    bootstrap.init_parallel_runtime(server_args=args, device="cpu", dist_port=port)
    bootstrap.init_layer_runtime(model_config=model_config)
    parallel = get_parallel()
    assert (parallel.attn_tp_size, parallel.attn_dp_size) == (ATTENTION_TP, RANKS // ATTENTION_TP)
    assert (parallel.attn_tp_rank, parallel.attn_dp_rank) == (rank % ATTENTION_TP, rank // ATTENTION_TP)

    model = get_model(model_config=model_config, load_config=LoadConfig(), device_config=DeviceConfig("cpu"))
    # The MTP layer as SGLang's EAGLE draft worker builds it: the draft architecture, the target's embedding and head.
    draft_config = ModelConfig.from_server_args(args, is_draft_model=True)
    draft = get_model(model_config=draft_config, load_config=LoadConfig(), device_config=DeviceConfig("cpu"))
    draft.set_embed_and_head(*model.get_embed_and_head())
    # Each request's state as the reference network holds it: its layers' and its MTP layer's.
    backend = StatesInProcess(load_model(path).float().new_state)
    runner = _Runner(model_config, backend)
    dp_rank = parallel.attn_dp_rank
    seq_lens: dict[int, int] = {}
    for number, step in enumerate(STEPS):
        requests = step.per_dp_rank[dp_rank]
        draft_batch = _forward_batch(step, dp_rank, seq_lens, draft=True)
        batch = _forward_batch(step, dp_rank, seq_lens)
        batch.prepare_mlp_sync_batch(runner)
        output = _forward(model, batch, backend)
        _assert_rows_equal(output, requests, expected.logits[number], dp_rank, f"rank {rank}, step {number}")
        # The draft model on the same rows, reading the oracle's target streams (padding rows: zeros).
        draft_batch.prepare_mlp_sync_batch(runner)
        streams = torch.zeros(draft_batch.input_ids.shape[0], draft.v4_config.hc_mult * draft.v4_config.hidden_size)
        real = [expected.streams[number][(dp_rank, row)] for row, _ in requests]
        if real:
            streams[: sum(len(rows) for rows in real)] = torch.cat(real)
        draft_batch.spec_info = SimpleNamespace(hidden_states=streams)
        output = _forward(draft, draft_batch, backend)
        _assert_rows_equal(
            output, requests, expected.draft_logits[number], dp_rank, f"draft: rank {rank}, step {number}"
        )


def _forward(model, batch, backend):
    """``model``'s forward of ``batch`` as SGLang's runner calls it: the backend's metadata, then the forward in
    its context."""
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    backend.init_forward_metadata(batch)
    with forward_context(ForwardContext(attn_backend=backend), forward_batch=batch):
        return model(batch.input_ids, batch.positions, batch)


def _assert_rows_equal(output, requests, oracle: dict, dp_rank: int, label: str) -> None:
    """Each of this DP rank's requests' logits (the output's first rows) equal to the oracle's."""
    for (row, _), served in zip(requests, output.next_token_logits[: len(requests)], strict=True):
        assert_logits_equal(served, oracle[(dp_rank, row)], f"{label}, row {row}")


def test_attention_tp2_by_dp2_forward_equals_one_process(tiny_path):
    mp.spawn(forward_on_rank, args=(free_port(), tiny_path, expected_outputs(tiny_path)), nprocs=RANKS)
