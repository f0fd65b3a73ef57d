"""The skinny-matmul kernel (`legato/layers/skinny_linear.py`) against `F.linear`.

`run_checks(device, dtype)` serves the GPU test (CUDA, bf16 and fp16) and a CPU test that runs this file in a
subprocess under Triton's interpreter (`TRITON_INTERPRET=1`, fp32): row counts 1..8, widths that are and are not
multiples of the tiles, a strided input. `model_checks` (CUDA only) runs the tiny talker's code predictor with
the kernel on and off. `python tests/skinny_linear_checks.py [cuda|cpu]`.
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

from legato.layers import skinny_linear


def run_checks(device: str, dtype: torch.dtype) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    errors: dict[str, float] = {}
    shapes = [(1, 37, 24), (3, 64, 256), (8, 300, 520), (5, 1024, 48), (2, 16, 2048 + 8)]
    if device == "cuda":  # the 0.6B talker's and code predictor's shapes
        shapes += [(m, n, k) for m in (1, 4, 8) for n, k in ((4096, 1024), (1024, 2048), (6144, 1024),
                                                               (1024, 3072), (2048, 1024), (3072, 1024))]
    for m, n, k in shapes:
        x = torch.randn(m, k, generator=gen).to(device, dtype)
        w = (torch.randn(n, k, generator=gen) / k**0.5).to(device, dtype)
        want = F.linear(x.double(), w.double())
        errors[f"{m}x{k} @ {n}x{k}"] = _err(skinny_linear.skinny_linear(x, w), want)
    # A strided input with leading dimensions: [2, 3, K] taken from a wider buffer.
    buf = torch.randn(2, 3, 2 * 64, generator=gen).to(device, dtype)
    x, w = buf[..., ::2], (torch.randn(40, 64, generator=gen) / 8).to(device, dtype)
    got = skinny_linear.skinny_linear(x, w)
    errors["strided [2, 3, 64]"] = _err(got, F.linear(x.double(), w.double())) + float(got.shape != (2, 3, 40))
    return errors


def model_checks(dtype: torch.dtype) -> dict[str, float]:
    return code_predictor_with_and_without(skinny_linear, dtype)


if __name__ == "__main__":
    sys.exit(check_script_main(run_checks, model_checks))
