"""The streaming codec's Triton kernels equal their PyTorch twins: on the CPU through Triton's interpreter (in a
subprocess, since the interpreter is chosen when a kernel is defined), on CUDA in tests/test_gpu.py."""

from __future__ import annotations

import pytest
from triton_interpreter import run_checks_script


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
