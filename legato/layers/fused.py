"""Elementwise pieces of a decoder layer, fused by `torch.compile` on CUDA.

Eagerly, one RMSNorm is ~7 kernels and one rotary embedding ~8; a frame runs 103 decoder-layer passes
(28 talker + 15 x 5 code predictor), so at small batch the step is bound by kernel count, not math.
On CUDA each function below becomes one generated kernel (compiled once, dynamic in the batch, before
the decode step is captured in a CUDA graph). On the CPU they run eagerly, bit for bit the reference math.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from legato.layers.rotary import apply_rotary


def cuda_compiled(fn: Callable) -> Callable:
    """`fn` eagerly for CPU tensors, through `torch.compile` (compiled lazily) for CUDA tensors."""
    compiled = None

    @functools.wraps(fn)
    def wrapper(x: torch.Tensor, *args, **kwargs):
        nonlocal compiled
        if not x.is_cuda:
            return fn(x, *args, **kwargs)
        if compiled is None:
            # One function serves several dtypes and ranks (talker, code predictor, fp32 codec modules);
            # past dynamo's default of 8 variants it would silently fall back to eager for new ones.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            compiled = torch.compile(fn, dynamic=True)
        return compiled(x, *args, **kwargs)

    return wrapper


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


@cuda_compiled
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32 and cast back before the weight multiply (the Qwen3 order)."""
    return _rms(x, weight, eps)


@cuda_compiled
def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    """q/k head norm followed by the rotary embedding: x [..., heads, D], cos/sin broadcastable."""
    return apply_rotary(_rms(x, weight, eps), cos, sin)


@cuda_compiled
def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


@cuda_compiled
def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next RMSNorm in one pass: returns (x + delta, rms_norm(x + delta))."""
    y = x + delta
    return y, _rms(y, weight, eps)
