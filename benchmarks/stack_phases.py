"""Device time of each phase of the code predictor's one-launch pass (`layers/decoder_stack.py`), each phase run as
its own launch, and of the whole pass as one launch: the o projection inside the attention's phase (the default) and
as a phase of its own (with q/k/v in one pass or two); each phase's weights requested before its barrier's wait (the
default) and after it; activation rows spread over the weight tile's layout (the default) and once per program;
the default timed again last, so drift shows. At one row, also the launch forms a frame uses (two prompt tokens in
one launch, an embedding row looked up by the launch) against the launches they replace: 0.6B code predictor
shapes, random weights, bf16, CUDA graphs of back-to-back launches.

    python benchmarks/stack_phases.py --rows 1,2 --out phases.json
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable

import torch
from attention_tune import time_launches  # benchmarks/ is the script's own folder

from legato.layers import decoder_stack
from legato.models.qwen3_tts.code_predictor import CodePredictor
from legato.models.qwen3_tts.config import CodePredictorConfig
from legato.models.qwen3_tts.decoder_layer import pack_projections
from legato.models.qwen3_tts.testing import randomize_


def _pass(cp: CodePredictor, rows: int) -> Callable[..., torch.Tensor]:
    """`decoder_stack.run` of `rows` random rows at position 8 of a fresh cache, its keyword arguments left open."""
    cfg = cp.config
    cos = torch.ones(cfg.head_dim, device="cuda")
    sin = torch.zeros(cfg.head_dim, device="cuda")
    x = torch.randn(rows, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    cache = cp.new_cache(rows, torch.bfloat16, torch.device("cuda"))
    return functools.partial(decoder_stack.run, cp.stack, x, cache.k, cache.v, 8, cos, sin, cp.lm_head[0].weight)


def measure(cp: CodePredictor, rows: int, names: list[str]) -> dict[str, float]:
    run = _pass(cp, rows)
    row = {}
    per_layer = decoder_stack.PHASES_PER_LAYER
    for kind, name in enumerate(names):
        phase = kind if kind < per_layer else per_layer * cp.stack.layers
        row[name] = time_launches(lambda phase=phase: run(sync=False, phases=(phase, phase)), 40)
    row["whole pass, one launch"] = time_launches(run, 40)
    row["whole pass, one launch, q/k/v in one pass"] = time_launches(lambda: run(qkv_parts=1), 40)
    row["whole pass, one launch, o a phase of its own"] = time_launches(lambda: run(split_o=False), 40)
    row["whole pass, one launch, o a phase of its own, q/k/v in one pass (session 52)"] = time_launches(
        lambda: run(split_o=False, qkv_parts=1), 40)
    row["whole pass, one launch, weights after the barrier"] = time_launches(lambda: run(early_tiles=False), 40)
    row["whole pass, one launch, activation once per program"] = time_launches(lambda: run(spread=False), 40)
    row["whole pass, one launch (again)"] = time_launches(run, 40)
    if rows == 1:
        row.update(_launch_forms(cp))
    row["whole pass, phase launches"] = time_launches(lambda: run(sync=False), 4)
    row["barrier errors"] = decoder_stack.barrier_errors()
    return row


def _launch_forms(cp: CodePredictor) -> dict[str, float]:
    """A frame's two prompt tokens as one launch against two, and a codebook's embedding row looked up by the
    launch against given to it (one row)."""
    cfg, dev = cp.config, torch.device("cuda")
    cache = cp.new_cache(1, torch.bfloat16, dev)
    cos, sin = torch.ones(2, cfg.head_dim, device=dev), torch.zeros(2, cfg.head_dim, device=dev)
    x = torch.randn(2, cfg.hidden_size, device=dev, dtype=torch.bfloat16)
    table = torch.randn(2048, cfg.hidden_size, device=dev, dtype=torch.bfloat16)
    code = torch.tensor([5], device=dev)
    head = cp.lm_head[0].weight

    def one(x, pos, **kw):
        return decoder_stack.run(cp.stack, x, cache.k, cache.v, pos, cos[0], sin[0], head, **kw)

    def apart():
        one(x[:1], 0)
        one(x[1:], 1)

    return {
        "two prompt tokens, one launch": time_launches(
            lambda: decoder_stack.run(cp.stack, x, cache.k, cache.v, 0, cos, sin, head), 40),
        "two prompt tokens, two launches": time_launches(apart, 40),
        "embedding row looked up by the launch": time_launches(lambda: one(table, 2, code=code), 40),
        "embedding row gathered, then the launch": time_launches(lambda: one(table[code], 2), 40),
    }


def sweep(cp: CodePredictor, knobs: list[tuple[int, int]]) -> dict[str, float]:
    """The whole one-row pass as one launch under (warps, programs) knobs, the default timed first and last."""
    run = _pass(cp, 1)
    default = (decoder_stack.WARPS, decoder_stack.default_programs(torch.device("cuda")))
    out = {}
    for warps, programs in [default, *knobs, default]:
        decoder_stack.WARPS = warps
        try:
            us = time_launches(lambda p=programs: run(programs=p), 40)
        finally:
            decoder_stack.WARPS = default[0]
        key = f"{warps} warps, {programs} programs"
        out[key if key not in out else key + " (again)"] = us
        print(json.dumps({key: round(us, 2), "barrier errors": decoder_stack.barrier_errors()}), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2")
    ap.add_argument("--out", default=None)
    ap.add_argument("--knobs", default="",
                    help="warps:programs,... for the one-row pass as one launch (a program per SM at most: the "
                         "barrier needs them all resident)")
    ap.add_argument("--ncu", type=int, default=0,
                    help="only run the one-row pass as one launch this many times, plain launches, for a profiler "
                         "(benchmarks/h200_step.sh ncu)")
    args = ap.parse_args()
    cfg = CodePredictorConfig()
    cp = CodePredictor(cfg, 1024)
    randomize_(cp, seed=0, std=0.02)
    cp.to(device="cuda", dtype=torch.bfloat16).eval()
    pack_projections(cp)
    cp.pack_stack()
    if args.ncu:
        run = _pass(cp, 1)
        for _ in range(args.ncu):
            run()
        torch.cuda.synchronize()
        print(json.dumps({"ncu launches": args.ncu, "barrier errors": decoder_stack.barrier_errors()}), flush=True)
        return
    names = ["norm+qkv", "attention+o partials", "norm+gate_up", "down", "head"]
    result = {"gpu": torch.cuda.get_device_name(), "rows": {}}
    for rows in [int(r) for r in args.rows.split(",")]:
        row = measure(cp, rows, names)
        result["rows"][f"{rows} rows"] = row
        print(json.dumps({"rows": rows, **{k: round(v, 2) for k, v in row.items()}}), flush=True)
    if args.knobs:
        result["knobs"] = sweep(cp, [tuple(int(v) for v in k.split(":")) for k in args.knobs.split(",")])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
