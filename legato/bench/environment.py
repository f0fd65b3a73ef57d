"""Where and on what a benchmark ran, recorded with every sweep so a number can be traced to its commit."""

from __future__ import annotations

import datetime
import os
import platform
import shutil
import subprocess


def _run(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out or None


def commit() -> str | None:
    """The git commit of the working tree (LEGATO_COMMIT wins: copies without .git, e.g. a GPU box)."""
    return os.environ.get("LEGATO_COMMIT") or _run(["git", "rev-parse", "--short=12", "HEAD"])


def gpus() -> list[str]:
    if shutil.which("nvidia-smi") is None:
        return []
    out = _run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"])
    return out.splitlines() if out else []


def environment() -> dict:
    return {"commit": commit(), "host": platform.node(), "python": platform.python_version(),
            "cpus": os.cpu_count(), "gpus": gpus(),
            "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
