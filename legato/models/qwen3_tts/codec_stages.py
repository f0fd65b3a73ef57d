"""The stages of the streaming codec decoder, each holding its weights folded for a time-major GEMM.

Built once from a loaded `CodecDecoder` (the checkpoint's modules stay the source of truth): codebooks are
divided by their usage, the codebook projections are folded into the first conv, RMSNorm and LayerNorm
weights into the GEMM that follows them, layer scales into the GEMM before them, and every conv weight is
laid out as `[taps * Cin, phases * Cout]` (see `legato/layers/causal_conv.py`). Folds are computed in float64
and stored in the decoder's dtype; SnakeBeta's exponentials are precomputed in fp32 and stay fp32.

Each stage is called with a time-major activation `[B, L, C]` and a `StepContext` (the call's slots, its
frame count, the slot bank, and whether to run the Triton kernels or their PyTorch twins).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from legato.layers import small_matmul
from legato.layers.causal_conv import (
    codebook_stage,
    conv_gemm,
    depthwise_layernorm,
    fused_unit_fits,
    residual_unit,
    restage,
    restage_group,
    stage,
)
from legato.layers.rows import rms_normalize, silu_mul_packed
from legato.layers.window_attention import window_attention

from .codec_slots import CodecSlots

# A conv's input staged by the conv before it: (P [B, H + L, Cin], its input SnakeBeta or None).
Staged = tuple[torch.Tensor, "tuple[torch.Tensor, torch.Tensor] | None"]

# Each conv of the vocoder stages its output for the next staged conv in its epilogue (`Conv.new_input`), instead
# of a staging kernel reading the activation back (off: every staged conv runs `stage`; codec_step.py compares).
FEED_NEXT = True

# A narrow residual unit as one kernel on the GPU (layers/conv_kernels.py). Off: on the H200 it measured no
# faster than its two kernels at one frame per call and slower at 256 x 4 (docs/benchmarks.md). Its kernel
# cannot feed the next conv, so it runs only where FEED_NEXT is off.
FUSE_UNITS = False

# The next three, each switched off in turn by `codec_step.py --variants new-group,new-tr,...` (docs/benchmarks.md,
# session of 2026-12-05 (5)): together 134 -> 102 kernels and 1.06x at 64 streams x 1 frame on an H100.

# A vocoder block's staged inputs (its three residual units' and the next conv's) get their history rows in one
# launch at the block's start and write their next histories in one at its end (`restage_group`), instead of a
# `restage` launch before each conv (17 launches -> 8). Off: a launch per conv.
GROUP_RESTAGE = True

# A block's last residual unit writes its output only into the next conv's staged input: the block's output
# itself is never read again (the next conv reads it through that input). Off: it writes both.
SKIP_DEAD_OUTPUT = True

# The transformer's layers in four kernels of the few-row GEMM (`small_matmul`) instead of eight: the RMSNorm
# inside the q/k/v and gate/up products, SiLU inside gate/up, the residual adds inside o and down (up to 256 rows;
# more go to cuBLAS). Off: cuBLAS, with the norms and the SiLU as kernels of their own.
FUSED_TRANSFORMER = True


@dataclass
class StepContext:
    slots: torch.Tensor  # [B] int64, the bank slot of each row
    frames: int
    bank: CodecSlots
    kernels: bool  # Triton kernels (CUDA, reduced precision) or the PyTorch twins
    # Staged inputs (by id) whose history rows a `restage_group` launch fills and whose next history it writes:
    # the conv reading one adds nothing.
    grouped: set[int] = field(default_factory=set)

    @property
    def rows(self) -> int:
        return self.slots.shape[0]


def _store(t: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    return t.detach().to(device=device, dtype=dtype).contiguous()


def snake_params(module, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(e^α, 1 / (e^β + 1e-9)) of a SnakeBeta, fp32."""
    alpha, beta = module.alpha.detach().double(), module.beta.detach().double()
    return (alpha.exp().float().to(device), (1.0 / (beta.exp() + 1e-9)).float().to(device))


def conv_weight(w: torch.Tensor) -> torch.Tensor:
    """Conv1d weight [Cout, Cin, taps] -> [taps * Cin, Cout]."""
    cout, cin, taps = w.shape
    return w.detach().double().permute(2, 1, 0).reshape(taps * cin, cout)


class Conv:
    """A causal conv (dense, stride 1) with its history, an optional SnakeBeta on its input and an epilogue."""

    def __init__(self, name: str, weight: torch.Tensor, bias: torch.Tensor | None, taps: int, dil: int, rate: int,
                 dtype: torch.dtype, device, snake_in=None, epilogue: str = "none", epi=None, phases: int = 1) -> None:
        self.name, self.taps, self.dil, self.rate, self.phases = name, taps, dil, rate, phases
        self.history = (taps - 1) * dil
        self.cin = weight.shape[0] // taps
        self.cout = weight.shape[1] // phases
        self.weight = _store(weight, dtype, device)
        self.bias = _store(bias, dtype, device) if bias is not None else None
        self.snake_in, self.epilogue, self.epi = snake_in, epilogue, epi
        self.staged = bool(self.history) or snake_in is not None  # its input goes through `stage` (and a bank entry)

    def __call__(self, x: torch.Tensor, ctx: StepContext, out: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None, pre: Staged | None = None,
                 feed: Staged | None = None, keep_out: bool = True) -> torch.Tensor:
        """x [B, L, Cin] -> [B * L * phases, Cout]. `pre`: x's rows already staged into this conv's input by the
        conv before (`feed` there); `feed`: the next conv's input, which the epilogue also writes (and, with
        `keep_out` False, writes alone)."""
        return conv_gemm(self.staged_input(x, ctx, pre), self.weight, self.bias, x.shape[1], self.taps, self.dil,
                         self.phases, self.epilogue, self.epi, out=out, out_dtype=out_dtype, kernel=ctx.kernels,
                         staged=feed, keep_out=keep_out)

    def staged_input(self, x: torch.Tensor, ctx: StepContext, pre: Staged | None = None) -> torch.Tensor:
        """P: the history rows then x's (through the input SnakeBeta), or x itself for a 1x1 conv without one.
        With `pre`, x's rows are in it already and only the history is added."""
        if not self.staged:
            return x
        bank = ctx.bank
        if pre is not None and id(pre[0]) in ctx.grouped:
            return pre[0]
        if pre is not None:
            return restage(pre[0], bank.hist[self.name], bank.calls, bank.position, ctx.slots, self.rate,
                           kernel=ctx.kernels)
        return stage(x, bank.hist[self.name], bank.calls, bank.position, ctx.slots, self.rate, self.snake_in,
                     kernel=ctx.kernels)

    def new_input(self, streams: int, length: int, ctx: StepContext) -> Staged | None:
        """An empty input P [B, H + length, Cin] for the conv before this one to write into (its `feed`), with
        this conv's input SnakeBeta; None for a conv that reads its input as it is."""
        if not self.staged or not FEED_NEXT:
            return None
        hist = ctx.bank.hist[self.name]
        return torch.empty(streams, self.history + length, self.cin, dtype=hist.dtype, device=hist.device), \
            self.snake_in


def transposed_conv(name: str, module, rate: int, dtype, device, snake_in=None) -> Conv:
    """A causal transposed conv of kernel `k` and stride `r` (k = r: no overlap; k = 2r: two taps of the
    previous and the current input step) as a conv over the input with `r` phases."""
    w = module.conv.weight.detach().double()  # [Cin, Cout, k]
    cin, cout, k = w.shape
    r = module.conv.stride[0]
    by_phase = lambda taps: taps.permute(0, 2, 1).reshape(cin, r * cout)  # noqa: E731 - [Cin, Cout, r] -> [Cin, r*Cout]
    if k == r:
        weight, taps = by_phase(w), 1
    elif k == 2 * r:
        # Output step s*r + j takes input s-1 through tap r + j and input s through tap j.
        weight, taps = torch.cat([by_phase(w[:, :, r:]), by_phase(w[:, :, :r])]), 2
    else:
        raise ValueError(f"codec decoder: transposed conv of kernel {k} and stride {r} is not supported")
    bias = module.conv.bias.detach().double().repeat(r) if module.conv.bias is not None else None
    return Conv(name, weight, bias, taps, 1, rate, dtype, device, snake_in=snake_in, phases=r)


class ResidualUnit:
    """x += conv1x1(snake(conv7(snake(x)))), the second snake in the first conv's epilogue; the first staged
    by the conv before (`pre`) where it can be."""

    def __init__(self, name: str, module, rate: int, dtype, device) -> None:
        c7, c1 = module.conv1, module.conv2
        self.conv7 = Conv(name + ".conv1", conv_weight(c7.conv.weight), c7.conv.bias, c7.conv.kernel_size[0],
                          c7.conv.dilation[0], rate, dtype, device, snake_in=snake_params(module.act1, device),
                          epilogue="snake", epi=snake_params(module.act2, device))
        self.conv1 = Conv(name + ".conv2", conv_weight(c1.conv.weight), c1.conv.bias, 1, 1, rate, dtype, device,
                          epilogue="residual")

        zeros = lambda conv: torch.zeros(conv.cout, dtype=conv.weight.dtype, device=device)  # noqa: E731
        self.bias7 = self.conv7.bias if self.conv7.bias is not None else zeros(self.conv7)
        self.bias1 = self.conv1.bias if self.conv1.bias is not None else zeros(self.conv1)

    def __call__(self, x: torch.Tensor, ctx: StepContext, pre: Staged | None = None,
                 feed: Staged | None = None, keep_out: bool = True) -> torch.Tensor:
        """x += the unit's output, in place (and into `feed`; only there with `keep_out` False)."""
        b, length, c = x.shape
        p = self.conv7.staged_input(x, ctx, pre)
        if FUSE_UNITS and feed is None and fused_unit_fits(p, ctx.kernels):
            c7 = self.conv7
            residual_unit(p, c7.weight, self.bias7, length, c7.taps, c7.dil, c7.epi, self.conv1.weight, self.bias1,
                          x.view(b * length, c), kernel=True)
            return x
        h = conv_gemm(p, self.conv7.weight, self.conv7.bias, length, self.conv7.taps, self.conv7.dil, 1, "snake",
                      self.conv7.epi, kernel=ctx.kernels)
        self.conv1(h.view(1, b * length, c), ctx, out=x.view(b * length, c), feed=feed, keep_out=keep_out)
        return x


class VocoderBlock:
    """SnakeBeta -> transposed conv (x rate) -> three residual units. Each conv that produces the activation
    also stages it for the next staged conv (`feed`), so no activation is read back only to be staged."""

    def __init__(self, name: str, module, rate: int, dtype, device) -> None:
        snake, up, *units = module.block
        self.up = transposed_conv(name + ".up", up, rate, dtype, device, snake_in=snake_params(snake, device))
        self.factor = up.conv.stride[0]
        out_rate = rate * self.factor
        self.units = [ResidualUnit(f"{name}.unit{i}", u, out_rate, dtype, device) for i, u in enumerate(units)]

    def __call__(self, x: torch.Tensor, ctx: StepContext, pre: Staged | None = None,
                 then: Conv | None = None) -> tuple[torch.Tensor, Staged | None]:
        """x [B, L, C] -> [B, L * factor, C']; `pre`: x staged for `up` already; `then`: the conv after the block,
        whose staged input is returned beside the output (with `SKIP_DEAD_OUTPUT`, on the kernel path, the output's
        last residual add went there only: read the staged input, not the output's values)."""
        b, length, _ = x.shape
        length *= self.factor
        feeds = [unit.conv7.new_input(b, length, ctx) for unit in self.units]
        feeds.append(then.new_input(b, length, ctx) if then is not None else None)
        group = self.group(feeds, [*(unit.conv7 for unit in self.units), then], ctx)
        if group:
            restage_group(*group, copy_in=True, copy_out=False, kernel=ctx.kernels)
        x = self.up(x, ctx, pre=pre, feed=feeds[0]).view(b, length, self.up.cout)
        last = len(self.units) - 1
        for i, unit in enumerate(self.units):
            # The last unit's output reaches the next conv only through its staged input (`then`'s `pre`).
            keep = not (SKIP_DEAD_OUTPUT and i == last and feeds[i + 1] is not None)
            x = unit(x, ctx, pre=feeds[i], feed=feeds[i + 1], keep_out=keep)
        if group:
            restage_group(*group, copy_in=False, copy_out=True, kernel=ctx.kernels)
        return x, feeds[-1]

    def group(self, feeds: list[Staged | None], convs: list[Conv | None], ctx: StepContext) -> tuple | None:
        """`restage_group`'s leading arguments for the staged inputs this block feeds (marked in `ctx.grouped`),
        or None where each conv restages its own (`GROUP_RESTAGE` off, or no kernels: the twins keep one path)."""
        pairs = [(f[0], c) for f, c in zip(feeds, convs, strict=True) if f is not None and c.history]
        if not (GROUP_RESTAGE and ctx.kernels and pairs):
            return None
        bank = ctx.bank
        ctx.grouped.update(id(p) for p, _ in pairs)
        return ([p for p, _ in pairs], [bank.hist[c.name] for _, c in pairs], bank.calls, bank.position, ctx.slots,
                pairs[0][1].rate)


class UpsampleStage:
    """Transposed conv (kernel = stride) -> ConvNeXt block (causal depthwise conv, LayerNorm, 4x GELU MLP)."""

    def __init__(self, name: str, module, rate: int, dtype, device) -> None:
        up, block = module
        self.factor = up.conv.stride[0]
        self.up = transposed_conv(name + ".up", up, rate, dtype, device)
        out_rate = rate * self.factor
        dw = block.dwconv.conv
        self.dw_name = name + ".dwconv"
        self.dw_rate = out_rate
        self.dw_history = dw.kernel_size[0] - 1
        self.dw_weight = _store(dw.weight[:, 0, :], dtype, device)
        self.dw_bias = _store(dw.bias, dtype, device)
        self.eps = block.norm.eps
        gamma_ln, beta_ln = block.norm.weight.detach().double(), block.norm.bias.detach().double()
        w1, b1 = block.pwconv1.weight.detach().double(), block.pwconv1.bias.detach().double()
        w2, b2 = block.pwconv2.weight.detach().double(), block.pwconv2.bias.detach().double()
        gamma = block.gamma.detach().double()
        self.pw1 = Conv(name + ".pw1", (w1 * gamma_ln).t(), b1 + w1 @ beta_ln, 1, 1, out_rate, dtype, device,
                        epilogue="gelu")
        self.pw2 = Conv(name + ".pw2", (gamma[:, None] * w2).t(), gamma * b2, 1, 1, out_rate, dtype, device,
                        epilogue="residual")

    def __call__(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        b, length, c = x.shape
        x = self.up(x, ctx).view(b, length * self.factor, c)
        length *= self.factor
        bank = ctx.bank
        p = stage(x, bank.hist[self.dw_name], bank.calls, bank.position, ctx.slots, self.dw_rate, kernel=ctx.kernels)
        h = depthwise_layernorm(p, self.dw_weight, self.dw_bias, length, self.eps, kernel=ctx.kernels)
        h = self.pw1(h.view(1, b * length, c), ctx)
        self.pw2(h.view(1, b * length, -1), ctx, out=x.view(b * length, c))
        return x


class Transformer:
    """The sliding-window transformer at one sample per frame: in-projection, layers, norm, out-projection."""

    def __init__(self, module, ring: int, dtype, device) -> None:
        f = lambda t: t.detach().double()  # noqa: E731
        self.w_in, self.b_in = _store(module.input_proj.weight, dtype, device), _store(module.input_proj.bias, dtype,
                                                                                       device)
        self.window = module.window
        attn0 = module.layers[0].self_attn
        self.heads, self.kv_heads, self.head_dim = attn0.num_heads, attn0.num_kv_heads, attn0.head_dim
        self.ring = ring
        self.inv_freq = module.rotary.inv_freq.detach().float().to(device)
        self.eps = module.layers[0].input_layernorm.eps
        self.layers = []
        for layer in module.layers:
            a, mlp = layer.self_attn, layer.mlp
            if a.o_proj.bias is not None or mlp.gate_proj.bias is not None:
                raise ValueError("codec decoder: attention or MLP biases are not supported")
            n1, n2 = f(layer.input_layernorm.weight), f(layer.post_attention_layernorm.weight)
            qkv = torch.cat([f(a.q_proj.weight), f(a.k_proj.weight), f(a.v_proj.weight)]) * n1
            qkv_bias = (torch.cat([f(a.q_proj.bias), f(a.k_proj.bias), f(a.v_proj.bias)])
                        if a.q_proj.bias is not None else None)
            ls1, ls2 = f(layer.self_attn_layer_scale.scale), f(layer.mlp_layer_scale.scale)
            gate_up = torch.cat([f(mlp.gate_proj.weight), f(mlp.up_proj.weight)]) * n2
            self.layers.append(dict(
                qkv=_store(qkv, dtype, device),
                qkv_bias=_store(qkv_bias, dtype, device) if qkv_bias is not None else None,
                o=_store(ls1[:, None] * f(a.o_proj.weight), dtype, device),
                gate_up=_store(gate_up, dtype, device),
                down=_store(ls2[:, None] * f(mlp.down_proj.weight), dtype, device),
            ))
        self.w_out = _store(f(module.output_proj.weight) * f(module.norm.weight), dtype, device)
        self.b_out = _store(module.output_proj.bias, dtype, device)

    def fused(self, h: torch.Tensor, ctx: StepContext) -> bool:
        """Whether this call's layers run as the few-row GEMM's fused forms (`FUSED_TRANSFORMER`)."""
        return (FUSED_TRANSFORMER and ctx.kernels and self.layers[0]["qkv_bias"] is None
                and 0 < h.shape[0] <= small_matmul.MAX_ROWS)

    def __call__(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """x [N, latent] (N = B * frames) -> [N, latent]."""
        bank, k = ctx.bank, ctx.kernels
        h = torch.addmm(self.b_in, x, self.w_in.t())
        if self.fused(h, ctx):
            mm = small_matmul.matmul
            for i, w in enumerate(self.layers):
                qkv = mm(h, w["qkv"], norm_eps=self.eps)
                a = window_attention(qkv, bank.keys[i], bank.values[i], bank.position, ctx.slots, ctx.frames,
                                     self.heads, self.window, self.inv_freq, kernel=k)
                mm(a, w["o"], add_to=h)
                mm(mm(h, w["gate_up"], gated=True, norm_eps=self.eps), w["down"], add_to=h)
            return torch.addmm(self.b_out, rms_normalize(h, self.eps, kernel=k), self.w_out.t())
        for i, w in enumerate(self.layers):
            n = rms_normalize(h, self.eps, kernel=k)
            qkv = n @ w["qkv"].t() if w["qkv_bias"] is None else torch.addmm(w["qkv_bias"], n, w["qkv"].t())
            a = window_attention(qkv, bank.keys[i], bank.values[i], bank.position, ctx.slots, ctx.frames,
                                 self.heads, self.window, self.inv_freq, kernel=k)
            h.addmm_(a, w["o"].t())
            n = rms_normalize(h, self.eps, kernel=k)
            h.addmm_(silu_mul_packed(n @ w["gate_up"].t(), kernel=k), w["down"].t())
        return torch.addmm(self.b_out, rms_normalize(h, self.eps, kernel=k), self.w_out.t())


class Quantizer:
    """Codes -> the first conv's input: two codebook groups summed, [B, H + T, 2D] with the conv's history."""

    def __init__(self, module, dtype, device) -> None:
        tables = []
        for group in (module.rvq_first, module.rvq_rest):
            for slot in group.vq.layers:
                cb = slot._codebook
                tables.append(cb.embedding_sum.detach().double()
                              / cb.cluster_usage.detach().double().clamp(min=1e-5)[:, None])
        self.tables = _store(torch.stack(tables), dtype, device)
        self.first = module.first
        # The groups' 1x1 output projections, side by side: the first conv's input is proj @ [head; rest].
        self.proj = torch.cat([module.rvq_first.output_proj.weight[:, :, 0].detach().double(),
                               module.rvq_rest.output_proj.weight[:, :, 0].detach().double()], dim=1)

    def __call__(self, codes: torch.Tensor, ctx: StepContext, name: str) -> torch.Tensor:
        bank = ctx.bank
        return codebook_stage(codes, self.tables, self.first, bank.hist[name], bank.calls, bank.position, ctx.slots,
                              kernel=ctx.kernels)
