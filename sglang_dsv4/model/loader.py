"""Load V4 safetensors checkpoints in any of the layouts a user may hold.

* release names (DeepSeek's own: ``embed.weight``, ``layers.0.attn.wq_a.weight``,
  ``layers.0.ffn.experts.3.w1.weight``, ``hc_head_fn``, ...), FP8 weights with
  ``*.scale`` block scales and FP4 routed experts;
* Hugging Face module names (``model.embed_tokens.weight``,
  ``model.layers.0.self_attn.q_a_proj.weight``, ``model.layers.0.mlp.experts.gate_up_proj``);
* what transformers' default ``save_pretrained`` writes: release names under ``model.``
  with a few module names mixed in.

Every name is first rewritten to the release spelling (:func:`release_name`), then
to this package's parameter names (experts stacked, ``hc_attn_fn`` -> ``hc_attn.fn``).
Missing or unexpected tensors raise :class:`CheckpointError` listing them. The multi-token-prediction
layer's tensors (``mtp.0.*``) load into the model's MTP layer; a model without one (its config says
``num_nextn_predict_layers: 0``, or it is the served model, which drafts nothing yet) skips them, and
``mtp.0.emb`` / ``mtp.0.head``, where a checkpoint holds them, are the target's own and skipped too.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from safetensors import safe_open
from torch import nn

from .block_formats import FP4_BLOCK, FP8_BLOCK, dequantize_fp4, dequantize_fp8
from .network import DeepseekV4

logger = logging.getLogger(__name__)

SCALE_SUFFIX = ".weight_scale_inv"  # SGLang's name for a block-quantized weight's scales
_EXPERT_SCALE = "_scale_inv"  # parameter_name's mark on an expert's scales: layers.N.ffn.experts.w1_scale_inv


class CheckpointError(ValueError):
    """A checkpoint that does not match the config; the message lists the offending tensors."""


# Hugging Face module names -> release names, applied in order to a name without "model.".
_HF_TO_RELEASE: list[tuple[str, str]] = [
    (r"^embed_tokens\.", "embed."),
    (r"^lm_head\.", "head."),
    (r"(^|\.)hc_head\.hc_(fn|base|scale)$", r"\1hc_head_\2"),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.", ".ffn."),
    (r"\.compressor\.indexer\.scorer\.weights_proj\.", ".indexer.weights_proj."),
    (r"\.compressor\.indexer\.q_b_proj\.", ".indexer.wq_b."),
    (r"\.compressor\.indexer\.", ".indexer.compressor."),
    (r"\.compressor\.kv_norm\.", ".compressor.norm."),
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"\.sinks$", ".attn_sink"),
    (r"\.q_a_proj\.", ".wq_a."),
    (r"\.q_a_norm\.", ".q_norm."),
    (r"\.q_b_proj\.", ".wq_b."),
    (r"\.kv_proj\.", ".wkv."),
    (r"\.gate_proj\.", ".wgate."),
    (r"\.o_a_proj\.", ".wo_a."),
    (r"\.o_b_proj\.", ".wo_b."),
    (r"\.position_bias$", ".ape"),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
]
# transformers' default save_pretrained writes the main attention's kv norm as `attn.norm`.
_MIXED_TO_RELEASE: list[tuple[str, str]] = [(r"^((?:layers|mtp)\.\d+\.attn)\.norm\.", r"\1.kv_norm.")]
# A layer's prefix: a main layer or an MTP layer.
_LAYER = r"(?:layers|mtp)\.\d+"
# The MTP layer's copies of the target's embedding and head, where a checkpoint holds them.
_TARGETS_OWN = re.compile(r"mtp\.\d+\.(emb|head)\.")


def release_name(name: str) -> str:
    """The release spelling of a tensor name written in any supported layout."""
    name = name.removeprefix("model.")
    for pattern, replacement in _HF_TO_RELEASE + _MIXED_TO_RELEASE:
        name = re.sub(pattern, replacement, name)
    return name


def read_safetensors(files: Iterable[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of ``files``, one at a time (nothing else of a file is read before it is asked for)."""
    for file in files:
        with safe_open(file, framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


@runtime_checkable
class LoadsExperts(Protocol):
    """A module that places its layer's routed experts itself (the served model's ``FusedMoE``).

    ``quantized``: it holds them as the checkpoint stores them (packed FP4 and their scales), so
    they reach it as stored, each scale with ``scale=True``, rather than dequantized.
    """

    quantized: bool

    def load(self, expert: int, projection: str, tensor: torch.Tensor, *, scale: bool = False) -> None: ...


def load_weights(model: DeepseekV4, tensors: Iterable[tuple[str, torch.Tensor]], *, dtype: torch.dtype) -> None:
    """Copy checkpoint tensors (any layout) into ``model`` as they arrive, converting to ``dtype``.

    Each tensor is placed (a routed expert into its slice of the stacked weights, or handed to
    the layer's :class:`LoadsExperts`) before the next is read, so loading holds one tensor
    beyond the model, and a quantized weight until its scales arrive. A quantized weight whose
    module holds it quantized (SGLang's quantized layers) is placed as stored, its scale beside it;
    any other is dequantized. What did not match is raised at the end, every tensor named.
    """
    params, expert_loaders = _parameters(model), _expert_loaders(model)
    seen: list[tuple[str, tuple[int, ...]]] = []
    released = _release_tensors(tensors, has_mtp=len(model.mtp) > 0)
    stored = _stored_or_dequantized(released, _holds_quantized(params, expert_loaders))
    for name, tensor in stored:
        seen.append((name, tuple(tensor.shape)))
        target, expert = parameter_name(name)
        owner, _, projection = target.rpartition(".")
        if expert is not None and owner in expert_loaders:
            scale = projection.endswith(_EXPERT_SCALE)
            expert_loaders[owner].load(expert, projection.removesuffix(_EXPERT_SCALE), tensor, scale=scale)
            continue
        param = params.get(target)
        if param is None:
            continue
        if hasattr(param, "weight_loader"):  # a parallel layer's: it takes this rank's shard itself
            param.weight_loader(param, tensor)
            continue
        expected = tuple(param.shape) if expert is None else tuple(param.shape[1:])
        if expected == tuple(tensor.shape):
            _place(param, tensor, expert, dtype)
    problems = mismatches(model, seen)
    if problems:
        raise CheckpointError(f"checkpoint does not match the config:{problems}")


def _holds_quantized(params: dict[str, torch.Tensor], expert_loaders: dict[str, LoadsExperts]) -> Callable[[str], bool]:
    """Whether the module that weight ``X.weight`` (``X`` a release name) goes to holds it quantized: a
    :class:`LoadsExperts` that says so, or a layer with an ``X.weight_scale_inv`` (SGLang's FP8 linear method)."""

    def holds_quantized(stem: str) -> bool:
        target, expert = parameter_name(f"{stem}.weight")
        if expert is not None:
            loader = expert_loaders.get(target.rpartition(".")[0])
            return loader is not None and loader.quantized
        return f"{stem}{SCALE_SUFFIX}" in params

    return holds_quantized


def mismatches(model: DeepseekV4, tensors: Iterable[tuple[str, tuple[int, ...]]]) -> str:
    """What in ``tensors`` (release names, dequantized shapes) does not fill ``model``: one line each, or ''.

    Experts a :class:`LoadsExperts` module places are its own to check (it is handed each one).
    """
    params, expert_loaders = _parameters(model), _expert_loaders(model)
    assigned: set[str] = set()
    experts: dict[str, set[int]] = defaultdict(set)
    unexpected, wrong_shapes = [], []
    for name, shape in tensors:
        target, expert = parameter_name(name)
        if expert is not None and target.rpartition(".")[0] in expert_loaders:
            continue
        if target not in params:
            unexpected.append(name)
            continue
        if hasattr(params[target], "weight_loader"):  # holds a shard; its loader checks the shape
            assigned.add(target)
            continue
        expected = tuple(params[target].shape) if expert is None else tuple(params[target].shape[1:])
        if shape != expected:
            wrong_shapes.append(f"{name}: shape {shape} in the checkpoint, {expected} expected")
        elif expert is None:
            assigned.add(target)
        else:
            experts[target].add(expert)
    lines = [f"\n  {line}" for line in wrong_shapes]
    for target, present in sorted(experts.items()):
        missing_experts = sorted(set(range(params[target].shape[0])) - present)
        if missing_experts:
            lines.append(f"\n  {target}: missing experts {missing_experts}")
        else:
            assigned.add(target)
    missing = sorted(set(params) - assigned - set(experts))
    if missing:
        lines.append(f"\n  missing tensors: {missing}")
    if unexpected:
        lines.append(f"\n  unexpected tensors: {sorted(unexpected)}")
    return "".join(lines)


def _expert_loaders(model: nn.Module) -> dict[str, LoadsExperts]:
    return {name: module for name, module in model.named_modules() if isinstance(module, LoadsExperts)}


def _parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters and buffers by name, less those of :class:`LoadsExperts` modules."""
    owned = tuple(f"{name}." for name in _expert_loaders(model))
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    return {name: tensor for name, tensor in tensors.items() if not name.startswith(owned)} if owned else tensors


def unstacked_experts(name: str) -> tuple[str, str] | None:
    """``(layers.N.ffn.experts, gate_up_proj | down_proj)`` for HF's stacked expert tensors, else None."""
    stacked = re.fullmatch(rf"({_LAYER}\.ffn\.experts)\.(gate_up_proj|down_proj)", name)
    return None if stacked is None else (stacked.group(1), stacked.group(2))


def _release_tensors(tensors: Iterable[tuple[str, torch.Tensor]], has_mtp: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """Rename to release names, split HF's stacked experts, drop MTP tensors unless the model ``has_mtp``
    (and the MTP layer's copies of the target's embedding and head always)."""
    skipped = 0
    for name, tensor in tensors:
        name = release_name(name)
        if is_skipped_mtp(name, has_mtp):
            skipped += 1
            continue
        stacked = unstacked_experts(name)
        if stacked is None:
            yield name, tensor
            continue
        prefix, kind = stacked
        for expert, weight in enumerate(tensor):
            if kind == "down_proj":
                yield f"{prefix}.{expert}.w2.weight", weight
            else:
                gate, up = weight.chunk(2, dim=0)
                yield f"{prefix}.{expert}.w1.weight", gate
                yield f"{prefix}.{expert}.w3.weight", up
    if skipped:
        logger.info("skipped %d multi-token-prediction (mtp.*) tensors", skipped)


def is_skipped_mtp(name: str, has_mtp: bool) -> bool:
    """Whether release name ``name`` is an MTP tensor the model does not load: all of them in a model without an
    MTP layer, ``mtp.N.emb`` / ``mtp.N.head`` (the target's own) in any."""
    return name.startswith("mtp.") and (not has_mtp or _TARGETS_OWN.match(name) is not None)


def scale_stem(name: str) -> str | None:
    """``X`` for a block-scale tensor ``X.scale`` (or ``X.weight_scale_inv``), else None."""
    for suffix in (".scale", SCALE_SUFFIX):
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return None


def _stored_or_dequantized(
    tensors: Iterable[tuple[str, torch.Tensor]], kept_quantized: Callable[[str], bool]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Quantized weights and their scales as stored (the scale as ``X.weight_scale_inv``) where
    ``kept_quantized(X)``; elsewhere each ``X.weight`` paired with its ``X.scale`` and yielded
    dequantized as soon as both are in."""
    weights: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for name, tensor in tensors:
        stem = scale_stem(name)
        if stem is not None:
            if kept_quantized(stem):
                yield f"{stem}{SCALE_SUFFIX}", tensor
                continue
            scales[stem] = tensor
        elif name.endswith(".weight") and is_quantized_dtype(tensor.dtype):
            stem = name.removesuffix(".weight")
            if kept_quantized(stem):
                yield name, packed_as_int8(tensor)
                continue
            weights[stem] = tensor
        else:
            yield name, tensor
            continue
        if stem in weights and stem in scales:
            yield f"{stem}.weight", dequantize(weights.pop(stem), scales.pop(stem), stem)
    for stem in sorted(scales):
        raise CheckpointError(f"{stem}: block scale without a quantized weight")
    for stem, weight in weights.items():
        raise CheckpointError(f"{stem}.weight is {weight.dtype} but has no '.scale' block scales")


def packed_as_int8(weight: torch.Tensor) -> torch.Tensor:
    """A packed FP4 weight (stored as int8, uint8 or float4_e2m1fn_x2) as the int8 bytes SGLang holds; FP8 as is."""
    return weight if weight.dtype == torch.float8_e4m3fn else weight.view(torch.int8)


def is_quantized_dtype(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float4_e2m1fn_x2, torch.int8, torch.uint8)


def expected_scale_shape(
    dtype: torch.dtype, stored_shape: tuple[int, ...], scale_shape: tuple[int, ...], name: str
) -> tuple[int, int]:
    """The block grid of a quantized weight stored as ``dtype`` / ``stored_shape``; raises unless ``scale_shape`` is it."""
    rows, cols = stored_shape if dtype == torch.float8_e4m3fn else (stored_shape[0], stored_shape[1] * 2)
    block = (FP8_BLOCK, FP8_BLOCK) if dtype == torch.float8_e4m3fn else (1, FP4_BLOCK)
    expected = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_shape) != expected:
        kind = "FP8" if block[0] == FP8_BLOCK else "FP4"
        raise CheckpointError(
            f"{name}: {kind} weight {(rows, cols)} needs scales of shape {expected}"
            f" ({block[0]}x{block[1]} blocks), got {tuple(scale_shape)}"
        )
    return expected


def dequantize(weight: torch.Tensor, scale: torch.Tensor, name: str = "weight") -> torch.Tensor:
    """Float32 weight from FP8 (128x128 block scales) or packed FP4 e2m1 (1x32 block scales).

    Scales may be UE8M0 (``float8_e8m0fnu``, powers of two) or plain floats.
    """
    expected_scale_shape(weight.dtype, tuple(weight.shape), tuple(scale.shape), name)
    if weight.dtype == torch.float8_e4m3fn:
        return dequantize_fp8(weight, scale)
    return dequantize_fp4(weight, scale)


def parameter_name(release: str) -> tuple[str, int | None]:
    """This package's parameter name for a release name, and the expert index if stacked (an expert's
    ``weight_scale_inv`` under ``layers.N.ffn.experts.wI_scale_inv``)."""
    expert = re.fullmatch(rf"({_LAYER}\.ffn\.experts)\.(\d+)\.(w[123])\.weight(_scale_inv)?", release)
    if expert is not None:
        prefix, index, which, scale = expert.groups()
        return f"{prefix}.{which}{scale or ''}", int(index)
    return re.sub(r"(^|\.)hc_(attn|ffn|head)_(fn|base|scale)$", r"\1hc_\2.\3", release), None


def _place(param: torch.Tensor, tensor: torch.Tensor, expert: int | None, dtype: torch.dtype) -> None:
    """Write ``tensor`` into ``param`` (into its row ``expert`` of stacked experts) in ``dtype``."""
    target_dtype = param.dtype if not param.is_floating_point() else dtype
    with torch.no_grad():
        if expert is None:
            param.data = tensor.to(device=param.device, dtype=target_dtype)
            return
        if param.dtype != target_dtype:
            param.data = torch.empty(param.shape, dtype=target_dtype, device=param.device)
        param.data[expert].copy_(tensor)


def release_state_dict(model: DeepseekV4) -> dict[str, torch.Tensor]:
    """The model's tensors under release names (experts unstacked), ready for safetensors."""
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        tensor = tensor.detach().contiguous()
        stacked = re.fullmatch(rf"({_LAYER}\.ffn\.experts)\.(w[123])", name)
        if stacked is not None:
            prefix, which = stacked.groups()
            for expert, weight in enumerate(tensor):
                tensors[f"{prefix}.{expert}.{which}.weight"] = weight.clone()
            continue
        tensors[re.sub(r"(^|\.)hc_(attn|ffn|head)\.(fn|base|scale)$", r"\1hc_\2_\3", name)] = tensor
    return tensors
