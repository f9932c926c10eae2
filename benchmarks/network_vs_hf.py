"""The torch network against HF transformers' DeepseekV4ForCausalLM, side by side in one run.

Prints, on the tiny checkpoint (float32, CPU): a 600-token prefill and 100 decode steps,
ours and HF's (median of a few repeats), as times and as a ratio; then the bytes of a
request's state at position 1000 for the tiny config (measured) and for V4-Flash (computed
from the same formula the tiny measurement is checked against).

    python benchmarks/network_vs_hf.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import DeepseekV4ForCausalLM

from sglang_dsv4 import load_model
from sglang_dsv4.config import named_config
from sglang_dsv4.model.state import online_state_floats, state_nbytes
from sglang_dsv4.tiny import build_checkpoint

PREFILL, DECODE_STEPS, STATE_POSITION = 600, 100, 1000


def median_seconds(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def ours_prefill(model, ids):
    model(ids, model.new_state())


def ours_decode(model, ids):
    state = model.new_state()
    model(ids[:PREFILL], state)
    started = time.perf_counter()
    for token in ids[PREFILL : PREFILL + DECODE_STEPS]:
        model(token.view(1), state)
    return time.perf_counter() - started


def hf_prefill(hf, ids):
    with torch.no_grad():
        hf(ids[None])


def hf_decode(hf, ids):
    with torch.no_grad():
        cache = hf(ids[None, :PREFILL], use_cache=True).past_key_values
        started = time.perf_counter()
        for token in ids[PREFILL : PREFILL + DECODE_STEPS]:
            cache = hf(token.view(1, 1), past_key_values=cache, use_cache=True).past_key_values
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as scratch:
        path = build_checkpoint(Path(scratch) / "tiny")
        model = load_model(path)
        hf = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(0, model.config.vocab_size, (STATE_POSITION,))

    ours_p = median_seconds(lambda: ours_prefill(model, ids[:PREFILL]), args.repeats)
    hf_p = median_seconds(lambda: hf_prefill(hf, ids[:PREFILL]), args.repeats)
    ours_d = statistics.median(ours_decode(model, ids) for _ in range(args.repeats))
    hf_d = statistics.median(hf_decode(hf, ids) for _ in range(args.repeats))
    print(f"tiny V4, float32, CPU ({torch.get_num_threads()} threads), median of {args.repeats}")
    print(f"{'':24}{'ours':>10}{'HF':>10}{'HF / ours':>12}")
    print(f"{'prefill 600 tokens':24}{ours_p:>9.3f}s{hf_p:>9.3f}s{hf_p / ours_p:>11.2f}x")
    print(f"{'decode 100 steps':24}{ours_d:>9.3f}s{hf_d:>9.3f}s{hf_d / ours_d:>11.2f}x")

    state = model.new_state()
    model(ids, state)
    tiny = model.config
    print(f"\nstate at position {STATE_POSITION}:")
    print(
        f"  tiny (float32 KV): {state.nbytes:,} B measured, {state_nbytes(tiny, STATE_POSITION, 4):,} B by formula;"
        f" online compressor state {state.compressor_state_nbytes:,} B"
    )
    flash = named_config("flash")
    for label, kv_bytes in (("bf16", 2), ("fp8", 1)):
        print(
            f"  V4-Flash ({label} KV): {state_nbytes(flash, STATE_POSITION, kv_bytes):,} B"
            f" (online compressor state {4 * online_state_floats(flash):,} B, float32)"
        )


if __name__ == "__main__":
    main()
