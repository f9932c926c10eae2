"""The torch twins of SGLang's EAGLE kernels (:mod:`sglang_dsv4.kernels.speculative`) against SGLang's own Triton
kernels, under Triton's interpreter (in a process of their own: see ``kernel_testing``).

The draft trees are built by SGLang's own drafting steps (``select_top_k_tokens``, ``organize_draft_results``)
from random scores: chains (topk 1, what the server drafts) and trees (topk 2, 3).

SGLang's sampling verify (``tree_speculative_sampling_target_only``) is a CUDA kernel only: ``sgl_kernel`` does not
import on a host without CUDA, and SGLang resolves the name to None there. Its torch twin is checked against a
line-by-line transcription of the kernel (``TreeSpeculativeSamplingTargetOnly`` with FlashInfer's
``DeviceSamplingFromProb``), and the renormalizations before it against SGLang's torch sampler's cuts.
"""

from __future__ import annotations

import pytest
import torch
from kernel_testing import interpreted_only, launcher_only, run_under_interpreter

from sglang_dsv4.kernels import speculative

STEPS = 3


@launcher_only
def test_speculative_kernels_under_the_interpreter():
    run_under_interpreter(__file__)


def draft_tree(batch: int, topk: int, draft_tokens: int, seed: int):
    """``(parent_list, top_scores_index, draft_tokens)`` as SGLang's draft worker organizes them."""
    from sglang.srt.speculative.eagle_utils import organize_draft_results
    from sglang.srt.speculative.spec_utils import _select_top_k_tokens_first, _select_top_k_tokens_later

    later = getattr(_select_top_k_tokens_later, "_torchdynamo_orig_callable", _select_top_k_tokens_later)
    generator = torch.Generator().manual_seed(seed)
    scores_list, tokens_list, parents_list = [], [], []
    topk_p = torch.rand(batch, topk, generator=generator)
    topk_index = torch.randint(0, 50, (batch, topk), generator=generator)
    _, _, scores, info = _select_top_k_tokens_first(topk_p, topk_index, None, topk)
    for step in range(STEPS):
        if step > 0:
            topk_p = torch.rand(batch * topk, topk, generator=generator)
            topk_index = torch.randint(0, 50, (batch * topk, topk), generator=generator)
            _, _, scores, info = later(step, topk_p, topk_index, None, scores, topk)
        scores_list.append(info[0])
        tokens_list.append(info[1])
        parents_list.append(info[2])
    return organize_draft_results(scores_list, tokens_list, parents_list, draft_tokens)


def built_tree(build, parent_list, top_scores_index, seq_lens, topk, draft_tokens):
    from sglang.kernels.ops.speculative.spec_tree import TreeMaskMode

    batch = seq_lens.numel()
    tree_mask = torch.full((int(seq_lens.sum()) * draft_tokens + draft_tokens * draft_tokens * batch,), True)
    positions = torch.empty(batch * draft_tokens, dtype=torch.long)
    retrieve = torch.full((3, batch, draft_tokens), -1, dtype=torch.long)
    build(
        parent_list,
        top_scores_index,
        seq_lens,
        tree_mask,
        positions,
        *retrieve,
        topk,
        STEPS,
        draft_tokens,
        TreeMaskMode.FULL_MASK,
    )
    return tree_mask, positions, retrieve


CASES = [(1, 4), (2, 6), (3, 8)]  # (topk, draft tokens)


@interpreted_only
@pytest.mark.parametrize(("topk", "draft_tokens"), CASES)
def test_tree_build_and_greedy_verify_are_sglangs(topk, draft_tokens):
    from sglang.kernels.ops.speculative.spec_tree import sgl_build_tree_kernel_triton, verify_tree_greedy_triton

    seq_lens = torch.tensor([7, 130, 1])
    parent_list, top_scores_index, drafts = draft_tree(len(seq_lens), topk, draft_tokens, seed=topk)
    expected = built_tree(sgl_build_tree_kernel_triton, parent_list, top_scores_index, seq_lens, topk, draft_tokens)
    actual = built_tree(speculative.build_tree, parent_list, top_scores_index, seq_lens, topk, draft_tokens)
    for a, e in zip(actual, expected, strict=True):
        assert torch.equal(a, e)

    _, _, (retrieve_index, next_token, next_sibling) = expected
    candidates = torch.cat([torch.full((len(seq_lens), 1), 7), drafts], dim=1)
    generator = torch.Generator().manual_seed(0)
    for _ in range(5):  # targets that agree with the drafts along some paths and not others
        targets = torch.where(
            torch.rand(candidates.shape, generator=generator) < 0.7,
            candidates.roll(-1, dims=1),
            torch.randint(0, 50, candidates.shape, generator=generator),
        )
        results = []
        for verify in (verify_tree_greedy_triton, speculative.verify_tree_greedy):
            predicts = torch.zeros(candidates.numel(), dtype=torch.int32)
            accept_index = torch.full((len(seq_lens), STEPS + 1), -1, dtype=torch.int32)
            accepted = torch.zeros(len(seq_lens), dtype=torch.int32)
            verify(
                predicts, accept_index, accepted, candidates, retrieve_index, next_token, next_sibling, targets
            )
            results.append((predicts, accept_index, accepted))
        for a, e in zip(results[1], results[0], strict=True):
            assert torch.equal(a, e)


@interpreted_only
def test_slot_assignment_is_sglangs():
    from sglang.kernels.ops.speculative.cache_locs import assign_draft_cache_locs_contiguous, assign_extend_cache_locs
    from sglang.kernels.ops.speculative.eagle import fill_accept_out_cache_loc, fill_bonus_tokens
    from sglang.srt.mem_cache.allocation import assign_req_to_token_pool

    rows, starts = torch.tensor([3, 1, 4]), torch.tensor([5, 0, 17])
    ends = starts + torch.tensor([4, 2, 4])
    slots = torch.arange(100, 110)
    tables = [torch.zeros(6, 32, dtype=torch.int32) for _ in range(2)]
    assign_req_to_token_pool[(3,)](rows, tables[0], starts, ends, slots, 32, 4)
    speculative.assign_req_to_token_pool(rows, tables[1], starts, ends, slots, 3)
    assert torch.equal(tables[1], tables[0])

    table = tables[0]
    gathered = [torch.zeros(3 * 4, dtype=torch.int64) for _ in range(2)]
    positions = [torch.zeros(3, dtype=torch.int64) for _ in range(2)]
    assign_draft_cache_locs_contiguous[(3,)](
        rows, table, starts, gathered[0], 32, 1, 4, positions=positions[0], mrope=None, BS=3,
        WRITE_POSITIONS=True, WRITE_MROPE=False,
    )  # fmt: skip
    speculative.assign_draft_cache_locs_contiguous(rows, table, starts, gathered[1], 1, 4, positions=positions[1])
    assert torch.equal(gathered[1], gathered[0]) and torch.equal(positions[1], positions[0])

    extended = torch.zeros(10, dtype=torch.int64)
    assign_extend_cache_locs[(3,)](rows, table, starts, ends, extended, 32, 4)
    assert torch.equal(speculative.assign_extend_cache_locs(rows, table, starts, ends, 3, 4, "cpu"), extended)

    accept_tokens = torch.tensor([[11, 12, -1, -1], [21, -1, -1, -1], [31, 32, 33, 34]], dtype=torch.int32)
    accept_lens = torch.tensor([2, 1, 4], dtype=torch.int32)
    bonus = [torch.zeros(3, dtype=torch.int32) for _ in range(2)]
    fill_bonus_tokens[(3,)](accept_tokens, accept_lens, bonus[0], 4)
    speculative.fill_bonus_tokens(accept_tokens, accept_lens, bonus[1], 4, 3)
    assert torch.equal(bonus[1], bonus[0])

    accept_index = torch.tensor([0, 1, -1, -1, 4, -1, -1, -1, 8, 9, 10, 11], dtype=torch.int32)
    out_cache_loc = torch.arange(200, 212)
    kept = [torch.zeros(7, dtype=torch.int64) for _ in range(2)]
    fill_accept_out_cache_loc[(12,)](accept_index, out_cache_loc, kept[0], 16)
    speculative.fill_accept_out_cache_loc(accept_index, out_cache_loc, kept[1], 12)
    assert torch.equal(kept[1], kept[0])


def transcribed_target_only_sampling(
    candidates, retrieve_index, next_token, next_sibling, coins, final_coins, target_probs, draft_probs,
    steps, threshold_single, threshold_acc,
):  # fmt: skip
    """SGLang's ``TreeSpeculativeSamplingTargetOnly`` CUDA kernel, one block (request) after another, scalar by
    scalar: ``(predicts, accept_index, accept_token_num)``; ``draft_probs`` is written in place as the kernel
    writes it."""
    batch, draft_tokens = candidates.shape
    vocab = target_probs.shape[-1]
    flat_target, flat_draft = target_probs.reshape(-1), draft_probs.reshape(-1)
    predicts = torch.zeros(batch * draft_tokens, dtype=torch.int32)
    accept_index = torch.full((batch, steps), -1, dtype=torch.int32)
    accept_token_num = torch.zeros(batch, dtype=torch.int32)
    threshold_acc = max(threshold_acc, 1e-9)
    for bx in range(batch):
        prob_acc = 0.0
        cur_prob_offset = bx * draft_tokens * vocab
        coin = float(coins[bx, 0])
        last_accepted = int(retrieve_index[bx, 0])
        accept_index[bx, 0] = last_accepted
        num_accepted = 0
        cur_index = 0
        for _ in range(1, steps):
            cur_index = int(next_token[bx, cur_index])
            while cur_index != -1:
                draft_index = int(retrieve_index[bx, cur_index])
                draft_token_id = int(candidates[bx, cur_index])
                target_prob_single = float(flat_target[cur_prob_offset + draft_token_id])
                prob_acc += target_prob_single
                if target_prob_single > 0 and (
                    coin < prob_acc / threshold_acc or target_prob_single >= threshold_single
                ):
                    prob_acc = 0.0
                    cur_prob_offset = (bx * draft_tokens + cur_index) * vocab
                    coin = float(coins[bx, cur_index])
                    predicts[last_accepted] = draft_token_id
                    num_accepted += 1
                    accept_index[bx, num_accepted] = draft_index
                    last_accepted = draft_index
                    break
                flat_draft[cur_prob_offset + draft_token_id] = flat_target[cur_prob_offset + draft_token_id]
                cur_index = int(next_sibling[bx, cur_index])
            if cur_index == -1:
                break
        accept_token_num[bx] = num_accepted
        relu = []
        for i in range(vocab):
            q = float(flat_target[cur_prob_offset + i])
            p = float(flat_draft[cur_prob_offset + i]) if num_accepted != steps - 1 else 0.0
            relu.append(max(q - p, 0.0))
        u = float(final_coins[bx]) * sum(relu)
        sampled, last_valid, aggregate = vocab, -1, 0.0
        for i, x in enumerate(relu):
            aggregate += x
            if x > 0:
                last_valid = i
                if aggregate > u:
                    sampled = i
                    break
        if sampled == vocab:
            sampled = vocab - 1 if last_valid == -1 else last_valid
        predicts[last_accepted] = sampled
    return predicts, accept_index, accept_token_num


@launcher_only
@pytest.mark.parametrize(("topk", "draft_tokens"), CASES)
@pytest.mark.parametrize(("threshold_single", "threshold_acc"), [(1.0, 1.0), (0.3, 0.6)])
def test_target_only_sampling_is_the_kernels_rule(topk, draft_tokens, threshold_single, threshold_acc):
    seq_lens = torch.tensor([7, 130, 1, 12])
    batch, vocab = len(seq_lens), 50
    parent_list, top_scores_index, drafts = draft_tree(batch, topk, draft_tokens, seed=topk)
    _, _, (retrieve_index, next_token, next_sibling) = built_tree(
        speculative.build_tree, parent_list, top_scores_index, seq_lens, topk, draft_tokens
    )
    candidates = torch.cat([torch.full((batch, 1), 7), drafts], dim=1)
    generator = torch.Generator().manual_seed(topk)
    for trial in range(8):
        # Peaked targets on the drafts (many accepted), some tokens without mass (drafts among them).
        logits = torch.randn(batch, draft_tokens, vocab, generator=generator)
        logits.scatter_add_(2, candidates.roll(-1, dims=1).unsqueeze(-1), torch.full((batch, draft_tokens, 1), 3.0))
        logits[torch.rand(logits.shape, generator=generator) < 0.2] = -torch.inf
        target_probs = torch.softmax(logits, dim=-1)
        coins = torch.rand(batch, draft_tokens, generator=generator)
        final_coins = torch.rand(batch, generator=generator)
        final_coins[0] = 1 - 2**-24  # the largest coin: rounding may leave no token past it
        expected_draft_probs = torch.zeros_like(target_probs)
        expected = transcribed_target_only_sampling(
            candidates, retrieve_index, next_token, next_sibling, coins, final_coins, target_probs,
            expected_draft_probs, STEPS + 1, threshold_single, threshold_acc,
        )  # fmt: skip
        draft_probs = torch.zeros_like(target_probs)
        predicts = torch.zeros(batch * draft_tokens, dtype=torch.int32)
        accept_index = torch.full((batch, STEPS + 1), -1, dtype=torch.int32)
        accepted = torch.zeros(batch, dtype=torch.int32)
        speculative.tree_speculative_sampling_target_only(
            predicts=predicts, accept_index=accept_index, accept_token_num=accepted, candidates=candidates,
            retrive_index=retrieve_index, retrive_next_token=next_token, retrive_next_sibling=next_sibling,
            uniform_samples=coins, uniform_samples_for_final_sampling=final_coins, target_probs=target_probs,
            draft_probs=draft_probs, threshold_single=threshold_single, threshold_acc=threshold_acc,
        )  # fmt: skip
        for actual, wanted in zip((predicts, accept_index, accepted), expected, strict=True):
            assert torch.equal(actual, wanted), trial
        assert torch.equal(draft_probs, expected_draft_probs)


@launcher_only
def test_renormalizations_cut_as_sglangs_torch_sampler():
    from sglang.srt.layers.sampler import top_k_top_p_min_p_sampling_from_probs_torch

    generator = torch.Generator().manual_seed(0)
    probs = torch.softmax(3 * torch.randn(6, 40, generator=generator), dim=-1)
    top_ks, top_ps = torch.tensor([1, 2, 5, 40, 7, 1 << 30]), torch.tensor([0.05, 0.3, 0.5, 0.9, 0.99, 1.0])
    no_top_k, no_top_p = torch.full_like(top_ks, 1 << 30), torch.ones_like(top_ps)
    cuts = {
        "top_k": (speculative.top_k_renorm_prob(probs, top_ks), top_ks, no_top_p),
        "top_p": (speculative.top_p_renorm_prob(probs, top_ps), no_top_k, top_ps),
    }
    for name, (renormalized, ks, ps) in cuts.items():
        _, kept, order, _ = top_k_top_p_min_p_sampling_from_probs_torch(
            probs.clone(), ks, ps, torch.zeros(6), False, None, None, return_filtered_probs=True
        )
        expected = torch.zeros_like(probs).scatter_(-1, order.long(), kept)
        torch.testing.assert_close(renormalized, expected / expected.sum(dim=-1, keepdim=True), msg=name)
