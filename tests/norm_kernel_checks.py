"""The residual add + RMSNorm kernel (`legato/layers/norm_kernel.py`) against `fused.add_rms_norm`.

`run_checks(device, dtype)` serves the GPU test (CUDA, bf16 and fp16, launched with PDL where the GPU has it) and
a CPU test that runs this file in a subprocess under Triton's interpreter (`TRITON_INTERPRET=1`, fp32): hidden
sizes that are and are not powers of two, leading dimensions. `python tests/norm_kernel_checks.py [cuda|cpu]`.
"""

from __future__ import annotations

import os
import sys

import torch
from triton_interpreter import check_script_main, rel_err

if os.environ.get("TRITON_INTERPRET") == "1":
    from triton_interpreter import patch_for_numpy

    patch_for_numpy()

from legato.layers import fused, norm_kernel


def run_checks(device: str, dtype: torch.dtype) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    chained = device == "cuda" and torch.cuda.get_device_capability()[0] >= 9
    errors = {}
    for shape in ((1, 1024), (3, 1, 2048), (5, 100)):
        x, delta = (torch.randn(shape, generator=gen).to(device, dtype) for _ in range(2))
        weight = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(device, dtype)
        y, h = norm_kernel.add_rms_norm_kernel(x, delta, weight, 1e-6, chained=chained)
        want_y, want_h = fused.add_rms_norm(x, delta, weight, 1e-6)
        errors[f"{shape}"] = max(rel_err(y, want_y), rel_err(h, want_h)) + float(y.shape != x.shape)
    return errors


if __name__ == "__main__":
    sys.exit(check_script_main(run_checks))
