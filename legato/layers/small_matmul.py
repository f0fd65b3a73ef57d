"""Matmuls of few rows (decode batches up to 256): a Triton GEMM that streams each weight once on tensor cores.

A decode step is 103 decoder-layer passes of four matmuls each, and at up to a few hundred rows every one of them
is bound by reading its weight (4 to 12.6 MB for the 0.6B), not by its FLOPs. On the H200 cuBLAS took 5–6.5 us a
matmul at 64 rows (1–1.5 TB/s), plus a split-K reduce and a separate SiLU kernel for the MLP, and the one-row
kernel of `skinny_linear.py` was slower still on large weights (29 us for the 1.7B's gate/up). Here each program
owns `block_n` output columns of `block_m` rows, walks its share of K with the weight tiles pipelined into shared
memory, and multiplies on tensor cores. Thin weights split K over several programs, whose fp32 partial sums a
second kernel adds in a fixed order (no atomics: a row's result does not depend on timing).

`matmul(..., gated=True)` (`matmuls.gated_linear`) serves the MLP's packed gate/up weight: the program multiplies
the gate's and the up's columns together and writes `silu(gate) * up` directly, half the output and one kernel
fewer. Gate and up are rounded to the input dtype before the SiLU, as the unfused path rounds them, so the only
difference from it is the order of the matmul's fp32 sums.

Tiles come from a table measured on the H200 (`benchmarks/matmul_tune.py`), keyed by the weight's shape and the
row count's bucket; shapes it does not name get a rule of thumb. A row's result depends on the bucket (as it does
with cuBLAS), and batch-invariant mode decodes in chunks of one fixed size, so it stays invariant. CPU tensors and
fp32 inputs never come here (`takes`): the CPU engine's arithmetic is unchanged.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from legato.layers import pdl
from legato.layers.fused import add_rms_norm

try:  # Triton ships with CUDA builds of torch; the CPU build has none.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

# Benchmarks switch it off to measure the path before it (the one-row kernel, then cuBLAS) in the same process.
ENABLED = True
MAX_ROWS = 256
_MIN_PROGRAMS = 128  # about one per SM on an H200: fewer leave SMs idle while the weight streams
# `matmul_add_rms_norm` finishes a split product with the residual add and the norm in one kernel; off, it runs the
# sum and `add_rms_norm` apart, as before (benchmarks measure both in one process).
FUSED_NORM = True
RULE_MAX_ROWS = 64  # past this the rule of thumb lost to cuBLAS on the H200 (matmul_tune.py): the table's shapes only


@dataclass(frozen=True)
class Tiles:
    """One matmul's launch: output columns and K per program step, programs K is split over, warps, stages."""

    block_n: int
    block_k: int
    split: int = 1
    warps: int = 4
    stages: int = 4


def row_bucket(m: int) -> int:
    """The row count's bucket: its power of two, the tile table's key (and the row tile, up to 64)."""
    return 1 << max(m - 1, 0).bit_length()


def block_m(m: int) -> int:
    return min(64, max(16, row_bucket(m)))  # tensor-core products take at least 16 rows


def rule_of_thumb(m: int, n: int, k: int, gated: bool = False) -> Tiles:
    """Tiles for a shape the measured table does not name: 32 output columns a program (the H200's best for most
    shapes), K split in up to 4 when the programs' weight strips (two per column when gated) would not give every
    SM one."""
    strips = -(-n // 32) * -(-m // block_m(m)) * (2 if gated else 1)
    split = 1
    while split < 4 and strips * split < _MIN_PROGRAMS and k // (2 * split) >= 256:
        split *= 2
    return Tiles(block_n=32, block_k=128, split=split)


def _load_table(path: str | None) -> dict[tuple[int, int, int, bool], Tiles | None]:
    """`benchmarks/matmul_tune.py`'s JSON (a list of {m, n, k, gated, tiles or null for cuBLAS})."""
    if not path:
        return {}
    with open(path) as f:
        rows = json.load(f)
    return {(r["m"], r["n"], r["k"], bool(r["gated"])): (Tiles(**r["tiles"]) if r["tiles"] else None) for r in rows}


# Measured on the H200 (benchmarks/matmul_tune.py, docs/benchmarks.md): per weight (N, K, gated) and row key
# (`table_rows`), the fastest tiles (block_n, block_k, split), or None where the path before this kernel was not
# beaten by 3 %. The 0.6B and 1.7B talkers' and the code predictor's shapes.
_T = Tiles
_H200: dict[tuple[int, int, bool], dict[int, Tiles | None]] = {
    (4096, 1024, False): {1: _T(32, 128, 1), 16: _T(32, 128, 1), 32: None, 64: _T(32, 128, 1), 128: None, 256: None},
    (1024, 2048, False): {1: _T(32, 128, 4), 16: _T(32, 128, 4), 32: None,
                          64: _T(32, 128, 4), 128: _T(16, 256, 1), 256: None},
    (6144, 1024, True): {1: _T(32, 128, 1), 16: _T(32, 128, 1), 32: None,
                         64: _T(32, 128, 1), 128: _T(64, 128, 1), 256: None},
    (1024, 3072, False): {1: _T(32, 128, 4), 16: _T(32, 128, 4), 32: _T(16, 128, 4),
                          64: _T(32, 128, 4), 128: _T(64, 128, 4), 256: None},
    (3072, 1024, False): {1: None, 16: _T(32, 128, 1), 32: None, 64: _T(32, 128, 1), 128: None, 256: None},
    (2048, 1024, False): {1: None, 16: _T(16, 256, 1), 32: None, 64: _T(16, 256, 1), 128: _T(32, 128, 1), 256: None},
    (4096, 2048, False): {1: _T(32, 256, 1), 16: None, 32: None, 64: None, 128: None, 256: None},
    (2048, 2048, False): {1: _T(64, 128, 4), 16: None, 32: None, 64: _T(16, 256, 1), 128: None, 256: None},
    (12288, 2048, True): {1: _T(32, 128, 1), 16: _T(32, 128, 1), 32: _T(64, 128, 1),
                          64: _T(64, 128, 1), 128: None, 256: None},
    (2048, 6144, False): {1: _T(32, 128, 4), 16: _T(64, 256, 4), 32: None, 64: _T(64, 128, 4), 128: None, 256: None},
    (3072, 2048, False): {1: _T(32, 256, 1), 16: None, 32: None, 64: None, 128: None, 256: None},
    # The codec decoder's transformer (q/k/v, o and down, gate/up) at 64 and 256 rows, K whole (its fused forms
    # normalise rows inside the product): measured on an H100 (`matmul_tune.py --sizes codec`, session of
    # 2026-12-05), where these beat cuBLAS by 1.08-1.49x at 64 rows.
    (3072, 512, False): {64: _T(32, 128, 1), 256: _T(64, 64, 1)},
    (512, 1024, False): {64: _T(16, 128, 1), 256: _T(16, 128, 1)},
    (2048, 512, True): {64: _T(16, 128, 1), 256: _T(32, 128, 1)},
}
TABLE: dict[tuple[int, int, int, bool], Tiles | None] = {
    (rows, n, k, gated): tiles for (n, k, gated), by_rows in _H200.items() for rows, tiles in by_rows.items()
}
# LEGATO_MATMUL_TILES names a tune JSON whose entries replace these (to try a table measured on another GPU).
TABLE.update(_load_table(os.environ.get("LEGATO_MATMUL_TILES")))


def table_rows(m: int) -> int:
    """The table's row key: 1, or the bucket from 16 up (2 to 16 rows run the same 16-row tile)."""
    return 1 if m == 1 else max(16, row_bucket(m))


def tiles_for(m: int, n: int, k: int, gated: bool = False) -> Tiles | None:
    """The launch for x [m, k] @ w [n, k]^T (n: the weight's rows, both halves when gated); None: the path
    before this kernel (the one-row kernel at one row, else cuBLAS) measured faster."""
    key = (table_rows(m), n, k, gated)
    if key in TABLE:
        return TABLE[key]
    return rule_of_thumb(m, n // 2 if gated else n, k, gated) if m <= RULE_MAX_ROWS else None


def plan(x: torch.Tensor, weight: torch.Tensor, gated: bool = False) -> Tiles | None:
    """The tiles `matmuls.linear(x, weight)` (or `gated_linear`) runs the kernel with; None: it does not."""
    if not (ENABLED and triton is not None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and weight.stride(-1) == 1 and x.shape[-1] % 8 == 0):
        return None
    m = x.numel() // x.shape[-1]
    return tiles_for(m, weight.shape[0], weight.shape[1], gated) if 0 < m <= MAX_ROWS else None


def takes(x: torch.Tensor, weight: torch.Tensor, gated: bool = False) -> bool:
    """Whether `matmuls.linear(x, weight)` (or `gated_linear`) runs the kernel."""
    return plan(x, weight, gated) is not None


def matmul(x: torch.Tensor, weight: torch.Tensor, gated: bool = False, tiles: Tiles | None = None,
           norm_eps: float | None = None, add_to: torch.Tensor | None = None,
           norm_after: tuple[torch.Tensor, torch.Tensor, float] | None = None):
    """x [..., K] @ weight [N, K]^T -> [..., N]; gated: weight is [gate; up] ([2I, K]) and the result
    silu(x @ gate^T) * (x @ up^T) [..., I]. Any dtype Triton takes (tests run fp32 under the interpreter);
    `tiles` overrides the table (the tune script).

    `norm_eps`: x's rows are RMS-normalised first (a weightless RMSNorm: fold its weight into `weight`): the
    program sums each row's squares as it walks K and scales the fp32 product by rsqrt(mean + eps), so the
    normalised rows never go through memory (K is not split then). `add_to` [..., N] (contiguous): the product
    is added into it, in place, and it is returned (a residual stream: `h += x @ W^T` in one kernel).
    `norm_after` (residual, norm weight, eps), K split: `matmul_add_rms_norm`'s pair (call that instead)."""
    k = x.shape[-1]
    n_w = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"x has {k} features, weight {tuple(weight.shape)}")
    if gated and n_w % 2:
        raise ValueError(f"a gated weight stacks gate and up: {n_w} rows is odd")
    n = n_w // 2 if gated else n_w
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    t = tiles or tiles_for(m, n_w, k, gated) or rule_of_thumb(m, n, k, gated)
    bm = block_m(m)
    if add_to is not None:
        if add_to.numel() != m * n or not add_to.is_contiguous() or add_to.dtype != x.dtype:
            raise ValueError(f"add_to {tuple(add_to.shape)} {add_to.dtype} is not {m} x {n} contiguous {x.dtype}")
        out = add_to.view(m, n)
    else:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    # Each split's share of K is whole K steps, so no program's strip straddles another's.
    k_steps = -(-k // t.block_k)
    split = 1 if norm_eps is not None else _splits(k, t)
    per_split = -(-k_steps // split) * t.block_k
    split = -(-k // per_split)
    grid = (triton.cdiv(n, t.block_n), triton.cdiv(m, bm), split)
    planes = 2 if gated else 1
    parts = out if split == 1 else torch.empty(split, planes, m, n, dtype=torch.float32, device=x.device)
    on = pdl.launch(x)
    line = max(1, 128 // weight.element_size())  # elements in a 128-byte line: one L2 prefetch each
    _rows_kernel[grid](
        rows, weight, out, parts, m, n, k, per_split, rows.stride(0), weight.stride(0),
        0.0 if norm_eps is None else float(norm_eps),
        BLOCK_M=bm, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GATED=gated, PARTS=split > 1,
        NORM=norm_eps is not None, ADD=add_to is not None,
        # fp32 (the interpreter's tests) sums exactly; half-precision inputs are exact on tensor cores anyway.
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", PDL=on, LINES=max(1, t.block_k // line),
        LINE=min(line, t.block_k), num_warps=t.warps, num_stages=t.stages, **pdl.launch_options(on),
    )
    if split > 1 and norm_after is not None:
        residual, norm_weight, eps = norm_after
        h = torch.empty_like(out)
        _sum_add_norm_kernel[(m,)](parts, residual.reshape(m, n), norm_weight, out, h, m, n, split, float(eps),
                                   BLOCK_N=triton.next_power_of_2(n), PDL=on, num_warps=4 if n <= 2048 else 8,
                                   **pdl.launch_options(on))
        return out.view(*x.shape[:-1], n), h.view(*x.shape[:-1], n)
    if split > 1:
        block = 256
        _sum_parts_kernel[(triton.cdiv(m * n, block),)](parts, out, m * n, split, GATED=gated,
                                                        ADD=add_to is not None, BLOCK=block, PDL=on,
                                                        **pdl.launch_options(on))
    if add_to is not None:
        return add_to
    return out.view(*x.shape[:-1], n)


def _splits(k: int, tiles: Tiles) -> int:
    """Programs K is split over under `tiles`: at most one per K step (a split product ends in a second kernel,
    which `matmul_add_rms_norm` makes the residual add and the norm after it too)."""
    return max(1, min(tiles.split, -(-k // tiles.block_k)))


def matmul_add_rms_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                        eps: float, tiles: Tiles | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + x @ weight^T, RMSNorm of it): a decoder layer's projection back into the residual stream and
    the norm that follows it. Where K is split over programs the kernel that adds the partial sums (in split order)
    also rounds the product to the activation dtype, adds the residual and normalises the row, in one program per
    row: the rounding of `add_rms_norm(residual, linear(x, weight))`, one launch fewer. Otherwise the product
    and `add_rms_norm` run as before."""
    m, n = x.numel() // x.shape[-1], weight.shape[0]
    t = tiles or tiles_for(m, n, weight.shape[1]) or rule_of_thumb(m, n, weight.shape[1])
    if (not FUSED_NORM or _splits(weight.shape[1], t) == 1 or residual.shape[-1] != n or residual.dtype != x.dtype
            or norm_weight.dtype != x.dtype or n > 8192):
        return add_rms_norm(residual, matmul(x, weight, tiles=t), norm_weight, eps)
    return matmul(x, weight, tiles=t, norm_after=(residual.contiguous(), norm_weight.contiguous(), eps))


if triton is not None:

    @triton.jit
    def _silu_mul(gate, up, out_ty: tl.constexpr):
        # The unfused path's rounding: gate and up leave their matmul in the output dtype, then SiLU in fp32.
        g = gate.to(out_ty).to(tl.float32)
        u = up.to(out_ty).to(tl.float32)
        return g / (1.0 + tl.exp(-g)) * u

    @triton.jit
    def _rows_kernel(x_ptr, w_ptr, y_ptr, part_ptr, M, N, K, per_split, stride_xm, stride_wn, EPS,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GATED: tl.constexpr,
                     PARTS: tl.constexpr, NORM: tl.constexpr, ADD: tl.constexpr, PRECISION: tl.constexpr,
                     PDL: tl.constexpr = False, LINES: tl.constexpr = 1, LINE: tl.constexpr = 64):
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        split = tl.program_id(2)
        kk = tl.arange(0, BLOCK_K)
        col_ok = cols < N
        row_ok = rows < M
        w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_wn
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        squares = tl.zeros([BLOCK_M], tl.float32)
        k_lo = split * per_split
        k_hi = tl.minimum(k_lo + per_split, K)
        if PDL:  # the program's weight strip into L2 while the kernel before still runs (weights never change)
            strip = w_ptr + tl.minimum(cols, N - 1)[:, None].to(tl.int64) * stride_wn
            for k0 in range(k_lo, k_hi, BLOCK_K):
                at = tl.minimum(k0 + tl.arange(0, LINES) * LINE, k_hi - 1)[None, :]
                pdl.warm_l2(strip + at, PDL)
                if GATED:
                    pdl.warm_l2(strip + N * stride_wn + at, PDL)
        pdl.wait(PDL)
        pdl.release(PDL)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k = k0 + kk
            k_ok = k < k_hi
            x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0)
            w = tl.load(w_rows + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
            if NORM:  # the row's sum of squares, from the tile already loaded (K is whole in this program)
                xf = x.to(tl.float32)
                squares += tl.sum(xf * xf, axis=1)
            if GATED:  # the up rows sit N rows below the gate rows
                wu = tl.load(w_rows + N * stride_wn + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
                acc_up = tl.dot(x, tl.trans(wu), acc_up, input_precision=PRECISION)
        if NORM:
            scale = tl.rsqrt(squares / K + EPS)[:, None]
            acc = acc * scale
            acc_up = acc_up * scale
        mask = row_ok[:, None] & col_ok[None, :]
        at = rows[:, None] * N + cols[None, :]
        if PARTS:  # fp32 partial sums, [split, plane, M, N]; _sum_parts_kernel finishes them
            if GATED:
                base = part_ptr + split * 2 * M * N
                tl.store(base + at, acc, mask=mask)
                tl.store(base + M * N + at, acc_up, mask=mask)
            else:
                tl.store(part_ptr + split * M * N + at, acc, mask=mask)
        else:
            ty = y_ptr.dtype.element_ty
            if GATED:
                y = _silu_mul(acc, acc_up, ty)
            else:
                y = acc
            if ADD:  # in fp32, one rounding, as cuBLAS's addmm (beta 1) does it
                y = y + tl.load(y_ptr + at, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_ptr + at, y.to(ty), mask=mask)

    @triton.jit
    def _sum_add_norm_kernel(part_ptr, res_ptr, w_ptr, y_ptr, h_ptr, M, N, splits, EPS, BLOCK_N: tl.constexpr,
                             PDL: tl.constexpr = False):
        # One row: the product from its split partial sums (in split order), rounded as the matmul's output is;
        # the residual add, rounded as a bf16 add is; then `fused._rms`: fp32 mean of squares, the normalised row
        # rounded, times the weight, rounded.
        pdl.wait(PDL)
        pdl.release(PDL)
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK_N)
        ok = cols < N
        at = row * N + cols
        acc = tl.zeros([BLOCK_N], tl.float32)
        for s in range(0, splits):
            acc += tl.load(part_ptr + s * M * N + at, mask=ok, other=0.0)
        ty = y_ptr.dtype.element_ty
        y = (tl.load(res_ptr + at, mask=ok, other=0.0).to(tl.float32) + acc.to(ty).to(tl.float32)).to(ty)
        tl.store(y_ptr + at, y, mask=ok)
        yf = y.to(tl.float32)
        scale = tl.rsqrt(tl.sum(yf * yf, axis=0) / N + EPS)
        normed = (yf * scale).to(ty).to(tl.float32)
        h = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32) * normed
        tl.store(h_ptr + at, h.to(ty), mask=ok)

    @triton.jit
    def _sum_parts_kernel(part_ptr, y_ptr, size, splits, GATED: tl.constexpr, ADD: tl.constexpr,
                          BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        pdl.wait(PDL)
        pdl.release(PDL)
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
            y = _silu_mul(acc, acc_up, ty)
        else:
            y = acc
        if ADD:
            y = y + tl.load(y_ptr + at, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + at, y.to(ty), mask=ok)
