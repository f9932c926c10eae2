"""Refuse a checkpoint that cannot load before any of its weights is read.

Everything here reads safetensors headers (names, shapes, dtypes), the shard index and the
few small routing tables, never a weight: a V4-Flash checkpoint is checked in seconds, and
a bad one is named before the loader has placed anything. What is checked:

* every shard ``model.safetensors.index.json`` names is present (a missing one names the
  file and the first tensors it should hold);
* every tensor the network needs is there with its shape, nothing else is, in any layout
  :func:`~.loader.release_name` reads (HF's stacked experts too); the MTP layer's (``mtp.0.*``) when the
  config has one and the checkpoint holds any ``mtp.*`` tensor (a checkpoint without them is a network
  without an MTP layer; ``mtp.*`` under a config without one are skipped, as the loader skips them);
* every quantized weight has its block scales, of the shape its blocks need;
* every hash-routing table ``gate.tid2eid`` routes to experts that exist.

:func:`load_model` checks a checkpoint so, then loads it (:mod:`.loader`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from ..config import DeepseekV4Config, load_config
from .loader import (
    CheckpointError,
    expected_scale_shape,
    is_quantized_dtype,
    is_skipped_mtp,
    load_weights,
    mismatches,
    read_safetensors,
    release_name,
    scale_stem,
    unstacked_experts,
)
from .network import DeepseekV4

INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class StoredTensor:
    """A tensor's header: where it is and what it holds, its data unread."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    file: Path
    stored_name: str

    def logical_shape(self, name: str) -> tuple[int, ...]:
        """Its shape once dequantized: a packed FP4 weight holds two values an element."""
        packed = name.endswith(".weight") and is_quantized_dtype(self.dtype) and self.dtype != torch.float8_e4m3fn
        return (*self.shape[:-1], self.shape[-1] * 2) if packed else self.shape


def load_model(
    path: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> DeepseekV4:
    """Build the network from ``path``'s ``config.json`` and load its safetensors, shard by shard, once
    :func:`check_checkpoint` passed."""
    config = check_checkpoint(path, load_config(path))
    with torch.device("meta"):
        model = DeepseekV4(config)
    model = model.to_empty(device=device)
    load_weights(model, read_safetensors(shard_files(path)), dtype=dtype)
    model.eval()
    return model


def check_checkpoint(path: str | Path, config: DeepseekV4Config) -> DeepseekV4Config:
    """Raise :class:`CheckpointError` naming what is wrong with the checkpoint at ``path``, if anything;
    return the config of the network it fills (``config`` without its MTP layer if it holds no ``mtp.*``)."""
    headers = dict(_headers(shard_files(path)))
    _check_scales(headers)
    if not any(name.startswith("mtp.") for name in headers):
        config = config.without_mtp()
    logical = {name: stored.logical_shape(name) for name, stored in headers.items()}
    with torch.device("meta"):
        network = DeepseekV4(config)
    problems = mismatches(network, _release_shapes(logical, has_mtp=config.num_mtp_layers > 0))
    if problems:
        raise CheckpointError(f"checkpoint does not match the config:{problems}")
    _check_routing_tables(headers, config.n_routed_experts)
    return config


def shard_files(path: str | Path) -> list[Path]:
    """The checkpoint's safetensors files: those its index names (all present), else every one in the folder."""
    folder = Path(path)
    index = folder / INDEX_FILE
    if not index.is_file():
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{path}: no *.safetensors files")
        return files
    weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    missing: dict[str, list[str]] = {}
    for tensor, file in sorted(weight_map.items()):
        if not (folder / file).is_file():
            missing.setdefault(file, []).append(tensor)
    if missing:
        shards = "; ".join(f"{file} (holding {', '.join(names[:3])}, ...)" for file, names in missing.items())
        raise CheckpointError(f"{path}: {INDEX_FILE} names shards that are not there: {shards}")
    return [folder / file for file in sorted(set(weight_map.values()))]


def _headers(files: list[Path]) -> Iterator[tuple[str, StoredTensor]]:
    """Every stored tensor's header, by its release name."""
    for file in files:
        with safe_open(file, framework="pt") as handle:
            for stored in handle.keys():
                piece = handle.get_slice(stored)
                dtype = _SAFETENSORS_DTYPES.get(piece.get_dtype(), torch.float32)
                shape = tuple(piece.get_shape())
                if dtype == torch.float4_e2m1fn_x2:  # headers count FP4 values; torch counts pairs
                    shape = (*shape[:-1], shape[-1] // 2)
                yield release_name(stored), StoredTensor(shape, dtype, file, stored)


def _check_scales(headers: dict[str, StoredTensor]) -> None:
    weights = {
        name.removesuffix(".weight"): stored
        for name, stored in headers.items()
        if name.endswith(".weight") and is_quantized_dtype(stored.dtype)
    }
    scales = {scale_stem(name): stored for name, stored in headers.items() if scale_stem(name) is not None}
    for stem in sorted(set(scales) - set(weights)):
        raise CheckpointError(f"{stem}: block scale without a quantized weight")
    for stem, weight in sorted(weights.items()):
        if stem not in scales:
            raise CheckpointError(f"{stem}.weight is {weight.dtype} but has no '.scale' block scales")
        expected_scale_shape(weight.dtype, weight.shape, scales[stem].shape, stem)


def _release_shapes(logical: dict[str, tuple[int, ...]], has_mtp: bool) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Release names and shapes of the network's tensors: scales and the ``mtp.*`` the loader skips dropped, HF
    experts unstacked."""
    for name, shape in logical.items():
        if is_skipped_mtp(name, has_mtp) or scale_stem(name) is not None:
            continue
        stacked = unstacked_experts(name)
        if stacked is None:
            yield name, shape
            continue
        prefix, kind = stacked
        experts, rows, columns = shape
        for expert in range(experts):
            if kind == "down_proj":
                yield f"{prefix}.{expert}.w2.weight", (rows, columns)
            else:
                yield f"{prefix}.{expert}.w1.weight", (rows // 2, columns)
                yield f"{prefix}.{expert}.w3.weight", (rows // 2, columns)


def _check_routing_tables(headers: dict[str, StoredTensor], experts: int) -> None:
    for name, stored in sorted(headers.items()):
        if not name.endswith(".gate.tid2eid"):
            continue
        with safe_open(stored.file, framework="pt") as handle:
            table = handle.get_tensor(stored.stored_name)
        low, high = int(table.min()), int(table.max())
        if low < 0 or high >= experts:
            raise CheckpointError(
                f"{name}: routes to expert ids in [{low}, {high}]; the config has {experts} experts (ids 0..{experts - 1})"
            )


_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E8M0": torch.float8_e8m0fnu,
    "F4": torch.float4_e2m1fn_x2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
