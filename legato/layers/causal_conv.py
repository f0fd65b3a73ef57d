"""Causal convolutions over time-major activations, as one implicit GEMM each, with per-slot history in place.

Layout. An activation is `[B, L, C]`: B streams, L time steps of this call, channels contiguous, so a conv over
it is a matrix product whose rows are (stream, time) and whose K dimension runs over (tap, input channel).

History. A causal conv of `taps` taps at dilation `dil` needs the `H = (taps - 1) * dil` samples before the
call. They live in a bank `hist [S, 2, H, C]` indexed by slot: two copies, `calls[slot] & 1` says which one
holds the current history and the call writes the next one into the other, so a call never overwrites what
one of its own programs still reads (and nothing is gathered or scattered per call). Samples before the
stream's start (index `position * rate - H + r < 0`) read as zero, which is the zero padding of the
whole-utterance forward; so a slot is reset by setting its position to 0, whatever its buffers hold.

`stage` builds the conv's input `P [B, H + L, C]` (history rows, then the call's rows, optionally through
SnakeBeta) and writes the new history; `conv_gemm` is the conv over `P` with its epilogue (bias, then
SnakeBeta, GELU, a residual add into the output, or a clamp). A transposed conv of kernel `2r` and stride
`r` is the same GEMM with two taps and `r` phases: output time `s * r + j` is phase j of input step s.

Every function has a Triton kernel (CUDA, bf16 or fp32 storage, fp32 math) and a plain PyTorch twin
(the CPU path, the exact fp32 path on CUDA, and the oracle of the kernel tests).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from legato.layers.conv_tiles import conv_blocks, pow2_at_least

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU build of torch ships no Triton
    triton = None

EPILOGUES = ("none", "snake", "gelu", "residual", "clamp")
# The interpreter (TRITON_INTERPRET=1, the CPU tests of the kernels) runs no inline PTX.
_FAST_SIN = os.environ.get("TRITON_INTERPRET") != "1"


def snake_reference(x: torch.Tensor, freq: torch.Tensor, inv_mag: torch.Tensor) -> torch.Tensor:
    """SnakeBeta over the last dim with precomputed `freq = e^α`, `inv_mag = 1 / (e^β + 1e-9)`, in fp32."""
    xf = x.float()
    return xf + inv_mag * torch.sin(xf * freq).pow(2)


def use_triton(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda and x.dtype != torch.float32


# --- stage: history + this call's rows -> P ---------------------------------------------------------------


def stage(x: torch.Tensor, hist: torch.Tensor, calls: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
          rate: int, snake: tuple[torch.Tensor, torch.Tensor] | None = None,
          kernel: bool | None = None) -> torch.Tensor:
    """x [B, L, C] -> P [B, H + L, C] in hist's dtype; writes each slot's next history (the last H rows of P).

    `hist [S, 2, H, C]`, `calls [S]`, `positions [S]` (frames decoded), `slots [B]`; `rate` is samples per
    frame at this layer; `snake` = (freq, inv_mag) applies SnakeBeta to the call's rows (the history is kept
    after it)."""
    b, length, c = x.shape
    h = hist.shape[2]
    out = torch.empty(b, h + length, c, dtype=hist.dtype, device=x.device)
    if kernel if kernel is not None else use_triton(hist):
        _launch_stage(x, hist, calls, positions, slots, rate, snake, out)
        return out
    new = snake_reference(x, *snake) if snake is not None else x
    return _with_history(new, hist, calls, positions, slots, rate, out)


def codebook_stage(codes: torch.Tensor, tables: torch.Tensor, first: int, hist: torch.Tensor, calls: torch.Tensor,
                   positions: torch.Tensor, slots: torch.Tensor, kernel: bool | None = None) -> torch.Tensor:
    """codes [B, T, Q] -> P [B, H + T, 2D]: the sum of codebooks [0, first) in channels [0, D) and of the rest in
    [D, 2D), after the history rows (as `stage`, at one sample per frame). `tables [Q, size, D]` are the
    codebooks already divided by their usage."""
    b, t, q = codes.shape
    d = tables.shape[2]
    h = hist.shape[2]
    out = torch.empty(b, h + t, 2 * d, dtype=hist.dtype, device=codes.device)
    if kernel if kernel is not None else use_triton(hist):
        _launch_codebook_stage(codes, tables, first, hist, calls, positions, slots, out)
        return out
    codes = codes.clamp(0, tables.shape[1] - 1)
    head = tables[0][codes[..., 0]]
    for j in range(1, first):
        head = head + tables[j][codes[..., j]]
    rest = tables[first][codes[..., first]]
    for j in range(first + 1, q):
        rest = rest + tables[j][codes[..., j]]
    x = torch.cat([head, rest], dim=-1)
    return _with_history(x, hist, calls, positions, slots, 1, out)


def _with_history(x: torch.Tensor, hist: torch.Tensor, calls: torch.Tensor, positions: torch.Tensor,
                  slots: torch.Tensor, rate: int, out: torch.Tensor) -> torch.Tensor:
    """The history rows (zero before the stream's start) then `x` into `out`; the last H rows become the next
    history. Masked with `where`, never a multiply: a reused slot's old rows may hold anything."""
    h, length = hist.shape[2], x.shape[1]
    par = calls[slots] & 1
    index = (positions[slots] * rate - h)[:, None] + torch.arange(h, device=x.device)
    old = hist[slots, par]
    out[:, :h] = torch.where((index >= 0)[:, :, None], old, torch.zeros((), dtype=old.dtype, device=old.device))
    out[:, h:] = x.to(out.dtype)
    if h:
        hist[slots, 1 - par] = out[:, length:]
    return out


# --- the conv as a GEMM -----------------------------------------------------------------------------------


def conv_gemm(p: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, length: int, taps: int, dil: int,
              phases: int = 1, epilogue: str = "none", epi: tuple[torch.Tensor, torch.Tensor] | None = None,
              out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
              kernel: bool | None = None) -> torch.Tensor:
    """Causal conv over P [B, H + length, Cin] -> [B * length * phases, Cout] (time-major, phase-interleaved).

    `weight [taps * Cin, phases * Cout]`: row (tap, cin), column (phase, cout); tap i reads P row
    `H - (taps - 1 - i) * dil + s` for output step s. `bias [phases * Cout]` (or None). Epilogue: "snake" with
    `epi` = (freq, inv_mag), "gelu" (exact), "residual" (adds into `out`, which must be given), "clamp" to
    [-1, 1]. The result is written to `out` when given, else a new tensor of `out_dtype` (default P's)."""
    if epilogue not in EPILOGUES:
        raise ValueError(f"unknown epilogue {epilogue!r}")
    b, rows, cin = p.shape
    cout = weight.shape[1] // phases
    h = rows - length
    if h < (taps - 1) * dil or weight.shape[0] != taps * cin:
        raise ValueError(f"conv_gemm: P {tuple(p.shape)}, weight {tuple(weight.shape)} do not fit {taps} taps at "
                         f"dilation {dil} over {length} steps")
    if out is None:
        if epilogue == "residual":
            raise ValueError("a residual epilogue adds into `out`")
        out = torch.empty(b * length * phases, cout, dtype=out_dtype or p.dtype, device=p.device)
    if kernel if kernel is not None else use_triton(p):
        _launch_conv(p, weight, bias, length, taps, dil, phases, epilogue, epi, out)
        return out
    off0 = h - (taps - 1) * dil
    cols = torch.cat([p[:, off0 + i * dil: off0 + i * dil + length] for i in range(taps)], dim=-1)
    y = cols.reshape(b * length, taps * cin) @ weight
    if bias is not None:
        y = y + bias
    y = y.reshape(b * length * phases, cout)
    if epilogue == "snake":
        y = snake_reference(y, *epi)
    elif epilogue == "gelu":
        y = F.gelu(y.float())
    elif epilogue == "clamp":
        y = y.float().clamp(-1.0, 1.0)
    if epilogue == "residual":
        out.copy_((out.float() + y.float()).to(out.dtype) if out.dtype != torch.float32 else out + y)
    else:
        out.copy_(y)
    return out


def depthwise_layernorm(p: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, length: int, eps: float,
                        kernel: bool | None = None) -> torch.Tensor:
    """Causal depthwise conv over P [B, H + length, C] (`weight [C, taps]`, taps = H + 1) then LayerNorm without
    affine (fold it into the next GEMM) -> [B * length, C] in P's dtype."""
    b, rows, c = p.shape
    taps = weight.shape[1]
    out = torch.empty(b * length, c, dtype=p.dtype, device=p.device)
    if kernel if kernel is not None else use_triton(p):
        _launch_dwln(p, weight, bias, length, eps, out)
        return out
    off0 = rows - length - (taps - 1)
    y = sum(p[:, off0 + i: off0 + i + length].float() * weight[:, i].float() for i in range(taps)) + bias.float()
    out.copy_(F.layer_norm(y, (c,), eps=eps).reshape(b * length, c))
    return out


# --- Triton kernels ---------------------------------------------------------------------------------------


if triton is not None:

    @triton.jit
    def _snake(x, freq, inv_mag, FAST_SIN: tl.constexpr):
        # The argument is first reduced to [-pi, pi], Cody-Waite style (2 pi as a short exact head and a tail),
        # where the hardware's sin.approx is accurate to ~1e-6 absolute (FAST_SIN, CUDA only); libdevice's sin
        # otherwise (the interpreter).
        arg = x * freq
        k = tl.floor(arg * 0.15915494309189535 + 0.5)
        arg = (arg - k * 6.28125) - k * 0.0019353071795864769
        if FAST_SIN:
            s = tl.inline_asm_elementwise("sin.approx.f32 $0, $1;", "=r,r", [arg], dtype=tl.float32, is_pure=True,
                                          pack=1)
        else:
            s = tl.sin(arg)
        return x + inv_mag * s * s

    @triton.jit
    def _stage_kernel(x_ptr, hist_ptr, calls_ptr, pos_ptr, slots_ptr, freq_ptr, inv_ptr, out_ptr,
                      L, H, C, RATE, SNAKE: tl.constexpr, FAST_SIN: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_C: tl.constexpr):
        b = tl.program_id(0)
        r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
        slot = tl.load(slots_ptr + b)
        par = tl.load(calls_ptr + slot) & 1
        first = tl.load(pos_ptr + slot) * RATE - H
        cmask = c < C
        in_hist = r < H
        rows = H + L
        valid = r < rows
        hbase = hist_ptr + slot * (2 * H * C)
        old = tl.load(hbase + par * (H * C) + r[:, None] * C + c[None, :],
                      mask=(in_hist & ((first + r) >= 0))[:, None] & cmask[None, :], other=0.0)
        xr = r - H
        new = tl.load(x_ptr + (b * L + xr)[:, None].to(tl.int64) * C + c[None, :],
                      mask=((~in_hist) & valid)[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        if SNAKE:
            freq = tl.load(freq_ptr + c, mask=cmask, other=0.0)
            inv = tl.load(inv_ptr + c, mask=cmask, other=0.0)
            new = _snake(new, freq[None, :], inv[None, :], FAST_SIN)
        val = tl.where(in_hist[:, None], old.to(tl.float32), new).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + (b * rows + r)[:, None].to(tl.int64) * C + c[None, :], val,
                 mask=valid[:, None] & cmask[None, :])
        keep = valid & (r >= L)
        tl.store(hbase + (1 - par) * (H * C) + (r - L)[:, None] * C + c[None, :], val,
                 mask=keep[:, None] & cmask[None, :])

    @triton.jit
    def _codebook_kernel(codes_ptr, tables_ptr, hist_ptr, calls_ptr, pos_ptr, slots_ptr, out_ptr,
                         T, H, D, SIZE, Q: tl.constexpr, FIRST: tl.constexpr, BLOCK_R: tl.constexpr,
                         BLOCK_C: tl.constexpr):
        b = tl.program_id(0)
        r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)  # over 2D channels
        C = 2 * D
        slot = tl.load(slots_ptr + b)
        par = tl.load(calls_ptr + slot) & 1
        first = tl.load(pos_ptr + slot) - H
        cmask = c < C
        rows = H + T
        valid = r < rows
        in_hist = r < H
        hbase = hist_ptr + slot * (2 * H * C)
        old = tl.load(hbase + par * (H * C) + r[:, None] * C + c[None, :],
                      mask=(in_hist & ((first + r) >= 0))[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        t = r - H
        live = (~in_hist) & valid
        group_rest = c >= D
        d = tl.where(group_rest, c - D, c)
        acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
        for j in tl.static_range(Q):
            code = tl.load(codes_ptr + (b * T + t) * Q + j, mask=live, other=0)
            code = tl.minimum(tl.maximum(code, 0), SIZE - 1)
            mine = tl.where(group_rest, j >= FIRST, j < FIRST)
            e = tl.load(tables_ptr + (j * SIZE + code)[:, None].to(tl.int64) * D + d[None, :],
                        mask=live[:, None] & (cmask & mine)[None, :], other=0.0)
            acc += e.to(tl.float32)
        val = tl.where(in_hist[:, None], old, acc).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + (b * rows + r)[:, None].to(tl.int64) * C + c[None, :], val,
                 mask=valid[:, None] & cmask[None, :])
        keep = valid & (r >= T)
        tl.store(hbase + (1 - par) * (H * C) + (r - T)[:, None] * C + c[None, :], val,
                 mask=keep[:, None] & cmask[None, :])

    @triton.jit
    def _conv_kernel(p_ptr, w_ptr, b_ptr, out_ptr, f_ptr, i_ptr,
                     M, L, PL, CIN, COUT, PHASES, OFF0, DIL,
                     TAPS: tl.constexpr, HAS_BIAS: tl.constexpr, EPILOGUE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, KT: tl.constexpr,
                     IEEE: tl.constexpr, FAST_SIN: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        phase = tl.program_id(2)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        mmask = rm < M
        nmask = rn < COUT
        prow = (rm // L) * PL + (rm % L) + OFF0  # P row of tap 0
        wcol = phase * COUT + rn
        wstride = PHASES * COUT
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for it in range(0, TAPS * KT):
            tap = it // KT
            kk = (it - tap * KT) * BLOCK_K + rk
            kmask = kk < CIN
            a = tl.load(p_ptr + (prow + tap * DIL)[:, None].to(tl.int64) * CIN + kk[None, :],
                        mask=mmask[:, None] & kmask[None, :], other=0.0)
            w = tl.load(w_ptr + (tap * CIN + kk)[:, None].to(tl.int64) * wstride + wcol[None, :],
                        mask=kmask[:, None] & nmask[None, :], other=0.0)
            if IEEE:
                acc = tl.dot(a, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w, acc)
        if HAS_BIAS:
            acc += tl.load(b_ptr + wcol, mask=nmask, other=0.0).to(tl.float32)[None, :]
        orow = rm * PHASES + phase
        optrs = out_ptr + orow[:, None].to(tl.int64) * COUT + rn[None, :]
        omask = mmask[:, None] & nmask[None, :]
        if EPILOGUE == 1:  # snake
            freq = tl.load(f_ptr + rn, mask=nmask, other=0.0)
            inv = tl.load(i_ptr + rn, mask=nmask, other=0.0)
            acc = _snake(acc, freq[None, :], inv[None, :], FAST_SIN)
        elif EPILOGUE == 2:  # exact GELU
            acc = 0.5 * acc * (1.0 + tl.erf(acc * 0.7071067811865476))
        elif EPILOGUE == 3:  # residual: the output already holds what this adds to
            acc += tl.load(optrs, mask=omask, other=0.0).to(tl.float32)
        elif EPILOGUE == 4:
            acc = tl.minimum(tl.maximum(acc, -1.0), 1.0)
        tl.store(optrs, acc.to(out_ptr.dtype.element_ty), mask=omask)

    @triton.jit
    def _dwln_kernel(p_ptr, w_ptr, b_ptr, out_ptr, L, PL, C, EPS, TAPS: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
        b = tl.program_id(0)
        t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        c = tl.arange(0, BLOCK_C)
        cmask = c < C
        tmask = t < L
        off0 = PL - L - (TAPS - 1)
        acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        for i in tl.static_range(TAPS):
            x = tl.load(p_ptr + (b * PL + off0 + i + t)[:, None].to(tl.int64) * C + c[None, :],
                        mask=tmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
            w = tl.load(w_ptr + c * TAPS + i, mask=cmask, other=0.0).to(tl.float32)
            acc += x * w[None, :]
        acc += tl.load(b_ptr + c, mask=cmask, other=0.0).to(tl.float32)[None, :]
        mean = tl.sum(tl.where(cmask[None, :], acc, 0.0), axis=1) / C
        diff = tl.where(cmask[None, :], acc - mean[:, None], 0.0)
        var = tl.sum(diff * diff, axis=1) / C
        y = diff * tl.rsqrt(var + EPS)[:, None]
        tl.store(out_ptr + (b * L + t)[:, None].to(tl.int64) * C + c[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=tmask[:, None] & cmask[None, :])


def _stage_blocks(rows: int, c: int) -> tuple[int, int]:
    block_c = min(pow2_at_least(c), 128)
    block_r = max(1, min(pow2_at_least(rows, 1), 4096 // block_c))
    return block_r, block_c


def _launch_stage(x, hist, calls, positions, slots, rate, snake, out):
    b, length, c = x.shape
    h = hist.shape[2]
    block_r, block_c = _stage_blocks(h + length, c)
    freq, inv = snake if snake is not None else (out, out)  # never read without SNAKE
    grid = (b, triton.cdiv(h + length, block_r), triton.cdiv(c, block_c))
    _stage_kernel[grid](x.contiguous(), hist, calls, positions, slots, freq, inv, out, length, h, c, rate,
                        SNAKE=snake is not None, FAST_SIN=_FAST_SIN, BLOCK_R=block_r, BLOCK_C=block_c)


def _launch_codebook_stage(codes, tables, first, hist, calls, positions, slots, out):
    b, t, q = codes.shape
    size, d = tables.shape[1], tables.shape[2]
    h = hist.shape[2]
    block_r, block_c = _stage_blocks(h + t, 2 * d)
    grid = (b, triton.cdiv(h + t, block_r), triton.cdiv(2 * d, block_c))
    _codebook_kernel[grid](codes.contiguous(), tables, hist, calls, positions, slots, out, t, h, d, size, Q=q,
                           FIRST=first, BLOCK_R=block_r, BLOCK_C=block_c)


def _launch_conv(p, weight, bias, length, taps, dil, phases, epilogue, epi, out, config=None):
    """`config`: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages), else `conv_blocks`' choice and 3 stages."""
    b, rows, cin = p.shape
    cout = weight.shape[1] // phases
    m = b * length
    block_m, block_n, block_k, warps, stages = config or conv_blocks(m, cin, cout, taps, phases)
    kt = triton.cdiv(cin, block_k)
    freq, inv = epi if epi is not None else (out, out)
    grid = (triton.cdiv(m, block_m), triton.cdiv(cout, block_n), phases)
    _conv_kernel[grid](p, weight, bias if bias is not None else out, out, freq, inv,
                       m, length, rows, cin, cout, phases, rows - length - (taps - 1) * dil, dil,
                       TAPS=taps, HAS_BIAS=bias is not None, EPILOGUE=EPILOGUES.index(epilogue),
                       BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, KT=kt,
                       IEEE=p.dtype == torch.float32, FAST_SIN=_FAST_SIN, num_warps=warps, num_stages=stages)


def _launch_dwln(p, weight, bias, length, eps, out):
    b, rows, c = p.shape
    block_c = pow2_at_least(c)
    block_t = max(1, min(16, 8192 // block_c))
    grid = (b, triton.cdiv(length, block_t))
    _dwln_kernel[grid](p, weight, bias, out, length, rows, c, eps, TAPS=weight.shape[1],
                       BLOCK_T=block_t, BLOCK_C=block_c, num_warps=8 if block_c >= 512 else 4)
