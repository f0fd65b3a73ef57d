"""The fused draw kernel gives `sampler.draw`'s tokens: on the CPU through Triton's interpreter (a subprocess,
since the interpreter is chosen when a kernel is defined), on CUDA in tests/test_gpu.py; the CPU engine never
takes it."""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import compile_for_hopper, run_checks_script, skip_unless_ptxas


def test_fused_draw_equals_draw_under_the_interpreter():
    pytest.importorskip("triton", reason="Triton is not installed (the test extra installs it)")
    run = run_checks_script("draw_kernel_checks.py")
    assert run.returncode == 0 and "ALL OK" in run.stdout, run.stdout + run.stderr
    assert run.stdout.count(" ok\n") == 6  # both head widths, two rounds, and a codebook given as an int


def test_the_cpu_sampler_never_takes_the_kernel():
    from legato.engine import draw_kernel

    assert not draw_kernel.available(torch.zeros(1, 8))


def test_the_draw_kernel_compiles_for_hopper():
    skip_unless_ptxas()
    from legato.engine import draw_kernel

    types = {"logits_ptr": "*fp32", "do_ptr": "*i1", "temp_ptr": "*fp32", "topk_ptr": "*i64", "topp_ptr": "*fp32",
             "seed_ptr": "*i64", "frame_ptr": "*i64", "codebook_ptr": "*i64", "out_ptr": "*i64"}
    for block in (2048, 4096):
        for fixed in (False, True):
            constexprs = dict(BLOCK_V=block, EXACT=True, MASS_SCALE=draw_kernel._MASS_SCALE, FIXED_CODEBOOK=fixed)
            assert compile_for_hopper(draw_kernel._draw_kernel, constexprs, types) > 0
