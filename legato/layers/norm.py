"""Normalisation layers."""

from __future__ import annotations

import torch
from torch import nn

from legato.layers.fused import rms_norm


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back to the input dtype before the weight multiply
    (the Qwen3 convention; the order matters for bf16 parity)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
