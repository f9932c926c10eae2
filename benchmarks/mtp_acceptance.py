"""Mean accepted length of the MTP layer's drafts, offline: the torch network, greedy, no server.

    python benchmarks/mtp_acceptance.py [--checkpoint DIR] [--sessions FILE]

Prompts are the held-out tenth of the recorded agent sessions (every tenth, as ``train_tiny.py`` holds them
out), rendered as the trainer renders them and tokenized with the checkpoint's tokenizer: each session is cut
at ``--turns`` of its assistant turns (after ``<｜Assistant｜></think>``, where the model writes a reply),
spread over its first ``--max-prompt`` tokens. From each prompt the target decodes ``--new-tokens`` greedily,
with the MTP layer drafting k = 1..4 tokens a step and the target verifying
(:func:`sglang_dsv4.model.speculative.speculative_decode`); every run's tokens are checked equal to plain greedy
decoding's. Prints, per k, the mean accepted length (tokens per verify step: accepted drafts + 1), and writes
them to ``benchmarks/results/mtp_acceptance.json``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from pathlib import Path

import torch
from train_tiny import HELD_OUT_EVERY, REPO, chat_renderer, session_messages
from transformers import AutoTokenizer

from sglang_dsv4.agentperf.trajectory import SESSION_TOOLS
from sglang_dsv4.chat_template import ASSISTANT
from sglang_dsv4.model import load_model
from sglang_dsv4.model.speculative import greedy_decode, read_prompt, speculative_decode
from sglang_dsv4.tiny import shipped_checkpoint

DRAFTS = (1, 2, 3, 4)


def held_out_prompts(sessions: Path, tokenizer, turns: int, max_prompt: int) -> list[torch.Tensor]:
    """Each held-out session's tokens up to ``turns`` of its assistant turns' starts, spread evenly."""
    with gzip.open(sessions, "rt", encoding="utf-8") as lines:
        rows = [json.loads(line) for line in lines if line.strip()]
    render, assistant = chat_renderer(), tokenizer.convert_tokens_to_ids(ASSISTANT)
    prompts = []
    for row in rows[::HELD_OUT_EVERY]:
        ids = tokenizer.encode(render(session_messages(row), list(SESSION_TOOLS)), add_special_tokens=False)
        # The reply starts after "<｜Assistant｜></think>" (two tokens).
        starts = [i + 2 for i, token in enumerate(ids[:max_prompt]) if token == assistant and i + 2 <= max_prompt]
        chosen = starts[len(starts) // (2 * turns) :: max(1, len(starts) // turns)][:turns]
        prompts += [torch.tensor(ids[:end]) for end in chosen]
    return prompts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, default=shipped_checkpoint())
    sessions = REPO.parent / "shared" / "data" / "agentic_trajectories.jsonl.gz"
    parser.add_argument("--sessions", type=Path, default=sessions)
    parser.add_argument("--turns", type=int, default=1)
    parser.add_argument("--max-prompt", type=int, default=8192)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--record", type=Path, default=REPO / "benchmarks" / "results" / "mtp_acceptance.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    started = time.perf_counter()
    model = load_model(args.checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    prompts = held_out_prompts(args.sessions, tokenizer, args.turns, args.max_prompt)
    accepted: dict[int, list[int]] = {k: [] for k in DRAFTS}
    for prompt in prompts:
        read = read_prompt(model, prompt)
        plain = greedy_decode(model, read, args.new_tokens)
        for k in DRAFTS:
            decoded = speculative_decode(model, read, args.new_tokens, k)
            if decoded.tokens != plain:
                raise AssertionError(f"k={k}: drafted decoding left plain greedy on a {len(prompt)}-token prompt")
            accepted[k] += decoded.accepted
    lengths = {k: 1 + sum(steps) / len(steps) for k, steps in accepted.items()}
    checkpoint = args.checkpoint.resolve()
    record = {
        "checkpoint": str(checkpoint.relative_to(REPO)) if checkpoint.is_relative_to(REPO) else str(checkpoint),
        "prompts": len(prompts),
        "prompt_tokens_mean": round(sum(p.numel() for p in prompts) / len(prompts)),
        "new_tokens": args.new_tokens,
        "equal_to_plain_greedy": True,
        "mean_accepted_length": {str(k): round(length, 3) for k, length in lengths.items()},
        "verify_steps": {str(k): len(steps) for k, steps in accepted.items()},
        "wall_s": round(time.perf_counter() - started, 1),
    }
    args.record.write_text(json.dumps(record, indent=1) + "\n")
    for k, length in lengths.items():
        print(f"k={k}: mean accepted length {length:.2f} ({len(accepted[k])} verify steps)")
    print(f"{len(prompts)} held-out prompts, {args.new_tokens} tokens each, equal to plain greedy; {record['wall_s']}s")


if __name__ == "__main__":
    main()
