"""The ``dsv4`` command."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from .agentperf import command as agentperf
from .config import ConfigError
from .emulation import command as emulate
from .memory_pool import ledger
from .moe import plan_command as plan_experts
from .moe.placement import ExpertPlanError


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="dsv4", description="DeepSeek-V4 for SGLang")
    commands = parser.add_subparsers(dest="command", required=True)

    tiny = commands.add_parser("tiny", help="build a tiny V4 checkpoint with random weights (the test builder)")
    tiny.add_argument("out_dir", type=Path)

    generate = commands.add_parser("generate", help="greedy continuation of a prompt with the torch network")
    generate.add_argument("--model", type=Path, help="V4 checkpoint directory (default: the shipped tiny one)")
    generate.add_argument("--prompt", default="def fix_bug(request):")
    generate.add_argument("--max-new-tokens", type=int, default=32)

    demo = commands.add_parser("demo", help="serve the shipped tiny checkpoint and run a multi-turn agent on it")
    demo.add_argument("--task", default="Fix the failing test in tests/test_cache.py.")

    plan_experts.add_arguments(commands.add_parser("plan-experts", help=plan_experts.__doc__.splitlines()[0]))
    ledger.add_arguments(commands.add_parser("ledger", help="KV bytes per token and per request, reference vs ours"))
    agentperf.add_arguments(commands.add_parser("agentperf", help="concurrent agents per GPU under TTFT/speed SLOs"))
    emulate.add_arguments(
        commands.add_parser("emulate", help="SGLang's server for a V4 config over an emulated H200 (no weights)")
    )

    args = parser.parse_args(argv)
    if args.command == "tiny":
        from .tiny import build_checkpoint

        print(build_checkpoint(args.out_dir))
    elif args.command == "demo":
        from .demo import run_demo

        run_demo(args.task)
    elif args.command == "plan-experts":
        try:
            plan_experts.run(args)
        except (ExpertPlanError, ConfigError) as error:
            parser.exit(2, f"dsv4 plan-experts: {error}\n")
    elif args.command == "emulate":
        raise SystemExit(emulate.run(args))
    elif args.command == "ledger":
        ledger.run(args)
    elif args.command == "agentperf":
        try:
            agentperf.run(args)
        except agentperf.REPORTED_ERRORS as error:
            parser.exit(2, f"dsv4 agentperf: {error}\n")
    else:
        _generate(args.model, args.prompt, args.max_new_tokens)


def _generate(model_dir: Path | None, prompt: str, max_new_tokens: int) -> None:
    from transformers import AutoTokenizer

    from . import load_model
    from .tiny import shipped_checkpoint

    model_dir = model_dir or shipped_checkpoint()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = load_model(model_dir)
    ids = torch.tensor([tokenizer.bos_token_id, *tokenizer.encode(prompt, add_special_tokens=False)])
    state = model.new_state()
    started = time.perf_counter()
    logits = model(ids, state)
    generated: list[int] = []
    for _ in range(max_new_tokens):
        token = int(logits[-1].argmax())
        generated.append(token)
        if token == model.config.eos_token_id:
            break
        logits = model(torch.tensor([token]), state)
    elapsed = time.perf_counter() - started
    print(f"prompt ({len(ids)} tokens): {prompt!r}")
    print(f"continuation ({len(generated)} tokens, {elapsed:.2f}s): {tokenizer.decode(generated)!r}")


if __name__ == "__main__":
    main()
