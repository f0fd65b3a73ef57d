"""Convolutional layers of the codec decoder, each usable whole-utterance or streaming.

Every layer takes `(x, stream)` (stateless ones ignore `stream`): with `stream=None` it zero-pads on the
left as the reference decoder does; with a `StreamContext` it prepends the tail it kept from the previous
chunk instead, and keeps the new one (see codec_streaming.py). Activations are [B, C, T]. Parameter names
follow the official checkpoint (`conv.weight`, `block.N`, `alpha` ...): one safetensors file loads into both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from legato.layers.snake import snake_beta

from .codec_streaming import StreamContext


class StreamingLayer(nn.Module):
    """A layer with per-request streaming buffers; `state_key` is set by the owning decoder."""

    state_key: str = ""

    def stream_buffers(self) -> dict[str, tuple[int, ...]]:
        """Buffer name suffix -> shape without the batch dimension (zeros at the start of a request)."""
        raise NotImplementedError


class CausalConv1d(StreamingLayer):
    """Stride-1 conv that sees only the past: `(k - 1) * dilation` samples of left context.

    The reference also right-pads to whole output frames, which is zero samples at stride 1, so only
    stride 1 is supported (every conv of the decoder has it).
    """

    def __init__(self, cin: int, cout: int, kernel_size: int, dilation: int = 1, groups: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel_size, dilation=dilation, groups=groups)
        self.context = (kernel_size - 1) * dilation

    def stream_buffers(self) -> dict[str, tuple[int, ...]]:
        return {"tail": (self.conv.in_channels, self.context)} if self.context else {}

    def forward(self, x: torch.Tensor, stream: StreamContext | None = None) -> torch.Tensor:
        if self.context:
            if stream is None:
                x = F.pad(x, (self.context, 0))
            else:
                key = self.state_key + ".tail"
                x = torch.cat([stream.take(key), x], dim=-1)
                stream.keep(key, x, self.context)
        return self.conv(x)


class CausalConvTranspose1d(StreamingLayer):
    """Upsampling by `stride`; the `kernel - stride` samples that overhang the right end are cut.

    Streaming: the overhang is the start of the next chunk's output, so it is carried (without bias)
    and added there; at the end of an utterance it is dropped, exactly like the whole-utterance cut.
    """

    def __init__(self, cin: int, cout: int, kernel_size: int, stride: int) -> None:
        super().__init__()
        self.conv = nn.ConvTranspose1d(cin, cout, kernel_size, stride=stride)
        self.overhang = kernel_size - stride

    def stream_buffers(self) -> dict[str, tuple[int, ...]]:
        return {"overhang": (self.conv.out_channels, self.overhang)} if self.overhang else {}

    def forward(self, x: torch.Tensor, stream: StreamContext | None = None) -> torch.Tensor:
        keep = x.shape[-1] * self.conv.stride[0]
        if stream is None or not self.overhang:
            return self.conv(x)[..., :keep]
        mask = stream.valid_mask(x.shape[-1])
        if mask is not None:
            # Padded frames must not leak into the carried overhang (they would, via their kernel tap).
            x = x * mask.to(x.dtype)
        y = F.conv_transpose1d(x, self.conv.weight, None, stride=self.conv.stride)
        key = self.state_key + ".overhang"
        y[..., : self.overhang] += stream.take(key)
        stream.keep(key, y, self.overhang)
        out = y[..., :keep]
        if self.conv.bias is not None:
            out = out + self.conv.bias[:, None]
        return out


class SnakeBeta(nn.Module):
    """`x + sin²(x·e^α) / (e^β + 1e-9)`, α and β per channel, stored as logs."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor, stream: StreamContext | None = None) -> torch.Tensor:
        return snake_beta(x, self.alpha, self.beta)


class ConvNeXtBlock(nn.Module):
    """Causal depthwise conv (k=7) → LayerNorm → 4x MLP (GELU) → per-channel gain γ, plus residual."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = CausalConv1d(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: torch.Tensor, stream: StreamContext | None = None) -> torch.Tensor:
        h = self.dwconv(x, stream).transpose(1, 2)
        h = self.pwconv2(F.gelu(self.pwconv1(self.norm(h))))
        return x + (self.gamma * h).transpose(1, 2)


class UpsampleStage(nn.ModuleList):
    """`[transposed conv (k = stride = factor), ConvNeXt block]`; a ModuleList for the key names `N.0`, `N.1`."""

    def __init__(self, dim: int, factor: int) -> None:
        super().__init__([CausalConvTranspose1d(dim, dim, factor, factor), ConvNeXtBlock(dim)])

    def forward(self, x: torch.Tensor, stream: StreamContext | None = None) -> torch.Tensor:
        for layer in self:
            x = layer(x, stream)
        return x


class ResidualUnit(nn.Module):
    """Snake → dilated causal conv k=7 → Snake → conv k=1, plus residual."""

    def __init__(self, dim: int, dilation: int) -> None:
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv1d(dim, dim, 7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv1d(dim, dim, 1)

    def forward(self, x: torch.Tensor, stream: StreamContext | None = None) -> torch.Tensor:
        h = self.conv1(self.act1(x), stream)
        return x + self.conv2(self.act2(h), stream)


class VocoderBlock(nn.Module):
    """Snake → transposed conv upsampling by `rate` (k = 2·rate) → residual units with dilations 1, 3, 9."""

    def __init__(self, cin: int, cout: int, rate: int) -> None:
        super().__init__()
        self.block = nn.ModuleList(
            [SnakeBeta(cin), CausalConvTranspose1d(cin, cout, 2 * rate, rate)]
            + [ResidualUnit(cout, d) for d in (1, 3, 9)]
        )

    def forward(self, x: torch.Tensor, stream: StreamContext | None = None) -> torch.Tensor:
        for layer in self.block:
            x = layer(x, stream)
        return x
