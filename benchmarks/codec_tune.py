"""Tile sizes of the codec's conv GEMM kernel, measured per conv of a step: the data behind
`legato.layers.conv_tiles` (TUNED_CONFIGS).

Records every conv GEMM of one `StreamingCodecDecoder.step` (full-size, bf16) at each cell (streams x frames),
then times each heavy one (more than `--min-gflop`) with each candidate config, beside the same conv as a
torch im2col + cuBLAS matmul, and the whole step by kernel. Prints the best config per conv.

    python3 benchmarks/codec_tune.py --cells 64x1,256x4 --out /tmp/tune.json
"""

from __future__ import annotations

import argparse
import json

import torch
import triton.testing

from legato.layers import causal_conv as cc
from legato.models.qwen3_tts.codec_decoder import CodecDecoder
from legato.models.qwen3_tts.config import CodecDecoderConfig
from legato.models.qwen3_tts.streaming_codec import StreamingCodecDecoder
from legato.models.qwen3_tts.testing import randomize_codec_decoder_

CONFIGS = [  # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
    (64, 64, 64, 4, 3), (128, 64, 64, 4, 3), (64, 128, 64, 4, 3), (128, 128, 64, 8, 3), (128, 128, 32, 8, 4),
    (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3),
]


def record(codec: StreamingCodecDecoder, b: int, n: int) -> list[dict]:
    calls = []
    launch = cc._launch_conv

    def spy(p, weight, bias, length, taps, dil, phases, epilogue, epi, out, config=None):
        calls.append(dict(p=p, weight=weight, bias=bias, length=length, taps=taps, dil=dil, phases=phases,
                          epilogue=epilogue, epi=epi, out=out))
        return launch(p, weight, bias, length, taps, dil, phases, epilogue, epi, out, config)

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", default="64x1,256x4")
    ap.add_argument("--min-gflop", type=float, default=1.0)
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
                       "default": cc.conv_blocks(m, cin, cout, c["taps"], c["phases"])}
                if gflop < args.min_gflop:
                    continue
                out = c["out"]
                saved = out.clone()
                times = {}
                for cfg in [None, *CONFIGS]:
                    if cfg is not None and cfg[1] > 2 * cout:
                        continue

                    def run(cfg=cfg, c=c, out=out):
                        cc._launch_conv(c["p"], c["weight"], c["bias"], c["length"], c["taps"], c["dil"],
                                        c["phases"], c["epilogue"], c["epi"], out, cfg)
                    try:
                        times[str(cfg)] = triton.testing.do_bench(run, warmup=5, rep=30, return_mode="median")
                    except Exception as e:  # a config that does not fit (shared memory): skip it
                        times[str(cfg)] = f"{type(e).__name__}"
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
            slots = torch.arange(1, b + 1, device="cuda")
            codes = torch.randint(0, 2048, (b, n, 16), device="cuda")
            step_ms = triton.testing.do_bench(lambda c=codec, s=slots, x=codes: c.step(s, x), warmup=5, rep=50,
                                              return_mode="median")
            print(f"{cell}: eager step {step_ms:.3f} ms = {1000 * step_ms / (b * n):.1f} us/frame", flush=True)
            results.append({"cell": cell, "eager_step_ms": step_ms})
            del codec
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
