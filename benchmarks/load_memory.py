"""Peak host memory while a V4-Flash-shaped release checkpoint loads, one rank and two TP/EP ranks.

The checkpoint: V4-Flash's dimensions (hidden 4096, 64 heads of 512, all 256 routed experts)
cut to two layers (a hash-routed ratio-4 layer and a gated ratio-128 one), random weights in
the release format (FP8 128x128 dense, FP4 e2m1 experts with UE8M0 scales, the rest bf16),
written in ~1 GiB shards with an index, as the release is. Per run:

* the readers alone, each in a fresh process: SGLang's default (multi-threaded, buffered) safetensors
  iterator and ours (one tensor at a time), every tensor read and dropped; peak RSS above the
  process's start;
* the real server (``sglang.launch_server``, CPU platform, bf16) at ``--tp 1`` and at ``--tp 2
  --ep-size 2``: each scheduler process's peak RSS (``VmHWM``) against its resident weights
  (``/server_info``) and the ledger's bytes for the rank.

The floor a loader can reach is the rank's resident weights plus one tensor; the figure of
merit is ``peak - resident`` against the largest shard file.

    python benchmarks/load_memory.py --out /tmp/v4-load   # ~8 GB of disk, ~12 GB of memory
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from sglang_dsv4.config import parse_config
from sglang_dsv4.memory_pool.ledger import RankLedger
from sglang_dsv4.model.weight_layout import FP4_BLOCK, FP8_BLOCK, Format, Parallelism, checkpoint_tensors
from sglang_dsv4.tiny import RELEASE_QUANTIZATION

GIB = 2**30
SHARD_BYTES = GIB


def flash_two_layers() -> dict:
    raw = json.loads(_flash_path().read_text())
    raw.update(num_hidden_layers=2, compress_ratios=[4, 128], num_hash_layers=1, num_nextn_predict_layers=0)
    raw["quantization_config"] = RELEASE_QUANTIZATION
    return raw


def _flash_path() -> Path:
    import sglang_dsv4.configs

    return Path(sglang_dsv4.configs.__file__).parent / "flash.json"


def _stored(spec, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Random stored tensors of one spec (weight, and its scale when quantized), as the release holds them."""
    rows, cols = spec.shape if len(spec.shape) == 2 else (1, spec.shape[0])
    stem = spec.name.removesuffix(".weight")
    if spec.format is Format.FP8:
        weight = (torch.randn(rows, cols, generator=generator) * 0.5).to(torch.float8_e4m3fn)
        scale = torch.full((-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)), 2.0**-8)
        return {spec.name: weight, f"{stem}.scale": scale}
    if spec.format is Format.FP4:
        packed = torch.randint(-128, 128, (rows, cols // 2), dtype=torch.int8, generator=generator)
        scale = torch.full((rows, cols // FP4_BLOCK), 2.0**-6).to(torch.float8_e8m0fnu)
        return {spec.name: packed, f"{stem}.scale": scale}
    if spec.format is Format.INDEX:
        experts = torch.stack([torch.randperm(256, generator=generator)[: spec.shape[1]] for _ in range(rows)])
        return {spec.name: experts}
    values = (
        torch.ones(spec.shape)
        if spec.name.endswith("norm.weight")
        else torch.randn(spec.shape, generator=generator) * 0.02
    )
    return {spec.name: values.to(torch.bfloat16)}


def build(out: Path) -> Path:
    """Write the checkpoint (skipped when ``out`` already holds one); return it."""
    if (out / "model.safetensors.index.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    raw = flash_two_layers()
    generator = torch.Generator().manual_seed(0)
    shard, shard_bytes, weight_map, files = {}, 0, {}, []

    def flush() -> None:
        nonlocal shard, shard_bytes
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, out / name, metadata={"format": "pt"})
        files.append(name)
        weight_map.update(dict.fromkeys(shard, name))
        shard, shard_bytes = {}, 0

    for spec in checkpoint_tensors(parse_config(raw), quantized=True):
        for name, tensor in _stored(spec, generator).items():
            shard[name] = tensor.contiguous()
            shard_bytes += tensor.numel() * tensor.element_size()
        if shard_bytes >= SHARD_BYTES:
            flush()
    if shard:
        flush()
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return out


READER = """
import resource, sys
import torch
from pathlib import Path
files = sorted(str(p) for p in Path(sys.argv[2]).glob("*.safetensors"))
start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if sys.argv[1] == "sglang":  # what DefaultModelLoader reads with by default
    from sglang.srt.model_loader.loader import DefaultModelLoader
    from sglang.srt.model_loader.weight_utils import buffered_multi_thread_safetensors_weights_iterator
    read = lambda files: buffered_multi_thread_safetensors_weights_iterator(files, DefaultModelLoader.DEFAULT_NUM_THREADS)
else:
    from sglang_dsv4.model.loader import read_safetensors
    read = lambda files: read_safetensors(map(Path, files))
for name, tensor in read(files):
    tensor.reshape(-1).view(torch.uint8).max()  # every byte read (the readers map the files lazily), then dropped
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - start) * 1024)
"""


def reader_peak(kind: str, checkpoint: Path) -> int:
    """Peak RSS above its start of a fresh process that reads every tensor with ``kind``'s reader."""
    result = subprocess.run([sys.executable, "-c", READER, kind, str(checkpoint)], capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(result.stderr[-3000:])
    return int(result.stdout.split()[-1])


def served_peaks(checkpoint: Path, log: Path, *args: str) -> tuple[list[int], list[int]]:
    """(peak RSS, resident weight bytes) of each scheduler process of a server started with ``args``."""
    import psutil
    import requests

    from sglang_dsv4.launch import running_server

    # No warm-up request: the peak is the load's, not a first forward's (whose dequantized experts are its own).
    extra = (
        "--dtype",
        "bfloat16",
        "--max-running-requests",
        "4",
        "--skip-tokenizer-init",
        "--skip-server-warmup",
        *args,
    )
    with running_server(checkpoint, *extra, log_path=log) as url:
        port = url.rsplit(":", 1)[1]
        server = next(p for p in psutil.process_iter(["cmdline"]) if port in " ".join(p.info["cmdline"] or []))
        ranks = sorted((c for c in server.children(recursive=True) if "scheduler" in c.name()), key=lambda c: c.name())
        peaks = [_vm_hwm(rank.pid) for rank in ranks]
        info = requests.get(f"{url}/server_info", timeout=120).json()["internal_states"][0]
        return peaks, info["dsv4_weights"]["resident_bytes_per_rank"]


def _vm_hwm(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for {pid}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/v4-flash-2-layers"))
    args = parser.parse_args()
    started = time.monotonic()
    checkpoint = build(args.out)
    shards = sorted(checkpoint.glob("*.safetensors"))
    largest = max(path.stat().st_size for path in shards)
    total = sum(path.stat().st_size for path in shards)
    print(f"checkpoint: {len(shards)} shards, {total / GIB:.2f} GiB, largest {largest / GIB:.2f} GiB "
          f"(built in {time.monotonic() - started:.0f} s)")  # fmt: skip
    print("\nreaders alone (every tensor read and dropped; peak RSS above the process's start):")
    for kind in ("sglang", "ours"):
        peak = reader_peak(kind, checkpoint)
        print(f"  {kind:7s} {peak / GIB:6.2f} GiB = {peak / largest:5.2f} x the largest shard", flush=True)
    config = parse_config(flash_two_layers())
    print("\nserved (bf16; peak RSS of each scheduler process, its resident weights, the ledger's):")
    for name, tp, ep in (("--tp 1", 1, 1), ("--tp 2 --ep-size 2", 2, 2)):
        flags = name.split()
        peaks, resident = served_peaks(checkpoint, args.out.parent / f"load-memory-tp{tp}.log", *flags)
        ledger = sum(RankLedger(config, Parallelism(tp=tp, ep=ep), quantized=True).weight_bytes().values())
        for rank, (peak, held) in enumerate(zip(peaks, resident)):
            print(f"  {name:18s} rank {rank}: peak {peak / GIB:6.2f} GiB, resident {held / GIB:6.2f} GiB "
                  f"(ledger {ledger / GIB:6.2f} GiB), peak - resident {(peak - held) / GIB:5.2f} GiB "
                  f"= {(peak - held) / largest:4.2f} x the largest shard", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
