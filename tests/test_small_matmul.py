"""The few-row GEMM (`legato/layers/small_matmul.py`) equals `F.linear`, gated and not, on the CPU through Triton's
interpreter (a subprocess, since the interpreter is chosen when a kernel is defined) and on CUDA in
tests/test_gpu.py; it compiles for Hopper; only CUDA half-precision calls take it, so the CPU engine's arithmetic
is unchanged; and the serving dispatch (`legato/layers/matmuls.py`) keeps the unfused math where it does not."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_interpreter import compile_for_hopper, run_checks_script, skip_unless_ptxas

from legato.layers import matmuls, small_matmul
from legato.layers.fused import silu_mul
from legato.layers.small_matmul import Tiles


def test_small_matmul_equals_f_linear_under_the_interpreter():
    pytest.importorskip("triton", reason="Triton is not installed (the test extra installs it)")
    run = run_checks_script("small_matmul_checks.py")
    assert run.returncode == 0 and "ALL OK" in run.stdout, run.stdout + run.stderr
    # every case, the normalised, residual and add-norm forms, the strided input
    assert run.stdout.count(" ok\n") == 14


def test_cpu_and_fp32_calls_keep_the_unfused_math():
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 16, generator=gen), torch.randn(8, 16, generator=gen)
    assert not small_matmul.takes(x, w) and not small_matmul.takes(x.bfloat16(), w.bfloat16(), gated=True)
    assert torch.equal(matmuls.linear(x, w), F.linear(x, w))
    gate, up = F.linear(x, w).chunk(2, dim=-1)
    assert torch.equal(matmuls.gated_linear(x, w), silu_mul(gate, up))


def test_tiles_come_from_the_measured_table_then_a_rule_that_splits_only_thin_weights():
    rule = small_matmul.rule_of_thumb
    assert rule(64, 4096, 1024) == Tiles(block_n=32, block_k=128)  # 128 programs from columns alone
    assert rule(1, 1024, 2048) == Tiles(block_n=32, block_k=128, split=4)  # 32 column programs: K split in four
    assert rule(64, 3072, 1024, gated=True).split == 1  # a gated program streams two strips
    assert rule(1, 16, 256).split == 1  # too little K to split
    assert [small_matmul.block_m(m) for m in (1, 9, 16, 33, 64, 256)] == [16, 16, 16, 64, 64, 64]
    assert [small_matmul.table_rows(m) for m in (1, 2, 16, 17, 64, 65, 256)] == [1, 16, 16, 32, 64, 128, 256]
    # The 0.6B's measured entries, gated ones keyed by the packed weight; None keeps the path before the kernel.
    assert small_matmul.tiles_for(64, 6144, 1024, gated=True) == Tiles(32, 128, 1)
    assert small_matmul.tiles_for(200, 4096, 1024) is None
    # A shape the table lacks takes the rule up to 64 rows and the old path above.
    assert small_matmul.tiles_for(8, 512, 1024) == rule(8, 512, 1024)
    assert small_matmul.tiles_for(65, 512, 1024) is None


def test_a_tune_table_file_replaces_the_measured_tiles(tmp_path):
    table = tmp_path / "tiles.json"
    table.write_text('[{"m": 64, "n": 4096, "k": 1024, "gated": false, "tiles": {"block_n": 64, "block_k": 64,'
                     ' "split": 2}}, {"m": 1, "n": 1024, "k": 2048, "gated": false, "tiles": null}]')
    loaded = small_matmul._load_table(str(table))
    assert loaded == {(64, 4096, 1024, False): Tiles(64, 64, 2), (1, 1024, 2048, False): None}


def test_the_small_matmul_kernels_compile_for_hopper():
    """The interpreter runs the kernels' semantics, not the GPU compiler: each form (plain and gated, whole K and
    split, the row norm inside, the residual add, the split sum with the add and the next norm) compiles as far as
    an sm_90 cubin, so a construct the GPU backend refuses fails on the CPU too."""
    skip_unless_ptxas()
    fp32 = {"part_ptr": "*fp32"}
    for gated in (False, True):
        for parts, norm, add in ((False, False, False), (True, False, False), (False, True, False),
                                 (False, False, True), (True, False, True)):
            size = compile_for_hopper(small_matmul._rows_kernel, dict(
                BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, GATED=gated, PARTS=parts, NORM=norm, ADD=add,
                PRECISION="tf32"), fp32)
            assert size > 0
        for add in (False, True):
            assert compile_for_hopper(small_matmul._sum_parts_kernel, dict(GATED=gated, ADD=add, BLOCK=256), fp32) > 0
    for block in (1024, 2048):  # the 0.6B's and the 1.7B's hidden widths
        assert compile_for_hopper(small_matmul._sum_add_norm_kernel, dict(BLOCK_N=block), {**fp32, "EPS": "fp32"}) > 0


def test_the_kernels_compile_for_hopper_with_programmatic_dependent_launch():
    """With PDL (layers/pdl.py) each kernel signals, waits and (the GEMM) warms L2 with inline PTX that only the
    GPU compiler sees: every form compiles to an sm_90 cubin, larger than the form without it."""
    skip_unless_ptxas()
    from legato.engine import draw_kernel
    from legato.layers import fused_attention

    fp32 = {"part_ptr": "*fp32"}
    for gated, parts in ((False, False), (True, False), (False, True)):
        meta = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, GATED=gated, PARTS=parts, NORM=False, ADD=False,
                    PRECISION="tf32", LINES=2, LINE=64)
        plain = compile_for_hopper(small_matmul._rows_kernel, {**meta, "PDL": False}, fp32)
        assert compile_for_hopper(small_matmul._rows_kernel, {**meta, "PDL": True}, fp32) > plain > 0
    from legato.layers import skinny_linear

    skinny = dict(BLOCK_M=1, BLOCK_N=16, BLOCK_K=512, LINES=8, LINE=64)
    assert compile_for_hopper(skinny_linear._skinny_kernel, {**skinny, "PDL": True}, {}) > compile_for_hopper(
        skinny_linear._skinny_kernel, {**skinny, "PDL": False}, {})
    norm = {**fp32, "EPS": "fp32"}
    assert compile_for_hopper(small_matmul._sum_add_norm_kernel, dict(BLOCK_N=1024, PDL=True), norm) > 0
    assert compile_for_hopper(small_matmul._sum_parts_kernel, dict(GATED=False, ADD=False, BLOCK=256, PDL=True),
                              fp32) > 0
    draw = {"logits_ptr": "*fp32", "temp_ptr": "*fp32", "topp_ptr": "*fp32", "do_ptr": "*i8", "topk_ptr": "*i64",
            "seed_ptr": "*i64", "frame_ptr": "*i64", "codebook_ptr": "*i64", "out_ptr": "*i64"}
    assert compile_for_hopper(draw_kernel._draw_kernel, dict(FIXED_CODEBOOK=True, BLOCK_V=2048, EXACT=True,
                                                             MASS_SCALE=2.0**36, PACKED=True, PDL=True), draw) > 0
    attn = {"cos_ptr": "*fp32", "sin_ptr": "*fp32", "lens_ptr": "*i32", "tables_ptr": "*i32", "ml_ptr": "*fp32",
            "acc_ptr": "*fp32", "eps": "fp32", "scale": "fp32"}
    meta = dict(HEADS=16, KV_HEADS=8, GROUP=2, GROUP_PAD=16, HEAD_DIM=128, BLOCK_SIZE=16, PAGED=True, SPLITS=4,
                MIN_SPAN=64, BLOCK_N=32)
    assert compile_for_hopper(fused_attention._fused_decode_kernel, {**meta, "DOT": True, "PRECISION": "tf32",
                                                                     "PV_PRECISION": "tf32x3", "PDL": True}, attn) > 0
    assert compile_for_hopper(fused_attention._combine_splits_kernel, {**meta, "GROUP_PAD": 2, "PDL": True}, attn) > 0
