"""A split-K matmul's partial sums, added where they are used.

`small_matmul` splits the K of thin weights (the o and down projections) over several programs, which leave fp32
partial sums. Both of those projections feed a residual add and an RMSNorm, so instead of a kernel that adds the
parts and another that adds the residual and normalises, `add_rms_norm` does all three in one pass per row: two
launches fewer per decoder layer. The rounding is the unfused path's: the parts' sum is rounded to the model's
dtype (the matmul's output), added to the residual and rounded, then normalised in fp32 as `fused.add_rms_norm`
does. Only the order of the fp32 sums differs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:  # Triton ships with CUDA builds of torch; the CPU build has none.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


@dataclass(frozen=True)
class PartialSums:
    """fp32 partial sums [split, planes, M, N] of a matmul whose result is `shape` in `dtype` (planes: 2 for the
    gated form's gate and up, else 1)."""

    parts: torch.Tensor
    shape: tuple[int, ...]
    dtype: torch.dtype
    gated: bool = False

    def sum(self) -> torch.Tensor:
        """The matmul's result (for the gated form, silu(gate) * up)."""
        split, _, m, n = self.parts.shape
        out = torch.empty(m, n, dtype=self.dtype, device=self.parts.device)
        block = 256
        _sum_parts_kernel[(triton.cdiv(m * n, block),)](self.parts, out, m * n, split, GATED=self.gated,
                                                         BLOCK=block)
        return out.view(self.shape)


def add_rms_norm(x: torch.Tensor, delta: PartialSums, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`fused.add_rms_norm(x, delta.sum(), weight, eps)` in one kernel: (x + delta, rms_norm(x + delta))."""
    split, planes, m, n = delta.parts.shape
    if delta.gated or tuple(x.shape) != tuple(delta.shape) or weight.shape != (n,):
        raise ValueError(f"x {tuple(x.shape)}, partial sums of {delta.shape} (gated={delta.gated}), weight "
                         f"{tuple(weight.shape)}: not one residual stream")
    rows = x.reshape(m, n)
    if not rows.is_contiguous():
        rows = rows.contiguous()
    y, h = torch.empty_like(rows), torch.empty_like(rows)
    block = triton.next_power_of_2(n)
    _add_rms_norm_kernel[(m,)](delta.parts, rows, weight, y, h, m, n, split, eps, BLOCK=block,
                               num_warps=8 if block >= 4096 else 4)
    return y.view(x.shape), h.view(x.shape)


if triton is not None:

    @triton.jit
    def _silu_mul(gate, up, out_ty: tl.constexpr):
        # The unfused path's rounding: gate and up leave their matmul in the output dtype, then SiLU in fp32.
        g = gate.to(out_ty).to(tl.float32)
        u = up.to(out_ty).to(tl.float32)
        return g / (1.0 + tl.exp(-g)) * u

    @triton.jit
    def _sum_parts_kernel(part_ptr, y_ptr, size, splits, GATED: tl.constexpr, BLOCK: tl.constexpr):
        at = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = at < size
        acc = tl.zeros([BLOCK], tl.float32)
        acc_up = tl.zeros([BLOCK], tl.float32)
        for s in range(0, splits):  # in split order, so the sum's rounding never depends on timing
            if GATED:
                acc += tl.load(part_ptr + s * 2 * size + at, mask=ok, other=0.0)
                acc_up += tl.load(part_ptr + (s * 2 + 1) * size + at, mask=ok, other=0.0)
            else:
                acc += tl.load(part_ptr + s * size + at, mask=ok, other=0.0)
        ty = y_ptr.dtype.element_ty
        if GATED:
            tl.store(y_ptr + at, _silu_mul(acc, acc_up, ty).to(ty), mask=ok)
        else:
            tl.store(y_ptr + at, acc.to(ty), mask=ok)

    @triton.jit
    def _add_rms_norm_kernel(part_ptr, x_ptr, w_ptr, y_ptr, h_ptr, M, N, splits, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < N
        acc = tl.zeros([BLOCK], tl.float32)
        for s in range(0, splits):  # in split order, as _sum_parts_kernel adds them
            acc += tl.load(part_ptr + (s * M + row) * N + cols, mask=ok, other=0.0)
        ty = x_ptr.dtype.element_ty
        delta = acc.to(ty).to(tl.float32)  # the matmul's output, rounded
        y = (tl.load(x_ptr + row * N + cols, mask=ok, other=0.0).to(tl.float32) + delta).to(ty)
        yf = y.to(tl.float32)
        inv = tl.rsqrt(tl.sum(yf * yf, axis=0) / N + eps)
        normed = (yf * inv).to(ty).to(tl.float32)
        h = (tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32) * normed).to(ty)
        tl.store(y_ptr + row * N + cols, y, mask=ok)
        tl.store(h_ptr + row * N + cols, h, mask=ok)
