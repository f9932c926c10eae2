"""The emulated GPU of one rank: a queue of forwards on the rank's clock, and the one place the host waits on it.

A GPU runs what the host issued in order, while the host goes on: :meth:`EmulatedDevice.issue` queues a forward
of a given duration after the ones before it and returns at once with the time it will finish. SGLang's overlap
loop waits for a forward only where it reads its sampled tokens on the host (the ``copy_done`` event of the
batch result, synchronized before the result is processed); :class:`ForwardDone` stands in for that event and
sleeps until the forward's finish. On ``--device cpu`` SGLang's own events do nothing, so without this the
scheduler would never wait.

Time is the rank's own (:class:`RankClock`): the wall clock less the time the scheduler's thread waited for a CPU
(other ranks and processes on this host's cores), with the thread's CPU time (``time.thread_time``) scaled by the
host-speed factor, so that the device sees the host work an H200 host's core would do, uncontended. The waits are
real sleeps of the clock's remaining time. Where the emulated host is the slower (factor above 1), the host first
sleeps off what its work took less than the emulated host's (:meth:`RankClock.settle`), so that the clients' wall
times keep pace with the rank's clock; they fall behind it only where this host's contention exceeds that.

The host tier's copies (:mod:`.host_tier`): a load runs on a copy engine beside the forwards, as our loads run on a
stream of their own, and the next forward issued starts after it (:meth:`EmulatedDevice.load`); the host's part
of a copy (issuing a load, waiting for a write-back's device-to-host copy) holds the host
(:meth:`EmulatedDevice.hold_host`).

Occupancy is the device's busy time over the rank's time since its first forward: what SGLang's
``fwd_occupancy`` reads on a GPU.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..settings import settings


def runqueue_wait_s() -> float:
    """Seconds this thread has waited for a CPU while runnable (Linux ``schedstat``; 0 where there is none)."""
    try:
        return int(Path(f"/proc/self/task/{threading.get_native_id()}/schedstat").read_text().split()[1]) * 1e-9
    except (OSError, IndexError, ValueError):
        return 0.0


class RankClock:
    """One thread's clock: wall time less its waits for a CPU, its CPU time counted ``host_speed`` times.

    ``host_speed``: the emulated host's single-thread time over this host's (below 1: a faster host). Blocked
    time (sleeping, waiting for requests) passes at the wall's rate, except the sleeps of :meth:`settle`, which
    stand for host work already counted."""

    def __init__(self, host_speed: float = 1.0):
        self.host_speed = host_speed
        self._start = self._sample()
        self._last_settled, self._last_left_out = self._start, 0.0
        self._owed_s = 0.0
        self.settled_s = 0.0
        self.device_side_s = 0.0

    def now(self) -> float:
        wall, cpu, queued = self._sample()
        start_wall, start_cpu, start_queued = self._start
        host = self.host_speed * (cpu - start_cpu - self.device_side_s)
        return wall - (queued - start_queued) - (cpu - start_cpu) + host - self.settled_s

    def leave_out(self, cpu_s: float) -> None:
        """Leave ``cpu_s`` of this thread's CPU time out of the clock: work a GPU server does on the device."""
        self.device_side_s += cpu_s

    def settle(self) -> None:
        """Sleep off the host work the emulated host does slower than this one (``host_speed`` above 1) since the
        last settle, less the time the thread waited for a CPU meanwhile (contention already slowed it) and the CPU
        time left out of the clock (:meth:`leave_out`), so the wall clock the clients read keeps pace with this
        one. Owed time under a millisecond is carried."""
        sample = self._sample()
        _, cpu, queued = sample
        (_, last_cpu, last_queued), last_left_out = self._last_settled, self._last_left_out
        left_out, slowed = self.device_side_s - last_left_out, queued - last_queued
        owed = (self.host_speed - 1) * (cpu - last_cpu - left_out) - slowed - left_out
        self._owed_s = max(0.0, self._owed_s + owed)
        self._last_settled, self._last_left_out = sample, self.device_side_s
        if self._owed_s < 1e-3:
            return
        time.sleep(self._owed_s)
        after = self._sample()
        self.settled_s += (after[0] - sample[0]) - (after[2] - sample[2])
        self._owed_s, self._last_settled = 0.0, after

    def spent(self) -> dict[str, float]:
        """The thread's CPU seconds, its seconds waiting for a CPU, its settle sleeps and the CPU seconds left out
        (device-side work), since the start."""
        _, cpu, queued = self._sample()
        _, start_cpu, start_queued = self._start
        return {
            "host_cpu_s": cpu - start_cpu,
            "cpu_queued_s": queued - start_queued,
            "settled_s": self.settled_s,
            "device_side_cpu_s": self.device_side_s,
        }

    @staticmethod
    def _sample() -> tuple[float, float, float]:
        return time.monotonic(), time.thread_time(), runqueue_wait_s()


@dataclass
class EmulatedDevice:
    host_speed: float = 1.0
    busy_until: float = 0.0
    busy_s: float = 0.0
    waited_s: float = 0.0
    forwards: int = 0
    loads_until: float = 0.0
    loaded_s: float = 0.0
    held_host_s: float = 0.0
    first_issue: float | None = None
    clock: RankClock | None = field(default=None, repr=False)

    def now(self) -> float:
        """The rank's clock."""
        return self.rank_clock().now()

    def rank_clock(self) -> RankClock:
        """The rank's clock, started by the first call, in the thread that issues and waits: the scheduler's."""
        if self.clock is None:
            self.clock = RankClock(self.host_speed)
        return self.clock

    def issue(self, seconds: float) -> float:
        """Queue a forward of ``seconds`` behind those issued before; its finish on the rank's clock."""
        now = self.now()
        if self.first_issue is None:
            self.first_issue = now
        self.busy_until = max(now, self.busy_until, self.loads_until) + seconds
        self.busy_s += seconds
        self.forwards += 1
        return self.busy_until

    def load(self, seconds: float) -> None:
        """Queue a host-to-device copy of ``seconds`` on the copy engine, behind the copies issued before it and
        beside the forwards: a forward issued from now on starts after it."""
        self.loads_until = max(self.now(), self.loads_until) + seconds
        self.loaded_s += seconds

    def hold_host(self, seconds: float) -> None:
        """Host work of ``seconds`` that a GPU server's host does and this one does not (the host tier's part of
        its copies): the host sleeps that long."""
        time.sleep(seconds)
        self.held_host_s += seconds

    def wait_until(self, finish: float) -> None:
        """Block the host until the device reaches ``finish``, its own work's slowdown slept off first."""
        self.rank_clock().settle()
        remaining = finish - self.now()
        if remaining > 0:
            time.sleep(remaining)
            self.waited_s += remaining

    def report(self) -> dict[str, float]:
        """Forwards, busy and waited seconds, the host tier's copies in seconds (loads on the copy engine, the
        host held), the rank's seconds since its first forward and occupancy so far (busy time queued ahead
        counted as done), the host-speed factor, and the scheduler thread's time on this host since its clock
        started (CPU, waiting for a CPU, settle sleeps; a clock's reading with each)."""
        wall = 0.0 if self.first_issue is None else max(self.now(), self.busy_until) - self.first_issue
        return {
            **{name: round(seconds, 3) for name, seconds in self.rank_clock().spent().items()},
            "rank_clock_s": round(self.now(), 3),
            "monotonic_s": round(time.monotonic(), 3),
            "forwards": self.forwards,
            "busy_s": round(self.busy_s, 3),
            "host_waited_s": round(self.waited_s, 3),
            "loaded_s": round(self.loaded_s, 6),
            "held_host_s": round(self.held_host_s, 6),
            "wall_s": round(wall, 3),
            "occupancy": round(self.busy_s / wall, 4) if wall > 0 else 0.0,
            "host_speed": self.host_speed,
        }


_DEVICE: EmulatedDevice | None = None


def device() -> EmulatedDevice:
    """This process's emulated device (one rank a process), its host-speed factor from the settings."""
    global _DEVICE
    if _DEVICE is None:
        _DEVICE = EmulatedDevice(host_speed=settings().emulate_host_speed)
    return _DEVICE


class ForwardDone:
    """The ``copy_done`` of a batch result whose forward finishes at ``finish``: SGLang's event interface."""

    def __init__(self, finish: float):
        self.finish = finish

    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return device().now() >= self.finish

    def synchronize(self) -> None:
        device().wait_until(self.finish)


def wait_at_result_copy(original, result, *args, **kwargs):
    """Around SGLang's ``GenerationBatchResult.copy_to_cpu``: the result is ready when the forward just issued
    finishes (the copy is queued right behind it, as on a GPU's stream)."""
    original(result, *args, **kwargs)
    result.copy_done = ForwardDone(device().busy_until)


LAUNCH_S = 20e-6
"""Host time a free-list operation costs a GPU server: one or two tensor ops launched from Python (an assumption,
not measured here); the copy itself on the device, about 50 us at HBM speed, is not added to its timeline."""


def on_the_device(original, *args, **kwargs):
    """Around a free-list operation: its CPU time on this host left out of the rank's clock but a launch's."""
    clock, started = device().rank_clock(), time.thread_time()
    try:
        return original(*args, **kwargs)
    finally:
        clock.leave_out(max(0.0, time.thread_time() - started - LAUNCH_S))
