"""Helpers for testing Triton kernels on the CPU, under Triton's interpreter.

Triton fixes interpret mode for a process when it is first imported (its own library
functions are decorated then, interpreted or compiled), so ``TRITON_INTERPRET=1`` must be
set before anything imports Triton, and should not reach other tests or the servers they
start. A kernel test module therefore runs its kernel tests in a fresh process that has
the variable from the start: :func:`run_under_interpreter` starts it, the module's
launcher test asserts it passed, and the kernel tests themselves are marked
:data:`interpreted_only` (skipped in the parent process).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

IN_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
interpreted_only = pytest.mark.skipif(not IN_INTERPRETER, reason="runs in its module's TRITON_INTERPRET=1 process")
launcher_only = pytest.mark.skipif(IN_INTERPRETER, reason="this process is the interpreted one")

# Tolerances against a float64 reference, by the dtype of the kernel's operands.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def run_under_interpreter(test_file: str) -> None:
    """Run ``test_file``'s tests in a fresh process with ``TRITON_INTERPRET=1``; fail with its report."""
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file],
        cwd=root,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, f"kernel tests failed under the interpreter:\n{result.stdout[-6000:]}"


def poison_allocations(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every float tensor that ``new_empty`` / ``empty_like`` allocates start as NaN,
    so an output element a kernel never writes shows up as NaN."""
    new_empty, empty_like = torch.Tensor.new_empty, torch.empty_like

    def poisoned(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor

    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **k: poisoned(new_empty(self, *a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poisoned(empty_like(*a, **k)))


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` in float64; NaN anywhere in ``actual`` fails."""
    assert not torch.isnan(actual).any(), "output has NaN (an element never written?)"
    expected = expected.double()
    return ((actual.double() - expected).norm() / expected.norm().clamp_min(1e-30)).item()
