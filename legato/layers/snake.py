"""SnakeBeta activation `x + sin²(x·e^α) / (e^β + 1e-9)` with per-channel α, β (stored as logs).

In eager PyTorch it is five elementwise kernels over the codec's largest tensors; on CUDA a fused Triton
kernel does it in one pass (one read, one write), computing in fp32 whatever the storage dtype.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU build of torch ships no Triton
    triton = None


def snake_beta_reference(x: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    freq = alpha.exp()[:, None]
    inv_mag = 1.0 / (beta.exp()[:, None] + 1e-9)
    return x + inv_mag * torch.sin(x * freq).pow(2)


def snake_beta(x: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """x [B, C, T]; alpha, beta [C]."""
    if x.is_cuda and triton is not None and x.dim() == 3:
        return _snake_triton(x, alpha, beta)
    return snake_beta_reference(x, alpha, beta)


if triton is not None:

    @triton.jit
    def _snake_kernel(x_ptr, out_ptr, alpha_ptr, beta_ptr, channels, length, BLOCK: tl.constexpr):
        row = tl.program_id(0)  # b * channels + c
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = col < length
        c = row % channels
        freq = tl.exp(tl.load(alpha_ptr + c).to(tl.float32))
        inv_mag = 1.0 / (tl.exp(tl.load(beta_ptr + c).to(tl.float32)) + 1e-9)
        x = tl.load(x_ptr + row * length + col, mask=mask, other=0.0).to(tl.float32)
        # tl.sin may lower to the fast hardware approximation, accurate only near [-pi, pi]: reduce the
        # argument first, Cody-Waite style (2*pi split in a short exact head and a tail) to stay exact in fp32.
        arg = x * freq
        k = tl.floor(arg * 0.15915494309189535 + 0.5)
        arg = (arg - k * 6.28125) - k * 0.0019353071795864769
        s = tl.sin(arg)
        y = x + inv_mag * s * s
        tl.store(out_ptr + row * length + col, y.to(out_ptr.dtype.element_ty), mask=mask)

    def _snake_triton(x: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        b, c, t = x.shape
        block = 1024
        _snake_kernel[(b * c, triton.cdiv(t, block))](x, out, alpha, beta, c, t, BLOCK=block)
        return out
