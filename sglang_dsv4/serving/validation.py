"""Refuse, with an HTTP 400 that names the field and the limit, requests that would fail inside the scheduler.

Upstream SGLang 0.5.23 already answers 400 to bad sampling parameters (temperature, top_p,
min_p, penalties, logit_bias keys, max_new_tokens, min_new_tokens, seeds), to empty
``input_ids``, to prompts over the context, to ``token_ids_logprob`` ids outside the
vocabulary and to a ``logprob_start_len`` beyond the prompt; those answers are kept. What it
lets through, and what each did to a server on this machine before these checks:

- token ids below 0 or at/above the vocabulary: ``IndexError`` in the embedding, server gone;
- a prompt that tokenizes to nothing (``"text": ""``): the forward of an empty extend raises,
  server gone;
- ``top_logprobs_num`` (OpenAI: completions ``logprobs``, chat ``top_logprobs``) above the
  vocabulary: ``topk`` raises in sampling, server gone; negative values were silently taken;
- ``top_k`` beyond int32: the sampling tensors overflow while the batch is built, server gone;
- ``n`` unbounded: one request fans out into that many sequences before anything is checked
  (n=1000 tied the tiny server up for minutes; n=10**9 would exhaust the HTTP process's memory);
  ``n`` below 1 was silently taken as 1 on ``/generate``;
- ``logprob_start_len`` below -1: silently taken;
- ``repetition_penalty`` a tiny positive number (upstream takes ``(0, 2]``) or a ``logit_bias`` value beyond
  float32: the sampler's float32 logits become infinite or NaN, and the batch's sampling raises (every request
  in the batch failed) or returns token 0;
- ``sampling_params: []``: an ``IndexError`` while the request is normalized, answered as a 500;
- input embeddings on DeepSeek-V4, whose first MoE layers route by token id (hash routing).

The bounds are this module's constants, documented in docs/serving.md.
"""

from __future__ import annotations

from typing import Any

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

# The most top log-probabilities one position may ask for: OpenAI's own bound for chat
# ``top_logprobs``, also applied to completions ``logprobs`` and ``/generate``'s ``top_logprobs_num``.
MAX_TOP_LOGPROBS = 20
# The most sequences one request may ask for (``n``): each is a full request inside the scheduler.
MAX_SAMPLES_PER_REQUEST = 16
# Sampling parameters travel to the sampler as int32 tensors.
INT32_MAX = 2**31 - 1
# The sampler divides float32 logits by the repetition penalty: from this floor up, logits below 3e32 stay
# finite (a repeated token's logit is already multiplied by a million; a smaller penalty decides nothing more).
MIN_REPETITION_PENALTY = 1e-6
# OpenAI's range for a logit_bias value (-100 or 100 already bans or forces a token).
MAX_LOGIT_BIAS = 100

V4_ARCHITECTURE = "DeepseekV4ForCausalLM"

_SAMPLE_COUNT = "sglang.srt.managers.io_struct.GenerateReqInput.normalize_batch_and_arguments"
_TOKENIZATION = "sglang.srt.managers.tokenizer_manager.TokenizerManager._tokenize_one_request"
_ONE_REQUEST = "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"
_OPENAI_COMPLETION = "sglang.srt.entrypoints.openai.serving_completions.OpenAIServingCompletion._validate_request"
_OPENAI_CHAT = "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat._validate_request"
VALIDATION_HOOKS = (_SAMPLE_COUNT, _TOKENIZATION, _ONE_REQUEST, _OPENAI_COMPLETION, _OPENAI_CHAT)


def register_validation_hooks() -> None:
    """Install the checks; each runs before SGLang's own check at the same place."""
    HookRegistry.register(_SAMPLE_COUNT, _refuse_bad_fan_out, HookType.BEFORE)
    HookRegistry.register(_TOKENIZATION, _refuse_input_embeds_on_v4, HookType.BEFORE)
    HookRegistry.register(_ONE_REQUEST, _refuse_what_the_scheduler_cannot_run, HookType.BEFORE)
    HookRegistry.register(_OPENAI_COMPLETION, _check_openai_completion, HookType.AFTER)
    HookRegistry.register(_OPENAI_CHAT, _check_openai_chat, HookType.AFTER)


def sample_count_error(field: str, n: Any) -> str | None:
    """Why ``n`` (named ``field`` in the caller's API) is refused, or None."""
    if isinstance(n, int) and not 1 <= n <= MAX_SAMPLES_PER_REQUEST:
        return f"{field} must be in [1, {MAX_SAMPLES_PER_REQUEST}] (completions per request); got {n}"
    return None


def top_logprobs_error(field: str, count: Any) -> str | None:
    """Why ``count`` top log-probabilities per position (named ``field``) are refused, or None."""
    if isinstance(count, int) and not 0 <= count <= MAX_TOP_LOGPROBS:
        return f"{field} must be in [0, {MAX_TOP_LOGPROBS}] (top log-probabilities per position); got {count}"
    return None


def _refuse_bad_fan_out(request) -> None:
    """Before SGLang copies the request ``n`` times (its first step on ``/generate``)."""
    sampling_params = request.sampling_params
    if sampling_params == []:
        # SGLang reads the first entry for ``n``: an IndexError, answered as a 500.
        raise ValueError("sampling_params must be an object, or a list with one object per prompt; got []")
    for params in sampling_params if isinstance(sampling_params, list) else [sampling_params]:
        if isinstance(params, dict) and (error := sample_count_error("sampling_params.n", params.get("n", 1))):
            raise ValueError(error)


def _refuse_input_embeds_on_v4(manager, request) -> None:
    """Before upstream's own input-embeds checks, whose advice (turn the radix cache off) does not apply to V4."""
    if error := _input_embeds_error(manager, request):
        raise ValueError(error)


def _refuse_what_the_scheduler_cannot_run(manager, request, input_ids) -> None:
    """One (sub-)request after tokenization, before it is sent to the scheduler."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    checks = [_prompt_error(manager, request, input_ids), _input_embeds_error(manager, request)]
    if isinstance(request, GenerateReqInput):
        checks += [
            top_logprobs_error("top_logprobs_num", request.top_logprobs_num),
            _logprob_start_error(request.logprob_start_len),
            _top_k_error(request.sampling_params.get("top_k")),
            _repetition_penalty_error(request.sampling_params.get("repetition_penalty")),
            _logit_bias_error(request.sampling_params.get("logit_bias")),
        ]
    if error := _first_error(*checks):
        raise ValueError(error)


def _prompt_error(manager, request, input_ids: list[int] | None) -> str | None:
    if input_ids is None:
        return None
    if not input_ids:
        # With a session, the scheduler prepends the session's history and checks the result itself.
        session = request.session_params if isinstance(request.session_params, dict) else {}
        if not session.get("id"):
            return "the prompt is empty (0 tokens after tokenization): send at least one token"
        return None
    vocab = manager.model_config.vocab_size
    low, high = min(input_ids), max(input_ids)
    if low < 0 or high >= vocab:
        return f"input_ids must be in [0, {vocab}) (the vocabulary size); got min {low}, max {high}"
    return None


def _input_embeds_error(manager, request) -> str | None:
    architectures = manager.model_config.hf_config.architectures or []
    if V4_ARCHITECTURE in architectures and getattr(request, "input_embeds", None) is not None:
        return (
            "DeepSeek-V4 routes its first MoE layers by token id (hash routing), so it needs token ids: "
            "send input_ids or text instead of input_embeds"
        )
    return None


def _logprob_start_error(start: Any) -> str | None:
    # Upstream refuses a start beyond the prompt itself (in the scheduler, still as a 400).
    if isinstance(start, int) and start < -1:
        return f"logprob_start_len must be -1 (log-probabilities of the output only) or >= 0; got {start}"
    return None


def _top_k_error(top_k: Any) -> str | None:
    # Upstream refuses 0 and values below -1; values above the vocabulary mean "no limit" and are fine.
    if isinstance(top_k, int) and top_k > INT32_MAX:
        return f"top_k must be -1 (no limit) or in [1, {INT32_MAX}]; got {top_k}"
    return None


def _repetition_penalty_error(penalty: Any) -> str | None:
    # Upstream refuses values outside (0, 2]; this raises the floor.
    if _is_number(penalty) and penalty < MIN_REPETITION_PENALTY:
        return f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, 2] (1 = no penalty); got {penalty}"
    return None


def _logit_bias_error(bias: Any) -> str | None:
    # Upstream checks the keys (token ids); the values reach the float32 logits unchecked.
    if not isinstance(bias, dict):
        return None
    for token, value in bias.items():
        if _is_number(value) and not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            return f"logit_bias values must be in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}]; got {value} for token {token}"
    return None


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_openai_completion(upstream_error: str | None, serving, request) -> str | None:
    """OpenAI ``/v1/completions``: the same bounds, under the OpenAI names (an AFTER hook; None keeps upstream's)."""
    if upstream_error:
        return None
    return _first_error(
        sample_count_error("n", request.n),
        top_logprobs_error("logprobs", request.logprobs),
        _top_k_error(getattr(request, "top_k", None)),
        _repetition_penalty_error(request.repetition_penalty),
        _logit_bias_error(request.logit_bias),
    )


def _check_openai_chat(upstream_error: str | None, serving, request) -> str | None:
    """OpenAI ``/v1/chat/completions``: the same bounds, under the OpenAI names."""
    if upstream_error:
        return None
    return _first_error(
        sample_count_error("n", request.n),
        top_logprobs_error("top_logprobs", request.top_logprobs),
        _top_k_error(getattr(request, "top_k", None)),
        _repetition_penalty_error(request.repetition_penalty),
        _logit_bias_error(request.logit_bias),
    )


def _first_error(*errors: str | None) -> str | None:
    return next((error for error in errors if error), None)
