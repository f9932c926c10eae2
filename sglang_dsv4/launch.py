"""Start the real ``python -m sglang.launch_server`` on this host (tests, demo, benchmarks)."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import requests

STARTUP_TIMEOUT_S = 240
ROUTER_STARTUP_S = 120
ONE_TORCH_THREAD = {"OMP_NUM_THREADS": "1"}
"""Server environment for load runs on a small shared host: with two torch threads each op's barrier waits out
other processes' time slices, and decode under concurrent agents slows 10-30x."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# Under attention DP, SGLang binds ``port + 233`` (its ``ZMQ_TCP_PORT_DELTA``) and the six ports after it.
DERIVED_PORT_OFFSETS = range(233, 233 + 7)
# Below 22000, where SGLang picks each server's ``nccl_port`` after our check (``get_free_port_below_ephemeral``:
# 22000 up to the ephemeral range) and where smg binds its metrics (29000 by default), so neither can take a
# derived port between our check and SGLang's precheck; and below Linux's ephemeral range (32768 up).
SGLANG_NCCL_PORTS_START = 22_000
SERVER_PORTS = range(10_000, SGLANG_NCCL_PORTS_START - DERIVED_PORT_OFFSETS[-1])


def free_server_port() -> int:
    """A ``--port`` free with every port SGLang derives from it, chosen below the ephemeral range.

    An ephemeral ``--port`` put the derived ports among those the host's client connections take their
    local ports from: one was taken, SGLang's precheck waited on it, and the server never started."""
    for port in random.sample(SERVER_PORTS, 200):
        if all(_is_free(port + offset) for offset in (0, *DERIVED_PORT_OFFSETS)):
            return port
    raise RuntimeError(f"no port in {SERVER_PORTS} is free with its derived ports")


def _is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@contextmanager
def running_server(
    model_path: Path,
    *extra_args: str,
    log_path: Path,
    env: dict | None = None,
    startup_timeout_s: float = STARTUP_TIMEOUT_S,
    max_total_tokens: int | None = 4096,
) -> Iterator[str]:
    """A CPU server on a free loopback port, healthy within ``startup_timeout_s``; yields its base URL and stops it
    on exit.

    Started from ``log_path``'s folder, outside any source tree, so the installed package
    is the one imported; in a process group of its own, so that stopping it stops every
    process it started (schedulers, DP controller, detokenizer), whatever state it is in.
    """
    port = free_server_port()
    command = server_command(model_path, port, *extra_args, max_total_tokens=max_total_tokens)
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, cwd=log_path.parent, env={**os.environ, **(env or {})},
            start_new_session=True,
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_until_healthy(url, process, log_path, startup_timeout_s)
            yield url
        finally:
            stop_process_group(process)


def stop_process_group(process: subprocess.Popen) -> None:
    """SIGKILL to the server's whole process group (launcher, schedulers, DP controller, detokenizer):
    a server process left behind keeps its memory and its port for the rest of a test session.

    Not SIGTERM: SGLang's graceful shutdown polls every 5 s, which on a test suite of thirty servers is
    minutes of CI, and a server's state (its pools and prefix cache) lives in its own processes' memory,
    so nothing is lost that a drain would have kept."""
    _signal_group(process.pid, signal.SIGKILL)
    process.wait()


def _signal_group(group: int, signal_number: int) -> None:
    try:
        os.killpg(group, signal_number)
    except ProcessLookupError:
        pass  # every process of the group has exited


def server_command(model_path: Path, port: int, *extra_args: str, max_total_tokens: int | None = 4096) -> list[str]:
    """``python -m sglang.launch_server`` for this CPU host, bounded pool (``max_total_tokens``; None: sized by
    the pool configurator) and no idle busy-poll."""
    bound = [] if max_total_tokens is None else ["--max-total-tokens", str(max_total_tokens)]
    return [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", str(model_path),
        "--device", "cpu",
        "--host", "127.0.0.1",
        "--port", str(port),
        *bound,
        "--sleep-on-idle",
        *extra_args,
    ]  # fmt: skip


def _wait_until_healthy(url: str, process: subprocess.Popen, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{log_path.read_text()[-4000:]}")
        try:
            if requests.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(1)
    raise RuntimeError(f"server not healthy after {timeout_s:g}s:\n{log_path.read_text()[-4000:]}")


def smg_command() -> str | None:
    """The ``smg`` router beside this Python (the ``pd`` extra installs it), or on the path; None without it."""
    return shutil.which("smg", path=str(Path(sys.executable).parent)) or shutil.which("smg")


@contextmanager
def running_pd_router(prefill: str, bootstrap_port: int, decode: str, log_path: Path) -> Iterator[str]:
    """``smg launch --pd-disaggregation`` in front of a prefill instance (its bootstrap port) and a decode instance;
    yields its URL once it lists their model, and stops it on exit."""
    port = free_port()
    command = [smg_command(), "launch", "--host", "127.0.0.1", "--port", str(port),
               "--prometheus-port", str(free_port()), "--pd-disaggregation",
               "--prefill", prefill, str(bootstrap_port), "--decode", decode]  # fmt: skip
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ROUTER_STARTUP_S
        while not _lists_a_model(url):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"smg did not start:\n{log_path.read_text()[-4000:]}")
            time.sleep(1)
        yield url
    finally:
        stop_process_group(process)


def _lists_a_model(url: str) -> bool:
    with contextlib.suppress(requests.RequestException, ValueError, KeyError):
        return bool(requests.get(f"{url}/v1/models", timeout=5).json()["data"])
    return False


@contextmanager
def running_emulated_server(
    config: str,
    *extra_args: str,
    log_path: Path,
    gpus: int = 8,
    context_length: int = 131072,
    env: dict | None = None,
    timing: dict | None = None,
) -> Iterator[str]:
    """``dsv4 emulate``'s server (:mod:`sglang_dsv4.emulation`) on a free loopback port; its pools as the ledger
    sizes them for one H200 of ``gpus``; ``timing``: :func:`~.emulation.command.emulation_env`'s other arguments
    (attention, attention_tp, experts, host_speed)."""
    from .emulation.command import DEFAULT_MEM_FRACTION_STATIC, emulated_model_dir, emulation_env

    model_dir = emulated_model_dir(config, log_path.parent / f"emulated-{config}")
    with running_server(
        model_dir,
        "--load-format", "dummy",
        "--context-length", str(context_length),
        "--mem-fraction-static", str(DEFAULT_MEM_FRACTION_STATIC),
        *extra_args,
        log_path=log_path,
        env={**(env or {}), **emulation_env(gpus, **(timing or {}))},
        max_total_tokens=None,
    ) as url:  # fmt: skip
        yield url
