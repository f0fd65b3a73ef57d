"""The fused draw kernel (`legato/engine/draw_kernel.py`) against `sampler.draw`, token for token.

`run_checks(device)` serves the GPU test (CUDA, libdevice math, against the eager and the compiled draw) and a
CPU test that runs this file in a subprocess under Triton's interpreter (`TRITON_INTERPRET=1`). Rows mix
greedy and sampled, temperature 0, top-k off / 1 / 50 / past the vocabulary, top-p off / 0.9 / 0.5 / 0.01,
tied logits, suppressed (-inf) ids, and seeds and frames past 2**32; both head widths (2048 and 3072); top-k by
bisection and by radix select.
`python tests/draw_kernel_checks.py [cuda|cpu]`.
"""

from __future__ import annotations

import os
import sys

import torch

if os.environ.get("TRITON_INTERPRET") == "1":
    from triton_interpreter import patch_for_numpy

    patch_for_numpy()

from legato.engine.draw_kernel import fused_draw
from legato.engine.sampler import HeadTensors, draw


def batch(vocab: int, rows: int, gen: torch.Generator, device: str):
    logits = torch.randn(rows, vocab, generator=gen) * 3
    logits[rows // 4: rows // 2] = torch.round(logits[rows // 4: rows // 2])  # many ties
    logits[::5, vocab - vocab // 3:] = float("-inf")  # suppressed ids, as codebook 0's rules leave them
    i = torch.arange(rows)
    head = HeadTensors(
        do_sample=(i % 7 != 0),
        temperature=torch.tensor([0.9, 1.0, 0.0, 0.7, 1.3, 0.05])[i % 6],
        top_k=torch.tensor([50, 0, 1, vocab, vocab + 5, 3, 2000])[i % 7],
        top_p=torch.tensor([1.0, 0.9, 0.5, 0.01, 1.0])[i % 5],
    )
    seed = torch.randint(0, 2**62, (rows,), generator=gen)
    frame = torch.randint(0, 2**40, (rows,), generator=gen)
    frame[:4] = torch.tensor([0, 1, 2**32 - 1, 2**32])
    codebook = i % 16
    head = HeadTensors(*(t.to(device) for t in (head.do_sample, head.temperature, head.top_k, head.top_p)))
    return logits.to(device), head, seed.to(device), frame.to(device), codebook.to(device)


def run_checks(device: str, rows: dict[int, int], rounds: int) -> dict[str, int]:
    """Rows whose fused token differs from the reference's (0 everywhere is the pass); `rows` per head width."""
    gen = torch.Generator().manual_seed(0)
    compiled = torch.compile(draw, fullgraph=True, dynamic=True) if device == "cuda" else None
    result = {}
    for vocab, n in rows.items():
        for r in range(rounds):
            logits, head, seed, frame, codebook = batch(vocab, n, gen, device)
            got = fused_draw(logits, head.do_sample, head.temperature, head.top_k, head.top_p, seed, frame, codebook)
            want = draw(logits, head, seed, frame, codebook)
            result[f"V={vocab} round {r}: vs draw"] = int((got != want).sum())
            if r == 0:
                # top-k by the radix select (draw_kernel.RADIX_SELECT) rather than the bisection
                radix = fused_draw(logits, head.do_sample, head.temperature, head.top_k, head.top_p, seed, frame,
                                   codebook, radix=True)
                result[f"V={vocab}: radix select vs draw"] = int((radix != want).sum())
                # a bf16 head's logits as they come, widened by the kernel as it loads them, against the draw of
                # the same logits widened by .float() (what the sampler passed before)
                half = logits.bfloat16()
                result[f"V={vocab}: bf16 logits vs draw of .float()"] = int((fused_draw(
                    half, head.do_sample, head.temperature, head.top_k, head.top_p, seed, frame, codebook)
                    != draw(half.float(), head, seed, frame, codebook)).sum())
                # one codebook for every row, given as an int (the sampler's way) rather than a tensor; 1 is the
                # value Triton would make a compile-time constant unless told not to
                result[f"V={vocab}: codebook as an int vs draw"] = sum(
                    int((fused_draw(logits, head.do_sample, head.temperature, head.top_k, head.top_p, seed, frame, cb)
                         != draw(logits, head, seed, frame, torch.full_like(codebook, cb))).sum()) for cb in (1, 15))
            if compiled is not None:
                result[f"V={vocab} round {r}: vs compiled draw"] = int((got != compiled(logits, head, seed, frame,
                                                                                        codebook)).sum())
    return result


def main() -> int:
    device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    # The GPU run checks 32k rows; the interpreter a few hundred (~10 ms a row).
    rows = {2048: 420, 3072: 210} if device == "cpu" else {2048: 4096, 3072: 4096}
    results = run_checks(device, rows, rounds=2 if device == "cpu" else 4)
    bad = 0
    for name, n in results.items():
        bad += n != 0
        print(f"{name}: {n} rows differ {'ok' if n == 0 else 'FAIL'}")
    print("ALL OK" if not bad else f"{bad} FAILED")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
