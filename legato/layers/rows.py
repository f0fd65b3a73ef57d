"""Row-wise kernels over `[N, C]` activations: RMS normalisation without a weight (fold it into the next
GEMM) and SwiGLU's `silu(gate) * up` on a packed `[N, 2 I]` projection. One Triton program per block of rows
on CUDA (fp32 math), plain PyTorch elsewhere."""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU build of torch ships no Triton
    triton = None


def _kernel(x: torch.Tensor, kernel: bool | None) -> bool:
    return kernel if kernel is not None else (triton is not None and x.is_cuda)


def rms_normalize(x: torch.Tensor, eps: float, kernel: bool | None = None) -> torch.Tensor:
    """x [N, C] -> x / rms(x) in x's dtype (the Qwen3 order: computed in fp32, cast back)."""
    if not _kernel(x, kernel):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    n, c = x.shape
    out = torch.empty_like(x)
    block_c = max(16, 1 << (c - 1).bit_length())
    block_n = max(1, min(16, 4096 // block_c))
    _rms_kernel[(triton.cdiv(n, block_n),)](x, out, n, c, eps, BLOCK_N=block_n, BLOCK_C=block_c)
    return out


def silu_mul_packed(gate_up: torch.Tensor, kernel: bool | None = None) -> torch.Tensor:
    """gate_up [N, 2 I] -> silu(gate) * up [N, I] (computed in fp32, stored in the input dtype)."""
    n, two_i = gate_up.shape
    inter = two_i // 2
    if not _kernel(gate_up, kernel):
        gate, up = gate_up.float().chunk(2, dim=-1)
        return (F.silu(gate) * up).to(gate_up.dtype)
    out = torch.empty(n, inter, dtype=gate_up.dtype, device=gate_up.device)
    block_c = min(1024, max(16, 1 << (inter - 1).bit_length()))
    _silu_mul_kernel[(n, triton.cdiv(inter, block_c))](gate_up, out, inter, BLOCK_C=block_c)
    return out


if triton is not None:

    @triton.jit
    def _rms_kernel(x_ptr, out_ptr, N, C, EPS, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
        r = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        c = tl.arange(0, BLOCK_C)
        mask = (r < N)[:, None] & (c < C)[None, :]
        ptrs = r.to(tl.int64)[:, None] * C + c[None, :]
        x = tl.load(x_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)
        inv = tl.rsqrt(tl.sum(x * x, axis=1) / C + EPS)
        tl.store(out_ptr + ptrs, (x * inv[:, None]).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, INTER, BLOCK_C: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = c < INTER
        gate = tl.load(x_ptr + r * 2 * INTER + c, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + r * 2 * INTER + INTER + c, mask=mask, other=0.0).to(tl.float32)
        y = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + r * INTER + c, y.to(out_ptr.dtype.element_ty), mask=mask)
