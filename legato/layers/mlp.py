"""Feed-forward blocks."""

from __future__ import annotations

import torch
from torch import nn

from legato.layers.fused import silu_mul
from legato.layers.matmuls import gated_linear, linear


class SwiGLU(nn.Module):
    """`down(silu(gate(x)) * up(x))`; parameter names follow the HF Qwen3 MLP."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

        self.gate_up_weight: torch.Tensor | None = None

    def pack(self) -> None:
        """Serve gate and up from one matmul (call after the weights are loaded and placed; a packed copy
        is kept beside the checkpoint parameters, which stay as loaded)."""
        if self.gate_proj.bias is not None or self.gate_up_weight is not None:
            return
        self.gate_up_weight = torch.cat([self.gate_proj.weight, self.up_proj.weight], dim=0).detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is not None:  # the serving layout: few-row calls take the Triton kernels
            return linear(self.down_input(x), self.down_proj.weight)
        return self.down_proj(self.down_input(x))

    def down_input(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate(x)) * up(x): what the down projection takes (a decoder layer runs that projection together
        with the residual add and the next norm)."""
        if self.gate_up_weight is not None:
            return gated_linear(x, self.gate_up_weight)
        return silu_mul(self.gate_proj(x), self.up_proj(x))
