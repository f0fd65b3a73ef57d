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


def test_a_projected_code_predictor_gathers_from_its_projected_tables_when_asked(monkeypatch):
    """`code_predictor.PROJECTED_LOOKUP` on a code predictor with a projection (the tiny one, 64 -> 48, as the
    1.7B's 2048 -> 1024): each single-token pass takes its row and first norm from the projected tables through
    the lookup-and-norm kernel (its reference stands in for it here, where the CPU never takes it), and gives the
    logits of the gather, projection and norm run apart, fp32, teacher-forced. Off, or on with no tables built,
    the kernel is not called."""
    from legato.layers import lookup_norm
    from legato.models.qwen3_tts import code_predictor
    from legato.models.qwen3_tts.talker import Talker
    from legato.models.qwen3_tts.testing import randomize_
    from legato.models.qwen3_tts.tiny import tiny_config

    cfg = tiny_config("base").talker_config
    talker = Talker(cfg)
    randomize_(talker, seed=1, std=0.1)
    talker.eval()
    cp = talker.code_predictor
    tables_read = []

    def kernel_stand_in(table, ids, weight, eps):
        tables_read.append(table)
        return lookup_norm.lookup_rms_norm_reference(table, ids, weight, eps)

    monkeypatch.setattr(lookup_norm, "available", lambda table: True)
    monkeypatch.setattr(lookup_norm, "lookup_rms_norm", kernel_stand_in)
    gen = torch.Generator().manual_seed(2)
    past, first = (torch.randn(3, cfg.hidden_size, generator=gen) for _ in range(2))

    def run(forced=None):
        logits = []

        def sample(scores, g):
            logits.append(scores)
            return scores.argmax(-1) if forced is None else forced[:, g - 1]

        with torch.inference_mode():
            codes = cp.predict_residuals(past, first, sample)
        return codes, torch.stack(logits)

    codes, apart = run()
    assert not tables_read and cp.projected_tables is None
    monkeypatch.setattr(code_predictor, "PROJECTED_LOOKUP", True)
    assert torch.equal(run(codes)[1], apart) and not tables_read  # asked for, but no tables built
    cp.project_tables()
    _, gathered = run(codes)
    assert len(tables_read) == cfg.num_code_groups - 2
    assert all(t is p for t, p in zip(tables_read, cp.projected_tables, strict=False))
    torch.testing.assert_close(gathered, apart, rtol=1e-5, atol=1e-6)
