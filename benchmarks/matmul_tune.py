"""Tiles for the few-row GEMM (`legato/layers/small_matmul.py`), measured against the path it replaces.

For each matmul shape of the 0.6B (and 1.7B) talker and code predictor and each row bucket, times every tile
choice of a small grid and the path before the kernel (the one-row kernel of `skinny_linear.py` at one row,
cuBLAS above; gated shapes add the separate SiLU kernel), each as a CUDA graph of back-to-back calls that cycle
through enough copies of the weight to overflow L2, as a decode step's 103 layers do. Writes the best tiles per
(bucket, shape), or null where the old path won, as the JSON `LEGATO_MATMUL_TILES` reads, and every timing.

    python3 benchmarks/matmul_tune.py --out tiles.json [--sizes 0.6B,1.7B] [--rows 1,16,32,64,128,256]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

import torch

from legato.layers import skinny_linear, small_matmul
from legato.layers.fused import silu_mul
from legato.layers.small_matmul import Tiles


def shapes(size: str) -> list[tuple[str, int, int, bool]]:
    """(name, N, K, gated) of a size's talker layers, heads and (the same for both sizes) code predictor; "codec":
    the codec decoder's transformer (hidden 512, 16 heads of 64, MLP 1024, latent 1024)."""
    if size == "codec":
        return [("codec qkv", 3 * 1024, 512, False), ("codec o", 512, 1024, False),
                ("codec gate_up", 2 * 1024, 512, True), ("codec in", 512, 1024, False),
                ("codec out", 1024, 512, False)]
    hidden, inter = (2048, 6144) if size == "1.7B" else (1024, 3072)
    q, kv = 16 * 128, 8 * 128
    talker = [(f"{size} talker qkv", q + 2 * kv, hidden, False), (f"{size} talker o", hidden, q, False),
              (f"{size} talker gate_up", 2 * inter, hidden, True), (f"{size} talker down", hidden, inter, False),
              (f"{size} codec_head", 3072, hidden, False)]
    if size == "1.7B":
        return talker
    return talker + [("code predictor lm_head", 2048, 1024, False)]  # its layers have the 0.6B talker's shapes


def time_graph(fn, copies: int, repeats: int = 5) -> float:
    """us per call: a CUDA graph of `copies` calls (fn(i) uses copy i), replayed `repeats` times; the median."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(copies):  # warm: compiles, allocations
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / copies)
    del graph
    return statistics.median(times)


def old_path(x: torch.Tensor, w: torch.Tensor, gated: bool) -> torch.Tensor:
    y = skinny_linear.linear(x, w)  # the one-row kernel at one row, cuBLAS above
    if gated:
        gate, up = y.chunk(2, dim=-1)
        return silu_mul(gate, up)
    return y


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="0.6B,1.7B")
    ap.add_argument("--rows", default="1,16,32,64,128,256")
    ap.add_argument("--block-n", default="16,32,64")
    ap.add_argument("--block-k", default="128,256")
    ap.add_argument("--splits", default="1,2,4")
    ap.add_argument("--stages", default="4")
    ap.add_argument("--l2-bytes", type=float, default=200e6, help="weight bytes a graph cycles through")
    ap.add_argument("--margin", type=float, default=0.97, help="the kernel must beat the old path by this ratio")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev, dtype = "cuda", torch.bfloat16
    grid = [Tiles(block_n=bn, block_k=bk, split=s, stages=st) for bn, bk, s, st in itertools.product(
        *([int(v) for v in getattr(args, a).split(",")] for a in ("block_n", "block_k", "splits", "stages")))]
    table, timings = [], []
    started = time.perf_counter()
    seen = set()
    for size in args.sizes.split(","):
        for name, n, k, gated in shapes(size):
            if (n, k, gated) in seen:
                continue
            seen.add((n, k, gated))
            copies = max(8, int(args.l2_bytes // (n * k * 2)))
            gen = torch.Generator(device=dev).manual_seed(0)
            weights = [torch.randn(n, k, device=dev, dtype=dtype, generator=gen) / k**0.5 for _ in range(copies)]
            for m in (int(v) for v in args.rows.split(",")):
                xs = [torch.randn(m, k, device=dev, dtype=dtype, generator=gen) for _ in range(copies)]
                want = old_path(xs[0], weights[0], gated).float()
                old = time_graph(lambda i, xs=xs, ws=weights, g=gated: old_path(xs[i], ws[i], g), copies)
                best, best_us = None, old
                rows = {"old": old}
                for t in grid:
                    try:
                        err = ((small_matmul.matmul(xs[0], weights[0], gated, t).float() - want).norm()
                               / want.norm()).item()
                        us = time_graph(lambda i, xs=xs, ws=weights, t=t, g=gated:
                                        small_matmul.matmul(xs[i], ws[i], g, t), copies)
                    except Exception as e:  # a tile that does not fit (shared memory): skipped, said so
                        rows[str(t)] = f"failed: {type(e).__name__}"
                        continue
                    rows[str(t)] = us
                    if err > 1e-2:
                        rows[str(t)] = f"error {err:.2e}"
                        continue
                    if us < best_us * (args.margin if best is None else 1.0):
                        best, best_us = t, us
                rule = small_matmul.rule_of_thumb(m, n // 2 if gated else n, k, gated)
                rule_us = rows.get(str(rule))
                tiles = None if best is None else {f: getattr(best, f) for f in Tiles.__dataclass_fields__}
                table.append({"m": m, "n": n, "k": k, "gated": gated, "tiles": tiles})
                timings.append({"shape": name, "m": m, "n": n, "k": k, "gated": gated, "old_us": old,
                                "best_us": best_us, "best": str(best), "rule_us": rule_us, "all": rows})
                gbs = n * k * 2 / best_us / 1e3
                print(f"[tune] {name:26s} m={m:<4d} old {old:7.2f} us  best {best_us:7.2f} us ({old / best_us:4.2f}x, "
                      f"{gbs:5.0f} GB/s)  rule {rule_us if isinstance(rule_us, str) else f'{rule_us:7.2f}'}  {best}",
                      flush=True)
            del weights
            # After every shape, so a run cut short by its time limit still leaves what it measured.
            with open(args.out, "w") as f:
                json.dump(table, f, indent=1)
            with open(args.out.replace(".json", "-timings.json"), "w") as f:
                json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "seconds":
                           time.perf_counter() - started, "timings": timings}, f, indent=1)


if __name__ == "__main__":
    main()
