"""SGLang's EAGLE bookkeeping kernels in torch: what its Triton kernels (CUDA) and ``sgl_kernel`` CPU ops (its own
CPU engine) compute, for the CPU platform, which has neither. Each function has the signature and in-place
outputs of the SGLang function it stands in for (named in its docstring); sizes are a batch of requests times a
few draft tokens, so the per-request loops run on the host.
"""

from __future__ import annotations

import torch

FULL_MASK = 0  # SGLang's TreeMaskMode.FULL_MASK; its other modes fill only the draft tokens' block


def assign_req_to_token_pool(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    batch_size: int,
) -> None:
    """``allocation.assign_req_to_token_pool_func``: request ``i``'s positions ``start .. end - 1`` get the next
    ``end - start`` slots of ``out_cache_loc`` (requests in order)."""
    offset = 0
    for row, start, end in zip(*(t[:batch_size].tolist() for t in (req_pool_indices, start_offset, end_offset))):
        req_to_token[row, start:end] = out_cache_loc[offset : offset + end - start].to(req_to_token.dtype)
        offset += end - start


def assign_draft_cache_locs_contiguous(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    topk: int,
    num_cols: int,
    positions: torch.Tensor | None = None,
    mrope: torch.Tensor | None = None,
) -> None:
    """``cache_locs.assign_draft_cache_locs_contiguous_func``: request ``i``'s ``topk * num_cols`` slots from its
    length on, into ``out_cache_loc``; its ``topk`` draft positions (its length) into ``positions`` (and each
    of the three ``mrope`` axes)."""
    width = topk * num_cols
    rows, lengths = req_pool_indices.tolist(), seq_lens.tolist()
    for i, (row, length) in enumerate(zip(rows, lengths, strict=True)):
        out_cache_loc[i * width : (i + 1) * width] = req_to_token[row, length : length + width]
        if positions is not None:
            positions[i * topk : (i + 1) * topk] = length
        if mrope is not None:
            mrope[:, i * topk : (i + 1) * topk] = length


def assign_extend_cache_locs(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    batch_size: int,
    draft_token_num: int,
    device,
) -> torch.Tensor:
    """``cache_locs.assign_extend_cache_locs_func`` (an out-of-tree platform's ``get_speculative_cache_locs_fn``):
    the slots of request ``i``'s positions ``start .. end - 1``, requests in order."""
    rows, starts, ends = (t[:batch_size].tolist() for t in (req_pool_indices, start_offset, end_offset))
    slots = [req_to_token[row, start:end] for row, start, end in zip(rows, starts, ends, strict=True)]
    return torch.cat(slots).to(device=device, dtype=torch.int64) if slots else torch.empty(0, dtype=torch.int64)


def fill_bonus_tokens(
    accept_tokens: torch.Tensor,
    accept_lens: torch.Tensor,
    bonus_tokens: torch.Tensor,
    accept_stride: int,
    batch_size: int,
) -> None:
    """``eagle.fill_bonus_tokens_func``: request ``i``'s last accepted token (its ``accept_lens[i]``-th)."""
    index = torch.arange(batch_size, device=accept_lens.device) * accept_stride + accept_lens[:batch_size] - 1
    bonus_tokens[:batch_size] = accept_tokens.reshape(-1)[index.long()].to(bonus_tokens.dtype)


def fill_accept_out_cache_loc(
    accept_index: torch.Tensor, out_cache_loc: torch.Tensor, accept_out_cache_loc: torch.Tensor, size: int
) -> None:
    """``eagle.fill_accept_out_cache_loc_func``: the slots of the accepted tokens (``accept_index`` not -1), in
    order."""
    accepted = accept_index[:size]
    accepted = accepted[accepted > -1].long()
    accept_out_cache_loc[: accepted.numel()] = out_cache_loc[accepted]


def build_tree(
    parent_list: torch.Tensor,
    top_scores_index: torch.Tensor,
    seq_lens: torch.Tensor,
    tree_mask: torch.Tensor,
    positions: torch.Tensor,
    retrieve_index: torch.Tensor,
    retrieve_next_token: torch.Tensor,
    retrieve_next_sibling: torch.Tensor,
    topk: int,
    spec_steps: int,
    num_verify_tokens: int,
    tree_mask_mode,
) -> None:
    """``spec_tree.build_tree_kernel_efficient_func`` (its Triton kernel, one request at a time): each draft
    token's position (its length plus its depth), its parent's ``retrieve_next_token`` and its siblings'
    ``retrieve_next_sibling`` links, and the mask of the tokens each draft token sees (its ancestors)."""
    count = num_verify_tokens
    lengths = seq_lens.tolist()
    selected = top_scores_index.tolist()
    parents = parent_list.tolist() if parent_list.numel() else [[] for _ in lengths]
    full = int(tree_mask_mode) == FULL_MASK
    mask_start = 0
    for b, length in enumerate(lengths):
        chosen, parent_of = selected[b], parents[b]
        base = b * count
        positions[base] = length
        next_token, next_sibling = [-1] * count, [-1] * count
        for token in range(count - 1, 0, -1):
            retrieve_index[b, token] = base + token
            parent = _parent_row(token, chosen, parent_of, topk)
            if parent is not None:
                if next_token[parent] != -1:
                    next_sibling[token] = next_token[parent]
                next_token[parent] = token
        retrieve_index[b, 0] = base
        retrieve_next_token[b] = torch.tensor(next_token, dtype=retrieve_next_token.dtype)
        retrieve_next_sibling[b] = torch.tensor(next_sibling, dtype=retrieve_next_sibling.dtype)
        row_width = length + count if full else count
        block = mask_start if full else b * count * count
        for token in range(count):
            row = block + row_width * token + (length if full else 0)
            tree_mask[row : row + count] = False
            tree_mask[row] = True
            depth, ancestor = 0, token
            while ancestor > 0:
                tree_mask[row + ancestor] = True
                depth += 1
                ancestor = _parent_row(ancestor, chosen, parent_of, topk)
                if ancestor is None:
                    break
            if token > 0:
                positions[base + token] = length + depth
        mask_start += row_width * count


def _parent_row(token: int, chosen: list[int], parent_of: list[int], topk: int) -> int | None:
    """The tree row of draft row ``token``'s parent (0: the request's own token), or None if it is not drafted."""
    parent = chosen[token - 1] // topk
    if parent == 0:
        return 0
    found = [p for p in range(len(chosen)) if chosen[p] == parent_of[parent]]
    return found[0] + 1 if found else None


def verify_tree_greedy(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrieve_index: torch.Tensor,
    retrieve_next_token: torch.Tensor,
    retrieve_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
    topk: int = -1,
):
    """``spec_tree.verify_tree_greedy_func``: walk each request's tree from its own token, accepting the child
    whose draft equals the target's greedy pick after the last accepted token; ``predicts`` gets the target's
    picks along the accepted path (and after its end), ``accept_index`` the path's rows, ``accept_token_num``
    the accepted drafts."""
    steps = accept_index.shape[1]
    flat_targets = target_predict.reshape(-1).tolist()
    for b in range(candidates.shape[0]):
        drafts, rows = candidates[b].tolist(), retrieve_index[b].tolist()
        next_token, next_sibling = retrieve_next_token[b].tolist(), retrieve_next_sibling[b].tolist()
        last = rows[0]
        accept_index[b, 0] = last
        accepted, current = 0, 0
        for _ in range(1, steps):
            current = next_token[current]
            target = flat_targets[last]
            while current != -1 and drafts[current] != target:
                current = next_sibling[current]
            if current == -1:
                break
            predicts[last] = target
            accepted += 1
            accept_index[b, accepted] = rows[current]
            last = rows[current]
        accept_token_num[b] = accepted
        predicts[last] = flat_targets[last]
    return predicts, accept_index, accept_token_num


def tree_speculative_sampling_target_only(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    uniform_samples: torch.Tensor,
    uniform_samples_for_final_sampling: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    deterministic: bool = True,
) -> None:
    """``verify_sampling.tree_speculative_sampling_target_only`` (SGLang's CUDA kernel): speculative sampling
    with the target's probabilities only. Walking each request's tree from its own token, the children of the
    last accepted row ``a`` are tried in sibling order with the coin ``u_a`` of that row: child ``c`` is accepted
    when ``q_a(c) > 0`` and ``u_a < (q_a(c_1) + ... + q_a(c)) / threshold_acc`` (or ``q_a(c) >= threshold_single``);
    a rejected child's ``q_a`` is copied into ``draft_probs``. The token after the accepted path is sampled,
    with the final coin, from ``relu(q_a - draft_probs_a)`` (the target's distribution without the rejected
    children; all of ``q_a`` after a path of full depth): the first token whose running sum passes
    ``coin * sum``. With thresholds 1 and a chain, draft ``d`` is kept with probability ``q(d)`` and otherwise
    ``q`` is sampled without ``d``, so every token is distributed as ``q``. ``deterministic`` is the kernel's
    reduction order; this version has one."""
    steps = accept_index.shape[1]
    threshold_acc = max(threshold_acc, 1e-9)
    final_coins = uniform_samples_for_final_sampling.tolist()
    for b in range(candidates.shape[0]):
        drafts, rows = candidates[b].tolist(), retrive_index[b].tolist()
        next_token, next_sibling = retrive_next_token[b].tolist(), retrive_next_sibling[b].tolist()
        coins = uniform_samples[b].tolist()
        accept_index[b, 0] = rows[0]
        last, decided_at, accepted, current = rows[0], 0, 0, 0
        for _ in range(1, steps):
            current = next_token[current]
            mass = 0.0
            while current != -1:
                target = float(target_probs[b, decided_at, drafts[current]])
                mass += target
                if target > 0 and (coins[decided_at] < mass / threshold_acc or target >= threshold_single):
                    break
                draft_probs[b, decided_at, drafts[current]] = target_probs[b, decided_at, drafts[current]]
                current = next_sibling[current]
            if current == -1:
                break
            predicts[last] = drafts[current]
            accepted += 1
            accept_index[b, accepted] = rows[current]
            last, decided_at = rows[current], current
        accept_token_num[b] = accepted
        residual = target_probs[b, decided_at]
        if accepted != steps - 1:
            residual = (residual - draft_probs[b, decided_at]).clamp(min=0)
        predicts[last] = _sample_by_coin(residual, final_coins[b])


def _sample_by_coin(weights: torch.Tensor, coin: float) -> int:
    """The first token with positive weight whose running sum exceeds ``coin`` times the total (the last such
    token where rounding leaves none, the last token if none has weight): inverse-CDF sampling as FlashInfer's
    ``DeviceSamplingFromProb``."""
    running = torch.cumsum(weights, dim=0)
    positive = weights > 0
    passed = torch.nonzero(positive & (running > coin * float(running[-1]))).flatten()
    if passed.numel():
        return int(passed[0])
    valid = torch.nonzero(positive).flatten()
    return int(valid[-1]) if valid.numel() else weights.numel() - 1


def top_k_renorm_prob(probs: torch.Tensor, top_ks: torch.Tensor) -> torch.Tensor:
    """``renorm.top_k_renorm_prob``: each row's ``top_k`` most probable tokens (by rank, as SGLang's torch
    sampler cuts them), renormalized to sum 1."""
    order = probs.argsort(dim=-1, descending=True, stable=True)
    positions = torch.arange(probs.shape[-1], device=probs.device).expand_as(order)
    ranks = torch.empty_like(order).scatter_(-1, order, positions)
    kept = probs * (ranks < top_ks.view(-1, 1))
    return kept / kept.sum(dim=-1, keepdim=True)


def top_p_renorm_prob(probs: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """``renorm.top_p_renorm_prob``: each row's most probable tokens up to and including the one whose running
    sum first reaches ``top_p`` (a token is cut when the mass before it already exceeds ``top_p``, as SGLang's
    torch sampler cuts), renormalized to sum 1."""
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    sorted_probs = sorted_probs * (mass_before <= top_ps.view(-1, 1))
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return kept / kept.sum(dim=-1, keepdim=True)
