"""Speculative decoding served: SGLang's EAGLE worker (``--speculative-algorithm EAGLE``, or its alias ``NEXTN``)
with V4's MTP layer as the draft model, a chain of drafts (``--speculative-eagle-topk 1``).

What SGLang needs from this package, and where it gets it:

* the launcher: :func:`check_speculation` (from the V4 model override) refuses what this package does not
  serve, naming it; the CPU platform allows EAGLE, and :func:`_eagle_for_v4_only` keeps it to V4 checkpoints;
* the draft model, ``DeepseekV4ForCausalLMNextN`` (:mod:`.model.sglang_draft`), whose pool is a second view of
  the target's (``plugin._build_v4_kv_pool``): its MTP layer's rows sit in the target's pool as its last layer;
* the draft worker's backends (:func:`_draft_decode_backend`, :func:`_draft_extend_backend`): SGLang's
  factory knows only its own;
* the verify's rows: SGLang reserves token slots for it without asking the request pool's auxiliary cache,
  so :func:`_reserve_for_verify` has the cache manager reserve the request tables up to the verify's end;
* the rollback after a verify: SGLang calls the KV pool's ``clear_unaccepted_c128_draft_states``
  (:meth:`sglang_dsv4.kv_cache.V4KVPool.clear_unaccepted_c128_draft_states`);
* the verify's sampling (temperature > 0): SGLang's target-only chain rule, whose kernels it resolves to None on
  a platform it does not know (:func:`_sample_with_torch_kernels`).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from .config import ConfigError
from .platform import on_torch_cpu_platform
from .served_config import is_v4_checkpoint, served_config

ALGORITHMS = ("EAGLE", "NEXTN")
# The launch flags of a served chain of three drafts, as docs/serving.md gives them (the tests and benchmarks use them).
SPECULATION = (
    "--speculative-algorithm", "EAGLE",
    "--speculative-num-steps", "3",
    "--speculative-eagle-topk", "1",
    "--speculative-num-draft-tokens", "4",
)  # fmt: skip
_EAGLE_FAMILY = "sglang.srt.arg_groups.speculative_hook._handle_eagle_family"
_VERIFY_RESERVATION = "sglang.srt.mem_cache.allocation.alloc_for_spec_decode"
_DRAFT_DECODE_BACKEND = "sglang.srt.speculative.draft_utils.DraftBackendFactory.create_decode_backend"
_DRAFT_EXTEND_BACKEND = "sglang.srt.speculative.draft_utils.DraftBackendFactory.create_draft_extend_backend"
# SGLang's EAGLE kernels (Triton, or its own CPU engine's ops) and their torch twins (kernels/speculative.py).
_KERNELS = {
    "sglang.srt.mem_cache.allocation.assign_req_to_token_pool_func": "assign_req_to_token_pool",
    "sglang.kernels.ops.speculative.cache_locs.assign_draft_cache_locs_contiguous_func": (
        "assign_draft_cache_locs_contiguous"
    ),
    "sglang.kernels.ops.speculative.spec_tree.build_tree_kernel_efficient_func": "build_tree",
    "sglang.kernels.ops.speculative.spec_tree.verify_tree_greedy_func": "verify_tree_greedy",
    "sglang.kernels.ops.speculative.eagle.fill_bonus_tokens_func": "fill_bonus_tokens",
    "sglang.kernels.ops.speculative.eagle.fill_accept_out_cache_loc_func": "fill_accept_out_cache_loc",
}
# Sampling kernels SGLang's verify module imports by name, resolved once per platform: None on ours.
_VERIFY_SAMPLE = "sglang.srt.speculative.eagle_utils.eagle_sample"
_SAMPLING_KERNELS = ("tree_speculative_sampling_target_only", "top_k_renorm_prob", "top_p_renorm_prob")
SPECULATION_HOOKS = (
    _EAGLE_FAMILY,
    _VERIFY_RESERVATION,
    _DRAFT_DECODE_BACKEND,
    _DRAFT_EXTEND_BACKEND,
    _VERIFY_SAMPLE,
    *_KERNELS,
)


def register_speculation_hooks() -> None:
    HookRegistry.register(_EAGLE_FAMILY, _eagle_for_v4_only, HookType.AROUND)
    HookRegistry.register(_VERIFY_RESERVATION, _reserve_for_verify, HookType.AROUND)
    HookRegistry.register(_DRAFT_DECODE_BACKEND, _draft_decode_backend, HookType.AROUND)
    HookRegistry.register(_DRAFT_EXTEND_BACKEND, _draft_extend_backend, HookType.AROUND)
    HookRegistry.register(_VERIFY_SAMPLE, _sample_with_torch_kernels, HookType.AROUND)
    for target, name in _KERNELS.items():
        HookRegistry.register(target, _on_this_platform(name), HookType.AROUND)


def _on_this_platform(name: str):
    """An AROUND hook that runs the torch twin ``name`` on the CPU platform, SGLang's kernel elsewhere."""
    from .kernels import speculative

    twin = getattr(speculative, name)

    def choose(original, *args, **kwargs):
        return (twin if on_torch_cpu_platform() else original)(*args, **kwargs)

    return choose


def _sample_with_torch_kernels(original, *args, **kwargs):
    """SGLang's verify (``eagle_sample``); on the CPU platform its sampling kernels, which SGLang imported as None
    there, bound to their torch twins first. A name set to None cannot be hooked (the hook registry would patch
    every None it finds), so the twins are bound in the one module that calls them, where it holds None."""
    if on_torch_cpu_platform():
        from .kernels import speculative

        caller = sys.modules[original.__module__]
        for name in _SAMPLING_KERNELS:
            if getattr(caller, name) is None:
                setattr(caller, name, getattr(speculative, name))
    return original(*args, **kwargs)


def verify_tokens() -> int:
    """Tokens per request of this server's verify forwards: ``--speculative-num-draft-tokens``, 0 without
    speculation (in a process SGLang's runtime context is set up in)."""
    from sglang.srt.runtime_context import get_spec

    spec = get_spec()
    return int(spec.speculative_num_draft_tokens) if spec.speculative_algorithm else 0


def check_speculation(view: Any, hf_config: Any) -> None:
    """Refuse, naming what is missing, a speculative configuration this package does not serve for a V4
    checkpoint: an algorithm other than EAGLE (NEXTN), a draft tree (topk > 1), a verify width other than
    the chain's, a separate draft model, a checkpoint without an MTP layer, draft steps after the first of a
    compressed MTP layer on a platform that captures decode graphs, or attention DP (not served yet: --tp alone
    is).

    Where decode graphs are captured SGLang captures the target's verify batches (the batched backend's graph
    hooks index them) and the draft steps after the first (the draft backend runs them on scratch rows of a
    window-only MTP layer, as the releases have it: :class:`~.attention_backend.batched.DraftChain`); it captures
    no draft-extend graph for this package's backend."""
    algorithm = view.speculative_algorithm
    if algorithm is None:
        return
    if algorithm not in ALGORITHMS:
        raise ConfigError(
            f"--speculative-algorithm {algorithm}: DeepSeek-V4 drafts with its MTP layer; use EAGLE (or NEXTN)"
        )
    if view.speculative_eagle_topk not in (None, 1):
        raise ConfigError(
            f"--speculative-eagle-topk {view.speculative_eagle_topk}: DeepSeek-V4's MTP layer drafts a chain; use 1"
        )
    steps, drafts = view.speculative_num_steps, view.speculative_num_draft_tokens
    if steps is not None and drafts is not None and drafts != steps + 1:
        raise ConfigError(
            f"--speculative-num-draft-tokens {drafts}: a chain of --speculative-num-steps {steps} drafts is verified "
            f"as {steps + 1} tokens"
        )
    if view.attn_dp_size != 1:
        raise ConfigError(
            f"--speculative-algorithm {algorithm}: not served under attention DP yet (got attention DP "
            f"{view.attn_dp_size}); --tp without --attn-dp-size serves it"
        )
    model_path = str(getattr(hf_config, "_name_or_path", ""))
    if view.speculative_draft_model_path not in (None, model_path):
        raise ConfigError(
            f"--speculative-draft-model-path {view.speculative_draft_model_path}: DeepSeek-V4 drafts with the MTP "
            "layer of its own checkpoint; leave it unset"
        )
    config = served_config(hf_config)
    if config.num_mtp_layers != 1 or not _holds_mtp_tensors(model_path, hf_config):
        raise ConfigError(
            f"--speculative-algorithm {algorithm}: the checkpoint has no MTP layer to draft with "
            "(num_nextn_predict_layers: 1 and mtp.* tensors)"
        )
    mtp_kind = config.layer_kind(config.num_layers)
    if captures_decode_graphs(view) and steps != 1 and mtp_kind != "window":
        raise ConfigError(
            f"--speculative-num-steps {steps if steps is not None else '(unset)'}: SGLang would capture the draft "
            "steps after the first in CUDA graphs, which run a window-only MTP layer's draft steps, not this "
            f"checkpoint's {mtp_kind} one; use --speculative-num-steps 1 --speculative-num-draft-tokens 2, or add "
            "--disable-cuda-graph"
        )


def captures_decode_graphs(view: Any) -> bool:
    """Whether SGLang will capture decode graphs: the platform can (CUDA can; the CPU platform cannot) and the
    resolved ``--cuda-graph-backend-decode`` is not ``disabled`` (``--disable-cuda-graph`` sets it so)."""
    from sglang.srt.platforms import current_platform

    return current_platform.capabilities.graph_capture and view.cuda_graph_config.decode.backend != "disabled"


def _holds_mtp_tensors(model_path: str, hf_config: Any) -> bool:
    """Whether a local checkpoint folder holds ``mtp.*`` tensors (its headers read; a hub name is taken at its
    config's word)."""
    from .model.checkpoint_check import check_checkpoint

    folder = Path(model_path)
    if not (folder / "config.json").is_file():
        return True
    return check_checkpoint(folder, served_config(hf_config)).num_mtp_layers == 1


def _eagle_for_v4_only(original, server_args: Any) -> None:
    """On the CPU platform (which allows EAGLE) only V4 checkpoints draft: their MTP layer runs on torch ops."""
    from sglang.srt.arg_groups.model_override_base import model_config_of

    if on_torch_cpu_platform() and not is_v4_checkpoint(model_config_of(server_args).hf_config):
        raise ValueError(
            "EAGLE speculative decoding on the sglang-dsv4 CPU platform drafts only for DeepSeek-V4 checkpoints "
            "(with their MTP layer)"
        )
    original(server_args)


def _reserve_for_verify(original, tree_cache, req_to_token_pool, *, batch=None, **kwargs) -> None:
    """SGLang's token slots for a draft-and-verify step, then the request tables' rows for the verify's
    tokens (its ``verify_tokens`` from each request's length), which SGLang does not ask for."""
    original(tree_cache, req_to_token_pool, batch=batch, **kwargs)
    tokens = verify_tokens()
    if batch is None or not tokens or batch.forward_mode.is_idle():
        return
    req_to_token_pool.alloc_aux_to_lengths(
        req_pool_indices_cpu=batch.req_pool_indices.cpu(), target_seq_lens_cpu=batch.seq_lens_cpu + tokens
    )


def _draft_decode_backend(original, factory):
    """The draft steps' backend for a V4 draft (:class:`~.attention_backend.draft_decode.DraftDecodeBackend`)."""
    from .attention_backend.draft_decode import DraftDecodeBackend
    from .kv_cache import V4KVPool

    runner = factory.draft_model_runner
    if not isinstance(runner.token_to_kv_pool, V4KVPool):
        return original(factory)
    if factory.speculative_num_steps <= 1:
        return None
    return DraftDecodeBackend(runner, factory.speculative_num_steps)


def _draft_extend_backend(original, factory):
    """The draft extend's backend for a V4 draft: the draft runner's own (one of this package's)."""
    from .kv_cache import V4KVPool

    runner = factory.draft_model_runner
    if not isinstance(runner.token_to_kv_pool, V4KVPool):
        return original(factory)
    return type(runner.attn_backend)(runner)
