"""The fused decode attention alone (`legato/layers/fused_attention.py`): device time per launch at the talker's
paged shape and the code predictor's contiguous one, this tree's kernel beside another tree's (`--base DIR`,
e.g. a `git archive` in .base/), and this tree's under other knobs (BLOCK_N, MIN_SPAN, SPLITS, WARPS).

Each (kernel, shape) is one CUDA graph of `--launches` launches; the time is the median of 20 replays between
CUDA events, divided by the launches. Every variant's output is compared with the PyTorch contract on the
same inputs first (relative error in the JSON). Shapes are the 0.6B talker's (16 heads, 8 kv heads, D 128,
16-position blocks): `talker` rows of `--contexts` cached positions, `cp` rows at code-predictor positions.

    python3 benchmarks/attention_tune.py --base .base --out /tmp/attn.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys

import torch

from legato.layers import fused_attention
from legato.layers.rotary import RotaryEmbedding

HEADS, KV_HEADS, D, BLOCK = 16, 8, 128, 16
KNOBS = {  # name -> module attributes set on this tree's kernel
    "new": {},
    "w4": {"WARPS": (4, 4)},
    "w2": {"WARPS": (2, 2)},
    "w8": {"WARPS": (8, 8)},
    "reduce": {"DOT": False},
    "span32": {"MIN_SPAN": 32},
    "block64": {"BLOCK_N": 64},
    # Fewer splits for many rows: at 64 rows x 8 kv heads there are programs enough without splitting positions,
    # and 13 of 16 splits of a 160-position row have nothing to do (MIN_SPAN 64).
    "splits1": {"SPLITS": 1},
    "split-all": {"ONE_SPLIT_ROWS": 1 << 30},  # SPLITS at every row count: the rule before ONE_SPLIT_ROWS
    "splits4": {"SPLITS": 4},
    "span128": {"MIN_SPAN": 128},
}


def load_tree(path: str):
    """fused_attention.py of another tree, as a module of its own."""
    spec = importlib.util.spec_from_file_location("base_fused_attention", f"{path}/legato/layers/fused_attention.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def inputs(kind: str, b: int, ctx: int, gen: torch.Generator):
    """(args, kwargs) of one launch: ctx cached positions before the new token."""
    qkv = (torch.randn(b, (HEADS + 2 * KV_HEADS) * D, generator=gen) * 2).cuda().bfloat16()
    qw = (1 + 0.3 * torch.randn(D, generator=gen)).cuda().bfloat16()
    kw = (1 + 0.3 * torch.randn(D, generator=gen)).cuda().bfloat16()
    cos, sin = RotaryEmbedding(D, 10000.0)(torch.full((b,), ctx))
    if kind == "talker":
        per_row = ctx // BLOCK + 1
        k = torch.randn(b * per_row + 1, BLOCK, KV_HEADS, D, generator=gen).cuda().bfloat16()
        tables = torch.randperm(b * per_row, generator=gen).view(b, per_row).int().cuda()
        kwargs = {"block_tables": tables, "context_lens": torch.full((b,), ctx + 1, dtype=torch.int32).cuda()}
    else:
        k = torch.randn(b, KV_HEADS, 17, D, generator=gen).cuda().bfloat16()
        kwargs = {"position": ctx}
    v = torch.randn(k.shape, generator=gen).cuda().bfloat16()
    return (qkv, qw, kw, 1e-6, cos.cuda(), sin.cuda(), k, v, HEADS), kwargs


def time_launches(fn, launches: int) -> float:
    """us of device time per launch: one graph of `launches` calls, median of 20 replays."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / launches)
    return statistics.median(times)


def measure(module, knobs: dict, kind: str, b: int, ctx: int, launches: int) -> dict:
    saved = {name: getattr(module, name) for name in knobs}
    for name, value in knobs.items():
        setattr(module, name, value)
    try:
        gen = torch.Generator().manual_seed(b * 1000 + ctx)
        args, kwargs = inputs(kind, b, ctx, gen)
        caches = [c.clone() for c in args[6:8]]
        got = module.fused_decode_attention(*args, **kwargs)
        want = fused_attention.fused_decode_attention_reference(*args[:6], *caches, HEADS, **kwargs)
        err = float((got.float() - want.float()).norm() / want.float().norm())
        return {"us": time_launches(lambda: module.fused_decode_attention(*args, **kwargs), launches), "rel_err": err}
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default=None, help="another tree whose fused_attention.py runs beside this one")
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--contexts", default="64,160,320", help="talker rows' cached positions")
    ap.add_argument("--cp-positions", default="2,9,15", help="code predictor rows' cached positions")
    ap.add_argument("--knobs", default=",".join(KNOBS))
    ap.add_argument("--launches", type=int, default=50)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    trees = {"base": (load_tree(args.base), {})} if args.base else {}
    trees.update({name: (fused_attention, KNOBS[name]) for name in args.knobs.split(",")})
    shapes = [("talker", int(c)) for c in args.contexts.split(",")] + [("cp", int(p)) for p in
                                                                        args.cp_positions.split(",")]
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        for kind, ctx in shapes:
            row = {"kind": kind, "batch": b, "cached": ctx}
            for name, (module, knobs) in trees.items():
                try:
                    row[name] = measure(module, knobs, kind, b, ctx, args.launches)
                except Exception as e:  # a knob a tree lacks, or a tile that does not compile: report, go on
                    row[name] = {"error": f"{type(e).__name__}: {e}"[:200]}
            rows.append(row)
            print(json.dumps({k: ([round(v["us"], 2), float(f"{v['rel_err']:.1e}")] if isinstance(v, dict) and "us" in v
                                  else v) for k, v in row.items()}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
