"""Building blocks of the Mimi encoder used by the 12 Hz codec: causal strided convolutions, the SEANet
conv encoder and the encoder transformer.

Attribute names follow the checkpoint's `encoder.*` keys (transformers `MimiModel` layout), so the
released `speech_tokenizer/model.safetensors` loads with `strict=True`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from legato.layers.rotary import RotaryEmbedding, apply_rotary
from legato.layers.same_conv import valid_conv1d
from legato.models.qwen3_tts.config import CodecEncoderConfig

_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "relu": F.relu,
}


class CausalStridedConv(nn.Module):
    """Conv1d whose output step t sees only input steps < (t + 1) * stride.

    The input is left-padded by (effective kernel - stride) and right-padded up to a whole number of
    strides, so the output has exactly ceil(length / stride) steps. Right padding only ever feeds the last
    output step, which is why a clip's last codec frame depends on how the clip was padded.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        stride: int = 1,
        dilation: int = 1,
        bias: bool = True,
        pad_mode: str = "constant",
    ) -> None:
        super().__init__()
        if pad_mode not in ("constant", "replicate"):
            raise ValueError(f"unsupported pad_mode {pad_mode!r}; expected 'constant' or 'replicate'")
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, stride, dilation=dilation, bias=bias)
        self.stride = stride
        self.left_pad = (kernel_size - 1) * dilation + 1 - stride
        self.pad_mode = pad_mode
        # None: matrix products on CUDA inputs (`valid_conv1d`), Conv1d on the CPU; True/False force one path.
        # Why: cuDNN plans every input length anew and reference clips come in every length: the whole encoder
        # took 46.5 ms for a clip of a new length on an H100, 16.0 as matrix products (fp32, no TF32: its codes
        # nearer exact fp32 math than cuDNN's; docs/benchmarks.md). The CPU keeps the official op, bit for bit.
        self.gemm: bool | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        right_pad = -x.shape[-1] % self.stride
        x = F.pad(x, (self.left_pad, right_pad), mode=self.pad_mode)
        if not (x.is_cuda if self.gemm is None else self.gemm):
            return self.conv(x)
        c = self.conv
        return valid_conv1d(x, c.weight, c.bias, c.stride[0], c.dilation[0])


class SeanetResidualUnit(nn.Module):
    """ELU -> conv k (dilated, to dim // compress) -> ELU -> conv 1 (back to dim), plus the skip path.

    `block` keeps the ELUs at indices 0 and 2 so the convs sit at `block.1` / `block.3` as in the checkpoint.
    """

    def __init__(self, cfg: CodecEncoderConfig, dim: int, dilation: int) -> None:
        super().__init__()
        hidden = dim // cfg.compress
        self.block = nn.ModuleList(
            [
                nn.ELU(),
                CausalStridedConv(dim, hidden, cfg.residual_kernel_size, dilation=dilation, pad_mode=cfg.pad_mode),
                nn.ELU(),
                CausalStridedConv(hidden, dim, 1, pad_mode=cfg.pad_mode),
            ]
        )
        self.shortcut = CausalStridedConv(dim, dim, 1, pad_mode=cfg.pad_mode) if cfg.use_conv_shortcut else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = x if self.shortcut is None else self.shortcut(x)
        for layer in self.block:
            x = layer(x)
        return skip + x


class SeanetEncoder(nn.Module):
    """Waveform [B, channels, N] -> features [B, hidden_size, ceil(N / prod(upsampling_ratios))].

    A k-conv to `num_filters`, then per stride r (the reversed `upsampling_ratios`): residual units, ELU
    and a conv of kernel 2r / stride r doubling the channels; finally ELU and a conv to `hidden_size`.
    The parameter-free ELUs are kept as list entries so the conv indices match the checkpoint.
    """

    def __init__(self, cfg: CodecEncoderConfig) -> None:
        super().__init__()
        width = cfg.num_filters
        layers: list[nn.Module] = [CausalStridedConv(cfg.audio_channels, width, cfg.kernel_size, pad_mode=cfg.pad_mode)]
        for ratio in reversed(cfg.upsampling_ratios):
            for j in range(cfg.num_residual_layers):
                layers.append(SeanetResidualUnit(cfg, width, dilation=cfg.dilation_growth_rate**j))
            layers.append(nn.ELU())
            layers.append(CausalStridedConv(width, 2 * width, 2 * ratio, stride=ratio, pad_mode=cfg.pad_mode))
            width *= 2
        layers.append(nn.ELU())
        layers.append(CausalStridedConv(width, cfg.hidden_size, cfg.last_kernel_size, pad_mode=cfg.pad_mode))
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class LayerScale(nn.Module):
    """Learned per-channel gain on a residual branch."""

    def __init__(self, dim: int, init: float) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), init))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class EncoderAttention(nn.Module):
    """Causal multi-head self-attention with RoPE over the whole sequence.

    `sliding_window` is deliberately NOT applied: transformers' Mimi builds a plain causal mask for its
    eager and sdpa attention (the default for the official speech tokenizer, which always loads with its
    default attention) and honours the window only under flash-attention. Matching eager/sdpa means full
    causal attention; clips longer than sliding_window / 25 Hz (10 s for the released model) would encode
    differently under a windowed implementation.
    """

    def __init__(self, cfg: CodecEncoderConfig) -> None:
        super().__init__()
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise ValueError("encoder_config: num_attention_heads must be a multiple of num_key_value_heads")
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0 / math.sqrt(self.head_dim))
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class EncoderMLP(nn.Module):
    def __init__(self, cfg: CodecEncoderConfig) -> None:
        super().__init__()
        if cfg.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"encoder_config.hidden_act {cfg.hidden_act!r} unsupported; one of {sorted(_ACTIVATIONS)}")
        self.act = _ACTIVATIONS[cfg.hidden_act]
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class EncoderLayer(nn.Module):
    """Pre-LayerNorm block (LayerNorm with bias, not RMSNorm), each branch scaled by a LayerScale."""

    def __init__(self, cfg: CodecEncoderConfig) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.self_attn = EncoderAttention(cfg)
        self.self_attn_layer_scale = LayerScale(cfg.hidden_size, cfg.layer_scale_initial_scale)
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.mlp = EncoderMLP(cfg)
        self.mlp_layer_scale = LayerScale(cfg.hidden_size, cfg.layer_scale_initial_scale)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), cos, sin))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class EncoderTransformer(nn.Module):
    """[B, T, hidden] -> [B, T, hidden]; positions restart at 0 on every call. No final norm."""

    def __init__(self, cfg: CodecEncoderConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rotary(torch.arange(x.shape[1], device=x.device))
        for layer in self.layers:
            x = layer(x, cos, sin)
        return x
