"""An embedding row looked up and RMS-normalised in one kernel: a code-predictor pass's input.

Each of a frame's 14 single-token code-predictor passes starts from the embedding of the code the pass before
drew, then normalises it for the first layer: an index-select kernel and a compiled norm kernel, two launches
that each wait for the one before. Here one program per row reads the drawn id, copies the table's row (the
residual stream) and writes its RMSNorm (the first layer's input), as `fused.rms_norm` rounds it: the mean of
squares in fp32, the normalised row rounded to the table's dtype, times the weight, rounded.

`lookup_rms_norm_reference` is the same contract in PyTorch: what the CPU runs, and the kernel's oracle.
"""

from __future__ import annotations

import torch

from legato.layers import pdl
from legato.layers.fused import rms_norm

try:  # Triton ships with CUDA builds of torch; the CPU build has none.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

# The code predictor takes the kernel on CUDA when this is on (benchmarks turn it off to measure the two kernels
# before it in the same process).
ENABLED = True


def available(table: torch.Tensor) -> bool:
    return ENABLED and triton is not None and table.is_cuda


def lookup_rms_norm_reference(table: torch.Tensor, ids: torch.Tensor, weight: torch.Tensor,
                              eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(table[ids], its RMSNorm): ids [B] -> two [B, D] tensors."""
    x = table[ids]
    return x, rms_norm(x, weight, eps)


def lookup_rms_norm(table: torch.Tensor, ids: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`lookup_rms_norm_reference` in one launch. table [V, D] (rows contiguous), ids [B] integer in [0, V)."""
    if table.stride(-1) != 1 or table.dim() != 2 or ids.dim() != 1 or weight.shape != (table.shape[1],):
        raise ValueError(f"lookup_rms_norm: table {tuple(table.shape)}, ids {tuple(ids.shape)}, "
                         f"weight {tuple(weight.shape)}")
    b, d = ids.shape[0], table.shape[1]
    x = torch.empty(b, d, dtype=table.dtype, device=table.device)
    h = torch.empty_like(x)
    if b == 0:
        return x, h
    on = pdl.launch(table)
    _lookup_norm_kernel[(b,)](table, ids, weight.contiguous(), x, h, d, table.stride(0), ids.stride(0), float(eps),
                              BLOCK=triton.next_power_of_2(d), PDL=on, num_warps=4 if d <= 2048 else 8,
                              **pdl.launch_options(on))
    return x, h


if triton is not None:

    @triton.jit
    def _lookup_norm_kernel(table_ptr, ids_ptr, w_ptr, x_ptr, h_ptr, D, stride_table, stride_ids, EPS,
                            BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        pdl.wait(PDL)  # the id is the draw's, the kernel before
        pdl.release(PDL)
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < D
        at = tl.load(ids_ptr + row * stride_ids).to(tl.int64) * stride_table
        x = tl.load(table_ptr + at + cols, mask=ok, other=0.0)
        tl.store(x_ptr + row * D + cols, x, mask=ok)
        xf = x.to(tl.float32)
        scale = tl.rsqrt(tl.sum(xf * xf, axis=0) / D + EPS)
        normed = (xf * scale).to(x_ptr.dtype.element_ty).to(tl.float32)
        h = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32) * normed
        tl.store(h_ptr + row * D + cols, h.to(h_ptr.dtype.element_ty), mask=ok)
