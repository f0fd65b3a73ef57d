"""The few-row GEMM (`legato/layers/small_matmul.py`) against `F.linear` (and, gated, against SiLU of the unfused
matmuls).

`run_checks(device, dtype)` serves the GPU test (CUDA, bf16 and fp16) and a CPU test that runs this file in a
subprocess under Triton's interpreter (`TRITON_INTERPRET=1`, fp32): row counts from 1 to past one row tile, widths
that are and are not multiples of the tiles, K split over programs and not, a strided input, the gated form.
`model_checks` (CUDA only) runs the tiny talker's code predictor with the kernel on and off.
`python tests/small_matmul_checks.py [cuda|cpu]`.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F
from matmul_model_checks import code_predictor_with_and_without
from triton_interpreter import check_script_main
from triton_interpreter import rel_err as _err

if os.environ.get("TRITON_INTERPRET") == "1":
    from triton_interpreter import patch_for_numpy

    patch_for_numpy()

from legato.layers import small_matmul
from legato.layers.fused import add_rms_norm
from legato.layers.small_matmul import Tiles


def _want(x: torch.Tensor, w: torch.Tensor, gated: bool) -> torch.Tensor:
    y = F.linear(x.double(), w.double())
    if not gated:
        return y
    gate, up = y.to(x.dtype).double().chunk(2, dim=-1)  # rounded where the unfused path rounds them
    return F.silu(gate) * up


def run_checks(device: str, dtype: torch.dtype) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    errors: dict[str, float] = {}
    # (m, n, k, gated, tiles): n counts both halves when gated; None: the table or the rule of thumb.
    cases = [
        (1, 40, 64, False, Tiles(16, 32)),
        (3, 48, 96, False, Tiles(16, 32, split=2)),  # K of 3 steps over 2 programs: one takes 2, one 1
        (17, 36, 100, False, Tiles(32, 32, split=3)),  # K not a multiple of the step; 2 row tiles of 16
        (5, 64, 64, True, Tiles(16, 16)),
        (70, 96, 160, True, Tiles(16, 64, split=2)),  # 2 row tiles of 64, gated split-K
        (2, 24, 48, False, None),
    ]
    if device == "cuda":  # the 0.6B talker's and code predictor's shapes, each row bucket, the table's tiles
        cases += [(m, n, k, gated, None) for m in (1, 8, 64, 200, 256)
                  for n, k, gated in ((4096, 1024, False), (1024, 2048, False), (6144, 1024, True),
                                      (1024, 3072, False), (2048, 1024, False), (3072, 1024, False))]
    for m, n, k, gated, tiles in cases:
        x = torch.randn(m, k, generator=gen).to(device, dtype)
        w = (torch.randn(n, k, generator=gen) / k**0.5).to(device, dtype)
        got = small_matmul.matmul(x, w, gated=gated, tiles=tiles)
        name = f"{m}x{k} @ {n}x{k}{' gated' if gated else ''}{f' {tiles}' if tiles else ''}"
        errors[name] = _err(got, _want(x, w, gated)) + float(got.shape != (m, n // 2 if gated else n))
    # A weightless RMSNorm of x's rows inside the kernel, and the product added into a residual in place (the codec
    # transformer's fused forms): against the normalised rows in float64, and against the residual plus F.linear.
    for m, n, k, gated, tiles in [(20, 48, 96, False, Tiles(16, 32)), (5, 64, 64, True, Tiles(16, 16)),
                                  (66, 40, 160, False, Tiles(32, 64, split=2))]:
        x = (3 * torch.randn(m, k, generator=gen)).to(device, dtype)
        w = (torch.randn(n, k, generator=gen) / k**0.5).to(device, dtype)
        xd = x.double()
        normed = (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
        got = small_matmul.matmul(x, w, gated=gated, tiles=tiles, norm_eps=1e-5)
        errors[f"norm {m}x{k} @ {n}x{k}{' gated' if gated else ''}"] = _err(got, _want(normed, w, gated))
    for m, n, k, tiles in [(20, 48, 96, Tiles(16, 32)), (66, 40, 160, Tiles(32, 64, split=2))]:
        x = torch.randn(m, k, generator=gen).to(device, dtype)
        w = (torch.randn(n, k, generator=gen) / k**0.5).to(device, dtype)
        residual = torch.randn(m, n, generator=gen).to(device, dtype)
        want = residual.double() + _want(x, w, False)
        got = small_matmul.matmul(x, w, tiles=tiles, add_to=residual)
        errors[f"add {m}x{k} @ {n}x{k} {tiles}"] = _err(residual, want) + float(got.data_ptr() != residual.data_ptr())
    # The split product finished with the residual add and the next RMSNorm in one kernel, against the two kernels
    # it replaces (the product, then `add_rms_norm`): the residual to the bit under the interpreter (the same
    # partial sums in the same order), the norm within the tolerance (its mean is summed in another order).
    for m, n, k, tiles in [(1, 48, 128, Tiles(16, 32, split=4)), (19, 40, 160, Tiles(16, 64, split=2))]:
        x = torch.randn(1, m, k, generator=gen).to(device, dtype)
        w = (torch.randn(n, k, generator=gen) / k**0.5).to(device, dtype)
        residual = torch.randn(1, m, n, generator=gen).to(device, dtype)
        norm_w = (1 + 0.1 * torch.randn(n, generator=gen)).to(device, dtype)
        y, h = small_matmul.matmul_add_rms_norm(x, w, residual, norm_w, 1e-6, tiles=tiles)
        y0, h0 = add_rms_norm(residual, small_matmul.matmul(x, w, tiles=tiles), norm_w, 1e-6)
        same = torch.equal(y, y0) if device == "cpu" else _err(y, y0) < 1e-2
        errors[f"add norm {m}x{k} @ {n}x{k} {tiles}"] = _err(h, h0) + float(not same) + float(h.shape != (1, m, n))
    # A strided input with leading dimensions: [2, 3, K] taken from a wider buffer.
    buf = torch.randn(2, 3, 2 * 64, generator=gen).to(device, dtype)
    x, w = buf[..., ::2], (torch.randn(40, 64, generator=gen) / 8).to(device, dtype)
    got = small_matmul.matmul(x, w, tiles=Tiles(16, 32))
    errors["strided [2, 3, 64]"] = _err(got, _want(x, w, False)) + float(got.shape != (2, 3, 40))
    return errors


def model_checks(dtype: torch.dtype) -> dict[str, float]:
    return code_predictor_with_and_without(small_matmul, dtype)


if __name__ == "__main__":
    sys.exit(check_script_main(run_checks, model_checks))
