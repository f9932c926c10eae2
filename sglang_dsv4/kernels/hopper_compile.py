"""Triton launches compiled for the H200 (sm_90) on a host without a GPU, for checks and reports.

While a :class:`CompiledForHopper` is active, Triton's active driver is an sm_90 device that is never launched on
and every ``@triton.jit`` launch compiles (Triton's ``warmup``) instead of running; the compiled kernels are kept
in launch order with their functions' names. The package's wrappers are called as usual with CPU tensors, so the
tiles are the ones they choose. Not used when serving.
"""

from __future__ import annotations

from typing import Any

from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction


class _Hopper:
    """Triton's active driver while compiling: an sm_90 device that is never launched on."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)


class CompiledForHopper:
    """While active, a Triton launch compiles for sm_90 and is recorded as ``(function name, compiled kernel)``
    in :attr:`compiled` instead of running; on exit no sm_90 binary lingers for a later launch in this process."""

    def __init__(self) -> None:
        self.compiled: list[tuple[str, Any]] = []
        self._touched: set[JITFunction] = set()
        self._run = JITFunction.run

    def __enter__(self) -> CompiledForHopper:
        run, compiled, touched = self._run, self.compiled, self._touched

        def compile_only(function, *args, grid, warmup, **kwargs):
            kernel = run(function, *args, grid=grid, warmup=True, **kwargs)
            compiled.append((function.fn.__name__, kernel))
            touched.add(function)
            return kernel

        driver.set_active(_Hopper())
        JITFunction.run = compile_only
        return self

    def __exit__(self, *exc) -> None:
        JITFunction.run = self._run
        for function in self._touched:
            function.device_caches.clear()
        driver._active = None

    def new_since(self, count: int) -> list[tuple[str, Any]]:
        """What was compiled after the first ``count`` launches."""
        return self.compiled[count:]
