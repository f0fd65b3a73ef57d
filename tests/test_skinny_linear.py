"""The skinny-matmul kernel equals `F.linear`: on the CPU through Triton's interpreter (a subprocess, since the
interpreter is chosen when a kernel is defined), on CUDA in tests/test_gpu.py; and only CUDA half-precision
calls of few rows take it, so the CPU engine's arithmetic is unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_interpreter import run_checks_script

from legato.layers import skinny_linear


def test_skinny_linear_equals_f_linear_under_the_interpreter():
    pytest.importorskip("triton", reason="Triton is not installed (the test extra installs it)")
    run = run_checks_script("skinny_linear_checks.py")
    assert run.returncode == 0 and "ALL OK" in run.stdout, run.stdout + run.stderr
    assert run.stdout.count(" ok\n") == 6  # every shape and the strided input


def test_cpu_calls_and_wide_or_fp32_inputs_take_f_linear():
    x, w = torch.randn(2, 16), torch.randn(8, 16)
    assert not skinny_linear.takes(x, w)
    assert torch.equal(skinny_linear.linear(x, w), F.linear(x, w))
    assert not skinny_linear.takes(x.bfloat16(), w.bfloat16())  # a CPU tensor, whatever its dtype


def test_tiles_depend_on_the_weight_shape_only():
    # At least ~256 programs where the width allows, never fewer than 4 columns per program.
    assert [skinny_linear.block_n(n) for n in (1024, 2048, 3072, 4096, 6144, 16)] == [4, 8, 8, 16, 16, 4]
