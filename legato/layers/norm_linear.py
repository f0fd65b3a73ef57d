"""The codec transformer's matmuls with their row-wise neighbours in one kernel: RMS normalisation of the input
rows before, and a bias, SwiGLU's `silu(gate) * up` or a residual add after.

At one frame per call the codec's transformer runs on as many rows as streams (64 at c=64), where each of its
matmuls is a few microseconds of launch and tail, and its RMSNorms and SwiGLU add as many launches again: eight
per layer, of which five remain here (norm + q/k/v, attention, o + residual, norm + gate/up + SwiGLU, down +
residual). The norm's weight is already folded into the following matmul (`codec_stages`), so the norm is a
per-row scale, `rsqrt(mean(x^2) + eps)`. The kernel sums each row's squares from the same tiles it multiplies
and scales the fp32 product at the end, instead of multiplying rows normalised and rounded beforehand: the same
function, rounded once less. Bias, residual and SwiGLU follow the unfused path's rounding (gate and up are
rounded to the output dtype before the SiLU).

`norm_linear(..., fused=False)` is that unfused path, the reference and the CPU's: `rows.rms_normalize`, the
matmul (`torch.addmm` with a bias, `Tensor.addmm_` into the residual), `rows.silu_mul_packed`.
"""

from __future__ import annotations

import torch

from legato.layers.rows import rms_normalize, silu_mul_packed

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU build of torch ships no Triton
    triton = None

_MIN_PROGRAMS = 64  # narrow outputs (512 columns) at 64 rows still spread their weight over this many programs


def norm_linear(x: torch.Tensor, weight: torch.Tensor, eps: float | None = None, bias: torch.Tensor | None = None,
                gated: bool = False, residual: torch.Tensor | None = None, fused: bool = False,
                row_kernels: bool | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T with: the rows of x RMS-normalised first (`eps` given); `bias` [N] added;
    `gated`: weight is [gate; up] ([2I, K]) and the result silu(gate) * up [M, I]; `residual` [M, N]: the
    product added to it in place (returned). `fused`: one Triton kernel (CUDA, or the interpreter); otherwise
    the unfused ops, whose row-wise parts run Triton kernels when `row_kernels` says so."""
    if gated and (residual is not None or bias is not None):
        raise ValueError("a gated projection takes neither a bias nor a residual")
    if residual is not None and bias is not None:
        raise ValueError("a residual projection takes no bias")
    if fused:
        return _launch(x, weight, eps, bias, gated, residual)
    n = rms_normalize(x, eps, kernel=row_kernels) if eps is not None else x
    if residual is not None:
        return residual.addmm_(n, weight.t())
    y = torch.addmm(bias, n, weight.t()) if bias is not None else n @ weight.t()
    return silu_mul_packed(y, kernel=row_kernels) if gated else y


def blocks(m: int, n: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) for m rows and n output columns (per half when gated): row tiles of up to 64, column
    tiles narrowed from 64 to 16 until the grid has `_MIN_PROGRAMS` programs (each streams its weight strip
    alone, so a small grid leaves the weight to a few SMs)."""
    block_m = min(64, max(16, 1 << max(m - 1, 0).bit_length()))
    block_n = 64
    while block_n > 16 and -(-n // block_n) * -(-m // block_m) < _MIN_PROGRAMS:
        block_n //= 2
    return block_m, block_n


# K per step, warps and pipeline stages (benchmarks/codec_tune.py measures the step with others). 32 x 4 warps is
# what ptxas fits in registers without spills at 64 x 32 tiles gated (K of 64 spilled).
BLOCK_K = 32
WARPS = 4
STAGES = 3


def _launch(x, weight, eps, bias, gated, residual):
    m, k = x.shape
    n_w = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"x has {k} features, weight {tuple(weight.shape)}")
    x, weight = x.contiguous(), weight.contiguous()  # no copy for the codec's own (contiguous) operands
    n = n_w // 2 if gated else n_w
    if residual is not None and (residual.shape != (m, n) or not residual.is_contiguous()):
        raise ValueError(f"the residual must be a contiguous [{m}, {n}], not {tuple(residual.shape)}")
    out = residual if residual is not None else torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m, block_n = blocks(m, n)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _norm_linear_kernel[grid](
        x, weight, bias if bias is not None else weight, out, m, n, k, eps if eps is not None else 0.0,
        NORM=eps is not None, BIAS=bias is not None, GATED=gated, RESIDUAL=residual is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=WARPS, num_stages=STAGES)
    return out


if triton is not None:

    @triton.jit
    def _norm_linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, EPS, NORM: tl.constexpr, BIAS: tl.constexpr,
                            GATED: tl.constexpr, RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        kk = tl.arange(0, BLOCK_K)
        col_ok = cols < N
        row_ok = rows < M
        x_rows = x_ptr + rows[:, None].to(tl.int64) * K
        w_rows = w_ptr + cols[:, None].to(tl.int64) * K
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        squares = tl.zeros([BLOCK_M], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + kk
            k_ok = k < K
            x = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            if NORM:
                xf = x.to(tl.float32)
                squares += tl.sum(xf * xf, axis=1)
            w = tl.load(w_rows + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
            if GATED:  # the up rows sit N rows below the gate rows
                wu = tl.load(w_rows + N * K + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
                acc_up = tl.dot(x, tl.trans(wu), acc_up, input_precision=PRECISION)
        if NORM:
            inv = tl.rsqrt(squares / K + EPS)[:, None]
            acc = acc * inv
            acc_up = acc_up * inv
        ty = y_ptr.dtype.element_ty
        mask = row_ok[:, None] & col_ok[None, :]
        at = rows[:, None].to(tl.int64) * N + cols[None, :]
        if BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:  # the unfused path's rounding: gate and up leave their matmul in the output dtype
            g = acc.to(ty).to(tl.float32)
            u = acc_up.to(ty).to(tl.float32)
            acc = g / (1.0 + tl.exp(-g)) * u
        if RESIDUAL:  # each program reads and writes only its own tile of the residual: in place is safe
            acc += tl.load(y_ptr + at, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + at, acc.to(ty), mask=mask)
