"""Where and on what a benchmark ran, recorded with every sweep so a number can be traced to its commit."""

from __future__ import annotations

import datetime
import os
import platform
import shutil
import subprocess
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # legato/


def _run(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out or None


def commit() -> str | None:
    """The git commit of the legato checkout this package runs from (LEGATO_COMMIT wins: copies without .git,
    e.g. a GPU box); None for an installed copy. Git is asked in the package's own folder, not the working
    directory: a sweep run from a results folder recorded None, and from another repository that one's commit."""
    if os.environ.get("LEGATO_COMMIT"):
        return os.environ["LEGATO_COMMIT"]
    out = _run(["git", "-C", str(PACKAGE_DIR), "rev-parse", "--show-prefix", "--short=12", "HEAD"])
    lines = out.splitlines() if out else []
    # Only a checkout whose top holds the package: a copy installed in a venv inside some project's repository
    # is not at that repository's commit.
    return lines[1] if len(lines) == 2 and lines[0] == f"{PACKAGE_DIR.name}/" else None


def gpus() -> list[str]:
    if shutil.which("nvidia-smi") is None:
        return []
    out = _run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"])
    return out.splitlines() if out else []


def environment() -> dict:
    return {"commit": commit(), "host": platform.node(), "python": platform.python_version(),
            "cpus": os.cpu_count(), "gpus": gpus(),
            "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
