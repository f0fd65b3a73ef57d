"""The fused decode-attention kernel equals its PyTorch contract, and a model with it equals the model without
it: on the CPU through Triton's interpreter (a subprocess, since the interpreter is chosen when a kernel is
defined), on CUDA in tests/test_gpu.py. On the CPU the engine itself never takes the kernel (`available`)."""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import compile_for_hopper, run_checks_script, skip_unless_ptxas


def test_fused_decode_attention_equals_its_contract_under_the_interpreter():
    pytest.importorskip("triton", reason="Triton is not installed (the test extra installs it)")
    run = run_checks_script("attention_kernel_checks.py")
    assert run.returncode == 0 and "ALL OK" in run.stdout, run.stdout + run.stderr
    assert run.stdout.count(" ok\n") >= 50  # every layout, shape and position, and the model checks


def test_the_cpu_path_never_takes_the_kernel():
    from legato.layers import fused_attention

    assert not fused_attention.available(torch.zeros(1))


def test_a_launch_splits_positions_only_while_its_rows_are_few():
    """Few rows leave the GPU idle unless each row's positions split; from ONE_SPLIT_ROWS rows the splits' combine
    only costs (measured, see the module). The interpreter check runs both branches against the contract."""
    from legato.layers import fused_attention as fa

    assert [fa.splits(r) for r in (1, fa.ONE_SPLIT_ROWS - 1)] == [fa.SPLITS] * 2
    assert [fa.splits(r) for r in (fa.ONE_SPLIT_ROWS, 64, 256)] == [1] * 3


def test_the_contiguous_cache_refuses_a_position_past_its_capacity():
    pytest.importorskip("triton", reason="Triton is not installed (the test extra installs it)")
    from legato.layers.fused_attention import fused_decode_attention

    cache = torch.zeros(1, 1, 4, 8)
    with pytest.raises(RuntimeError, match="KV cache full"):
        fused_decode_attention(torch.zeros(1, 24), torch.ones(8), torch.ones(8), 1e-6, torch.ones(1, 8),
                               torch.zeros(1, 8), cache, cache.clone(), 1, position=4)


def test_the_attention_kernels_compile_for_hopper():
    """The tensor-core products in bf16 (TF32x3 for the weighted sum) and fp32, and the reduction path, paged and
    contiguous, as far as an sm_90 cubin (the interpreter runs fp32 only)."""
    skip_unless_ptxas()
    from legato.layers import fused_attention as fa

    fp32 = {"cos_ptr", "sin_ptr", "ml_ptr", "acc_ptr"}
    for cache in ("*bf16", "*fp32"):
        types = {**{n: "*fp32" for n in fp32}, "tables_ptr": "*i32", "lens_ptr": "*i32", "eps": "fp32",
                 "scale": "fp32", **{n: cache for n in ("qkv_ptr", "qw_ptr", "kw_ptr", "k_ptr", "v_ptr", "out_ptr")}}
        exact = cache == "*fp32"
        for paged, dot in ((True, True), (False, True), (True, False)):
            meta = dict(HEADS=16, KV_HEADS=8, GROUP=2, GROUP_PAD=16 if dot else 2, HEAD_DIM=128, BLOCK_SIZE=16,
                        PAGED=paged, SPLITS=16 if paged else 1, MIN_SPAN=64, BLOCK_N=32 if paged else 16, DOT=dot,
                        PRECISION="ieee" if exact else "tf32", PV_PRECISION="ieee" if exact else "tf32x3")
            assert compile_for_hopper(fa._fused_decode_kernel, meta, types) > 0, (cache, paged, dot)
