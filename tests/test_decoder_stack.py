"""The code predictor's one-launch pass (`legato/layers/decoder_stack.py`): equal to the unfused layers under
Triton's interpreter (each phase its own launch, fp32: greedy codes equal, logits and caches within 1e-5), compiled
for Hopper in both forms (the barrier's atomics and polls included), and taken only where it may run: CUDA rows, few
of them, shapes it takes, one replica group. The one-launch form against the phase launches runs on the GPU
(tests/test_gpu.py)."""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import compile_for_hopper, run_checks_script, skip_unless_ptxas

from legato.layers import decoder_stack
from legato.models.qwen3_tts.code_predictor import CodePredictor
from legato.models.qwen3_tts.decoder_layer import pack_projections
from legato.models.qwen3_tts.tiny import tiny_config


def test_the_stacked_pass_equals_the_unfused_code_predictor_under_the_interpreter():
    pytest.importorskip("triton", reason="Triton is not installed (the test extra installs it)")
    # ~330 s alone on a 2-core box (540 before the checks were cut to INTERPRETED_FORMS); 1,200 s leaves room for
    # a loaded one (the longer form ran past 600 beside two busy processes)
    run = run_checks_script("decoder_stack_checks.py", timeout_s=1200)
    assert run.returncode == 0 and "ALL OK" in run.stdout, run.stdout + run.stderr
    # 2 shapes x 2 row counts x (logits, caches); per shape at one row, greedy codes run free and the weights
    # after the barrier against before it; the tiny model's launch forms at both row counts and (it has a
    # projection) its projected tables at one row
    assert run.stdout.count(" ok\n") == 15


def test_the_stack_kernel_compiles_for_hopper_with_and_without_its_barrier_and_early_tiles_in_each_launch_form():
    skip_unless_ptxas()
    # The spread form's 256-wide chunks (SPREAD_WIDTH) with o's partials in the attention's phase (132 programs: 16
    # o tiles a kv head), and the forms before them (`spread=False`, `split_o=False`, `qkv_parts=1`) once.
    shapes = dict(LAYERS=5, HIDDEN=1024, HEADS=16, KV_HEADS=8, HEAD_DIM=128, INTER=3072, VOCAB=2048, CAP=16,
                  CAP_P2=16, KC_H=256, C_H=4, CP_H=4, KC_A=256, C_A=8, KC_I=256, C_I=12, CP_I=16, BN_QKV=32, BN_O=8,
                  BN_GU=32, BN_V=16, SPIN=decoder_stack.SPIN_LIMIT,
                  PHASES_PER_LAYER=decoder_stack.PHASES_PER_LAYER, GU_PARTS=2, QKV_PARTS=2, SPREAD=True, SPLIT_O=True,
                  O_TILES=16, BN_OS=64, KC_G=256, C_G=1, CP_G=1)
    before = dict(KC_H=1024, C_H=1, CP_H=1, KC_A=1024, C_A=2, KC_I=1024, C_I=3, CP_I=4, SPREAD=False, SPLIT_O=False,
                  PHASES_PER_LAYER=decoder_stack.PHASES_PER_LAYER + 1, QKV_PARTS=1)
    types = {"logits_ptr": "*fp32", "op_ptr": "*fp32", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "bar_ptr": "*i32",
             "eps": "fp32", "scale": "fp32"}
    one, two, looked_up = dict(TOKENS=1, GATHER=False), dict(TOKENS=2, GATHER=False), dict(TOKENS=1, GATHER=True)
    # (form, barrier, early tiles, forms before): each launch form with the barrier, then one form each way the
    # barrier and the tiles can go (a compile is ~11 s of the CPU: not every product), and the looked-up launch
    # with programmatic dependent launch (layers/pdl.py: its signal and wait are inline PTX)
    cases = [(one, True, True, False), (two, True, True, False), (looked_up, True, True, False),
             (one, True, False, False), (one, False, True, False), (one, True, True, True)]
    for form, sync, early, old in cases + [({**looked_up, "PDL": True}, True, True, False)]:
        kinds = {**types, "code_ptr": "*i64"} if form["GATHER"] else types
        constexprs = {**shapes, **form, **(before if old else {}), "SYNC": sync, "EARLY": early, "O_EARLY": early}
        assert compile_for_hopper(decoder_stack._stack_kernel, constexprs, kinds) > 0


def test_only_cuda_rows_few_enough_take_the_stack():
    x = torch.zeros(1, 8)
    assert not decoder_stack.takes(x)  # CPU rows keep the unfused arithmetic
    assert decoder_stack.supported(16, 8, 128) and decoder_stack.supported(4, 2, 16)
    assert not decoder_stack.supported(12, 4, 128) and not decoder_stack.supported(16, 8, 96)
    assert decoder_stack._chunk(3072) == (1024, 3, 4) and decoder_stack._chunk(48) == (16, 3, 4)
    assert decoder_stack._chunk(4096) == (1024, 4, 4)


def test_a_cpu_code_predictor_builds_no_stack_and_runs_as_before():
    tiny = tiny_config("base").talker_config
    cp = CodePredictor(tiny.code_predictor_config, tiny.hidden_size).eval()
    pack_projections(cp)
    cp.pack_stack()  # the engine's call when asked for the stack: a CPU (or fp32) code predictor stays unstacked
    assert cp.stack is None
    gen = torch.Generator().manual_seed(0)
    past, first = torch.randn(2, tiny.hidden_size, generator=gen), torch.randn(2, tiny.hidden_size, generator=gen)
    with torch.inference_mode():
        codes = cp.predict_residuals(past, first, lambda logits, g: logits.argmax(-1))
    assert codes.shape == (2, tiny.code_predictor_config.num_code_groups - 1)


def test_the_one_launch_pass_runs_only_for_callers_that_ask_for_it(monkeypatch):
    """The stacked weights live on the code predictor, which engines on the same weights share; each call says
    whether it takes them (an engine with the stack off, or with replica groups, keeps the unfused layers even where
    another engine built the stack)."""
    tiny = tiny_config("base").talker_config
    cp = CodePredictor(tiny.code_predictor_config, tiny.hidden_size).eval()
    cp.stack = object()  # stands for built weights: the kernel itself needs a GPU
    monkeypatch.setattr(decoder_stack, "takes", lambda x: x.shape[0] <= 1)
    ran = []
    monkeypatch.setattr(cp, "_predict_in_stack_launches", lambda *a: ran.append(True) or "stacked")
    gen = torch.Generator().manual_seed(0)
    past, first = torch.randn(1, tiny.hidden_size, generator=gen), torch.randn(1, tiny.hidden_size, generator=gen)
    with torch.inference_mode():
        codes = cp.predict_residuals(past, first, lambda logits, g: logits.argmax(-1))
        assert codes.shape == (1, tiny.code_predictor_config.num_code_groups - 1) and not ran
        assert cp.predict_residuals(past, first, lambda logits, g: logits.argmax(-1), stack=True) == "stacked"
    assert ran == [True]


def test_the_stack_views_the_packed_projections_instead_of_copying_them():
    tiny = tiny_config("base").talker_config
    cp = CodePredictor(tiny.code_predictor_config, tiny.hidden_size)
    w = decoder_stack.stack(cp.model.layers, cp.model.norm)
    att, mlp = cp.model.layers[1].self_attn, cp.model.layers[1].mlp
    assert att.qkv_weight.data_ptr() == w.qkv[1].data_ptr() and mlp.gate_up_weight.data_ptr() == w.gate_up[1].data_ptr()
    assert torch.equal(w.o[1], att.o_proj.weight) and torch.equal(w.down[1], mlp.down_proj.weight)
    assert w.layers == tiny.code_predictor_config.num_hidden_layers and w.inter == mlp.down_proj.in_features
