"""1-D convolutions as matrix products, for inputs whose length changes per call (reference clips).

cuDNN plans each convolution shape it meets, and the plan cache belongs to the thread: a speaker-encoder
pass over a clip of a length the encoder thread has not seen cost ~21 ms on an H200 against ~3.3 ms for a seen
one (`benchmarks/voice_shapes.py`), and reference clips come in every length. As a GEMM the shape needs no
plan: the k dilated taps of the padded input are stacked along the channels, `[B, k * C_in, T]`, and one
`[C_out, k * C_in]` weight multiplies them. The codec encoder's convolutions run at the audio rate, where
stacking the taps would copy a clip k times over (a 30 s clip's first residual convs: ~0.5 GB): there each tap is
its own matrix product, added up (`valid_conv1d`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def same_padding(kernel_size: int, dilation: int) -> tuple[int, int]:
    """The (left, right) split that `Conv1d(padding="same")` uses: any odd sample goes right."""
    total = dilation * (kernel_size - 1)
    return total // 2, total - total // 2


def same_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dilation: int = 1) -> torch.Tensor:
    """`Conv1d(padding="same", padding_mode="reflect", dilation=dilation)` of x `[B, C_in, T]` -> `[B, C_out, T]`."""
    c_out, c_in, k = weight.shape
    t = x.shape[2]
    w = weight.permute(0, 2, 1).reshape(c_out, k * c_in)  # taps outermost, as the stacked input
    if k == 1:
        taps = x
    else:
        left, right = same_padding(k, dilation)
        padded = F.pad(x, (left, right), mode="reflect")
        taps = torch.cat([padded[:, :, j * dilation: j * dilation + t] for j in range(k)], dim=1)
    out = torch.matmul(w, taps)
    return out if bias is None else out + bias[:, None]


def valid_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: int = 1,
                 dilation: int = 1) -> torch.Tensor:
    """`F.conv1d(x, weight, bias, stride, dilation=dilation)` (no padding) of x `[B, C_in, L]` as one matrix
    product per tap, summed: no stacked copy of the input, so it suits long, audio-rate inputs."""
    c_out, c_in, k = weight.shape
    t = (x.shape[2] - dilation * (k - 1) - 1) // stride + 1
    if t <= 0:
        raise ValueError(f"input of length {x.shape[2]} is shorter than the kernel's span {dilation * (k - 1) + 1}")
    span = stride * (t - 1) + 1
    out = None
    for j in range(k):
        tap = torch.matmul(weight[:, :, j], x[:, :, j * dilation: j * dilation + span: stride])
        out = tap if out is None else out.add_(tap)
    return out if bias is None else out + bias[:, None]
