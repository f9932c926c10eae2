"""What each attention-DP rank's prefix cache tells the DP controller's router: the checkpoints it made and
dropped, over a ZMQ channel of our own (a PUSH per rank, one PULL in the controller).

The channel's address is an IPC path named by the server's ``PortArgs.instance_id`` (a fresh id per launch,
as SGLang names its own load collector), so two servers on one host never share it, and it works whether
or not ``--kv-events-config`` is set. Only ranks on the controller's node report (an IPC path does not
reach another node); the router routes the other nodes' ranks by load alone.

A rank sends, as its prefix cache (:class:`~sglang_dsv4.prefix_cache.tree.V4RadixCache`) changes:

* :class:`Made`: the checkpoints one ``checkpoint`` call attached for request ``rid`` (prefill-chunk ends,
  the prompt's end and a token before it, interval points, the finished request's end), by position; the
  router knows the prompt it routed, so only tokens past the prompt travel (the output, at the request's
  end);
* :class:`Dropped`: a checkpoint it made for ``rid`` at ``position`` is gone (evicted, superseded, or its
  tokens evicted);
* :class:`Released`: ``rid`` left the rank (the router forgets its prompt);
* :class:`Flushed`: the whole tree was reset (``/flush_cache``).

Sends never block (SGLang's sockets have no high-water mark); the controller drains what has arrived before
each decision and never waits (:class:`ReportReader`).
"""

from __future__ import annotations

import hashlib
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass

import zmq


@dataclass(frozen=True)
class Made:
    rank: int
    rid: str
    positions: tuple[int, ...]
    tokens_past_prompt: tuple[int, ...]


@dataclass(frozen=True)
class Dropped:
    rank: int
    rid: str
    position: int


@dataclass(frozen=True)
class Released:
    rank: int
    rid: str


@dataclass(frozen=True)
class Flushed:
    rank: int


RankReport = Made | Dropped | Released | Flushed


def report_address(instance_id: str) -> str:
    """The IPC endpoint of one server's rank reports, named by its launch's ``instance_id``."""
    digest = hashlib.blake2s(instance_id.encode(), digest_size=6).hexdigest()
    return f"ipc://{tempfile.gettempdir()}/sglang_dsv4_rank_reports_{digest}.sock"


class RankReporter:
    """One rank's end of the channel: what its prefix cache made and dropped, per request."""

    def __init__(self, address: str, rank: int):
        from sglang.srt.utils.network import get_zmq_socket

        self.rank = rank
        self._socket = get_zmq_socket(zmq.Context.instance(), zmq.PUSH, address, bind=False)

    def made(self, rid: str, positions: Sequence[int], tokens_past_prompt: Sequence[int]) -> None:
        self._send(Made(self.rank, rid, tuple(positions), tuple(tokens_past_prompt)))

    def dropped(self, rid: str, position: int) -> None:
        self._send(Dropped(self.rank, rid, position))

    def released(self, rid: str) -> None:
        self._send(Released(self.rank, rid))

    def flushed(self) -> None:
        self._send(Flushed(self.rank))

    def _send(self, report: RankReport) -> None:
        self._socket.send_pyobj(report, flags=zmq.NOBLOCK)


class ReportReader:
    """The controller's end: every report that has arrived, without waiting for more."""

    def __init__(self, address: str):
        from sglang.srt.utils.network import get_zmq_socket

        self._socket = get_zmq_socket(zmq.Context.instance(), zmq.PULL, address, bind=True)

    def drain(self) -> list[RankReport]:
        reports = []
        while True:
            try:
                reports.append(self._socket.recv_pyobj(flags=zmq.NOBLOCK))
            except zmq.Again:
                return reports
