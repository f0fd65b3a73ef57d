"""`linear` for the one-row matmuls of batch-1 decode: a Triton kernel that streams the weight once.

At batch 1 a frame is 103 decoder-layer passes of four matmuls each, and every one of them reads its whole
weight to produce one row. cuBLAS picks tiles made for wide inputs there: on the H200 the talker's gate/up
projection (12.6 MB) took 11 us, about a quarter of the memory bandwidth, and the matmuls were more than half of
a frame's device time. This kernel gives each program a few output columns and walks K in long, pipelined
strips, so all SMs stream weights at once.

`skinny_linear` itself takes any row count (its tiles depend on the weight's shape and the row count's power of
two); `linear` sends it only calls of `MAX_ROWS` rows or fewer, where it was measured faster. A batch of one row
always takes the same path, and batch-invariant mode decodes in chunks of one fixed size, so a row's result never
depends on its neighbours. The sum runs in fp32 and is rounded once, as cuBLAS does, in another order: results
equal `F.linear`'s up to fp32 rounding, not bit for bit. CPU calls and fp32 inputs are always `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from legato.layers import pdl

try:  # Triton ships with CUDA builds of torch; the CPU build has none.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

# Benchmarks switch it off to measure cuBLAS in the same process.
ENABLED = True
# One row only: the H200 measured it faster than cuBLAS at batch 1 (5.37 -> 5.02 ms a frame, docs/benchmarks.md),
# and 3.2x slower at batch 8 (its 8-row tiles walk K in short strips); wider calls stay on cuBLAS.
MAX_ROWS = 1
_TARGET_PROGRAMS = 256  # about two per SM on an H200, enough loads in flight to stream at full bandwidth


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear(x, weight)` runs the kernel."""
    return (ENABLED and triton is not None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and x.numel() // x.shape[-1] <= MAX_ROWS and weight.stride(-1) == 1
            and x.shape[-1] % 8 == 0)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, weight)` (no bias): x [..., K], weight [N, K] -> [..., N]."""
    if not takes(x, weight):
        return F.linear(x, weight)
    return skinny_linear(x, weight)


def block_n(n: int) -> int:
    """Output columns per program for a weight of N rows (a function of the shape only)."""
    size = 32
    while size > 4 and -(-n // size) < _TARGET_PROGRAMS:
        size //= 2
    return size


def skinny_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The kernel itself, for any row count (tests call it directly; `linear` decides when it pays)."""
    k = x.shape[-1]
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"x has {k} features, weight {tuple(weight.shape)}")
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    bn, bm = block_n(n), max(triton.next_power_of_2(m), 1)
    # A strip of K per loop step as long as ~64 fp32 products a thread allows (4 warps): long strips keep many
    # loads in flight at one row, short ones keep 8 rows from spilling registers.
    bk = min(512, max(64, 8192 // (bm * bn)))
    on = pdl.launch(x)
    line = min(bk, max(1, 128 // weight.element_size()))  # elements in a 128-byte line: one L2 prefetch each
    _skinny_kernel[(triton.cdiv(n, bn),)](
        rows, weight, out, m, n, k, rows.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PDL=on, LINES=max(1, bk // line), LINE=line, num_warps=4, num_stages=3,
        **pdl.launch_options(on),
    )
    return out.view(*x.shape[:-1], n)


if triton is not None:

    @triton.jit
    def _skinny_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       PDL: tl.constexpr = False, LINES: tl.constexpr = 1, LINE: tl.constexpr = 64):
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        if PDL:  # the weight strip into L2 while the kernel before still runs (see small_matmul)
            strip = w_ptr + tl.minimum(cols, N - 1)[:, None].to(tl.int64) * stride_wn
            for k0 in range(0, K, BLOCK_K):
                pdl.warm_l2(strip + tl.minimum(k0 + tl.arange(0, LINES) * LINE, K - 1)[None, :], PDL)
        pdl.wait(PDL)
        pdl.release(PDL)
        rows = tl.arange(0, BLOCK_M)
        kk = tl.arange(0, BLOCK_K)
        col_ok = cols < N
        row_ok = rows < M
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + kk
            k_ok = k < K
            w = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_wn + k[None, :],
                        mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0).to(tl.float32)
            acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
        tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])
