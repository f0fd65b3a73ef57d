"""Device time of one fused draw (`engine/draw_kernel.py`) in each of its forms: the path before session 56 (top-k
by 32 halvings, Philox once per id), the packed top-k search (four counts a pass, early stop; `PACKED_SEARCH`), then
Philox once per four-word block (`PHILOX_PER_BLOCK`), then that with 8 and 16 warps a program (`WARPS`), and the
first form again (drift shows). At the code predictor's head width (2048) and the talker's (3072), batch 1 and 64,
with the model's sampling settings (top-k 50, top-p 1: no top-p search), with top-p 0.9, and greedy. Random logits,
CUDA graphs of back-to-back draws; every form's tokens compared with the first's.

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


FORMS = [
    ("before", dict(packed=False, per_block=False)),
    ("packed", dict(packed=True, per_block=False)),
    ("packed + per block", dict(packed=True, per_block=True)),
    ("packed + per block, 8 warps", dict(packed=True, per_block=True, warps=8)),
    ("packed + per block, 16 warps", dict(packed=True, per_block=True, warps=16)),
    ("before again", dict(packed=False, per_block=False)),
]


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
                for name, form in FORMS:
                    cell[f"{name} us"] = round(time_launches(
                        lambda xs=xs, form=form: fused_draw(*xs, 3, **form), args.launches), 3)
                    tokens[name] = fused_draw(*xs, 3, **form)
                first = FORMS[0][0]
                cell["tokens differ"] = sum(int((t != tokens[first]).sum()) for t in tokens.values())
                print(json.dumps(cell), flush=True)
                result["cells"].append(cell)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
