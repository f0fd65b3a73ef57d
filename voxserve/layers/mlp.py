"""Feed-forward blocks."""

from __future__ import annotations

import torch
from torch import nn

from voxserve.layers.fused import silu_mul


class SwiGLU(nn.Module):
    """`down(silu(gate(x)) * up(x))`; parameter names follow the HF Qwen3 MLP."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))
