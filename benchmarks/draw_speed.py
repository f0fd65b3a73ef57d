"""Device time of one fused draw (`engine/draw_kernel.py`): top-k by the packed search (four counts a pass, early
stop; `PACKED_SEARCH`, the default) against plain bisection (32 halvings, the path before), at the code predictor's
head width (2048) and the talker's (3072), batch 1 and 64, with the model's sampling settings (top-k 50, top-p 1:
no top-p search) and with top-p 0.9, and greedy. Random logits, CUDA graphs of back-to-back draws; tokens of both
forms compared on every setting.

    python benchmarks/draw_speed.py --out draw.json
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from attention_tune import time_launches  # benchmarks/ is the script's own folder

from legato.engine.draw_kernel import fused_draw


def inputs(rows: int, vocab: int, top_p: float, gen: torch.Generator, sample: bool = True) -> tuple:
    logits = (torch.randn(rows, vocab, generator=gen) * 3).cuda()
    on = torch.full((rows,), sample, dtype=torch.bool, device="cuda")
    temperature = torch.full((rows,), 0.9, device="cuda")
    top_k = torch.full((rows,), 50, dtype=torch.int64, device="cuda")
    top_p_t = torch.full((rows,), top_p, device="cuda")
    seed = torch.randint(0, 2**62, (rows,), generator=gen).cuda()
    frame = torch.randint(0, 2**20, (rows,), generator=gen).cuda()
    return logits, on, temperature, top_k, top_p_t, seed, frame


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,64")
    ap.add_argument("--launches", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "commit": os.environ.get("LEGATO_COMMIT"), "cells": []}
    for rows in (int(r) for r in args.rows.split(",")):
        for vocab in (2048, 3072):
            for top_p, sample in ((1.0, True), (0.9, True), (1.0, False)):
                xs = inputs(rows, vocab, top_p, gen, sample)
                cell = {"rows": rows, "vocab": vocab, "top_k": 50, "top_p": top_p, "sampled": sample}
                tokens = {}
                # bisection, packed, bisection again: drift between the first and the last shows
                for name, packed in (("bisection", False), ("packed", True), ("bisection again", False)):
                    cell[f"{name} us"] = round(time_launches(
                        lambda xs=xs, packed=packed: fused_draw(*xs, 3, packed=packed), args.launches), 3)
                    tokens[packed] = fused_draw(*xs, 3, packed=packed)
                cell["tokens differ"] = int((tokens[True] != tokens[False]).sum())
                cell["packed speed-up"] = round(cell["bisection us"] / cell["packed us"], 3)
                print(json.dumps(cell), flush=True)
                result["cells"].append(cell)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
