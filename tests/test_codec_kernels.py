"""The streaming codec's Triton kernels equal their PyTorch twins: on the CPU through Triton's interpreter (in a
subprocess, since the interpreter is chosen when a kernel is defined), on CUDA in tests/test_gpu.py."""

from __future__ import annotations

import pytest
from triton_interpreter import compile_for_hopper, run_checks_script, skip_unless_ptxas


def test_kernels_equal_their_twins_under_the_interpreter():
    pytest.importorskip("triton", reason="Triton is not installed (the test extra installs it)")
    run = run_checks_script("codec_kernel_checks.py")
    assert run.returncode == 0 and "ALL OK" in run.stdout, run.stdout + run.stderr
    assert run.stdout.count(": ") >= 46  # every check ran and reported


def test_split_k_fills_one_wave_and_leaves_full_grids_alone():
    from legato.layers.conv_kernels import split_k

    assert split_k(programs=24, iters=112, sms=132) == 5  # the 7-tap conv at one frame: 24 tiles, K = 7 x 16
    assert split_k(programs=16, iters=64, sms=132) == 4  # K = 4096 over 16 tiles
    assert split_k(programs=32, iters=16, sms=132) == 1  # too short a K: the partial sums cost more
    assert split_k(programs=200, iters=84, sms=132) == 1  # already more than a wave
    assert split_k(programs=70, iters=84, sms=132) == 1  # more than half a wave: a split would add a second
    for programs, iters in ((1, 100), (3, 50), (10, 33), (5, 64), (2, 1000)):
        split = split_k(programs, iters, 132)
        per = -(-iters // split)
        assert (split - 1) * per < iters  # no empty part
        assert programs * split <= 132 and split <= 16
        assert split == 1 or per >= 16


def test_the_last_blocks_96_channel_convs_take_tiles_that_pad_nothing():
    from legato.layers.conv_tiles import conv_blocks

    for m, taps in ((122880, 7), (122880, 1), (1966080, 7), (40960, 2)):  # 64 x 1 and 256 x 4 frames per call
        block_m, block_n, block_k, _, _, block_n2 = conv_blocks(m, 96, 96, taps)
        assert block_n + block_n2 == 96 and 96 % block_k == 0
    assert len(conv_blocks(122880, 12, 12, 7)) == 5  # a tiny config's channels: the fitted tiles, one block


def _compile_for_hopper(kernel, constexprs: dict) -> int:
    """sm_90 cubin size of a codec kernel: bf16 tensors, int64 slot and position tensors, fp32 parameters."""
    i64 = {"calls_ptr", "pos_ptr", "slots_ptr", "codes_ptr"}
    fp32 = {"f_ptr", "i_ptr", "freq_ptr", "inv_ptr", "sf_ptr", "si_ptr", "ws_ptr"}
    pairs = {f"{k}{i}": "*bf16" for k in "ph" for i in range(4)}  # restage_group's (P, history) pointers
    return compile_for_hopper(kernel, constexprs, {**{n: "*i64" for n in i64}, **{n: "*fp32" for n in fp32}, **pairs})


def test_the_codec_kernels_compile_for_hopper():
    """The interpreter runs the kernels' semantics, not the GPU compiler: this compiles each changed kernel shape
    (two column blocks, flat K, split-K partial sums, a staged epilogue, restaging, the column kernel, the
    one-kernel residual unit) as far as an sm_90 cubin, so a construct the GPU backend refuses fails on the CPU
    too."""
    skip_unless_ptxas()
    from legato.layers import conv_kernels as ck
    from legato.layers import stage_kernels as sk

    conv = dict(TAPS=7, HAS_BIAS=True, EPILOGUE=1, SPLIT=1, BLOCK_M=128, BLOCK_N=64, BLOCK_K=32, KT=3, IEEE=False,
                FAST_SIN=True, FLAT=False, VEC=8, BLOCK_N2=32, STAGED=True, STAGED_SNAKE=True, KEEP_OUT=True)
    cases = [
        (ck._conv_kernel, conv),  # the last block's 7-tap conv, feeding the next
        (ck._conv_kernel, {**conv, "TAPS": 1, "EPILOGUE": 3, "BLOCK_K": 64, "KT": 2, "FLAT": True}),  # flat K
        (ck._conv_kernel, {**conv, "SPLIT": 4, "BLOCK_N": 128, "BLOCK_N2": 0, "STAGED": False}),  # split-K parts
        (ck._conv_kernel, {**conv, "TAPS": 1, "EPILOGUE": 3, "KEEP_OUT": False}),  # writes the staged input only
        (ck._split_reduce_kernel, dict(SPLIT=4, HAS_BIAS=True, EPILOGUE=3, BLOCK_R=32, BLOCK_C=128, FAST_SIN=True,
                                       STAGED=True, STAGED_SNAKE=True, KEEP_OUT=False)),
        (ck._column_kernel, dict(TAPS=7, HAS_BIAS=True, EPILOGUE=4, BLOCK_M=128, BLOCK_C=32, FAST_SIN=True)),
        (ck._unit_kernel, dict(TAPS=7, BLOCK_M=128, BLOCK_C=128, BLOCK_K=32, KT=3, CHUNK=128, IEEE=False,
                               FAST_SIN=True)),
        (sk._stage_kernel, dict(SNAKE=True, FAST_SIN=True, BLOCK_R=32, BLOCK_C=128)),
        (sk._restage_kernel, dict(BLOCK_R=32, BLOCK_C=128)),
        (sk._restage_group_kernel, dict(COPY_IN=True, COPY_OUT=False, BLOCK_R=32, BLOCK_C=128)),
        (sk._restage_group_kernel, dict(COPY_IN=False, COPY_OUT=True, BLOCK_R=32, BLOCK_C=128)),
        (sk._codebook_kernel, dict(Q=16, FIRST=1, BLOCK_R=16, BLOCK_C=128)),
    ]
    for kernel, constexprs in cases:
        assert _compile_for_hopper(kernel, constexprs) > 0, kernel.__name__


def test_a_staged_buffer_that_does_not_fit_the_output_is_refused():
    import torch

    from legato.layers.causal_conv import conv_gemm

    p, w = torch.randn(2, 5, 8), torch.randn(8, 6)
    for shape in ((3, 5, 6), (2, 4, 6), (2, 5, 7)):  # streams that do not divide the rows, too few rows, channels
        with pytest.raises(ValueError, match="staged"):
            conv_gemm(p, w, None, 5, 1, 1, staged=(torch.empty(shape), None), kernel=False)
    staged = torch.full((2, 7, 6), float("nan"))  # 2 history rows, then the output's 5 rows per stream
    out = conv_gemm(p, w, None, 5, 1, 1, staged=(staged, None), kernel=False)
    assert torch.equal(staged[:, 2:], out.view(2, 5, 6))
