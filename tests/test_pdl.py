"""Programmatic dependent launch (`legato/layers/pdl.py`): off by default and never on for CPU tensors; with it on,
the decode step's Triton kernels compile for Hopper with the wait before anything they read from the kernel before
and the release after it, and the matmul asks L2 for its weights first; without it they have neither. The norm
kernel that replaces torch.compile's in a PDL chain equals it under the interpreter (and on CUDA in test_gpu.py)."""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import hopper_asm, run_checks_script, skip_unless_ptxas

from legato.layers import fused, norm_kernel, pdl


def test_the_norm_kernel_equals_the_compiled_norm_under_the_interpreter():
    pytest.importorskip("triton", reason="Triton is not installed (the test extra installs it)")
    run = run_checks_script("norm_kernel_checks.py")
    assert run.returncode == 0 and "ALL OK" in run.stdout, run.stdout + run.stderr
    assert run.stdout.count(" ok\n") == 3


def test_pdl_is_off_by_default_and_never_on_for_cpu_tensors(monkeypatch):
    assert pdl.ENABLED is False
    x = torch.randn(2, 8)
    assert not pdl.on(x) and pdl.launch_args(False) == {}
    monkeypatch.setattr(pdl, "ENABLED", True)
    assert not pdl.on(x)
    delta, weight = torch.randn(2, 8), torch.rand(8)
    got, want = norm_kernel.add_rms_norm(x, delta, weight, 1e-6), fused.add_rms_norm(x, delta, weight, 1e-6)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))  # the CPU path is unchanged


def _ptx(kernel, constexprs: dict, types: dict) -> str:
    return hopper_asm(kernel, constexprs, types)["ptx"]


def test_kernels_launched_with_pdl_wait_for_the_kernel_before_and_only_then_release_the_next():
    """Each kernel in a PDL chain, compiled for sm_90 with PDL on and off: on, its PTX waits (griddepcontrol.wait)
    before it releases the next kernel (griddepcontrol.launch_dependents), and the matmul prefetches into L2 before
    both; off, none of them appear."""
    skip_unless_ptxas()
    from legato.layers import fused_attention as fa
    from legato.layers import small_matmul as sm

    attn_types = {**{n: "*fp32" for n in ("cos_ptr", "sin_ptr", "ml_ptr", "acc_ptr")}, "tables_ptr": "*i32",
                  "lens_ptr": "*i32", "eps": "fp32", "scale": "fp32"}
    attn = dict(HEADS=16, KV_HEADS=8, GROUP=2, GROUP_PAD=16, HEAD_DIM=128, BLOCK_SIZE=16, PAGED=True, SPLITS=16,
                MIN_SPAN=64, BLOCK_N=32)
    cases = {
        "matmul": (sm._rows_kernel, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, GATED=True, PARTS=False,
                                         PRECISION="tf32"), {}),
        "matmul parts": (sm._rows_kernel, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, GATED=False, PARTS=True,
                                               PRECISION="tf32"), {"part_ptr": "*fp32"}),
        "sum of parts": (sm._sum_parts_kernel, dict(GATED=False, BLOCK=256), {"part_ptr": "*fp32"}),
        "norm": (norm_kernel._add_rms_norm_kernel, dict(BLOCK=1024), {"eps": "fp32"}),
        "attention": (fa._fused_decode_kernel, dict(**attn, DOT=True, PRECISION="tf32", PV_PRECISION="tf32x3"),
                      attn_types),
        "combine": (fa._combine_splits_kernel, dict(**{**attn, "GROUP_PAD": 2}), attn_types),
    }
    for name, (kernel, meta, types) in cases.items():
        on, off = _ptx(kernel, {**meta, "PDL": True}, types), _ptx(kernel, {**meta, "PDL": False}, types)
        wait, release = on.find("griddepcontrol.wait"), on.find("griddepcontrol.launch_dependents")
        assert 0 <= wait < release, name
        assert "griddepcontrol" not in off and "prefetch.global.L2" not in off, name
        if name.startswith("matmul"):
            assert 0 <= on.find("prefetch.global.L2") < wait, name
