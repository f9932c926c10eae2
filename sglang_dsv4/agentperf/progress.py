"""The progress bar: the running trial's share of its window and the run's time, redrawn on a terminal."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TextIO

BAR_WIDTH = 24
REDRAW_S = 0.5


class Progress:
    """On a terminal, one line redrawn twice a second while a trial runs; every finished trial gets a line."""

    def __init__(self, run_seconds: float, stream: TextIO = sys.stderr) -> None:
        self.run_seconds = run_seconds
        self.stream = stream
        self.live = stream.isatty()
        self.run_start: float | None = None

    @asynccontextmanager
    async def trial(self, label: str, window_s: float) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        self.run_start = loop.time() if self.run_start is None else self.run_start
        ticker = asyncio.create_task(self._redraw(label, loop.time(), window_s)) if self.live else None
        try:
            yield
        finally:
            if ticker is not None:
                ticker.cancel()
                self.stream.write("\r\033[K")

    def finished(self, line: str) -> None:
        self.stream.write(line + "\n")
        self.stream.flush()

    async def _redraw(self, label: str, started: float, window_s: float) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self.stream.write(
                "\r\033[K" + self.line(label, loop.time() - started, window_s, loop.time() - self.run_start)
            )
            self.stream.flush()
            await asyncio.sleep(REDRAW_S)

    def line(self, label: str, trial_s: float, window_s: float, run_s: float) -> str:
        """``[#####-------] label  12/30s  run 140/600s`` (past the window: the last replies draining)."""
        filled = min(BAR_WIDTH, int(BAR_WIDTH * trial_s / window_s))
        bar = "#" * filled + "-" * (BAR_WIDTH - filled)
        return f"[{bar}] {label}  {trial_s:.0f}/{window_s:.0f}s  run {run_s:.0f}/{self.run_seconds:.0f}s"
