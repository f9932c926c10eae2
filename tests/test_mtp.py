"""The MTP layer: its forward against the equations, and greedy decoding with its drafts against plain greedy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from random_configs import random_v4_config

from sglang_dsv4.model import speculative
from sglang_dsv4.model.network import DeepseekV4
from sglang_dsv4.model.speculative import greedy_decode, read_prompt, speculative_decode
from sglang_dsv4.tiny import random_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


def mtp_by_the_equations(model: DeepseekV4, target_streams: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
    """The MTP layer's logits over a whole sequence, from a fresh state, written out::

    h = h_proj(hnorm(streams)), e = e_proj(enorm(embed(next))), x = h + e on every stream,
    x = mHC around attention (the block's own, HF-checked), then around the MoE, unfused,
    logits = head(norm(sum_k (sigmoid(hc_head_fn . rms(flat x)) * scale + base) + eps)_k x_k)).
    """
    mtp, eps = model.mtp[0], model.config.rms_norm_eps
    h = F.linear(rms(target_streams, eps) * mtp.hnorm.weight, mtp.h_proj.weight)
    e = F.linear(rms(model.embed.weight[next_ids], eps) * mtp.enorm.weight, mtp.e_proj.weight)
    x = h + e[:, None, :]
    layer_state = mtp.attn.new_state(x.dtype, x.device)
    collapsed, post, comb = mtp.hc_attn.pre(x)
    x = mtp.hc_attn.post(mtp.attn(mtp.attn_norm(collapsed), 0, layer_state), x, post, comb)
    collapsed, post, comb = mtp.hc_ffn.pre(x)
    x = mtp.hc_ffn.post(mtp.ffn(mtp.ffn_norm(collapsed), next_ids), x, post, comb)
    flat = rms(x.flatten(1), eps)
    weights = torch.sigmoid(F.linear(flat, mtp.hc_head.fn) * mtp.hc_head.scale + mtp.hc_head.base) + model.config.hc_eps
    collapsed = (weights[:, :, None] * x).sum(1)
    return F.linear(rms(collapsed, eps) * mtp.norm.weight, model.head.weight)


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
@torch.inference_mode()
def test_mtp_forward_is_the_equations_in_chunks_with_its_own_window(seed):
    raw = random_v4_config(seed)
    model = random_model(raw, seed=seed)
    length = 2 * model.config.sliding_window + 9  # past the MTP layer's window, and its blocks where it compresses
    ids = torch.randint(0, model.config.vocab_size, (length + 1,), generator=torch.Generator().manual_seed(seed))
    state = model.new_state()
    target_streams = model.streams(ids, state)[:-1]
    expected = mtp_by_the_equations(model, target_streams, ids[1:])
    chunks, start = [length // 2, 1, 1, length - length // 2 - 2], 0
    for size in chunks:
        logits, _ = model.draft(target_streams[start : start + size], ids[1:][start : start + size], state.mtp)
        torch.testing.assert_close(logits, expected[start : start + size], rtol=0, atol=1e-5)
        start += size
    assert state.mtp.position == length


def planted_drafter(plain: list[int], prompt_length: int):
    """A drafter that drafts plain greedy's own tokens, with one planted mistake every few steps (a draft
    rejected at each position of the chain in turn) and sometimes none (every draft accepted)."""

    def draft(model, last_streams, token, state, drafts):
        done = state.position - prompt_length + 1  # tokens of the continuation decided so far
        drafted = plain[done : done + drafts]
        drafted += [0] * (drafts - len(drafted))
        if done % 3:
            wrong = done % drafts
            drafted[wrong] = (drafted[wrong] + 1) % model.config.vocab_size
        return drafted

    return draft


@pytest.mark.parametrize(("seed", "drafts"), [(5, 2), (9, 4), (11, 3)])
def test_verified_drafts_roll_back_exactly_to_plain_greedy_across_block_ends(seed, drafts, monkeypatch):
    """Positions 100..199: ratio-4 block ends, HCA ones (128; every 16 and 32 in seeds 9 and 11), past the window."""
    model = random_model(random_v4_config(seed), seed=seed)
    new_tokens, config = 100, model.config
    prompt = torch.randint(0, config.vocab_size, (100,), generator=torch.Generator().manual_seed(seed))
    read = read_prompt(model, prompt)
    plain = greedy_decode(model, read, new_tokens)
    monkeypatch.setattr(speculative, "_draft", planted_drafter(plain, len(prompt)))
    decoded = speculative_decode(model, read, new_tokens, drafts)
    assert decoded.tokens == plain
    assert drafts in decoded.accepted and min(decoded.accepted) < drafts  # both paths taken


@pytest.mark.parametrize("seed", [3, 7])
def test_mtp_drafted_decoding_is_plain_greedy(seed):
    model = random_model(random_v4_config(seed), seed=seed)
    new_tokens = model.config.sliding_window + 40
    prompt = torch.randint(0, model.config.vocab_size, (20,), generator=torch.Generator().manual_seed(seed))
    read = read_prompt(model, prompt)
    decoded = speculative_decode(model, read, new_tokens, drafts=1 + seed % 4)
    assert decoded.tokens == greedy_decode(model, read, new_tokens)


@torch.inference_mode()
def test_a_release_format_fp8_checkpoint_with_an_mtp_layer_drafts_as_its_dequantized_twin(
    quantized_tiny_path, twin_path
):
    """FP8 dense projections and FP4 experts in ``mtp.0.*`` (with their scales) load into the MTP layer as
    their exact dequantization: its drafts equal the twin's, whose weights are those values in float32."""
    from sglang_dsv4 import load_model

    quantized, twin = load_model(quantized_tiny_path), load_model(twin_path)
    assert len(quantized.mtp) == len(twin.mtp) == 1
    ids = torch.randint(0, quantized.config.vocab_size, (40,), generator=torch.Generator().manual_seed(7))
    drafts = []
    for model in (quantized, twin):
        state = model.new_state()
        logits, _ = model.draft(model.streams(ids[:-1], state), ids[1:], state.mtp)
        drafts.append(logits)
    torch.testing.assert_close(drafts[0], drafts[1], rtol=0, atol=1e-5)
