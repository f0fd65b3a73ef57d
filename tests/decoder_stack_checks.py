"""The one-launch decoder stack (`legato/layers/decoder_stack.py`) against the unfused code predictor.

`run_checks(device, dtype)` runs a code predictor's residual codebooks both ways, the stacked pass teacher-forced
with the unfused pass's greedy codes, and measures the logits' relative error and the KV caches'. Shapes: the tiny
model's (hidden 48: chunks masked past the row; a projection from the talker's width) and the 0.6B's layer shapes
with fewer layers and codebooks (the real chunking: 3 chunks for the MLP's 3072); 1 and 3 rows (on the CPU some
checks at some of them: INTERPRETED_FORMS); on CUDA the
0.6B's and the 1.7B's whole code predictors take the cut-down one's place. On the CPU the kernel runs under Triton's
interpreter one phase per launch (`TRITON_INTERPRET=1`, fp32, where greedy codes must also be equal); with each
phase's weights requested after its barrier (`early_tiles=False`, the kernel's older order) it must equal itself bit
for bit, and so must the launch forms the code predictor uses (a frame's two prompt tokens in one launch, a codebook's
embedding row looked up in the kernel) equal plain one-token launches; where a projection sits between the talker's
width and the model's, inputs gathered from embedding tables projected once match a projection a pass. On CUDA the
one-launch form runs too (both orders, both launch forms) and must equal the phase-per-launch form bit for bit, no
barrier may have given up, and reruns of the one launch (some behind matmuls on another stream) must equal it bit for
bit; each half-precision path's logits are also measured against fp32 math on the same weights (`FP32_REFERENCE`,
printed, not checked).
`python tests/decoder_stack_checks.py [cuda|cpu]`.
"""

from __future__ import annotations

import os
import sys
import time

import torch
from triton_interpreter import check_script_main, rel_err, report

if os.environ.get("TRITON_INTERPRET") == "1":
    from triton_interpreter import patch_for_numpy

    patch_for_numpy()

from legato.layers import decoder_stack
from legato.models.qwen3_tts.code_predictor import CodePredictor
from legato.models.qwen3_tts.config import CodePredictorConfig
from legato.models.qwen3_tts.decoder_layer import pack_projections
from legato.models.qwen3_tts.testing import randomize_
from legato.models.qwen3_tts.tiny import tiny_config

# Half precision against the unfused layers: the fused decode attention's model tolerance (its scores and softmax
# stay fp32 where the CPU's unfused attention rounds them, and the error compounds over 16 passes of 5 layers).
TOLERANCE = 2e-2

# Under the interpreter a stacked run costs 10-55 s of a 2-core CPU, and the launch forms' check is five of them
# (59 and 73 s for the 0.6B layer shapes, the biggest slice of CI's slowest test). On the CPU the forms run on the
# tiny model only, whose rows and chunks are masked, at both row counts, and the free-running greedy codes at one
# row; the 0.6B layer shapes keep their teacher-forced logits and caches at both row counts. CUDA runs every check
# on every model (the served shapes are checked there).
INTERPRETED_FORMS = ("tiny",)


def _models(device: str) -> dict[str, tuple[CodePredictorConfig, int]]:
    tiny = tiny_config("base").talker_config
    shaped = CodePredictorConfig(hidden_size=1024, num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=8,
                                 head_dim=128, intermediate_size=3072, vocab_size=256, num_code_groups=4)
    if device != "cuda":
        return {"tiny": (tiny.code_predictor_config, tiny.hidden_size), "0.6B layer shapes": (shaped, 1024)}
    # On CUDA the whole served code predictors instead of the cut-down one (too slow for the interpreter); the
    # 1.7B's differs from the 0.6B's only in the projection from the talker's width, outside the kernel.
    return {"tiny": (tiny.code_predictor_config, tiny.hidden_size),
            "0.6B code predictor": (CodePredictorConfig(), 1024), "1.7B code predictor": (CodePredictorConfig(), 2048)}


def _run(cp: CodePredictor, past: torch.Tensor, first: torch.Tensor, forced: torch.Tensor | None, stacked: bool,
         sync: bool | None = None, early_tiles: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logits: list[torch.Tensor] = []

    def sample(scores, g):
        logits.append(scores.float())
        return scores.argmax(-1) if forced is None else forced[:, g - 1]

    cache = cp.new_cache(past.shape[0], past.dtype, past.device)
    run = decoder_stack.run
    if sync is not None:
        decoder_stack.run = lambda *a, **kw: run(*a, **kw, sync=sync, early_tiles=early_tiles)
    try:
        with torch.inference_mode():
            if stacked:
                codes = cp._predict_in_stack_launches(past, first, sample, cache)
            else:
                stack, cp.stack = cp.stack, None
                try:
                    codes = cp.predict_residuals(past, first, sample, cache)
                finally:
                    cp.stack = stack
    finally:
        decoder_stack.run = run
    return codes, torch.stack(logits), torch.cat([cache.k.flatten(), cache.v.flatten()])


# (model, rows, dtype) -> (unfused, one launch): each half-precision path's logits against the same model's in fp32
# math (its weights rounded to the half dtype, teacher-forced with the same codes). Not a pass/fail check: the record
# on which the stack could become the default path (it is as accurate as the unfused layers, or not).
FP32_REFERENCE: dict[tuple[str, int, str], tuple[float, float]] = {}


def _against_fp32(name, rows, cp, talker_hidden, device, dtype, past, first, codes, unfused, one) -> None:
    ref = CodePredictor(cp.config, talker_hidden)  # the half-precision model's own weights, fp32 math
    ref.load_state_dict({k: v.float() for k, v in cp.state_dict().items()}, strict=False)  # not its packed copies
    ref.to(device).eval()
    _, want, _ = _run(ref, past.float(), first.float(), codes, stacked=False)
    errors = FP32_REFERENCE[(name, rows, str(dtype)[6:])] = (rel_err(unfused, want), rel_err(one, want))
    print(f"[stack check] {name}, {rows} rows, {str(dtype)[6:]}: logits against fp32 math, unfused {errors[0]:.2e}, "
          f"one launch {errors[1]:.2e}", flush=True)


def _launch_forms_that_differ(cp: CodePredictor, past: torch.Tensor, first: torch.Tensor, sync: bool) -> float:
    """The launch forms `_predict_in_stack_launches` uses against plain one-token launches, bit for bit: a frame's
    two prompt tokens in one launch against one launch each, and a codebook's embedding row looked up by the
    kernel (`code`) against the row given. Returns how many of the two differ (logits or caches)."""
    rows, hidden = past.shape[0], cp.config.hidden_size
    cos, sin = cp.model.rotary(torch.arange(cp.config.num_code_groups, device=past.device))
    head = cp.lm_head[0].weight

    def launch(x, pos, tokens=1, code=None):
        cache = cp.new_cache(rows, past.dtype, past.device)
        if pos:  # the cache as the two prompt tokens left it
            decoder_stack.run(cp.stack, torch.stack((x_past, x_first), 1).flatten(0, 1).contiguous(), cache.k,
                              cache.v, 0, cos[:2], sin[:2], head, sync=sync)
        out = decoder_stack.run(cp.stack, x, cache.k, cache.v, pos, cos[pos : pos + tokens], sin[pos : pos + tokens],
                                head, code=code, sync=sync)
        return out, torch.cat([cache.k.flatten(), cache.v.flatten()])

    with torch.inference_mode():
        x_past, x_first = cp.small_to_mtp_projection(past), cp.small_to_mtp_projection(first)
        together = launch(torch.stack((x_past, x_first), 1).flatten(0, 1).contiguous(), 0, tokens=2)
        cache = cp.new_cache(rows, past.dtype, past.device)
        decoder_stack.run(cp.stack, x_past.contiguous(), cache.k, cache.v, 0, cos[0], sin[0], head, sync=sync)
        apart = decoder_stack.run(cp.stack, x_first.contiguous(), cache.k, cache.v, 1, cos[1], sin[1], head, sync=sync)
        apart = (apart, torch.cat([cache.k.flatten(), cache.v.flatten()]))
        gen = torch.Generator().manual_seed(7)
        table = torch.randn(64, hidden, generator=gen).to(past.device, past.dtype)
        code = torch.randint(0, 64, (rows,), generator=gen).to(past.device)
        looked_up, given = launch(table, 2, code=code), launch(table[code].contiguous(), 2)
    return float(sum(not (torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]))
                     for a, b in ((together, apart), (looked_up, given))))


# Reruns of the one-launch pass on the same inputs (`_reruns_that_differ`).
RERUNS = 20


def _reruns_that_differ(cp, past, first, codes, want) -> float:
    """The one-launch pass again on the same inputs, every other run queued behind matmuls on another stream, so
    its programs start at different times and some wait at barriers for SMs the matmuls hold. A barrier that let a
    program read what another had not yet written would show as a run whose logits or caches differ bit-wise
    (H200, 2026-12-04: an engine with the stack on gave the async loop codes that differed from the sync loop's;
    not explained). Returns the count of such runs."""
    side = torch.cuda.Stream()
    a = torch.randn(4096, 4096, device=past.device, dtype=past.dtype)
    differ = 0
    for i in range(RERUNS):
        if i % 2:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(4):
                    a = (a @ a).clamp_(-1, 1)
        got = _run(cp, past, first, codes, stacked=True, sync=True)
        differ += not (torch.equal(got[1], want[1]) and torch.equal(got[2], want[2]))
    torch.cuda.synchronize()
    return float(differ)


def run_checks(device: str, dtype: torch.dtype, only: str | None = None,
               names: set[str] | None = None) -> dict[str, float]:
    """`only`: one model, each result printed as it comes (a device probe); `names`: the models to run (all)."""
    errors: dict[str, float] = {}
    for name, (cfg, talker_hidden) in _models(device).items():
        if (only is not None and name != only) or (names is not None and name not in names):
            continue
        cp = CodePredictor(cfg, talker_hidden)
        randomize_(cp, seed=3, std=0.05)
        cp.to(device=device, dtype=dtype).eval()
        pack_projections(cp)
        if cp.stack is None:  # CPU (or fp32): the serving layout is built by hand, as the interpreter runs it
            cp.stack = decoder_stack.stack(cp.model.layers, cp.model.norm)
        for rows in (1, 3):
            gen = torch.Generator().manual_seed(rows)
            past, first = (torch.randn(rows, talker_hidden, generator=gen).to(device, dtype) for _ in range(2))
            start = time.perf_counter()
            want_codes, want_logits, want_cache = _run(cp, past, first, None, stacked=False)
            got_codes, got_logits, got_cache = _run(cp, past, first, want_codes, stacked=True, sync=False)
            if only is not None:
                print(f"[stack check] {name}, {rows} rows: unfused and phase launches done in "
                      f"{time.perf_counter() - start:.1f} s", flush=True)
            errors[f"{name}, {rows} rows: logits"] = rel_err(got_logits, want_logits)
            errors[f"{name}, {rows} rows: caches"] = rel_err(got_cache, want_cache)
            if device == "cuda" or name in INTERPRETED_FORMS:
                errors[f"{name}, {rows} rows: two tokens a launch, looked-up rows: forms that differ"] = (
                    _launch_forms_that_differ(cp, past, first, sync=False))
            if rows == 1:  # each phase's weights requested before its barrier's wait (the default) or after it
                late = _run(cp, past, first, want_codes, stacked=True, sync=False, early_tiles=False)
                errors[f"{name}, {rows} rows: weights after the barrier vs before"] = float(
                    not (torch.equal(late[1], got_logits) and torch.equal(late[2], got_cache)))
            if rows == 1 and cp.projected_tables is None and cfg.hidden_size != talker_hidden:
                # codebooks' inputs gathered from tables projected once, against projected each pass
                cp.project_tables()
                try:
                    tabled = _run(cp, past, first, want_codes, stacked=True, sync=False)
                finally:
                    cp.projected_tables = None
                errors[f"{name}, {rows} rows: projected tables vs a projection a pass"] = rel_err(tabled[1],
                                                                                                 got_logits)
            if dtype == torch.float32 and rows == 1:  # greedy codes of the stacked pass run free
                free_codes = _run(cp, past, first, None, stacked=True, sync=False)[0]
                errors[f"{name}, {rows} rows: greedy codes differ"] = float((free_codes != want_codes).sum())
            if device == "cuda":  # the one-launch form: the same sums in the same order
                start = time.perf_counter()
                one = _run(cp, past, first, want_codes, stacked=True, sync=True)
                torch.cuda.synchronize()
                print(f"[stack check] {name}, {rows} rows, {str(dtype)[6:]}: one-launch pass done in "
                      f"{time.perf_counter() - start:.1f} s (first: compiles), barrier errors "
                      f"{decoder_stack.barrier_errors()}", flush=True)
                errors[f"{name}, {rows} rows: one launch: two tokens a launch, looked-up rows: forms that differ"] = (
                    _launch_forms_that_differ(cp, past, first, sync=True))
                errors[f"{name}, {rows} rows: one launch vs phase launches"] = float(
                    not (torch.equal(one[1], got_logits) and torch.equal(one[2], got_cache)))
                late = _run(cp, past, first, want_codes, stacked=True, sync=True, early_tiles=False)
                errors[f"{name}, {rows} rows: one launch, weights after the barrier vs before"] = float(
                    not (torch.equal(late[1], one[1]) and torch.equal(late[2], one[2])))
                _against_fp32(name, rows, cp, talker_hidden, device, dtype, past, first, want_codes, want_logits,
                              one[1])
                errors[f"{name}, {rows} rows: one-launch reruns that differ"] = _reruns_that_differ(
                    cp, past, first, want_codes, one)
            if only is not None:
                print({k: f"{v:.2e}" for k, v in errors.items()}, flush=True)
    if device == "cuda":
        errors["barrier waits that gave up"] = float(decoder_stack.barrier_errors())
    return errors


if __name__ == "__main__":
    if len(sys.argv) > 2:  # `cuda <model name>`: one model in bf16, each result printed as it comes (a device probe)
        probe = run_checks(sys.argv[1], torch.bfloat16, only=sys.argv[2])
        sys.exit(report({name: (err, TOLERANCE) for name, err in probe.items()}))
    sys.exit(check_script_main(run_checks))
