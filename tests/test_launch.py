"""Servers started by :func:`sglang_dsv4.launch.running_server` get a port SGLang can derive its own from, and
stopping one leaves none of its processes behind."""

from __future__ import annotations

import inspect
import random
import socket
import subprocess
import sys
import time

from sglang_dsv4 import launch
from sglang_dsv4.launch import stop_process_group

# A launcher whose child ignores SIGTERM and outlives it, as a scheduler stuck in a forward would: the child's
# pid is the launcher's first line of output.
LAUNCHER = """
import signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); \\
print(flush=True); time.sleep(600)"], stdout=subprocess.PIPE)
child.stdout.readline()  # the child ignores SIGTERM from here on
print(child.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a killed process not reaped yet is a zombie: state Z)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_stopping_a_server_stops_every_process_it_started_even_one_that_ignores_sigterm():
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, start_new_session=True)
    child = int(launcher.stdout.readline())
    assert _alive(child)
    stop_process_group(launcher)
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:  # reaped by init once killed
        time.sleep(0.1)
    assert not _alive(child)


def test_a_server_port_is_chosen_with_the_ports_sglang_derives_from_it_free(monkeypatch):
    from sglang.srt.server_args import ZMQ_TCP_PORT_DELTA

    assert launch.DERIVED_PORT_OFFSETS[0] == ZMQ_TCP_PORT_DELTA
    first, second = launch.free_server_port(), launch.free_server_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", first + launch.DERIVED_PORT_OFFSETS[3]))  # one of first's derived ports in use
        taken.listen()
        monkeypatch.setattr(random, "sample", lambda population, count: [first, second])
        assert launch.free_server_port() == second
    assert all(port < 32768 - launch.DERIVED_PORT_OFFSETS[-1] for port in (first, second))


def test_a_server_port_derives_no_port_where_sglang_picks_its_nccl_port():
    from sglang.srt.utils.network import get_free_port_below_ephemeral

    nccl_ports_start = inspect.signature(get_free_port_below_ephemeral).parameters["low"].default
    assert launch.SERVER_PORTS[-1] + launch.DERIVED_PORT_OFFSETS[-1] < nccl_ports_start
