"""Which kernel a serving matmul runs: the few-row tensor-core GEMM (`small_matmul`) where its table takes the
shape, else the one-row kernel (`skinny_linear`) for a single row, else cuBLAS (`F.linear`). A matmul whose result
only feeds a residual add and RMSNorm may hand that norm its split-K partial sums (`linear_partial`, `add_rms_norm`)."""

from __future__ import annotations

import torch

from legato.layers import fused, partial_sums, small_matmul
from legato.layers.fused import silu_mul
from legato.layers.partial_sums import PartialSums
from legato.layers.skinny_linear import linear as _one_row_or_cublas


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, weight)` (no bias): x [..., K], weight [N, K] -> [..., N]."""
    if small_matmul.takes(x, weight):
        return small_matmul.matmul(x, weight)
    return _one_row_or_cublas(x, weight)


def gated_linear(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(x @ gate^T) * (x @ up^T)` for the packed weight [gate; up] ([2I, K]) -> [..., I]."""
    if small_matmul.takes(x, gate_up, gated=True):
        return small_matmul.matmul(x, gate_up, gated=True)
    gate, up = _one_row_or_cublas(x, gate_up).chunk(2, dim=-1)
    return silu_mul(gate, up)


def linear_partial(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | PartialSums:
    """`linear`, or its split-K partial sums still to be added, for `add_rms_norm` (or `full`) to finish."""
    if small_matmul.takes(x, weight):
        return small_matmul.matmul_partial(x, weight)
    return _one_row_or_cublas(x, weight)


def full(delta: torch.Tensor | PartialSums) -> torch.Tensor:
    """`linear_partial`'s result as a tensor."""
    return delta.sum() if isinstance(delta, PartialSums) else delta


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | PartialSums, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)); partial sums are added in the same kernel."""
    if isinstance(delta, PartialSums):
        return partial_sums.add_rms_norm(x, delta, weight, eps)
    return fused.add_rms_norm(x, delta, weight, eps)
