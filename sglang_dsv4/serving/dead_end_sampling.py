"""A request whose constraints leave no token to sample fails alone, as it does when greedy.

When a grammar (``regex``, ``json_schema``, ``ebnf``) has nothing left to accept but
``min_tokens`` still masks EOS, every logit of the request's row is -inf. Greedy, SGLang
takes the row's argmax (token 0), the grammar refuses it, and SGLang fails that request
alone (HTTP 500, "Grammar accept_token failed"). Sampled, the row's probabilities are NaN
and ``torch.multinomial`` raises for the whole batch, failing every request in it
(:mod:`.containment`). Here a row with no finite probability samples token 0 as well, so
the request meets the same refusal and its neighbours are untouched.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from sglang.srt.plugins.hook_registry import HookRegistry, HookType

_TORCH_SAMPLING = "sglang.srt.layers.sampler.top_k_top_p_min_p_sampling_from_probs_torch"
DEAD_END_HOOKS = (_TORCH_SAMPLING,)


def register_dead_end_hooks() -> None:
    HookRegistry.register(_TORCH_SAMPLING, _dead_rows_take_token_zero, HookType.AROUND)


def _dead_rows_take_token_zero(original: Callable, probs: torch.Tensor, *args, **kwargs):
    """SGLang's torch top-k / top-p / min-p sampling, rows without a finite probability made one-hot at token 0."""
    dead = ~torch.isfinite(probs).all(dim=-1, keepdim=True)
    token_zero = torch.zeros_like(probs[:1])
    token_zero[0, 0] = 1
    return original(torch.where(dead, token_zero, probs), *args, **kwargs)
