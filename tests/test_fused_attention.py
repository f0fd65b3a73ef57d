"""The fused decode-attention kernel equals its PyTorch contract, and a model with it equals the model without
it: on the CPU through Triton's interpreter (a subprocess, since the interpreter is chosen when a kernel is
defined), on CUDA in tests/test_gpu.py. On the CPU the engine itself never takes the kernel (`available`)."""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import run_checks_script


def test_fused_decode_attention_equals_its_contract_under_the_interpreter():
    pytest.importorskip("triton", reason="Triton is not installed (the test extra installs it)")
    run = run_checks_script("attention_kernel_checks.py")
    assert run.returncode == 0 and "ALL OK" in run.stdout, run.stdout + run.stderr
    assert run.stdout.count(" ok\n") >= 50  # every layout, shape and position, and the model checks


def test_the_cpu_path_never_takes_the_kernel():
    from legato.layers import fused_attention

    assert not fused_attention.available(torch.zeros(1))


def test_the_contiguous_cache_refuses_a_position_past_its_capacity():
    pytest.importorskip("triton", reason="Triton is not installed (the test extra installs it)")
    from legato.layers.fused_attention import fused_decode_attention

    cache = torch.zeros(1, 1, 4, 8)
    with pytest.raises(RuntimeError, match="KV cache full"):
        fused_decode_attention(torch.zeros(1, 24), torch.ones(8), torch.ones(8), 1e-6, torch.ones(1, 8),
                               torch.zeros(1, 8), cache, cache.clone(), 1, position=4)
