"""The streaming codec's Triton kernels equal their PyTorch twins: on the CPU through Triton's interpreter (in a
subprocess, since the interpreter is chosen when a kernel is defined), on CUDA in tests/test_gpu.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def test_kernels_equal_their_twins_under_the_interpreter():
    pytest.importorskip("triton", reason="Triton is not installed (the test extra installs it)")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(
        [str(HERE.parent), str(HERE), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, str(HERE / "codec_kernel_checks.py"), "cpu"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "ALL OK" in run.stdout, run.stdout + run.stderr
    assert run.stdout.count(": ") >= 16  # every check ran and reported
