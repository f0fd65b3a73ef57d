"""`legato serve` starting: a port in use is one line before anything loads (issue 20)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from serve_process import ROOT

DEPLOY = ROOT / "deploy"


def serve(tmp: Path, *flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "LEGATO_CACHE": str(tmp / "cache"),
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "legato.cli", "serve", *flags], capture_output=True, text=True,
                          timeout=120, env=env)


@pytest.mark.parametrize("model", [[], ["--model", "/nonexistent/model"]], ids=["default", "missing-model"])
def test_a_port_in_use_is_one_line_before_the_model_loads(tmp_path, model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = serve(tmp_path, "--port", str(port), *model)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"legato serve: error: cannot listen on 127.0.0.1:{port}: the port is already in use (another server?); "
        "stop it or pick another --port"], proc.stderr
    assert not (tmp_path / "cache").exists()  # the default model was never written, let alone loaded


def test_an_address_this_machine_lacks_is_one_line(tmp_path):
    proc = serve(tmp_path, "--host", "192.0.2.1", "--port", "8000")  # TEST-NET-1: never a local address
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "legato serve: error: cannot listen on 192.0.2.1:8000: this machine has no such address; check --host"]
