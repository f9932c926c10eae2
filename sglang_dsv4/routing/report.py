"""The router's figures per rank in ``/server_info``: the DP controller writes them to a file named by the
server's launching process just before it forwards a ``/server_info`` request to the ranks; each rank reads
its own while it answers.

The launcher starts the controller, and under attention DP the ranks too (SGLang prelaunches them); in
other layouts the controller starts the ranks. So the file is named by the controller's parent, and a rank
finds it under its parent or its parent's parent.
"""

from __future__ import annotations

import atexit
import json
import os
import tempfile
from pathlib import Path

import psutil


def report_path(server_pid: int) -> Path:
    return Path(tempfile.gettempdir()) / f"sglang_dsv4_routing_{server_pid}.json"


def write_report(report: list[dict[str, float]]) -> None:
    """The controller's per-rank figures, replaced whole (a rank never reads half a file)."""
    path = report_path(os.getppid())
    if not path.exists():
        atexit.register(path.unlink, missing_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(report))
    partial.replace(path)


def rank_report(dp_rank: int) -> dict[str, float] | None:
    """Rank ``dp_rank``'s figures from this server's controller (None: it has no router)."""
    parent = os.getppid()
    for server_pid in (parent, psutil.Process(parent).ppid()):
        path = report_path(server_pid)
        if path.exists():
            return json.loads(path.read_text())[dp_rank]
    return None
