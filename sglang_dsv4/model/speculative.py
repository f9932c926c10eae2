"""Greedy decoding with the MTP layer drafting and the target verifying, one request, no server.

Each step, at target position ``P`` (the target has read tokens ``0 .. P-1``; token ``P`` is its greedy
pick, not yet read):

* draft: the MTP layer, on a copy of its state, reads the target's streams of token ``P-1`` with token
  ``P`` and drafts ``d_1``; each further draft reads the MTP's own streams with the previous draft
  (EAGLE's chain, top-1), ``k`` drafts in all;
* verify: the target reads ``[P, d_1 .. d_k]`` in one forward; drafts are accepted while each equals the
  target's greedy pick before it, and the target's pick after the last accepted one is the bonus token;
* roll back: if a draft was rejected, the target's state is restored to its snapshot before the verify
  and the accepted tokens are read again (the window, the compressors' partial blocks and the completed
  blocks of the rejected drafts go with the snapshot);
* the MTP layer reads the target's streams of the accepted tokens, each with its next token.

The tokens equal plain greedy decoding's (:func:`greedy_decode`); each verify yields ``accepted + 1``
tokens, whose mean is the mean accepted length. Both continue from a copy of a prompt read once
(:func:`read_prompt`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .network import DeepseekV4
from .state import RequestState


@dataclass(frozen=True)
class ReadPrompt:
    """A prompt the target has read: its state after it (its MTP layer's, if it has one, after every token but the
    last, whose next token is ``first_token``), and its streams and greedy pick at the last token."""

    state: RequestState
    last_streams: torch.Tensor
    first_token: int


@torch.inference_mode()
def read_prompt(model: DeepseekV4, prompt: torch.Tensor) -> ReadPrompt:
    """The target reads ``prompt``; then its MTP layer, if any, reads each token's streams with the next token."""
    if prompt.numel() < 2:
        raise ValueError("the prompt needs at least 2 tokens (the MTP layer reads a token's streams with the next)")
    state = model.new_state()
    streams = model.streams(prompt, state)
    if state.mtp is not None:
        model.draft(streams[:-1], prompt[1:], state.mtp)
    return ReadPrompt(state, streams[-1:], int(model.head_logits(streams[-1:])[0].argmax()))


@dataclass(frozen=True)
class SpeculativeDecode:
    tokens: list[int]
    # Drafts accepted at each verify step (0 .. k).
    accepted: list[int]

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verify step: accepted drafts plus the target's own token."""
        return 1 + sum(self.accepted) / len(self.accepted)


@torch.inference_mode()
def greedy_decode(model: DeepseekV4, prompt: ReadPrompt, max_new_tokens: int) -> list[int]:
    """The target's greedy continuation of ``prompt``, one token per forward."""
    state = prompt.state.snapshot()
    tokens = [prompt.first_token]
    while len(tokens) < max_new_tokens:
        tokens.append(int(model(torch.tensor(tokens[-1:]), state)[-1].argmax()))
    return tokens


@torch.inference_mode()
def speculative_decode(model: DeepseekV4, prompt: ReadPrompt, max_new_tokens: int, drafts: int) -> SpeculativeDecode:
    """:func:`greedy_decode`'s tokens, drafted ``drafts`` at a time by the MTP layer and verified by the target."""
    if prompt.state.mtp is None:
        raise ValueError("this model has no MTP layer to draft with (num_nextn_predict_layers: 0, or no mtp.* tensors)")
    state, last_streams, token = prompt.state.snapshot(), prompt.last_streams, prompt.first_token
    tokens, accepted = [token], []
    while len(tokens) < max_new_tokens:
        drafted = _draft(model, last_streams, token, state, drafts)
        before = state.snapshot()
        read = torch.tensor([token, *drafted])
        verified = model.streams(read, state)
        picks = model.head_logits(verified).argmax(-1).tolist()
        count = 0
        while count < drafts and drafted[count] == picks[count]:
            count += 1
        if count < drafts:
            state = before
            read = read[: count + 1]
            verified = model.streams(read, state)
        model.draft(torch.cat([last_streams, verified[:-1]]), read, state.mtp)
        last_streams, token = verified[-1:], picks[count]
        tokens += [*drafted[:count], token]
        accepted.append(count)
    return SpeculativeDecode(tokens[:max_new_tokens], accepted)


def _draft(model: DeepseekV4, last_streams: torch.Tensor, token: int, state: RequestState, drafts: int) -> list[int]:
    """``drafts`` tokens after ``token`` from the MTP layer, chained on its own streams, on a copy of its state."""
    mtp_state = state.mtp.snapshot()
    streams, drafted = last_streams, [token]
    for _ in range(drafts):
        logits, streams = model.draft(streams, torch.tensor(drafted[-1:]), mtp_state)
        drafted.append(int(logits[-1].argmax()))
    return drafted[1:]
