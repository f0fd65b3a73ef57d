"""The fused draw kernel gives `sampler.draw`'s tokens: on the CPU through Triton's interpreter (a subprocess,
since the interpreter is chosen when a kernel is defined), on CUDA in tests/test_gpu.py; the CPU engine never
takes it."""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import run_checks_script


def test_fused_draw_equals_draw_under_the_interpreter():
    pytest.importorskip("triton", reason="Triton is not installed (the test extra installs it)")
    run = run_checks_script("draw_kernel_checks.py")
    assert run.returncode == 0 and "ALL OK" in run.stdout, run.stdout + run.stderr
    assert run.stdout.count(" ok\n") == 2  # both head widths


def test_the_cpu_sampler_never_takes_the_kernel():
    from legato.engine import draw_kernel

    assert not draw_kernel.available(torch.zeros(1, 8))
