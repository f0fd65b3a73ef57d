"""Tiles of the codec's one-kernel residual units and of its split-K convs, against the two-kernel path and no split.

Records the residual units and the small-row convs (m <= `--max-split-rows`) of one full-size bf16
`StreamingCodecDecoder.step` per cell, then times:
- each unit as one kernel with each candidate config, beside its 7-tap conv + 1x1 conv as two kernels
  (`conv_tiles` defaults, no split);
- each small conv at its default tiles with split 1 (none), the rule's split, and fixed splits.

    python3 benchmarks/unit_tune.py --cells 64x1,256x4 --out /tmp/unit_tune.json
"""

from __future__ import annotations

import argparse
import json

import torch
import triton.testing
from codec_tune import codecs_per_cell  # benchmarks/ is the script's folder, first on sys.path

from legato.layers import causal_conv as cc
from legato.layers import conv_kernels as ck
from legato.models.qwen3_tts.streaming_codec import StreamingCodecDecoder

UNIT_CONFIGS = [  # (BLOCK_M, BLOCK_C, BLOCK_K, warps, stages); BLOCK_C is the channels' power of two
    (64, 0, 32, 4, 3), (64, 0, 32, 8, 3), (128, 0, 32, 8, 3), (128, 0, 32, 8, 2), (128, 0, 32, 8, 4),
    (256, 0, 32, 8, 3), (64, 0, 64, 8, 3), (32, 0, 32, 4, 3), (128, 0, 64, 8, 2),
]
SPLITS = [1, None, 2, 4, 8]


def bench(fn) -> float | str:
    try:
        return triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median")
    except Exception as e:  # a config that does not fit (shared memory, registers): recorded, skipped
        return type(e).__name__


def record(codec: StreamingCodecDecoder, b: int, n: int, max_rows: int) -> tuple[list[dict], list[dict]]:
    units, convs = [], []
    launch_unit, launch_conv = cc._launch_unit, cc._launch_conv

    def spy_unit(p, w7, b7, length, taps, dil, epi, w1, b1, x, config=None):
        units.append(dict(p=p, w7=w7, b7=b7, length=length, taps=taps, dil=dil, epi=epi, w1=w1, b1=b1, x=x))
        return launch_unit(p, w7, b7, length, taps, dil, epi, w1, b1, x, config)

    def spy_conv(p, weight, bias, length, taps, dil, phases, epilogue, epi, out, config=None, split=None, **kw):
        if p.shape[0] * length <= max_rows:
            convs.append(dict(p=p, weight=weight, bias=bias, length=length, taps=taps, dil=dil, phases=phases,
                              epilogue=epilogue, epi=epi, out=out))
        return launch_conv(p, weight, bias, length, taps, dil, phases, epilogue, epi, out, config, split, **kw)

    cc._launch_unit, cc._launch_conv = spy_unit, spy_conv
    try:
        slots = torch.arange(1, b + 1, device="cuda")
        codec.step(slots, torch.randint(0, 2048, (b, n, 16), device="cuda"))
    finally:
        cc._launch_unit, cc._launch_conv = launch_unit, launch_conv
    return units, convs


def tune_unit(u: dict) -> dict:
    p, x = u["p"], u["x"]
    m, c = x.shape
    saved = x.clone()
    h = torch.empty_like(x)
    times: dict[str, float | str] = {}

    def two_kernels():
        ck.launch_conv(p, u["w7"], u["b7"], u["length"], u["taps"], u["dil"], 1, "snake", u["epi"], h, split=1)
        ck.launch_conv(h.view(1, m, c), u["w1"], u["b1"], m, 1, 1, 1, "residual", None, x, split=1)

    times["two kernels"] = bench(two_kernels)
    x.copy_(saved)
    block_c = ck.pow2_at_least(c)
    for cfg in [None, *UNIT_CONFIGS]:
        cfg = cfg and (cfg[0], block_c, *cfg[2:])
        times[str(cfg)] = bench(lambda cfg=cfg: ck.launch_unit(p, u["w7"], u["b7"], u["length"], u["taps"], u["dil"],
                                                                u["epi"], u["w1"], u["b1"], x, cfg))
        x.copy_(saved)
    return {"m": m, "c": c, "taps": u["taps"], "dil": u["dil"], "ms": times}


def tune_conv(cv: dict) -> dict:
    out = cv["out"]
    saved = out.clone()
    times = {}
    for split in SPLITS:
        times[str(split)] = bench(lambda s=split: ck.launch_conv(cv["p"], cv["weight"], cv["bias"], cv["length"],
                                                                 cv["taps"], cv["dil"], cv["phases"],
                                                                 cv["epilogue"], cv["epi"], out, split=s))
        out.copy_(saved)
    p = cv["p"]
    return {"m": p.shape[0] * cv["length"], "cin": p.shape[2], "cout": cv["weight"].shape[1] // cv["phases"],
            "taps": cv["taps"], "phases": cv["phases"], "epilogue": cv["epilogue"], "ms": times}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", default="64x1,256x4")
    ap.add_argument("--max-split-rows", type=int, default=4096)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    results = []
    with torch.inference_mode():
        for cell, b, n, codec in codecs_per_cell(args.cells):
            units, convs = record(codec, b, n, args.max_split_rows)
            for i, u in enumerate(units):
                row = {"cell": cell, "kind": "unit", "index": i, **tune_unit(u)}
                results.append(row)
                print(json.dumps(row), flush=True)
            for i, cv in enumerate(convs):
                row = {"cell": cell, "kind": "conv", "index": i, **tune_conv(cv)}
                results.append(row)
                print(json.dumps(row), flush=True)
            del codec
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
