"""Batch-1 tile variants for the few-row GEMM, to time inside the decode frame rather than alone.

`matmul_tune.py` picks each shape's tiles from a CUDA graph of the same product back to back, launched plainly. In
the frame the kernels launch with programmatic dependent launch: a product's programs start while the kernel
before (a norm, an attention) still runs, warm their weight strips into L2, then wait. How much of the walk that
hides depends on the tile, so the tile that ends soonest there is only measured there: in session 56's batch-1
profile the 0.6B's gate/up product (96 programs of 32 columns) took 9.1 us a call against 6.0 for q/k/v (128
programs), which reads more weight. Each variant here is a `LEGATO_MATMUL_TILES` JSON that replaces one-row
entries of the table (`small_matmul.TABLE`, key rows 1), for `offline.py` to time a whole frame with:

    python3 benchmarks/frame_tiles.py --out-dir /tmp/tiles [--size 0.6B]
    for f in /tmp/tiles/*.json; do LEGATO_MATMUL_TILES=$f python3 benchmarks/offline.py --batch-sizes 1 ...; done

(`h200_step.sh tiles` runs both.) The table's other rows are untouched.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# (N, K, gated) of a size's layer weights: q/k/v, o, gate/up, down (the code predictor's are the 0.6B talker's).
SHAPES = {
    "0.6B": {"qkv": (4096, 1024, False), "o": (1024, 2048, False), "gate_up": (6144, 1024, True),
             "down": (1024, 3072, False)},
    "1.7B": {"qkv": (4096, 2048, False), "o": (2048, 2048, False), "gate_up": (12288, 2048, True),
             "down": (2048, 6144, False)},
}


def tiles(block_n: int, block_k: int, split: int) -> dict:
    return {"block_n": block_n, "block_k": block_k, "split": split, "warps": 4, "stages": 4}


# Each variant: {weight name: (block_n, block_k, split)} at one row. More programs for the weights that now run
# fewer than one per SM, or more K splits for the products that end in a sum kernel anyway.
VARIANTS = {
    "0.6B": {
        "gate_up-n16": {"gate_up": (16, 128, 1)},
        "gate_up-split2": {"gate_up": (32, 128, 2)},
        "qkv-n16": {"qkv": (16, 128, 1)},
        "o-down-split8": {"o": (32, 128, 8), "down": (32, 128, 8)},
        "o-down-n16": {"o": (16, 128, 4), "down": (16, 128, 4)},
    },
    "1.7B": {
        "gate_up-n16": {"gate_up": (16, 128, 1)},
        "qkv-n16": {"qkv": (16, 256, 1)},
        "o-n32": {"o": (32, 128, 4)},
    },
}


def write(out_dir: Path, size: str) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, picks in VARIANTS[size].items():
        rows = [{"m": 1, "n": n, "k": k, "gated": gated, "tiles": tiles(*picks[w])}
                for w, (n, k, gated) in SHAPES[size].items() if w in picks]
        path = out_dir / f"{size}-{name}.json"
        path.write_text(json.dumps(rows, indent=1))
        paths.append(path)
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--size", default="0.6B", choices=sorted(VARIANTS))
    args = ap.parse_args()
    for path in write(Path(args.out_dir), args.size):
        print(path)


if __name__ == "__main__":
    main()
