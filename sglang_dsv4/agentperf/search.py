"""The CPG search: the largest concurrency whose trials meet the SLO, found by raising it until one fails.

Concurrency doubles from 1 until a level fails (or ``max_concurrency`` passes), then bisects between the
last passing and the first failing level, one trial a level. The two levels left at the boundary are then
repeated until a majority of ``trials`` agrees on each, so one noisy run cannot decide the result: if the
passing one fails its majority, or the failing one passes, the search resumes from there (a confirmed level
is never run again). The result assumes what the SLO implies: more agents never make any agent faster.
"""

from __future__ import annotations

from collections.abc import Generator


class CpgSearch:
    """Drive with ``steps()``: it yields each concurrency to try and is sent whether that trial met the SLO."""

    def __init__(self, max_concurrency: int, trials: int) -> None:
        if max_concurrency < 1 or trials < 1:
            raise ValueError(f"max_concurrency ({max_concurrency}) and trials ({trials}) must be at least 1")
        self.max_concurrency = max_concurrency
        self.majority = trials // 2 + 1
        self.outcomes: dict[int, list[bool]] = {}
        self.passing = 0  # the largest level known to pass (0: none yet)

    def steps(self) -> Generator[int, bool, int]:
        """The search; its return value is the CPG (largest confirmed passing concurrency, 0 if none)."""
        failing: int | None = None
        while True:
            failing = yield from self._bracket(failing)
            if self.passing and not (yield from self._judge(self.passing, confirm=True)):
                failing = self.passing
                self.passing = max((c for c in self.outcomes if c < failing and self._passes(c)), default=0)
            elif failing is not None and (yield from self._judge(failing, confirm=True)):
                self.passing = failing
                failing = min((c for c in self.outcomes if c > failing and not self._passes(c)), default=None)
            else:
                return self.passing

    def _bracket(self, failing: int | None) -> Generator[int, bool, int | None]:
        """Narrow to adjacent passing/failing levels (``failing`` ``None``: none fails up to the maximum)."""
        while failing is None or failing - self.passing > 1:
            if failing is None and self.passing >= self.max_concurrency:
                return None
            probe = max(1, 2 * self.passing) if failing is None else (self.passing + failing) // 2
            probe = min(probe, self.max_concurrency)
            if (yield from self._judge(probe, confirm=False)):
                self.passing = probe
            else:
                failing = probe
        return failing

    def lower_bound(self) -> int:
        """For a search cut short: the largest level whose trials so far mostly passed, as did every level tried
        below it (a level being confirmed with its trials tied does not count)."""
        bound = 0
        for concurrency in sorted(self.outcomes):
            if not self._passes(concurrency):
                break
            bound = concurrency
        return bound

    def _judge(self, concurrency: int, confirm: bool) -> Generator[int, bool, bool]:
        """Run trials at ``concurrency`` until it has one (or, to ``confirm``, a majority); return its verdict."""
        results = self.outcomes.setdefault(concurrency, [])
        while not results or (confirm and max(results.count(True), results.count(False)) < self.majority):
            results.append((yield concurrency))
        return self._passes(concurrency)

    def _passes(self, concurrency: int) -> bool:
        results = self.outcomes[concurrency]
        return results.count(True) > results.count(False)
