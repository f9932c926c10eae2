"""Speculative decoding served: SGLang's EAGLE worker drafting with V4's MTP layer (topk 1), through the real
``python -m sglang.launch_server``. Greedy output with speculation is greedy output without, token for token, and
every pool row comes back.

The oracle is the network's own greedy decoding, one token per forward (:func:`greedy_decode`), in float32 as the
servers run. Three servers: the shipped checkpoint (a trained MTP layer: many drafts accepted) on the batched
backend, in one process and over two tensor-parallel ranks (``--tp 2``, whose accepted drafts must be the single
process's), and a random config whose MTP layer has a ratio-4 compressor and indexer (a random
MTP layer: nearly every draft rejected, so nearly every verify rolls back) on the torch reference backend. Each
serves a batch of mixed prompt lengths with outputs across ratio-4 and ratio-128 block ends and the sliding
window's end.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests
import scipy.stats
import torch
from conftest import random_ids
from launch_checks import config_only_checkpoint, refusal_at_resolution
from random_configs import build_random_checkpoint
from serving_checks import assert_pools_idle, generate

from sglang_dsv4 import load_config, load_model, speculation
from sglang_dsv4.config import ConfigError
from sglang_dsv4.launch import running_server
from sglang_dsv4.memory_pool.ledger import KVLedger
from sglang_dsv4.model.speculative import greedy_decode, read_prompt
from sglang_dsv4.speculation import SPECULATION
from sglang_dsv4.tiny import TINY_CONFIG, shipped_checkpoint

PROMPT_LENGTHS = (5, 60, 130, 250)
NEW_TOKENS = (160, 40, 120, 80)
# A random config whose MTP layer compresses (ratio 4, with an indexer): its draft state has compressor records.
RANDOM_MTP_SEED = 2
# The shipped server's prefill chunk: prompts longer than it are prefilled in chunks before the first draft.
CHUNK_TOKENS = 128
N_NEW_TOKENS = 24
# The speculative sampling test: requests, tokens sampled from each, and the chi-square test's significance level
# (the chance that a correct server fails it).
SAMPLES = 150
SAMPLED_TOKENS = 3
SIGNIFICANCE = 1e-3


@pytest.fixture(scope="module")
def shipped_server(log_dir):
    args = ["--dtype", "float32", "--chunked-prefill-size", str(CHUNK_TOKENS), *SPECULATION]
    with running_server(shipped_checkpoint(), *args, log_path=log_dir / "speculative-shipped.log") as url:
        yield url


@pytest.fixture(scope="module")
def shipped_model():
    return load_model(shipped_checkpoint()).float()


@pytest.fixture(scope="module")
def random_mtp_path(tmp_path_factory) -> Path:
    path, _ = build_random_checkpoint(tmp_path_factory.mktemp("random-mtp"), RANDOM_MTP_SEED)
    assert load_config(path).mtp_compress_ratios == (4,)
    return path


@pytest.fixture(scope="module")
def tensor_parallel_server(log_dir):
    args = ["--dtype", "float32", "--tp", "2", "--max-total-tokens", "4096", *SPECULATION]
    with running_server(shipped_checkpoint(), *args, log_path=log_dir / "speculative-tp2.log") as url:
        yield url


@pytest.fixture(scope="module")
def random_server(random_mtp_path, log_dir):
    args = ["--dtype", "float32", "--attention-backend", "dsv4_torch", *SPECULATION]
    with running_server(random_mtp_path, *args, log_path=log_dir / "speculative-random.log") as url:
        yield url


def serve_greedy(url: str, prompts: list[list[int]], new_tokens: tuple[int, ...]) -> list[dict]:
    """The replies to the prompts sent at once (one batch of mixed lengths)."""

    def one(ids: list[int], count: int) -> dict:
        params = {"max_new_tokens": count, "temperature": 0, "ignore_eos": True}
        reply = generate(url, ids, timeout=1200, sampling_params=params)
        assert reply.status_code == 200, reply.text
        return reply.json()

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts, new_tokens))


def assert_greedy_with_speculation_is_greedy_without(url: str, path: Path) -> list[float]:
    """Served outputs against the network's greedy; the mean accepted lengths SGLang reports, checked against the
    counts it reports beside them."""
    model = load_model(path).float()
    prompts = [random_ids(n, model.config.vocab_size, seed=n).tolist() for n in PROMPT_LENGTHS]
    replies = serve_greedy(url, prompts, NEW_TOKENS)
    accepted = []
    for ids, count, reply in zip(prompts, NEW_TOKENS, replies, strict=True):
        assert reply["output_ids"] == greedy_decode(model, read_prompt(model, torch.tensor(ids)), count)
        meta = reply["meta_info"]
        assert meta["spec_accept_length"] == pytest.approx(count / meta["spec_verify_ct"])
        accepted.append(meta["spec_accept_length"])
    # SGLang's, until the flush below resets it; under attention DP every rank's (each served some requests).
    assert all(report["avg_spec_accept_length"] >= 1 for report in server_reports(url))
    assert_pools_idle(url)
    for report in server_reports(url):
        assert set(report["dsv4_prefix_cache"]["rows_miscounted"].values()) == {0}
    return accepted


def server_reports(url: str) -> list[dict]:
    """Each DP rank's report (one without attention DP)."""
    return requests.get(f"{url}/server_info", timeout=30).json()["internal_states"]


def server_report(url: str) -> dict:
    return server_reports(url)[0]


@pytest.fixture(scope="module")
def trained_mtp_accepted(shipped_server) -> list[float]:
    """The single-process server's mean accepted lengths, its outputs checked."""
    return assert_greedy_with_speculation_is_greedy_without(shipped_server, shipped_checkpoint())


def test_trained_mtp_greedy_with_speculation_is_greedy_without(trained_mtp_accepted):
    assert min(trained_mtp_accepted) > 1.5  # the trained MTP layer's drafts are often right


def test_random_mtp_greedy_with_speculation_is_greedy_without(random_server, random_mtp_path):
    accepted = assert_greedy_with_speculation_is_greedy_without(random_server, random_mtp_path)
    assert max(accepted) < 1.2  # a random MTP layer's drafts are nearly all rejected: nearly every verify rolls back


def test_greedy_with_speculation_over_two_tensor_parallel_ranks_is_greedy_without(
    tensor_parallel_server, trained_mtp_accepted
):
    accepted = assert_greedy_with_speculation_is_greedy_without(tensor_parallel_server, shipped_checkpoint())
    # The MTP layer's sums reduced over both ranks: the same drafts accepted as on the single-process server.
    assert accepted == trained_mtp_accepted


def test_the_speculating_server_allocates_what_the_ledger_under_speculation_says(shipped_server):
    # The MTP layer's KV and every request row's rollback records (4 tokens a verify forward) included.
    layout = KVLedger(load_config(shipped_checkpoint()), torch.float32, verify_tokens=4).ours
    usage = server_report(shipped_server)["dsv4_pools"]
    tokens, request_rows = usage["token_slots"]["total"], usage["request_rows"]["total"] + 1
    expected = tokens * layout.bytes_per_token + layout.padding_bytes + request_rows * layout.bytes_per_request
    assert usage["allocated_bytes"] == expected


def test_a_turn_resumed_from_the_prefix_cache_continues_as_a_cold_one(shipped_server):
    model = load_model(shipped_checkpoint()).float()
    first = random_ids(90, TINY_CONFIG["vocab_size"], seed=7).tolist()
    (reply,) = serve_greedy(shipped_server, [first], (70,))
    second = first + reply["output_ids"] + random_ids(20, TINY_CONFIG["vocab_size"], seed=8).tolist()
    (resumed,) = serve_greedy(shipped_server, [second], (60,))
    assert resumed["meta_info"]["cached_tokens"] >= len(first)
    assert resumed["output_ids"] == greedy_decode(model, read_prompt(model, torch.tensor(second)), 60)
    assert_pools_idle(shipped_server)


@torch.inference_mode()
def first_tokens_distribution(model, prompt: list[int], length: int, temperature: float, top_k: int) -> dict:
    """The network's probability of each sequence of ``length`` first tokens sampled at ``temperature`` among
    the ``top_k`` most probable: the product of each token's renormalized probability given those before it."""
    distribution = {(): 1.0}
    for _ in range(length):
        extended = {}
        for before, chance in distribution.items():
            logits = model(torch.tensor(prompt + list(before)), model.new_state())[-1].double()
            top = torch.softmax(logits / temperature, dim=-1).topk(top_k)
            for token, probability in zip(top.indices.tolist(), (top.values / top.values.sum()).tolist()):
                extended[(*before, token)] = chance * probability
        distribution = extended
    return distribution


def chi_square_p_value(samples: list[tuple[int, ...]], distribution: dict) -> float:
    """Pearson's test of ``samples`` against ``distribution``; sequences expected fewer than 5 times (and any
    outside it) are pooled into one cell."""
    count = len(samples)
    common = [key for key, chance in distribution.items() if chance * count >= 5]
    observed = [samples.count(key) for key in common]
    expected = [distribution[key] * count for key in common]
    observed.append(count - sum(observed))
    expected.append(count - sum(expected))
    return float(scipy.stats.chisquare(observed, expected).pvalue)


def test_sampled_tokens_with_speculation_follow_the_networks_distribution(shipped_server, shipped_model):
    """Speculative sampling (SGLang's target-only chain rule) keeps the model's distribution: the first
    ``SAMPLED_TOKENS`` tokens of ``SAMPLES`` requests (the first from the prefill's sampler, the others from
    verifies that accept and reject drafts) against their exact probabilities, at significance ``SIGNIFICANCE``."""
    model = shipped_model
    prompt = random_ids(16, TINY_CONFIG["vocab_size"], seed=11).tolist()
    params = {"max_new_tokens": SAMPLED_TOKENS, "temperature": 0.8, "top_k": 3, "ignore_eos": True}
    reply = generate(shipped_server, [prompt] * SAMPLES, timeout=600, sampling_params=params)
    assert reply.status_code == 200, reply.text
    samples = [tuple(one["output_ids"]) for one in reply.json()]
    distribution = first_tokens_distribution(model, prompt, SAMPLED_TOKENS, 0.8, 3)
    assert chi_square_p_value(samples, distribution) > SIGNIFICANCE
    accepted = [one["meta_info"]["spec_accept_length"] for one in reply.json()]
    assert 1 < sum(accepted) / len(accepted) < SAMPLED_TOKENS  # drafts both accepted and rejected
    assert_pools_idle(shipped_server)


def test_a_prompt_prefilled_in_chunks_then_speculated_is_greedy(shipped_server, shipped_model):
    model = shipped_model
    prompt = random_ids(3 * CHUNK_TOKENS + 50, TINY_CONFIG["vocab_size"], seed=21).tolist()  # four chunks
    assert server_report(shipped_server)["chunked_prefill_size"] == CHUNK_TOKENS
    (reply,) = serve_greedy(shipped_server, [prompt], (40,))
    assert reply["output_ids"] == greedy_decode(model, read_prompt(model, torch.tensor(prompt)), 40)
    assert reply["meta_info"]["spec_verify_ct"] < 40  # drafts were accepted: it speculated
    assert_pools_idle(shipped_server)


def leave_mid_stream(url: str, ids: list[int], events: int, temperature: float) -> None:
    """A streaming client that closes its connection after ``events`` events (the server aborts its request)."""
    params = {"max_new_tokens": 400, "temperature": temperature, "ignore_eos": True}
    payload = {"input_ids": ids, "sampling_params": params, "stream": True}
    with requests.post(f"{url}/generate", json=payload, stream=True, timeout=600) as reply:
        assert reply.status_code == 200, reply.text
        for _, _ in zip(range(events), reply.iter_lines(), strict=False):
            pass


def aborted_by_id(url: str, ids: list[int], rid: str) -> dict:
    """A request aborted through ``/abort_request`` once it streams (mid-speculation): its last event."""
    params = {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}
    payload = {"input_ids": ids, "sampling_params": params, "stream": True, "rid": rid}
    with requests.post(f"{url}/generate", json=payload, stream=True, timeout=600) as reply:
        events = (line for line in reply.iter_lines() if line.startswith(b"data: {"))
        last = json.loads(next(events)[len(b"data: ") :])
        assert requests.post(f"{url}/abort_request", json={"rid": rid}, timeout=60).status_code == 200
        for line in events:
            last = json.loads(line[len(b"data: ") :])
    return last


def test_aborted_and_disconnected_requests_mid_speculation_return_every_row(shipped_server, shipped_model):
    # At once: clients gone mid-speculation (greedy and sampled), one gone during a chunked prefill, one aborted
    # by id while it speculates, and one kept, which must be greedy's.
    model = shipped_model
    prompts = [random_ids(n, TINY_CONFIG["vocab_size"], seed=30 + n).tolist() for n in (40, 90, 300, 60, 120)]
    with ThreadPoolExecutor(5) as pool:
        left = [pool.submit(leave_mid_stream, shipped_server, prompts[0], 5, 0.0)]
        left.append(pool.submit(leave_mid_stream, shipped_server, prompts[1], 5, 0.8))
        left.append(pool.submit(leave_mid_stream, shipped_server, prompts[2], 0, 0.0))
        aborted = pool.submit(aborted_by_id, shipped_server, prompts[3], "speculating-then-aborted")
        kept = pool.submit(serve_greedy, shipped_server, [prompts[4]], (40,))
        for client in left:
            client.result()
        assert aborted.result()["meta_info"]["finish_reason"]["type"] == "abort"
        (reply,) = kept.result()
    assert reply["output_ids"] == greedy_decode(model, read_prompt(model, torch.tensor(prompts[4])), 40)
    assert_pools_idle(shipped_server)


def test_n_samples_with_speculation(shipped_server, shipped_model):
    # n = 3 greedy: three copies of greedy's output; n = 3 sampled: three outputs of the asked length.
    model = shipped_model
    prompt = random_ids(50, TINY_CONFIG["vocab_size"], seed=41).tolist()
    expected = greedy_decode(model, read_prompt(model, torch.tensor(prompt)), N_NEW_TOKENS)
    for temperature in (0.0, 0.8):
        params = {"max_new_tokens": N_NEW_TOKENS, "temperature": temperature, "ignore_eos": True, "n": 3}
        reply = generate(shipped_server, prompt, timeout=600, sampling_params=params)
        assert reply.status_code == 200, reply.text
        outputs = [one["output_ids"] for one in reply.json()]
        assert [len(output) for output in outputs] == [N_NEW_TOKENS] * 3
        if temperature == 0:
            assert outputs == [expected] * 3
    assert_pools_idle(shipped_server)


@pytest.mark.parametrize(
    ("changes", "flags", "named"),
    [
        ({"num_nextn_predict_layers": 0}, SPECULATION, "the checkpoint has no MTP layer to draft with"),
        ({}, (*SPECULATION[:4], "--speculative-eagle-topk", "2"), "--speculative-eagle-topk 2"),
        ({}, (*SPECULATION, "--tp", "2", "--attn-dp-size", "2", "--ep-size", "2"), "not served under attention DP"),
    ],
    ids=["no-mtp-layer", "topk-2", "attention-dp"],
)
def test_unserved_speculation_is_refused_at_start_naming_it(tmp_path, sglang_with_plugin, changes, flags, named):
    checkpoint = config_only_checkpoint(tmp_path / "checkpoint", **changes)
    assert named in refusal_at_resolution(checkpoint, *flags)


def test_draft_steps_are_served_where_graphs_are_captured_and_refused_only_for_a_compressed_mtp_layer(monkeypatch):
    # SGLang captures the target's verify batches, which the batched backend's graph hooks index
    # (test_batched_backend.py drives them), and the draft steps after the first, which the draft backend runs on
    # scratch rows of a window-only MTP layer, as the releases have it (test_draft_decode.py drives them): a
    # platform that captures graphs (CUDA) serves any chain of such a layer, and refuses more than one draft of a
    # compressed one with the way out. The CPU platform captures none, so it serves any chain.
    from sglang.srt.platforms import current_platform
    from sglang.srt.platforms.interface import PlatformCapabilities

    from sglang_dsv4.served_config import CHECKPOINT_CONFIG

    def hf_config(mtp_ratio: int) -> SimpleNamespace:
        raw = {**TINY_CONFIG, "compress_ratios": [*TINY_CONFIG["compress_ratios"], mtp_ratio]}
        return SimpleNamespace(_name_or_path="a-hub/tiny-v4", **{CHECKPOINT_CONFIG: raw})  # the config's word

    def view(decode_graphs: str, steps: int | None) -> SimpleNamespace:
        return SimpleNamespace(
            speculative_algorithm="EAGLE", speculative_eagle_topk=1, speculative_num_steps=steps,
            speculative_num_draft_tokens=None if steps is None else steps + 1, speculative_draft_model_path=None,
            tp_size=1, attn_dp_size=1, cuda_graph_config=SimpleNamespace(decode=SimpleNamespace(backend=decode_graphs)),
        )  # fmt: skip

    window, compressed = hf_config(0), hf_config(128)
    assert not speculation.captures_decode_graphs(view("full", 3))
    speculation.check_speculation(view("full", 3), compressed)
    monkeypatch.setattr(type(current_platform), "capabilities", PlatformCapabilities(graph_capture=True))
    for steps in (3, 5, None):
        speculation.check_speculation(view("full", steps), window)
        with pytest.raises(ConfigError, match="window-only MTP layer's draft steps, not this checkpoint's hca one"):
            speculation.check_speculation(view("full", steps), compressed)
    speculation.check_speculation(view("full", 1), compressed)
    speculation.check_speculation(view("disabled", 3), compressed)
    assert not speculation.captures_decode_graphs(view("disabled", 3))
