"""What an emulated rank's scheduler spent a trial on: py-spy's samples of it, by stage of SGLang's overlap loop.

Reads the collapsed stacks ``benchmarks/emulated_cpg.py --profile`` writes for a trial (py-spy ``--idle
--threads --format raw``, the scheduler's process) and, for its main thread, gives each stage of
``Scheduler.event_loop_overlap`` (the first ``Scheduler`` method below it, past the hooks' and metrics'
wrappers: ingest_requests, get_next_batch_to_run, run_batch, process_batch_result, ...) its share of the samples,
split into waiting (sleeping on the emulated device, the host-speed settle, idle polling), the allocator's
free-list operations (a GPU's work, left out of the rank's clock) and working, and the working samples by whose
code they are in: the innermost frame of this plugin (``sglang_dsv4``) or of SGLang,
the libraries they call (torch, zmq, the standard library) counted to their caller. Samples at 50 Hz: a share's
error is about 1/sqrt(samples).

    python benchmarks/scheduler_profile.py /tmp/profiles/ours_7.txt [--top 12]
"""

from __future__ import annotations

import argparse
import functools
import json
import re
from collections import Counter
from pathlib import Path

import sglang

LOOP = "Scheduler.event_loop_overlap"
WAITS = {
    "device": "EmulatedDevice.wait_until",
    "settle": "RankClock.settle",
    "idle": "IdleSleeper.maybe_sleep",
}
WRAPPERS = {"sglang_dsv4/serving/containment.py"}  # ours, around SGLang's run_batch and result processing
SGLANG = Path(sglang.__file__).parent
FRAME = re.compile(r"^(?P<function>.*) \((?P<file>[^()]*?)(?::\d+)?\)$")


def frames(stack: str) -> list[tuple[str, str]]:
    """(function, file) per frame, outermost first, of a collapsed stack without its thread prefix."""
    parsed = []
    for frame in stack.split(";"):
        match = FRAME.match(frame.strip())
        parsed.append((match["function"], match["file"]) if match else (frame.strip(), ""))
    return parsed


def stage_of(stack: list[tuple[str, str]]) -> str:
    """The loop's stage this sample is in (``outside the loop`` before it starts)."""
    names = [function for function, _ in stack]
    if LOOP not in names:
        return "outside the loop"
    below = names[names.index(LOOP) + 1 :]
    stage = next((name for name in below if name.startswith("Scheduler.") and "<locals>" not in name), None)
    return stage or (below[0] if below else "the loop")


def owner(file: str) -> str | None:
    """``emulator`` (the timing model and the emulated device: not on a GPU server), ``ours``, ``SGLang``, or None
    for a library's frame (py-spy names files from their package's folder)."""
    if file.startswith("sglang_dsv4/emulation/") and not file.endswith("backend.py"):
        return "emulator"
    if file.startswith("sglang_dsv4/"):
        return "ours"
    return "SGLang" if file.startswith("sglang/") or in_sglang(file) else None


@functools.cache
def in_sglang(file: str) -> bool:
    """Whether SGLang has a file at a path ending in ``file`` (py-spy shortens paths to their last folders)."""
    return file.endswith(".py") and next(SGLANG.rglob(file), None) is not None


def kind_of(stack: list[tuple[str, str]]) -> str:
    """``wait: <what>`` where the thread sleeps, the free list's device-side work, else ``work: <owner>`` of the
    innermost frame not a library's."""
    names = {function for function, _ in stack}
    for what, function in WAITS.items():
        if function in names:
            return f"wait: {what}"
    if "on_the_device" in names:
        return "device-side: free list"
    return f"work: {next((o for _, file in reversed(stack) if (o := owner(file))), 'other')}"


def tally(path: Path) -> tuple[Counter[tuple[str, str]], Counter[str], int]:
    """The main thread's samples by (stage, kind), the working samples that are ours by our outermost frame
    (``function (file)``, past the wrappers), and the samples in all."""
    by_stage: Counter[tuple[str, str]] = Counter()
    ours: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        thread, _, stack = stack.partition(";")
        if "MainThread" not in thread:
            continue
        parsed, samples = frames(stack), int(count)
        total += samples
        stage, kind = stage_of(parsed), kind_of(parsed)
        by_stage[(stage, kind)] += samples
        if kind == "work: ours":
            mine = (f"{f} ({file})" for f, file in parsed if owner(file) == "ours" and file not in WRAPPERS)
            ours[next(mine, "the wrappers")] += samples
    return by_stage, ours, total


def summarize(path: Path, top: int) -> dict:
    """Shares of the main thread's samples by kind and by stage and kind, and the leading functions of ours (the
    outermost frame of ours on the working samples that are ours)."""
    by_stage, ours, total = tally(path)
    share = lambda n: round(n / max(total, 1), 3)  # noqa: E731
    stages: dict[str, dict[str, float]] = {}
    for (stage, kind), samples in by_stage.most_common():
        stages.setdefault(stage, {})[kind] = share(samples)
    kinds: Counter[str] = Counter()
    for (_, kind), samples in by_stage.items():
        kinds[kind] += samples
    return {
        "samples": total,
        "kinds": {kind: share(n) for kind, n in kinds.most_common()},
        "stages": stages,
        "ours_outermost": {name: share(n) for name, n in ours.most_common(top)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", type=Path)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    print(json.dumps(summarize(args.profile, args.top), indent=1))


if __name__ == "__main__":
    main()
