"""Shared helpers of the codec-decoder tests: well-conditioned random values for every parameter."""

from __future__ import annotations

import math

import torch
from torch import nn

# Below 1 so the 12 residual units of the vocoder do not blow activations up (the output would then sit
# on the ±1 clamp, where a wrong layer can hide); 0.7 keeps the waveform at std ~0.05 (tiny) to ~0.25 (full).
MATRIX_GAIN = 0.7


def randomize_codec_weights_(module: nn.Module, seed: int = 0) -> nn.Module:
    """Overwrites every parameter of `module` in place with random values and returns it.

    The reference init leaves many parameters constant (codebooks zero, cluster usage one, layer scales
    0.01, SnakeBeta zeros, ConvNeXt gains 1e-6), which would hide wrong wiring. Matrices and conv kernels
    get N(0, gain²/fan_in) so activations stay O(1) at any width; norm weights get 1 + noise; cluster
    usage stays positive; every other vector gets N(0, 0.1²).
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            owner, _, leaf = name.rpartition(".")
            if leaf == "cluster_usage":
                value = torch.rand(p.shape, generator=gen) * 2 + 0.05
            elif leaf == "embedding_sum":
                value = torch.randn(p.shape, generator=gen) * 0.3
            elif leaf == "weight" and "norm" in owner.rpartition(".")[2]:
                value = 1 + 0.1 * torch.randn(p.shape, generator=gen)
            elif p.ndim >= 2:
                value = torch.randn(p.shape, generator=gen) * (MATRIX_GAIN / math.sqrt(math.prod(p.shape[1:])))
            else:
                value = 0.1 * torch.randn(p.shape, generator=gen)
            p.copy_(value)
    return module
