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
    # both head widths: two rounds, the k-th value alone (both searches), plain bisection, Philox per block, 16 warps,
    # the hard rows (both searches), a codebook given as an int, bf16 logits
    assert run.stdout.count(" ok\n") == 22


def test_the_cpu_sampler_never_takes_the_kernel():
    from legato.engine import draw_kernel

    assert not draw_kernel.available(torch.zeros(1, 8))


def test_the_draw_kernel_compiles_for_hopper():
    skip_unless_ptxas()
    from legato.engine import draw_kernel

    types = {"logits_ptr": "*fp32", "do_ptr": "*i1", "temp_ptr": "*fp32", "topk_ptr": "*i64", "topp_ptr": "*fp32",
             "seed_ptr": "*i64", "frame_ptr": "*i64", "codebook_ptr": "*i64", "out_ptr": "*i64"}
    for block in (2048, 4096):
        for fixed, packed, per_block in ((False, True, False), (True, True, False), (True, False, True)):
            constexprs = dict(BLOCK_V=block, EXACT=True, MASS_SCALE=draw_kernel._MASS_SCALE, FIXED_CODEBOOK=fixed,
                              PACKED=packed, PER_BLOCK=per_block)
            assert compile_for_hopper(draw_kernel._draw_kernel, constexprs, types) > 0, (block, fixed, packed)
    # a bf16 head's logits, widened as they load
    constexprs = dict(BLOCK_V=2048, EXACT=True, MASS_SCALE=draw_kernel._MASS_SCALE, FIXED_CODEBOOK=True, PACKED=True)
    assert compile_for_hopper(draw_kernel._draw_kernel, constexprs, {**types, "logits_ptr": "*bf16"}) > 0


def test_the_launcher_passes_the_codebook_as_a_runtime_value_even_when_it_is_1():
    """Triton's launcher makes an int argument of 1 a compile-time constant unless the kernel says otherwise: the
    codebook-1 draw then failed to compile on the H100 (a constant has no `.to`), on every engine's first frame. The
    launcher's own binder (no GPU needed) must give codebook 1 the runtime int type it gives 5."""
    pytest.importorskip("triton", reason="Triton is not installed (the test extra installs it)")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    from legato.engine import draw_kernel

    kernel = draw_kernel._draw_kernel
    binder = create_function_from_signature(kernel.signature, kernel.params, make_backend(GPUTarget("cuda", 90, 32)))
    ids, logits = torch.zeros(4, dtype=torch.int64), torch.zeros(4, 2048)
    names = [p.name for p in kernel.params]
    for codebook in (1, 5):
        args = (logits, ids, logits, ids, logits, ids, ids, ids, codebook, ids, 2048, 2048)
        _, specialization, _ = binder(*args, FIXED_CODEBOOK=True, BLOCK_V=2048, EXACT=True, MASS_SCALE=2.0**36)
        assert dict(zip(names, specialization, strict=True))["codebook_value"][0] == "i32", codebook
