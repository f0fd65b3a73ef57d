"""The Qwen3 decoder block shared by the talker and the code predictor, and the KV-cache contract.

The block is pre-norm: RMSNorm -> attention (q/k RMSNorm over head_dim before RoPE, GQA, no biases)
-> residual; RMSNorm -> SwiGLU -> residual. Parameter names follow the HF Qwen3 layout
(`self_attn.{q,k,v,o}_proj`, `self_attn.{q,k}_norm`, `mlp.*`, `input_layernorm`,
`post_attention_layernorm`) so one checkpoint loads into both implementations.

Attention itself (cache write + softmax over the cached keys) is delegated to a `KVCache` object passed
into `forward`. The layers never see how keys are stored, so the serving engine can swap the contiguous
per-request cache below for a paged cache and capture decode steps in CUDA graphs without touching the
model code.
"""

from __future__ import annotations

import abc

import torch
import torch.nn.functional as F
from torch import nn

from legato.layers import fused_attention
from legato.layers.fused import add_rms_norm, cuda_compiled, rms_norm_rope
from legato.layers.matmuls import linear, linear_add_rms_norm
from legato.layers.mlp import SwiGLU
from legato.layers.norm import RMSNorm

# A layer's MLP down projection not yet run: its input [B, S, intermediate], its weight [hidden, intermediate], and
# whether the layer is packed for serving (`project_add_norm`).
Pending = tuple[torch.Tensor, torch.Tensor, bool]


class KVCache(abc.ABC):
    """Where a model's keys and values live, and how a layer attends over them.

    Tensors use the flash-attention layout: q [B, S, heads, head_dim], k/v [B, S, kv_heads, head_dim],
    already normalised and rotated. `attend` stores k/v for the S new tokens of every row and returns
    the causal attention output [B, S, heads, head_dim]; the new tokens see all earlier cached tokens
    of their row and the new tokens before them.
    """

    @abc.abstractmethod
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...

    def attend_fused(self, layer: int, qkv: torch.Tensor, attn: Attention, cos: torch.Tensor,
                     sin: torch.Tensor) -> torch.Tensor | None:
        """The whole attention block from the packed projection qkv [B, S, (H + 2 Hkv) * D] in one kernel per
        new token (`layers/fused_attention.py`) -> [B, S, H * D], or None where this cache cannot (then the
        layer runs the unfused path). cos/sin [B, S, D]."""
        return None


class ContiguousKVCache(KVCache):
    """A fixed-capacity cache where every row holds the same number of tokens (batch-1 requests, or a
    batch of code-predictor frames that all advance in lock-step).

    Storage is [layers, B, kv_heads, capacity, head_dim]. Layers write at `length`; the caller moves
    `length` on with `advance(S)` once the whole forward pass over S tokens is done.
    """

    def __init__(
        self,
        num_layers: int,
        batch: int,
        kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        shape = (num_layers, batch, kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    def advance(self, n: int) -> None:
        self.length += n

    def reset(self) -> None:
        self.length = 0

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        new = q.shape[1]
        start, end = self.length, self.length + new
        if end > self.capacity:
            raise RuntimeError(f"KV cache full: {end} tokens needed, capacity {self.capacity}")
        self.k[layer, :, :, start:end] = k.transpose(1, 2)
        self.v[layer, :, :, start:end] = v.transpose(1, 2)
        keys = self.k[layer, :, :, :end]
        values = self.v[layer, :, :, :end]
        return causal_attention(q.transpose(1, 2), keys, values, start).transpose(1, 2)

    def attend_fused(self, layer: int, qkv: torch.Tensor, attn: Attention, cos: torch.Tensor,
                     sin: torch.Tensor) -> torch.Tensor | None:
        # The S new tokens one launch each: token i attends over everything before it and itself, which is
        # the causal attention of the S tokens together.
        b, s, _ = qkv.shape
        out = torch.empty(b, s, attn.heads * attn.head_dim, dtype=qkv.dtype, device=qkv.device)
        for i in range(s):
            fused_attention.fused_decode_attention(
                qkv[:, i], attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps, cos[:, i], sin[:, i],
                self.k[layer], self.v[layer], attn.heads, position=self.length + i, out=out[:, i])
        return out


@cuda_compiled
def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int) -> torch.Tensor:
    """Plain (eager) GQA attention: q [B, H, S, D] over k/v [B, Hkv, T, D], where query i sits at absolute
    position offset + i and sees keys 0..offset + i. Softmax runs in fp32, as in the reference model."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * q.shape[-1] ** -0.5
    new, total = q.shape[2], k.shape[2]
    if new > 1:
        query_pos = torch.arange(offset, offset + new, device=q.device)[:, None]
        key_pos = torch.arange(total, device=q.device)[None, :]
        scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)
        self.qkv_weight: torch.Tensor | None = None

    def pack(self) -> None:
        """Serve q, k and v from one matmul (call after loading and placing the weights; idempotent)."""
        if self.qkv_weight is not None:
            return
        self.qkv_weight = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]).detach()

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, layer: int
    ) -> torch.Tensor:
        """x [B, S, hidden]; cos/sin [B, S, head_dim] (fp32) -> [B, S, hidden]."""
        out = self.heads_out(x, cos, sin, cache, layer)
        return linear(out, self.o_proj.weight) if self.qkv_weight is not None else self.o_proj(out)

    def heads_out(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, layer: int
    ) -> torch.Tensor:
        """The attention before o_proj: the heads' outputs side by side, [B, S, heads * head_dim] (the layer
        runs o_proj together with the residual add and the norm after it)."""
        b, s, _ = x.shape
        if self.qkv_weight is not None and fused_attention.available(x):
            out = cache.attend_fused(layer, linear(x, self.qkv_weight), self, cos, sin)
            if out is not None:
                return out
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # broadcast over heads
        if self.qkv_weight is not None:
            kv_width = self.kv_heads * self.head_dim
            q, k, v = F.linear(x, self.qkv_weight).split([self.heads * self.head_dim, kv_width, kv_width], -1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = rms_norm_rope(q.view(b, s, self.heads, self.head_dim), self.q_norm.weight, self.q_norm.eps, cos, sin)
        k = rms_norm_rope(k.view(b, s, self.kv_heads, self.head_dim), self.k_norm.weight, self.k_norm.eps, cos, sin)
        v = v.reshape(b, s, self.kv_heads, self.head_dim)
        return cache.attend(layer, q, k, v).reshape(b, s, self.heads * self.head_dim)


class DecoderLayer(nn.Module):
    def __init__(
        self, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, eps: float
    ) -> None:
        super().__init__()
        self.self_attn = Attention(hidden, heads, kv_heads, head_dim, eps)
        self.mlp = SwiGLU(hidden, intermediate)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, layer: int
    ) -> torch.Tensor:
        x, (down_in, down, serving) = self.residual_step(x, None, cos, sin, cache, layer)
        return x + (linear(down_in, down) if serving else F.linear(down_in, down))

    def residual_step(
        self, x: torch.Tensor, pending: Pending | None, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
        layer: int, normed: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Pending]:
        """The layer with both residual adds moved into the norm after them: `pending` is the previous layer's
        MLP down projection (`Pending`), not yet run nor added to `x` (None for the first layer).
        Returns (x, this layer's down projection), so the caller runs it inside the next norm. Eagerly this is
        the same arithmetic in the same order; on CUDA each projection back into the residual shares a kernel
        with the add and the norm where its K is split (`matmuls.linear_add_rms_norm`), else each add does.
        `normed`: the first layer's input norm of `x`, where the caller computed it with `x` (`lookup_norm`)."""
        attn, norm = self.self_attn, self.input_layernorm
        if pending is None:
            h = normed if normed is not None else norm(x)
        else:
            x, h = project_add_norm(*pending, x, norm)
        x, h = project_add_norm(attn.heads_out(h, cos, sin, cache, layer), attn.o_proj.weight,
                                attn.qkv_weight is not None, x, self.post_attention_layernorm)
        return x, (self.mlp.down_input(h), self.mlp.down_proj.weight, self.mlp.gate_up_weight is not None)


def build_layers(cfg) -> nn.ModuleList:
    """The decoder layers of a talker or code-predictor config (both carry the same field names)."""
    if cfg.hidden_act != "silu":
        raise ValueError(f"only silu (SwiGLU) MLPs are supported, config says {cfg.hidden_act!r}")
    return nn.ModuleList(
        DecoderLayer(
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            cfg.intermediate_size,
            cfg.rms_norm_eps,
        )
        for _ in range(cfg.num_hidden_layers)
    )


def run_layers(
    layers: nn.ModuleList, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, final_norm: RMSNorm,
    normed: torch.Tensor | None = None,
) -> torch.Tensor:
    """The decoder layers, then `final_norm` -> normed hidden states; each residual add rides in a norm. `normed`:
    the first layer's input norm of x, computed already."""
    pending = None
    for i, layer in enumerate(layers):
        x, pending = layer.residual_step(x, pending, cos, sin, cache, i, normed if i == 0 else None)
    return project_add_norm(*pending, x, final_norm)[1]


def project_add_norm(a: torch.Tensor, weight: torch.Tensor, serving: bool, x: torch.Tensor,
                     norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """x + a @ weight^T and its norm: with the serving kernels where the layer's weights are packed for serving
    (`matmuls.linear_add_rms_norm`), else with `F.linear`, the checkpoint layout's arithmetic."""
    if serving:
        return linear_add_rms_norm(a, weight, x, norm.weight, norm.eps)
    return add_rms_norm(x, F.linear(a, weight), norm.weight, norm.eps)


def pack_projections(module: nn.Module) -> None:
    """Packs q/k/v and gate/up matmuls of every decoder layer under `module` (a serving-time layout on the
    GPU, where fewer, wider matmuls mean fewer kernel launches per frame)."""
    for sub in module.modules():
        if isinstance(sub, (Attention, SwiGLU)):
            sub.pack()


def packed_bytes(module: nn.Module) -> int:
    """Bytes held by the packed projection copies under `module`."""
    total = 0
    for sub in module.modules():
        for name in ("qkv_weight", "gate_up_weight"):
            t = getattr(sub, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
        stacked = getattr(sub, "stack", None)  # the stacked launch's own copies (its q/k/v and gate/up are views)
        tables = getattr(sub, "projected_tables", None) or []  # and its inputs' tables, where projected
        for t in (getattr(stacked, "o", None), getattr(stacked, "down", None), *tables):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total
