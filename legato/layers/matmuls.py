"""Which kernel a serving matmul runs: the few-row tensor-core GEMM (`small_matmul`) where its table takes the
shape, else the one-row kernel (`skinny_linear`) for a single row, else cuBLAS (`F.linear`)."""

from __future__ import annotations

import torch

from legato.layers import small_matmul
from legato.layers.fused import add_rms_norm, rms_norm, silu_mul
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


# A decoder layer's chain of kernels at few rows (`decoder_layer.DecoderLayer.residual_step`): with CHAIN on, each
# norm runs inside the matmul after it (`norm_linear`) and each projection back into the residual stream adds the
# residual in its own epilogue (`linear_add`), K whole, so no layer needs a kernel of its own to sum a split
# product, add and normalise: two dependent launches fewer a layer. Off by default: no GPU has timed it. At one row
# a frame is a chain of ~850 kernels, each waiting for the one before, and each wait costs about as much as the
# kernel's work (docs/benchmarks.md, session of 2026-12-07 (3)); o and down then run unsplit, on fewer programs.
CHAIN = False
CHAIN_ROWS = 16


def chains(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether a decoder layer on x [..., hidden] runs the chain form: `CHAIN` on, at most `CHAIN_ROWS` rows, and
    the few-row GEMM able to take x with each of the layer's weights (else the chain would add kernels)."""
    return CHAIN and x.numel() // x.shape[-1] <= CHAIN_ROWS and all(small_matmul.eligible(x, w) for w in weights)


def whole_k_tiles(m: int, weight: torch.Tensor, gated: bool) -> small_matmul.Tiles:
    """The chain's tiles for m rows: the table's (or the rule's) with K whole, since a split product would need
    the kernel after it that the chain does without; a split entry's columns narrowed to keep the programs many."""
    n, k = weight.shape
    tiles = (small_matmul.tiles_for(m, n, k, gated)
             or small_matmul.rule_of_thumb(m, n // (2 if gated else 1), k, gated))
    return small_matmul.Tiles(block_n=min(tiles.block_n, 16) if tiles.split > 1 else tiles.block_n,
                              block_k=tiles.block_k, split=1, warps=tiles.warps, stages=tiles.stages)


def norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                gated: bool = False) -> torch.Tensor:
    """`linear(rms_norm(x, norm_weight, eps), weight)` (`gated_linear` when gated): one kernel where the few-row
    GEMM can take the shape, the norm inside it."""
    if small_matmul.eligible(x, weight):
        tiles = whole_k_tiles(x.numel() // x.shape[-1], weight, gated)
        return small_matmul.matmul(x, weight, gated=gated, tiles=tiles, norm_in=(norm_weight, eps))
    h = rms_norm(x, norm_weight, eps)
    return gated_linear(h, weight) if gated else linear(h, weight)


def linear_add(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """`residual + linear(x, weight)`, rounded as that add rounds (the product first): one kernel where the
    few-row GEMM can take the shape."""
    if small_matmul.eligible(x, weight):
        tiles = whole_k_tiles(x.numel() // x.shape[-1], weight, False)
        return small_matmul.matmul(x, weight, tiles=tiles, residual=residual).view(residual.shape)
    return residual + linear(x, weight)
