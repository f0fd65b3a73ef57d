"""The residual add and RMSNorm of a decoder layer as a Triton kernel that can launch with PDL (`pdl.py`).

`fused.add_rms_norm` is torch.compile's kernel, which cannot take part in a PDL chain: with one between every pair
of matmuls, no matmul could start before the norm in front of it had ended. With PDL on, the decode step's norms
run here instead, with the same rounding: the sum is rounded to the input dtype, normalised in fp32, cast back,
then multiplied by the weight and rounded, as `fused._rms` does. Only the order of the fp32 mean's sum differs.
"""

from __future__ import annotations

import torch

from legato.layers import fused, pdl

try:  # Triton ships with CUDA builds of torch; the CPU build has none.
    import triton
    import triton.language as tl

    from legato.layers.pdl import wait_then_release
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)): this module's kernel where PDL is on, else `fused.add_rms_norm`."""
    if (pdl.on(x) and x.dtype in (torch.bfloat16, torch.float16) and delta.shape == x.shape
            and delta.dtype == x.dtype and weight.shape == x.shape[-1:]):
        return add_rms_norm_kernel(x, delta, weight, eps, chained=True)
    return fused.add_rms_norm(x, delta, weight, eps)


def add_rms_norm_kernel(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                        chained: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel itself (tests call it directly); chained: launched with PDL."""
    n = x.shape[-1]
    rows, drows = x.reshape(-1, n).contiguous(), delta.reshape(-1, n).contiguous()
    y, h = torch.empty_like(rows), torch.empty_like(rows)
    block = triton.next_power_of_2(n)
    _add_rms_norm_kernel[(rows.shape[0],)](rows, drows, weight, y, h, n, eps, BLOCK=block, PDL=chained,
                                           num_warps=8 if block >= 4096 else 4, **pdl.launch_args(chained))
    return y.view(x.shape), h.view(x.shape)


if triton is not None:

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, d_ptr, w_ptr, y_ptr, h_ptr, N, eps, BLOCK: tl.constexpr, PDL: tl.constexpr):
        if PDL:  # delta comes from the kernel before (pdl.py)
            wait_then_release()
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < N
        ty = x_ptr.dtype.element_ty
        x = tl.load(x_ptr + row * N + cols, mask=ok, other=0.0).to(tl.float32)
        d = tl.load(d_ptr + row * N + cols, mask=ok, other=0.0).to(tl.float32)
        y = (x + d).to(ty)
        yf = y.to(tl.float32)
        inv = tl.rsqrt(tl.sum(yf * yf, axis=0) / N + eps)
        normed = (yf * inv).to(ty).to(tl.float32)
        h = (tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32) * normed).to(ty)
        tl.store(y_ptr + row * N + cols, y, mask=ok)
        tl.store(h_ptr + row * N + cols, h, mask=ok)
