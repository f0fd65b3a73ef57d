"""Which kernel a serving matmul runs: the few-row tensor-core GEMM (`small_matmul`) where its table takes the
shape, else the one-row kernel (`skinny_linear`) for a single row, else cuBLAS (`F.linear`)."""

from __future__ import annotations

import torch

from legato.layers import small_matmul
from legato.layers.fused import add_rms_norm, silu_mul
from legato.layers.skinny_linear import linear as _one_row_or_cublas


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, weight)` (no bias): x [..., K], weight [N, K] -> [..., N]."""
    tiles = small_matmul.plan(x, weight)
    if tiles is not None:
        return small_matmul.matmul(x, weight, tiles=tiles)
    return _one_row_or_cublas(x, weight)


def gated_linear(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(x @ gate^T) * (x @ up^T)` for the packed weight [gate; up] ([2I, K]) -> [..., I]."""
    tiles = small_matmul.plan(x, gate_up, gated=True)
    if tiles is not None:
        return small_matmul.matmul(x, gate_up, gated=True, tiles=tiles)
    gate, up = _one_row_or_cublas(x, gate_up).chunk(2, dim=-1)
    return silu_mul(gate, up)


def linear_add_rms_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm(residual, linear(x, weight), norm_weight, eps)`: (the residual stream after the projection,
    its RMSNorm). Where the few-row GEMM splits K, its partial sums, the add and the norm share one kernel."""
    tiles = small_matmul.plan(x, weight)
    if tiles is not None:
        return small_matmul.matmul_add_rms_norm(x, weight, residual, norm_weight, eps, tiles=tiles)
    return add_rms_norm(residual, _one_row_or_cublas(x, weight), norm_weight, eps)
