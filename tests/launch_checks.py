"""What stops SGLang's launcher: checked by launching it, or by its own resolution step in this process.

The launcher runs ``prepare_server_args(sys.argv[1:])``, then ``ServerArgs.resolve_once()`` (where every
plugin check runs: the config, the parallel sizes, speculation, cache tiers) before it starts any scheduler.
:func:`launch_until_exit` starts the real ``python -m sglang.launch_server`` (a process start costs about
20 s of CI); :func:`refusal_at_resolution` runs those same two steps in this process, with SGLang's plugins
loaded as the launcher loads them (:func:`conftest.sglang_with_plugin`). One real launch per refusal path
shows the launcher stops with the message; the other refusals on that path are checked in process.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from sglang_dsv4.launch import free_port, server_command
from sglang_dsv4.tiny import TINY_CONFIG

LAUNCH_TIMEOUT_S = 240


def launch_until_exit(model_path: Path, *args: str) -> subprocess.CompletedProcess:
    """The real launcher on ``model_path`` with ``args``, run until it exits (a refused start)."""
    return subprocess.run(
        server_command(model_path, free_port(), *args),
        check=False,
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT_S,
        cwd=model_path,
    )


def refusal_at_resolution(model_path: Path, *args: str) -> str:
    """``"<error type>: <message>"`` of the error that stops the launcher's resolution of these arguments."""
    from sglang.srt.server_args import prepare_server_args

    server_args = prepare_server_args(server_command(model_path, free_port(), *args)[3:])
    with pytest.raises(Exception) as refusal:  # noqa: PT011 - the type is part of what the caller checks
        server_args.resolve_once()
    return f"{refusal.typename}: {refusal.value}"


def resolved_at_resolution(model_path: Path, *args: str):
    """SGLang's server arguments as the launcher's resolution leaves them (the plugin's settings applied)."""
    from sglang.srt.server_args import prepare_server_args

    server_args = prepare_server_args(server_command(model_path, free_port(), *args)[3:])
    server_args.resolve_once()
    return server_args


def config_only_checkpoint(directory: Path, **changes) -> Path:
    """A checkpoint directory with only config.json: the launcher must refuse it before loading anything."""
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({**TINY_CONFIG, **changes}))
    return directory
