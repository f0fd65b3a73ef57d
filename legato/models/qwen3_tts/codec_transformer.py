"""The codec decoder's sliding-window transformer (`pre_transformer`), whole-utterance or streaming.

Each query frame attends to itself and the `window - 1` frames before it, with RoPE on absolute frame
positions. Streaming keeps, per layer, the RoPE'd keys and values of the last `window - 1` frames and the
request's frame position, so a chunk sees exactly the keys the whole-utterance forward would show it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from legato.layers.mlp import SwiGLU
from legato.layers.norm import RMSNorm
from legato.layers.rotary import RotaryEmbedding, apply_rotary

from .codec_modules import StreamingLayer
from .codec_streaming import StreamContext
from .config import CodecDecoderConfig


class LayerScale(nn.Module):
    def __init__(self, dim: int, init: float) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), init))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class WindowAttention(StreamingLayer):
    def __init__(self, cfg: CodecDecoderConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.memory = cfg.sliding_window - 1  # past frames a query can see
        hidden, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)

    def stream_buffers(self) -> dict[str, tuple[int, ...]]:
        shape = (self.num_kv_heads, self.memory, self.head_dim)
        return {"k": shape, "v": shape}

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
        stream: StreamContext | None,
    ) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rope
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        if stream is not None:
            k = torch.cat([stream.take(self.state_key + ".k"), k], dim=2)
            v = torch.cat([stream.take(self.state_key + ".v"), v], dim=2)
            stream.keep(self.state_key + ".k", k, self.memory, dim=2)
            stream.keep(self.state_key + ".v", v, self.memory, dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


class TransformerLayer(nn.Module):
    def __init__(self, cfg: CodecDecoderConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = WindowAttention(cfg)
        self.self_attn_layer_scale = LayerScale(cfg.hidden_size, cfg.layer_scale_initial_scale)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.mlp_layer_scale = LayerScale(cfg.hidden_size, cfg.layer_scale_initial_scale)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
        stream: StreamContext | None,
    ) -> torch.Tensor:
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), rope, mask, stream))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class CodecTransformer(nn.Module):
    """[B, T, latent_dim] -> [B, T, latent_dim]: in-projection, window-attention layers, norm, out-projection."""

    def __init__(self, cfg: CodecDecoderConfig) -> None:
        super().__init__()
        if cfg.hidden_act != "silu":
            raise ValueError(f"codec decoder: only hidden_act='silu' is supported, got {cfg.hidden_act!r}")
        self.window = cfg.sliding_window
        self.input_proj = nn.Linear(cfg.latent_dim, cfg.hidden_size)
        self.layers = nn.ModuleList(TransformerLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.output_proj = nn.Linear(cfg.hidden_size, cfg.latent_dim)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)

    def forward(self, x: torch.Tensor, stream: StreamContext | None = None) -> torch.Tensor:
        n = x.shape[1]
        steps = torch.arange(n, device=x.device)
        if stream is None:
            q_pos = steps[None]
            k_pos = q_pos
        else:
            start = stream.state.position.to(x.device)[:, None]
            q_pos = start + steps
            # The kept keys are the frames just before this chunk (negative positions: not there yet).
            k_pos = start + torch.arange(-self.layers[0].self_attn.memory, n, device=x.device)
        cos, sin = self.rotary(q_pos)
        rope = (cos[:, None], sin[:, None])
        gap = q_pos[:, :, None] - k_pos[:, None, :]
        mask = ((gap >= 0) & (gap < self.window) & (k_pos[:, None, :] >= 0))[:, None]
        h = self.input_proj(x)
        for layer in self.layers:
            h = layer(h, rope, mask, stream)
        return self.output_proj(self.norm(h))
