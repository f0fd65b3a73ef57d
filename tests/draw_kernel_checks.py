"""The fused draw kernel (`legato/engine/draw_kernel.py`) against `sampler.draw`, token for token.

`run_checks(device)` serves the GPU test (CUDA, libdevice math, against the eager and the compiled draw) and a
CPU test that runs this file in a subprocess under Triton's interpreter (`TRITON_INTERPRET=1`). Rows mix
greedy and sampled, temperature 0, top-k off / 1 / 50 / past the vocabulary, top-p off / 0.9 / 0.5 / 0.01,
tied logits, suppressed (-inf) ids, and seeds and frames past 2**32; both head widths (2048 and 3072); top-k by the
packed search (the default) and by plain bisection; Philox per id (the default) and per block; 16 warps; and rows
built to stress the top-k search (`hard_batch`).
`python tests/draw_kernel_checks.py [cuda|cpu]`.
"""

from __future__ import annotations

import os
import sys

import torch

if os.environ.get("TRITON_INTERPRET") == "1":
    from triton_interpreter import patch_for_numpy

    patch_for_numpy()

from legato.engine import draw_kernel
from legato.engine.draw_kernel import fused_draw
from legato.engine.sampler import HeadTensors, draw

if draw_kernel.triton is not None:
    import triton
    import triton.language as tl

    @triton.jit
    def _kth_value_kernel(x_ptr, k_ptr, out_ptr, V, BLOCK_V: tl.constexpr, PACKED: tl.constexpr):
        # the search alone: each row's k-th largest value, as the draw finds it
        row = tl.program_id(0)
        v = tl.arange(0, BLOCK_V)
        valid = v < V
        x = tl.load(x_ptr + row * V + v, mask=valid, other=float("-inf"))
        key = draw_kernel._order_key(x)
        k = tl.load(k_ptr + row)
        if PACKED:
            at = draw_kernel._kth_largest_at(key, valid, k)
        else:
            lowest, highest = draw_kernel._key_bounds(key, valid)
            at = draw_kernel._kth_largest_key(key, valid, k, lowest, highest)
        tl.store(out_ptr + row, draw_kernel._value_at_key(x, key, valid, at))


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


def hard_batch(vocab: int, gen: torch.Generator, device: str):
    """Rows where the top-k search's ends and ties matter: one value everywhere, a single finite id, +0.0 and -0.0
    mixed, subnormals, values a ulp apart, all but a few ids suppressed, huge magnitudes; k from 1 to V - 1."""
    tiny = torch.finfo(torch.float32).tiny
    rows = [
        torch.full((vocab,), 1.5),
        torch.where(torch.arange(vocab) == 7, 2.0, float("-inf")),
        torch.where(torch.rand(vocab, generator=gen) < 0.5, 0.0, -0.0),
        torch.randn(vocab, generator=gen) * tiny,  # subnormal and zero after the temperature
        torch.nextafter(torch.full((vocab,), 1.0), torch.tensor(2.0)) * (torch.arange(vocab) % 3 == 0)
        + (torch.arange(vocab) % 3 != 0) * 1.0,  # 1.0 and the next float above it
        torch.where(torch.arange(vocab) < 60, torch.randn(vocab, generator=gen), float("-inf")),
        torch.randn(vocab, generator=gen) * 1e30,
        -torch.rand(vocab, generator=gen) - 5,  # all negative
        torch.randint(-3, 3, (vocab,), generator=gen).float(),  # a few values, heavy ties
    ]
    logits = torch.stack(rows).repeat(6, 1)
    n = logits.shape[0]
    i = torch.arange(n)
    top_k = torch.tensor([1, 2, 50, 59, 60, 61, vocab - 1, vocab // 2, 1000])[i % 9]
    head = HeadTensors(do_sample=torch.ones(n, dtype=torch.bool), temperature=torch.tensor([0.9, 1.0, 0.3])[i % 3],
                       top_k=top_k, top_p=torch.tensor([1.0, 0.8])[(i // 9) % 2])
    seed = torch.randint(0, 2**62, (n,), generator=gen)
    frame = torch.randint(0, 2**40, (n,), generator=gen)
    head = HeadTensors(*(t.to(device) for t in (head.do_sample, head.temperature, head.top_k, head.top_p)))
    return logits.to(device), head, seed.to(device), frame.to(device), (i % 16).to(device)


def kth_value_checks(vocab: int, gen: torch.Generator, device: str) -> dict[str, int]:
    """The top-k search alone against `torch.topk`'s k-th value, both forms, k from 1 to V - 1 on every kind of
    `hard_batch` row and on random ones: rows whose k-th value differs."""
    rows = torch.cat([hard_batch(vocab, gen, "cpu")[0], torch.randn(24, vocab, generator=gen) * 3])
    k = torch.tensor([1, 2, 3, 50, 59, 60, 61, 100, vocab // 2, vocab - 2, vocab - 1])[torch.arange(len(rows)) % 11]
    want = torch.stack([torch.topk(r, int(n)).values[-1] for r, n in zip(rows, k, strict=True)])
    out = {}
    for packed in (True, False):
        got = torch.empty(len(rows), device=device)
        _kth_value_kernel[(len(rows),)](rows.to(device), k.to(device), got, vocab,
                                        BLOCK_V=triton.next_power_of_2(vocab), PACKED=packed)
        out[f"V={vocab}: k-th value, {'packed' if packed else 'bisection'} vs topk"] = int(
            (got.cpu() != want).sum())
    return out


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
                result.update(kth_value_checks(vocab, gen, device))
                # top-k by plain bisection (draw_kernel.PACKED_SEARCH off, the path before) rather than packed
                plain = fused_draw(logits, head.do_sample, head.temperature, head.top_k, head.top_p, seed, frame,
                                   codebook, packed=False)
                result[f"V={vocab}: bisection vs draw"] = int((plain != want).sum())
                # Philox once per four-word block (PHILOX_PER_BLOCK, off by default), and a program of 16 warps
                per_block = fused_draw(logits, head.do_sample, head.temperature, head.top_k, head.top_p, seed, frame,
                                       codebook, per_block=True)
                result[f"V={vocab}: Philox per block vs draw"] = int((per_block != want).sum())
                wide = fused_draw(logits, head.do_sample, head.temperature, head.top_k, head.top_p, seed, frame,
                                  codebook, warps=16)
                result[f"V={vocab}: 16 warps vs draw"] = int((wide != want).sum())
                hard = hard_batch(vocab, gen, device)
                for packed in (True, False):
                    got_hard = fused_draw(hard[0], hard[1].do_sample, hard[1].temperature, hard[1].top_k,
                                          hard[1].top_p, *hard[2:], packed=packed)
                    result[f"V={vocab}: hard rows, {'packed' if packed else 'bisection'} vs draw"] = int(
                        (got_hard != draw(hard[0], hard[1], *hard[2:])).sum())
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
