"""``dsv4 emulate``: ``python -m sglang.launch_server`` over an emulated H200, for a shipped V4 config.

``dsv4 emulate --config flash --gpus 8 --context-length 131072 -- --port 30000 --enable-cache-report`` serves
V4-Flash as one attention-DP rank of a node of 8 H200s (DP 8, EP 8): the ledger's pools of one GPU, each forward
the H200's time. The model folder it serves is written once under the cache folder: the config's
``config.json`` and the shipped tiny checkpoint's tokenizer (a real one has no weights either). Arguments after
``--`` go to SGLang unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path

from ..config import named_config
from ..settings import EMULATED_ATTENTION, EMULATED_EXPERTS
from .model import TIMED_MODELS

DEFAULT_MEM_FRACTION_STATIC = 0.85
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", choices=TIMED_MODELS, required=True, help="the V4 config served")
    parser.add_argument(
        "--gpus", type=int, default=8, help="H200s of the deployment: one attention-DP rank each, experts over all"
    )
    parser.add_argument(
        "--context-length", type=int, required=True, help="longest session served (SGLang's request table width)"
    )
    parser.add_argument("--mem-fraction-static", type=float, default=DEFAULT_MEM_FRACTION_STATIC)
    parser.add_argument(
        "--attention", choices=EMULATED_ATTENTION, default="measured",
        help="the timing model's attention: this project's H200 measurements, or upstream's kernels' roofline",
    )
    parser.add_argument(
        "--attention-tp", type=int, default=1,
        help="1: attention DP, one rank a GPU (experts over EP); --gpus: one TP group (flashmla attention only)",
    )
    parser.add_argument("--experts", choices=EMULATED_EXPERTS, default="fp4", help="the routed experts' weights")
    parser.add_argument(
        "--lockstep", action="store_true",
        help="the attention-DP ranks' forwards run together: every rank's extends stall this one",
    )
    parser.add_argument(
        "--host-speed", type=float, default=1.0,
        help="the emulated host's single-thread time over this host's (benchmarks/host_speed.py on both)",
    )
    parser.add_argument("sglang_args", nargs=argparse.REMAINDER, help="-- then SGLang's own arguments")


def emulated_model_dir(config: str, folder: Path | None = None) -> Path:
    """A model folder with the shipped ``config``'s ``config.json`` and the tiny checkpoint's tokenizer."""
    named_config(config)  # refuses an unknown name
    folder = folder or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sglang-dsv4" / config
    folder.mkdir(parents=True, exist_ok=True)
    shipped = resources.files("sglang_dsv4")
    (folder / "config.json").write_text(json.dumps(json.loads(shipped.joinpath(f"configs/{config}.json").read_text())))
    for name in TOKENIZER_FILES:
        with resources.as_file(shipped.joinpath(f"checkpoints/tiny/{name}")) as source:
            shutil.copyfile(source, folder / name)
    return folder


def emulation_env(
    gpus: int,
    attention: str = "measured",
    attention_tp: int = 1,
    experts: str = "fp4",
    host_speed: float = 1.0,
    lockstep: bool = False,
) -> dict[str, str]:
    prefix = "SGLANG_DSV4_PLUGIN_EMULATE"
    return {
        prefix: "h200",
        f"{prefix}_GPUS": str(gpus),
        f"{prefix}_ATTENTION": attention,
        f"{prefix}_ATTENTION_TP": str(attention_tp),
        f"{prefix}_EXPERTS": experts,
        f"{prefix}_HOST_SPEED": str(host_speed),
        f"{prefix}_LOCKSTEP": "1" if lockstep else "0",
    }


def emulated_server_args(model_dir: Path, context_length: int, mem_fraction_static: float) -> list[str]:
    """SGLang's arguments for the emulated model: no weights read, the CPU device, the H200's memory fraction."""
    return [
        "--model-path", str(model_dir),
        "--device", "cpu",
        "--load-format", "dummy",
        "--context-length", str(context_length),
        "--mem-fraction-static", str(mem_fraction_static),
        "--sleep-on-idle",
    ]  # fmt: skip


def run(args: argparse.Namespace) -> int:
    extra = args.sglang_args[1:] if args.sglang_args[:1] == ["--"] else args.sglang_args
    model_dir = emulated_model_dir(args.config)
    command = [
        sys.executable, "-m", "sglang.launch_server",
        *emulated_server_args(model_dir, args.context_length, args.mem_fraction_static),
        *extra,
    ]  # fmt: skip
    env = emulation_env(args.gpus, args.attention, args.attention_tp, args.experts, args.host_speed, args.lockstep)
    return subprocess.call(command, env={**os.environ, **env})
