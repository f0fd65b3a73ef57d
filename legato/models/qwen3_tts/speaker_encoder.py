"""ECAPA-TDNN speaker encoder of the Qwen3-TTS Base models (the "x-vector" of voice cloning).

Reference audio (24 kHz) -> log-mel (mel.py) -> a TDNN layer, SE-Res2Net blocks, multi-layer feature
aggregation, attentive statistics pooling -> one `enc_dim` vector per clip, which the talker inserts in
the codec stream as the speaker slot (so `enc_dim` equals the talker hidden size).

Module attribute names follow the checkpoint's `speaker_encoder.*` keys exactly; no BatchNorm is used,
so the model holds parameters only (conv weights and biases), no buffers.
"""

from __future__ import annotations

import torch
from torch import nn

from legato.layers.same_conv import same_conv1d, same_padding
from legato.models.qwen3_tts.config import SpeakerEncoderConfig
from legato.models.qwen3_tts.mel import LogMelSpectrogram, MelConfig

# Floor on the pooled variance before the square root: a constant channel (e.g. digital silence) gets a
# std of 1e-6 instead of 0, whose sqrt would have an infinite gradient.
_VAR_FLOOR = 1e-12


class SameConv(nn.Conv1d):
    """Conv1d with reflect "same" padding; on a CUDA input as one GEMM (`same_conv1d`), on the CPU as Conv1d.

    Why: cuDNN plans each input length anew, per thread, and reference clips come in every length: on an H100 the
    speaker network took 17.5 ms for a clip of a new length against 2.7 ms for a seen one, and 3.1 ms as GEMMs
    either way, its bf16 embeddings as far from fp32 math as cuDNN's (3.48e-3 relative both;
    `benchmarks/voice_shapes.py`, docs/benchmarks.md). The CPU keeps Conv1d, the official implementation's op,
    where no planning costs anything and the embeddings stay bit-equal to the official ones. `gemm` True or False
    forces one path (tests, benchmarks)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, dilation: int = 1) -> None:
        super().__init__(in_channels, out_channels, kernel_size, dilation=dilation, padding="same",
                         padding_mode="reflect")
        self.gemm: bool | None = None  # None: GEMM on CUDA inputs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (x.is_cuda if self.gemm is None else self.gemm):
            return super().forward(x)
        return same_conv1d(x, self.weight, self.bias, self.dilation[0])


class TDNNLayer(nn.Module):
    """Dilated conv over time with reflect "same" padding, then ReLU."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, dilation: int) -> None:
        super().__init__()
        self.conv = SameConv(in_channels, out_channels, kernel_size, dilation=dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x))


class Res2Conv(nn.Module):
    """Res2Net-style hierarchy: the channels are cut into `scale` groups; group 0 passes through, and
    every later group is convolved after adding the previous group's output, so the receptive field
    grows group by group inside one layer."""

    def __init__(self, channels: int, scale: int, kernel_size: int, dilation: int) -> None:
        super().__init__()
        width = channels // scale
        self.scale = scale
        self.blocks = nn.ModuleList(TDNNLayer(width, width, kernel_size, dilation) for _ in range(scale - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        groups = torch.chunk(x, self.scale, dim=1)
        outs = [groups[0]]
        carry = None
        for layer, group in zip(self.blocks, groups[1:], strict=True):
            carry = layer(group if carry is None else group + carry)
            outs.append(carry)
        return torch.cat(outs, dim=1)


class ChannelGate(nn.Module):
    """Squeeze-excitation: per-channel sigmoid gates computed from the time-averaged features."""

    def __init__(self, channels: int, bottleneck: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(channels, bottleneck, kernel_size=1)
        self.conv2 = nn.Conv1d(bottleneck, channels, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        summary = x.mean(dim=2, keepdim=True)
        gate = torch.sigmoid(self.conv2(torch.relu(self.conv1(summary))))
        return x * gate


class SERes2Block(nn.Module):
    """1x1 TDNN -> Res2Conv -> 1x1 TDNN -> channel gate, with a residual connection."""

    def __init__(self, channels: int, scale: int, se_channels: int, kernel_size: int, dilation: int) -> None:
        super().__init__()
        self.tdnn1 = TDNNLayer(channels, channels, kernel_size=1, dilation=1)
        self.res2net_block = Res2Conv(channels, scale, kernel_size, dilation)
        self.tdnn2 = TDNNLayer(channels, channels, kernel_size=1, dilation=1)
        self.se_block = ChannelGate(channels, se_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x))))


def _weighted_mean_std(x: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and standard deviation over time of x [B, C, T] under weights that sum to 1 over T."""
    mean = (weights * x).sum(dim=2)
    var = (weights * (x - mean.unsqueeze(2)).pow(2)).sum(dim=2)
    return mean, var.clamp(min=_VAR_FLOOR).sqrt()


class AttentivePooling(nn.Module):
    """Attentive statistics pooling: per-channel softmax weights over time, conditioned on each frame
    and on the utterance-level mean / std, give a weighted mean and std. [B, C, T] -> [B, 2C]."""

    def __init__(self, channels: int, attention_channels: int) -> None:
        super().__init__()
        self.tdnn = TDNNLayer(channels * 3, attention_channels, kernel_size=1, dilation=1)
        self.conv = SameConv(attention_channels, channels, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        num_frames = x.shape[2]
        uniform = torch.full((1, 1, num_frames), 1.0 / num_frames, dtype=x.dtype, device=x.device)
        mean, std = _weighted_mean_std(x, uniform)
        context = torch.cat([x, mean.unsqueeze(2).expand_as(x), std.unsqueeze(2).expand_as(x)], dim=1)
        scores = self.conv(torch.tanh(self.tdnn(context)))
        mean, std = _weighted_mean_std(x, torch.softmax(scores, dim=2))
        return torch.cat([mean, std], dim=1)


class SpeakerEncoder(nn.Module):
    """ECAPA-TDNN over log-mel features; `embed` is the public entry point.

    State-dict keys equal the checkpoint's `speaker_encoder.*` keys with that prefix stripped.
    """

    def __init__(self, config: SpeakerEncoderConfig) -> None:
        super().__init__()
        channels, kernels, dilations = config.enc_channels, config.enc_kernel_sizes, config.enc_dilations
        _validate(config)
        self.config = config
        self.mel = LogMelSpectrogram(
            MelConfig(sample_rate=config.sample_rate, n_mels=config.mel_dim, fmax=config.sample_rate / 2)
        )
        self.blocks = nn.ModuleList([TDNNLayer(config.mel_dim, channels[0], kernels[0], dilations[0])])
        for i in range(1, len(channels) - 1):
            self.blocks.append(
                SERes2Block(channels[i], config.enc_res2net_scale, config.enc_se_channels, kernels[i], dilations[i])
            )
        # Multi-layer feature aggregation over the concatenated SE-Res2Net outputs.
        self.mfa = TDNNLayer(channels[-1], channels[-1], kernels[-1], dilations[-1])
        self.asp = AttentivePooling(channels[-1], config.enc_attention_channels)
        # A 1x1 conv rather than a Linear, to keep the checkpoint's [out, in, 1] weight shape.
        self.fc = nn.Conv1d(channels[-1] * 2, config.enc_dim, kernel_size=1)
        # Reflect padding needs more frames than it pads on either side, in every dilated conv.
        widest = max(same_padding(k, d)[1] for k, d in zip(kernels, dilations, strict=True))
        self.min_frames = widest + 1
        self.min_samples = self.mel.config.min_samples_for(self.min_frames)

    def forward(self, mels: torch.Tensor) -> torch.Tensor:
        """Log-mel features [B, mel_dim, num_frames] (channels first) -> embeddings [B, enc_dim]."""
        x = self.blocks[0](mels)
        block_outputs = []
        for block in self.blocks[1:]:
            x = block(x)
            block_outputs.append(x)
        x = self.mfa(torch.cat(block_outputs, dim=1))
        pooled = self.asp(x)
        return self.fc(pooled.unsqueeze(2)).squeeze(2)

    @torch.no_grad()
    def embed(self, wav_24k: torch.Tensor) -> torch.Tensor:
        """Speaker embeddings of mono waveforms at `config.sample_rate` (24 kHz in every release).

        wav_24k: float [num_samples] or [batch, num_samples], nominally in [-1, 1]; resampling and
        channel mixing are the caller's job. A batch must hold clips of equal length (padding would
        change the pooled statistics), so embed clips of different lengths one call each.
        Returns [batch, enc_dim] in the model's parameter dtype; the mel features are computed in fp32.
        Raises ValueError for a tensor of the wrong rank or dtype, or a clip shorter than `min_samples`.
        """
        if wav_24k.dim() not in (1, 2):
            shape = tuple(wav_24k.shape)
            raise ValueError(f"expected a waveform [num_samples] or [batch, num_samples], got shape {shape}")
        if not wav_24k.is_floating_point():
            raise ValueError(f"expected a floating-point waveform, got {wav_24k.dtype}")
        num_samples = wav_24k.shape[-1]
        if num_samples < self.min_samples:
            raise ValueError(
                f"reference audio too short for the speaker encoder: {num_samples} samples, need at least "
                f"{self.min_samples} ({self.min_samples / self.config.sample_rate * 1000:.0f} ms at "
                f"{self.config.sample_rate} Hz)"
            )
        weight = self.fc.weight
        wav = wav_24k.reshape(-1, num_samples).to(device=weight.device)
        mels = self.mel(wav)
        return self.forward(mels.to(weight.dtype))


def _validate(config: SpeakerEncoderConfig) -> None:
    channels, kernels, dilations = config.enc_channels, config.enc_kernel_sizes, config.enc_dilations
    if not len(channels) == len(kernels) == len(dilations) or len(channels) < 3:
        raise ValueError("enc_channels, enc_kernel_sizes and enc_dilations need one equal length >= 3")
    if len(set(channels[:-1])) != 1:
        raise ValueError(f"the SE-Res2Net blocks are residual, so enc_channels[:-1] must be equal, got {channels}")
    if sum(channels[1:-1]) != channels[-1]:
        raise ValueError(f"enc_channels[-1] must equal the sum of enc_channels[1:-1], got {channels}")
    if channels[0] % config.enc_res2net_scale:
        raise ValueError(f"enc_res2net_scale {config.enc_res2net_scale} must divide the channels {channels[0]}")
