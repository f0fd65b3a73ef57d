"""The code predictor's lookup-and-norm kernel (`legato/layers/lookup_norm.py`) equals the index and the norm it
replaces on the CPU through Triton's interpreter (a subprocess, since the interpreter is chosen when a kernel is
defined) and on CUDA in tests/test_gpu.py; it compiles for Hopper with and without PDL; the CPU never takes it, and
a call it cannot serve is refused with a message."""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import compile_for_hopper, run_checks_script, skip_unless_ptxas


def test_lookup_norm_equals_its_contract_under_the_interpreter():
    pytest.importorskip("triton", reason="Triton is not installed (the test extra installs it)")
    run = run_checks_script("lookup_norm_checks.py")
    assert run.returncode == 0 and "ALL OK" in run.stdout, run.stdout + run.stderr
    assert run.stdout.count(" ok\n") == 6  # three tables, ids contiguous and strided


def test_the_cpu_path_never_takes_the_kernel():
    from legato.layers import lookup_norm

    assert not lookup_norm.available(torch.zeros(4, 8))


def test_a_table_or_ids_it_cannot_read_are_refused():
    pytest.importorskip("triton", reason="Triton is not installed (the test extra installs it)")
    from legato.layers.lookup_norm import lookup_rms_norm

    table, weight = torch.zeros(4, 8), torch.ones(8)
    with pytest.raises(ValueError, match="lookup_rms_norm"):
        lookup_rms_norm(table, torch.zeros(2, 1, dtype=torch.long), weight, 1e-6)
    with pytest.raises(ValueError, match="lookup_rms_norm"):
        lookup_rms_norm(table.t(), torch.zeros(2, dtype=torch.long), weight, 1e-6)
    with pytest.raises(ValueError, match="lookup_rms_norm"):
        lookup_rms_norm(table, torch.zeros(2, dtype=torch.long), torch.ones(4), 1e-6)


def test_the_kernel_compiles_for_hopper():
    skip_unless_ptxas()
    from legato.layers import lookup_norm

    types = {"ids_ptr": "*i64", "EPS": "fp32"}
    plain = compile_for_hopper(lookup_norm._lookup_norm_kernel, dict(BLOCK=1024, PDL=False), types)
    assert compile_for_hopper(lookup_norm._lookup_norm_kernel, dict(BLOCK=1024, PDL=True), types) > plain > 0
