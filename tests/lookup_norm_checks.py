"""The lookup-and-norm kernel (`legato/layers/lookup_norm.py`) against its PyTorch contract.

`run_checks(device, dtype)` serves the GPU test (CUDA, bf16 and fp16) and a CPU test that runs this file in a
subprocess under Triton's interpreter (`TRITON_INTERPRET=1`, fp32): one row and several, ids repeated and at the
table's ends, a width that is not a power of two, ids taken as a strided column. The looked-up row must equal the
table's to the bit; the norm is within the tolerance (its mean is summed in another order).
`python tests/lookup_norm_checks.py [cuda|cpu]`.
"""

from __future__ import annotations

import os
import sys

import torch
from triton_interpreter import check_script_main
from triton_interpreter import rel_err as _err

if os.environ.get("TRITON_INTERPRET") == "1":
    from triton_interpreter import patch_for_numpy

    patch_for_numpy()

from legato.layers.lookup_norm import lookup_rms_norm, lookup_rms_norm_reference


def run_checks(device: str, dtype: torch.dtype) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    errors: dict[str, float] = {}
    for v, d, ids in ((16, 64, [3]), (40, 96, [0, 39, 7, 7, 12]), (2048, 1024, [2047, 0, 5, 1000])):
        table = (3 * torch.randn(v, d, generator=gen)).to(device, dtype)
        weight = (1 + 0.1 * torch.randn(d, generator=gen)).to(device, dtype)
        codes = torch.tensor(ids, device=device)
        for name, col in (("", codes), (" strided ids", torch.stack((codes, codes), 1)[:, 1])):
            x, h = lookup_rms_norm(table, col, weight, 1e-6)
            x0, h0 = lookup_rms_norm_reference(table, codes, weight, 1e-6)
            errors[f"{len(ids)} rows of {v}x{d}{name}"] = _err(h, h0) + float(not torch.equal(x, x0))
    return errors


if __name__ == "__main__":
    sys.exit(check_script_main(run_checks))
