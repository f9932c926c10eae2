"""The emulated GPU of one rank: a queue of forwards on the wall clock, and the one place the host waits on it.

A GPU runs what the host issued in order, while the host goes on: :meth:`EmulatedDevice.issue` queues a forward
of a given duration after the ones before it and returns at once with the time it will finish. SGLang's overlap
loop waits for a forward only where it reads its sampled tokens on the host (the ``copy_done`` event of the
batch result, synchronized before the result is processed); :class:`ForwardDone` stands in for that event and
sleeps until the forward's finish. On ``--device cpu`` SGLang's own events do nothing, so without this the
scheduler would never wait.

Occupancy is the device's busy time over the wall time since its first forward: what SGLang's ``fwd_occupancy``
reads on a GPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class EmulatedDevice:
    busy_until: float = 0.0
    busy_s: float = 0.0
    waited_s: float = 0.0
    forwards: int = 0
    first_issue: float | None = None

    def issue(self, seconds: float) -> float:
        """Queue a forward of ``seconds`` behind those issued before; its finish time (``time.monotonic``)."""
        now = time.monotonic()
        if self.first_issue is None:
            self.first_issue = now
        self.busy_until = max(now, self.busy_until) + seconds
        self.busy_s += seconds
        self.forwards += 1
        return self.busy_until

    def wait_until(self, finish: float) -> None:
        """Block the host until the device reaches ``finish``."""
        remaining = finish - time.monotonic()
        if remaining > 0:
            time.sleep(remaining)
            self.waited_s += remaining

    def report(self) -> dict[str, float]:
        """Forwards, busy and waited seconds, and occupancy so far (busy time queued ahead counted as done)."""
        wall = 0.0 if self.first_issue is None else max(time.monotonic(), self.busy_until) - self.first_issue
        return {
            "forwards": self.forwards,
            "busy_s": round(self.busy_s, 3),
            "host_waited_s": round(self.waited_s, 3),
            "wall_s": round(wall, 3),
            "occupancy": round(self.busy_s / wall, 4) if wall > 0 else 0.0,
        }


_DEVICE = EmulatedDevice()


def device() -> EmulatedDevice:
    """This process's emulated device (one rank a process)."""
    return _DEVICE


class ForwardDone:
    """The ``copy_done`` of a batch result whose forward finishes at ``finish``: SGLang's event interface."""

    def __init__(self, finish: float):
        self.finish = finish

    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return time.monotonic() >= self.finish

    def synchronize(self) -> None:
        device().wait_until(self.finish)


def wait_at_result_copy(original, result, *args, **kwargs):
    """Around SGLang's ``GenerationBatchResult.copy_to_cpu``: the result is ready when the forward just issued
    finishes (the copy is queued right behind it, as on a GPU's stream)."""
    original(result, *args, **kwargs)
    result.copy_done = ForwardDone(device().busy_until)
