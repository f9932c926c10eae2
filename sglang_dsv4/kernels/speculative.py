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
