"""Tile sizes of the codec's conv GEMM kernel, measured per conv of a step: the data behind
`legato.layers.conv_tiles` (TUNED_CONFIGS).

Records every conv GEMM of one `StreamingCodecDecoder.step` (full-size, bf16) at each cell (streams x frames),
then times each heavy one (more than `--min-gflop`) with each candidate config, beside the same conv as a
torch im2col + cuBLAS matmul (each conv alone: without the staged copy for the next conv that its epilogue may
also write). Candidates: "None" is the tree's own choice, "tap" the same tiles with K blocked per tap (the
kernel before flat K), then the CONFIGS, and WIDE ones (two column blocks, 64 + 32 wide and the like) for
channel counts that are not a power of two. Prints the best config per conv, then times the whole step as one
graph replay with the tree's choices, with each conv's best and under each of KNOBS, and lists an eager step's
kernels one by one (`launches`).

    python3 benchmarks/codec_tune.py --cells 64x1,256x4 --out /tmp/tune.json
"""

from __future__ import annotations

import argparse
import ast
import json

import torch
import triton.testing
from codec_step import time_step  # benchmarks/ is the script's own folder

from legato.layers import causal_conv as cc
from legato.layers import conv_kernels as ck
from legato.layers import stage_kernels as sk
from legato.layers import window_attention as wa
from legato.layers.conv_tiles import conv_blocks
from legato.models.qwen3_tts import codec_stages
from legato.models.qwen3_tts.codec_decoder import CodecDecoder
from legato.models.qwen3_tts.config import CodecDecoderConfig
from legato.models.qwen3_tts.streaming_codec import StreamingCodecDecoder
from legato.models.qwen3_tts.testing import randomize_codec_decoder_

CONFIGS = [  # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
    (64, 64, 64, 4, 3), (128, 64, 64, 4, 3), (64, 128, 64, 4, 3), (128, 128, 64, 8, 3), (128, 128, 32, 8, 4),
    (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3),
]
WIDE = [  # (..., BLOCK_N2): tried where BLOCK_N < Cout <= BLOCK_N + BLOCK_N2
    (256, 64, 64, 8, 3, 32), (256, 64, 32, 8, 4, 32), (128, 64, 64, 4, 3, 32), (128, 64, 32, 4, 4, 32),
    (128, 64, 64, 8, 3, 32), (64, 64, 64, 4, 3, 32),
    (128, 128, 64, 8, 3, 64), (64, 128, 64, 4, 3, 64), (128, 128, 32, 8, 4, 64), (128, 128, 64, 4, 3, 64),
]


# Narrow tiles with K split over several programs, tried for convs of few rows (`--narrow-rows`): there the
# weight (up to 38 MB) is what streams, and wide tiles leave most SMs without a program. (..., BLOCK_N2, SPLIT).
NARROW = [(64, 32, 128, 4, 4), (128, 32, 128, 4, 3), (128, 64, 128, 4, 3), (64, 64, 64, 4, 4)]
SPLITS = [0, 2, 4, 8]


def record(codec: StreamingCodecDecoder, b: int, n: int) -> list[dict]:
    calls = []
    launch = cc._launch_conv

    def spy(p, weight, bias, length, taps, dil, phases, epilogue, epi, out, config=None, **kw):
        calls.append(dict(p=p, weight=weight, bias=bias, length=length, taps=taps, dil=dil, phases=phases,
                          epilogue=epilogue, epi=epi, out=out))
        return launch(p, weight, bias, length, taps, dil, phases, epilogue, epi, out, config, **kw)

    cc._launch_conv = spy
    try:
        slots = torch.arange(1, b + 1, device="cuda")
        codec.step(slots, torch.randint(0, 2048, (b, n, 16), device="cuda"))
    finally:
        cc._launch_conv = launch
    return calls


def cublas(c: dict) -> float:
    p, w, length, taps, dil = c["p"], c["weight"], c["length"], c["taps"], c["dil"]
    off0 = p.shape[1] - length - (taps - 1) * dil

    def run():
        cols = torch.cat([p[:, off0 + i * dil: off0 + i * dil + length] for i in range(taps)], dim=-1)
        return cols.reshape(-1, cols.shape[-1]) @ w

    return triton.testing.do_bench(run, warmup=5, rep=30, return_mode="median")


def codecs_per_cell(cells: str):
    """(cell, streams, frames, a full-size bf16 StreamingCodecDecoder of random weights) per "BxN" cell."""
    base = randomize_codec_decoder_(CodecDecoder(CodecDecoderConfig()).eval(), seed=1).cuda()
    for cell in cells.split(","):
        b, n = (int(v) for v in cell.split("x"))
        yield cell, b, n, StreamingCodecDecoder(base, b + 1, dtype=torch.bfloat16)


def choice(name: str):
    """(config, flat) of a candidate's name."""
    if name == "None":
        return None, None
    if name == "tap":
        return None, False
    return tuple(ast.literal_eval(name)), None


# Whole-step variants beyond the conv tiles: module knobs set for the variant's graph only.
KNOBS = {
    "no feed (every staged input through the staging kernel)": {(codec_stages, "FEED_NEXT"): False},
    "fused transformer (few-row GEMMs with norm, SiLU, residual)": {(codec_stages, "FUSED_TRANSFORMER"): True},
    "fused transformer, window 64 keys, 2 warps": {(codec_stages, "FUSED_TRANSFORMER"): True,
                                                  (wa, "KEY_BLOCK"): 64, (wa, "WARPS"): 2},
    "grouped restage": {(codec_stages, "GROUP_RESTAGE"): True},
    "fused transformer, grouped restage": {(codec_stages, "FUSED_TRANSFORMER"): True,
                                           (codec_stages, "GROUP_RESTAGE"): True},
    "window 128 keys, 4 warps": {(wa, "KEY_BLOCK"): 128, (wa, "WARPS"): 4},
    "window 128 keys, 2 warps": {(wa, "KEY_BLOCK"): 128, (wa, "WARPS"): 2},
    "window 64 keys, 2 warps": {(wa, "KEY_BLOCK"): 64, (wa, "WARPS"): 2},
    "window 64 keys, 4 warps": {(wa, "KEY_BLOCK"): 64, (wa, "WARPS"): 4},
    "window 32 keys, 1 warp": {(wa, "KEY_BLOCK"): 32, (wa, "WARPS"): 1},
    "stage tiles 8192": {(sk, "STAGE_TILE"): 8192},
    "stage tiles 16384, 8 warps": {(sk, "STAGE_TILE"): 16384, (sk, "STAGE_WARPS"): 8},
    "column tile 256 x 32, 4 warps": {(ck, "COLUMN_TILE"): (256, 32, 4)},
    "column tile 128 x 128, 4 warps": {(ck, "COLUMN_TILE"): (128, 128, 4)},
    "column tile 64 x 128, 4 warps": {(ck, "COLUMN_TILE"): (64, 128, 4)},
    "column tile 256 x 128, 8 warps": {(ck, "COLUMN_TILE"): (256, 128, 8)},
    "column tile 64 x 32, 2 warps": {(ck, "COLUMN_TILE"): (64, 32, 2)},
}


def whole_step(codec: StreamingCodecDecoder, cell: str, b: int, n: int, rows: list[dict]) -> dict:
    """The step as one graph replay (ms) with the tree's choices ("default"), with K blocked per tap everywhere
    ("tap", the kernel before flat K), with each tuned conv's best candidate ("best", where this cell was
    tuned), and with the tree's choices under each of KNOBS; and an eager default step's kernels one by one."""
    slots = torch.arange(1, b + 1, device="cuda")
    codes = torch.randint(0, 2048, (b, n, 16), device="cuda")
    launch = cc._launch_conv
    variants = [("default", {}, {}), ("tap", "tap", {})]
    if rows:
        variants.append(("best", {r["index"]: choice(r["best"]) for r in rows if "best" in r}, {}))
    variants += [(name, {}, knobs) for name, knobs in KNOBS.items()]
    out = {"cell": cell}
    for variant, pick, knobs in variants:
        count = [0]

        def spy(p, weight, bias, length, taps, dil, phases, epilogue, epi, o, config=None, pick=pick, count=count,
                **kw):
            i = count[0]
            count[0] += 1
            if pick == "tap":
                kw["flat"] = False
            elif i in pick:
                config, kw["flat"] = pick[i]
            return launch(p, weight, bias, length, taps, dil, phases, epilogue, epi, o, config, **kw)

        def step(count=count):
            count[0] = 0
            return codec.step(slots, codes)

        saved = {key: getattr(*key) for key in knobs}
        cc._launch_conv = spy
        for (module, name), value in knobs.items():
            setattr(module, name, value)
        try:
            codec.reset(slots)
            t = time_step(step, "cuda", 50)
        finally:
            cc._launch_conv = launch
            for (module, name), value in saved.items():
                setattr(module, name, value)
        out[f"{variant}_ms"] = t["median_ms"]
        out[f"{variant}_us_per_frame"] = 1000 * t["median_ms"] / (b * n)
        print(f"{cell}: graph step, {variant}: {t['median_ms']:.3f} ms = {out[f'{variant}_us_per_frame']:.1f} "
              f"us/frame", flush=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        codec.step(slots, codes)
        torch.cuda.synchronize()
    out["launches"] = [{"kernel": e.name[:60], "us": e.time_range.elapsed_us()} for e in prof.events()
                       if e.device_type == torch.autograd.DeviceType.CUDA]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", default="64x1,256x4")
    ap.add_argument("--min-gflop", type=float, default=1.0)
    ap.add_argument("--step-only", default="", help="cells whose convs are not tuned one by one, only the step")
    ap.add_argument("--max-rows", type=int, default=1 << 30, help="convs of more rows are not tuned one by one")
    ap.add_argument("--narrow-rows", type=int, default=256, help="convs of at most this many rows also try NARROW")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    results = []
    with torch.inference_mode():
        for cell, b, n, codec in codecs_per_cell(args.cells):
            for i, c in enumerate(record(codec, b, n)):
                m = c["p"].shape[0] * c["length"]
                cin, cout = c["p"].shape[2], c["weight"].shape[1] // c["phases"]
                gflop = 2 * m * c["taps"] * cin * cout * c["phases"] / 1e9
                row = {"cell": cell, "index": i, "m": m, "cin": cin, "cout": cout, "taps": c["taps"],
                       "phases": c["phases"], "epilogue": c["epilogue"], "gflop": gflop,
                       "default": conv_blocks(m, cin, cout, c["taps"], c["phases"])}
                if gflop < args.min_gflop or m > args.max_rows or cell in args.step_only.split(","):
                    continue
                out = c["out"]
                saved = out.clone()
                times = {}
                wide = [w for w in WIDE if w[1] < cout <= w[1] + w[5]]
                if m <= args.narrow_rows and c["phases"] * cout >= 256:
                    wide += [(*t, 0, s) for t in NARROW for s in SPLITS]
                for name, cfg, flat in [("None", None, None), ("tap", None, False),
                                        *((str(w), w, None) for w in [*CONFIGS, *wide])]:
                    if cfg is not None and cfg[1] > 2 * cout:
                        continue

                    def run(cfg=cfg, c=c, out=out, flat=flat):
                        cc._launch_conv(c["p"], c["weight"], c["bias"], c["length"], c["taps"], c["dil"],
                                        c["phases"], c["epilogue"], c["epi"], out, cfg, flat=flat)
                    try:
                        times[name] = triton.testing.do_bench(run, warmup=5, rep=30, return_mode="median")
                    except Exception as e:  # a config that does not fit (shared memory): skip it
                        times[name] = f"{type(e).__name__}"
                    out.copy_(saved)
                row["ms"] = times
                row["cublas_ms"] = cublas(c)
                ok = {k: v for k, v in times.items() if isinstance(v, float)}
                row["best"] = min(ok, key=ok.get)
                row["best_tflops"] = gflop / ok[row["best"]]
                results.append(row)
                print(f"{cell} #{i:2d} m={m:7d} {cin:5d}->{cout:5d} taps={c['taps']} ph={c['phases']} "
                      f"{c['epilogue']:8s} {gflop:6.2f} GF  default {times['None']:.3f} ms  best {row['best']} "
                      f"{ok[row['best']]:.3f} ms ({row['best_tflops']:.0f} TF/s)  cublas {row['cublas_ms']:.3f} ms",
                      flush=True)
            results.append(whole_step(codec, cell, b, n, [r for r in results if r.get("cell") == cell]))
            del codec
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
