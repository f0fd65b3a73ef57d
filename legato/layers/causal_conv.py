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

import torch
import torch.nn.functional as F

from legato.layers.conv_kernels import EPILOGUES, FAST_SIN, UNIT_MAX_CHANNELS, triton
from legato.layers.conv_kernels import launch_conv as _launch_conv
from legato.layers.conv_kernels import launch_unit as _launch_unit
from legato.layers.conv_tiles import pow2_at_least

if triton is not None:
    import triton.language as tl

    from legato.layers.conv_kernels import snake_fn



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


def restage(p: torch.Tensor, hist: torch.Tensor, calls: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
            rate: int, kernel: bool | None = None) -> torch.Tensor:
    """`stage` for a P whose rows after its H history rows the previous conv's epilogue already wrote
    (`conv_gemm(..., staged=)`): fills the history rows and writes each slot's next history. Returns P."""
    h = hist.shape[2]
    if kernel if kernel is not None else use_triton(hist):
        if h:
            _launch_restage(p, hist, calls, positions, slots, rate)
        return p
    return _with_history(None, hist, calls, positions, slots, rate, p)


def restage_group(ps: list[torch.Tensor], hists: list[torch.Tensor], calls: torch.Tensor, positions: torch.Tensor,
                  slots: torch.Tensor, rate: int, copy_in: bool, copy_out: bool, kernel: bool | None = None) -> None:
    """`restage`'s two halves for up to four staged inputs of one (streams, length, channels, rate) in one
    launch: `copy_in` fills each P's history rows from its bank; `copy_out` writes each slot's next history from
    P's last rows, so it must come after the conv that feeds P. A vocoder block stages its three residual units'
    inputs and the next conv's this way, in two launches instead of four (`codec_stages.GROUP_RESTAGE`)."""
    if not ps:
        return
    if len(ps) > 4 or len(hists) != len(ps):
        raise ValueError(f"restage_group takes 1 to 4 (P, history) pairs, got {len(ps)} and {len(hists)}")
    b, rows0, c = ps[0].shape
    length = rows0 - hists[0].shape[2]
    for p, hist in zip(ps, hists, strict=True):
        if p.shape != (b, hist.shape[2] + length, c) or hist.shape[3] != c:
            raise ValueError(f"restage_group: P {tuple(p.shape)} and history {tuple(hist.shape)} do not share "
                             f"{b} streams of {length} rows of {c} channels")
    if kernel if kernel is not None else use_triton(hists[0]):
        _launch_restage_group(ps, hists, calls, positions, slots, rate, length, copy_in, copy_out)
        return
    for p, hist in zip(ps, hists, strict=True):
        h = hist.shape[2]
        if not h:
            continue
        par = calls[slots] & 1
        if copy_in:
            index = (positions[slots] * rate - h)[:, None] + torch.arange(h, device=p.device)
            old = hist[slots, par]
            p[:, :h] = torch.where((index >= 0)[:, :, None], old, torch.zeros((), dtype=old.dtype, device=old.device))
        if copy_out:
            hist[slots, 1 - par] = p[:, length:]


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


def _with_history(x: torch.Tensor | None, hist: torch.Tensor, calls: torch.Tensor, positions: torch.Tensor,
                  slots: torch.Tensor, rate: int, out: torch.Tensor) -> torch.Tensor:
    """The history rows (zero before the stream's start) then `x` into `out` (x None: `out` holds its rows
    already); the last H rows become the next history. Masked with `where`, never a multiply: a reused slot's
    old rows may hold anything."""
    h = hist.shape[2]
    length = out.shape[1] - h
    par = calls[slots] & 1
    index = (positions[slots] * rate - h)[:, None] + torch.arange(h, device=out.device)
    old = hist[slots, par]
    out[:, :h] = torch.where((index >= 0)[:, :, None], old, torch.zeros((), dtype=old.dtype, device=old.device))
    if x is not None:
        out[:, h:] = x.to(out.dtype)
    if h:
        hist[slots, 1 - par] = out[:, length:]
    return out


# --- the conv as a GEMM -----------------------------------------------------------------------------------


def conv_gemm(p: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, length: int, taps: int, dil: int,
              phases: int = 1, epilogue: str = "none", epi: tuple[torch.Tensor, torch.Tensor] | None = None,
              out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
              kernel: bool | None = None,
              staged: tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None] | None = None,
              keep_out: bool = True) -> torch.Tensor:
    """Causal conv over P [B, H + length, Cin] -> [B * length * phases, Cout] (time-major, phase-interleaved).

    `weight [taps * Cin, phases * Cout]`: row (tap, cin), column (phase, cout); tap i reads P row
    `H - (taps - 1 - i) * dil + s` for output step s. `bias [phases * Cout]` (or None). Epilogue: "snake" with
    `epi` = (freq, inv_mag), "gelu" (exact), "residual" (adds into `out`, which must be given), "clamp" to
    [-1, 1]. The result is written to `out` when given, else a new tensor of `out_dtype` (default P's).

    `staged` = (S, SnakeBeta or None): the result also goes, through that SnakeBeta, into the rows of the next
    conv's input S [B', H' + L', Cout] (B' x L' = the output's rows) after its H' history rows, as `stage`
    would put it there (`restage` then fills the history rows): one pass over the activation instead of a
    write and a re-read. `keep_out` False (with `staged`, on the kernel path): the result goes to S only and
    `out` is left as it was, for an output nothing reads but the next conv through S."""
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
    if staged is not None:  # its streams need not be P's: a 1x1 conv may run over [1, B * L, C]
        sb, srows, sc = staged[0].shape
        per_stream = b * length * phases // sb  # output rows per staged stream
        if per_stream * sb != b * length * phases or srows < per_stream or sc != cout:
            raise ValueError(f"conv_gemm: staged {tuple(staged[0].shape)} does not fit {b * length * phases} rows "
                             f"of {cout}")
    if kernel if kernel is not None else use_triton(p):
        _launch_conv(p, weight, bias, length, taps, dil, phases, epilogue, epi, out, staged=staged,
                     keep_out=keep_out or staged is None)
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
    if staged is not None:
        s_buf, s_snake = staged
        rows_out = out.view(s_buf.shape[0], per_stream, cout)
        new = snake_reference(rows_out, *s_snake) if s_snake is not None else rows_out
        s_buf[:, s_buf.shape[1] - per_stream:] = new.to(s_buf.dtype)
    return out


def fused_unit_fits(p: torch.Tensor, kernel: bool | None = None) -> bool:
    """Whether `residual_unit` runs as one kernel here (else it is the two GEMMs it stands for)."""
    return (kernel if kernel is not None else use_triton(p)) and p.shape[2] <= UNIT_MAX_CHANNELS


def residual_unit(p: torch.Tensor, w7: torch.Tensor, b7: torch.Tensor, length: int, taps: int, dil: int,
                  epi: tuple[torch.Tensor, torch.Tensor], w1: torch.Tensor, b1: torch.Tensor, x: torch.Tensor,
                  kernel: bool | None = None) -> torch.Tensor:
    """x [B * length, C] += conv1x1(snake(conv(P))) in place: the conv of `taps` taps at dilation `dil` over
    P [B, H + length, C] (`w7 [taps * C, C]`, `b7`), SnakeBeta `epi` = (freq, inv_mag), then `w1 [C, C]`, `b1`.
    One kernel where `fused_unit_fits`; the intermediate is rounded to P's dtype either way."""
    if fused_unit_fits(p, kernel):
        if p.shape[0] * length != x.shape[0] or w7.shape != (taps * p.shape[2], p.shape[2]):
            raise ValueError(f"residual_unit: P {tuple(p.shape)}, x {tuple(x.shape)}, w7 {tuple(w7.shape)}")
        _launch_unit(p, w7, b7, length, taps, dil, epi, w1, b1, x)
        return x
    h = conv_gemm(p, w7, b7, length, taps, dil, 1, "snake", epi, kernel=kernel)
    return conv_gemm(h.view(1, x.shape[0], -1), w1, b1, x.shape[0], 1, 1, 1, "residual", out=x, kernel=kernel)


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
    def _slot_bank(hist_ptr, calls_ptr, pos_ptr, slots_ptr, b, H, C, RATE):
        """Stream b's slot: the base of its history bank, which of the two copies is current, and the sample
        index of history row 0 (negative rows are before the stream's start)."""
        slot = tl.load(slots_ptr + b)
        return hist_ptr + slot * (2 * H * C), tl.load(calls_ptr + slot) & 1, tl.load(pos_ptr + slot) * RATE - H

    @triton.jit
    def _old_history(hbase, par, first, r, c, cmask, H, C):
        """Rows r of the current history, zero before the stream's start and for r >= H."""
        return tl.load(hbase + par * (H * C) + r[:, None] * C + c[None, :],
                       mask=((r < H) & ((first + r) >= 0))[:, None] & cmask[None, :], other=0.0)

    @triton.jit
    def _stage_kernel(x_ptr, hist_ptr, calls_ptr, pos_ptr, slots_ptr, freq_ptr, inv_ptr, out_ptr,
                      L, H, C, RATE, SNAKE: tl.constexpr, FAST_SIN: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_C: tl.constexpr):
        b = tl.program_id(0)
        r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = c < C
        in_hist = r < H
        rows = H + L
        valid = r < rows
        hbase, par, first = _slot_bank(hist_ptr, calls_ptr, pos_ptr, slots_ptr, b, H, C, RATE)
        old = _old_history(hbase, par, first, r, c, cmask, H, C)
        xr = r - H
        new = tl.load(x_ptr + (b * L + xr)[:, None].to(tl.int64) * C + c[None, :],
                      mask=((~in_hist) & valid)[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        if SNAKE:
            freq = tl.load(freq_ptr + c, mask=cmask, other=0.0)
            inv = tl.load(inv_ptr + c, mask=cmask, other=0.0)
            new = snake_fn(new, freq[None, :], inv[None, :], FAST_SIN)
        val = tl.where(in_hist[:, None], old.to(tl.float32), new).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + (b * rows + r)[:, None].to(tl.int64) * C + c[None, :], val,
                 mask=valid[:, None] & cmask[None, :])
        keep = valid & (r >= L)
        tl.store(hbase + (1 - par) * (H * C) + (r - L)[:, None] * C + c[None, :], val,
                 mask=keep[:, None] & cmask[None, :])

    @triton.jit
    def _restage_rows(p_ptr, hist_ptr, calls_ptr, pos_ptr, slots_ptr, b, r, c, L, H, C, RATE,
                      COPY_IN: tl.constexpr, COPY_OUT: tl.constexpr):
        # Row r < H of P from the current history (COPY_IN), and row r of the next history from P's row L + r
        # (COPY_OUT): the old history where L + r < H (read from the bank, not from P, which may be being
        # written), else the row the previous conv's epilogue wrote.
        cmask = c < C
        live = r < H
        hbase, par, first = _slot_bank(hist_ptr, calls_ptr, pos_ptr, slots_ptr, b, H, C, RATE)
        pbase = p_ptr + (b * (H + L)).to(tl.int64) * C
        if COPY_IN:
            tl.store(pbase + r[:, None] * C + c[None, :], _old_history(hbase, par, first, r, c, cmask, H, C),
                     mask=live[:, None] & cmask[None, :])
        if COPY_OUT:
            src = L + r
            from_hist = src < H
            prev = _old_history(hbase, par, first, src, c, cmask, H, C)
            cur = tl.load(pbase + src[:, None].to(tl.int64) * C + c[None, :],
                          mask=(live & ~from_hist)[:, None] & cmask[None, :], other=0.0)
            tl.store(hbase + (1 - par) * (H * C) + r[:, None] * C + c[None, :],
                     tl.where(from_hist[:, None], prev, cur), mask=live[:, None] & cmask[None, :])

    @triton.jit
    def _restage_kernel(p_ptr, hist_ptr, calls_ptr, pos_ptr, slots_ptr, L, H, C, RATE, BLOCK_R: tl.constexpr,
                        BLOCK_C: tl.constexpr):
        b = tl.program_id(0)
        r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
        _restage_rows(p_ptr, hist_ptr, calls_ptr, pos_ptr, slots_ptr, b, r, c, L, H, C, RATE, True, True)

    @triton.jit
    def _restage_group_kernel(p0, p1, p2, p3, h0, h1, h2, h3, H0, H1, H2, H3, calls_ptr, pos_ptr, slots_ptr, L, C,
                              RATE, C_BLOCKS, COPY_IN: tl.constexpr, COPY_OUT: tl.constexpr, BLOCK_R: tl.constexpr,
                              BLOCK_C: tl.constexpr):
        # `_restage_kernel`'s work (or one of its halves) for pair `job` of up to four (P, history) pairs.
        b = tl.program_id(0)
        r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        job = tl.program_id(2) // C_BLOCKS
        c = (tl.program_id(2) % C_BLOCKS) * BLOCK_C + tl.arange(0, BLOCK_C)
        if job == 0:
            p_ptr, hist_ptr, H = p0, h0, H0
        elif job == 1:
            p_ptr, hist_ptr, H = p1, h1, H1
        elif job == 2:
            p_ptr, hist_ptr, H = p2, h2, H2
        else:
            p_ptr, hist_ptr, H = p3, h3, H3
        _restage_rows(p_ptr, hist_ptr, calls_ptr, pos_ptr, slots_ptr, b, r, c, L, H, C, RATE, COPY_IN, COPY_OUT)

    @triton.jit
    def _codebook_kernel(codes_ptr, tables_ptr, hist_ptr, calls_ptr, pos_ptr, slots_ptr, out_ptr,
                         T, H, D, SIZE, Q: tl.constexpr, FIRST: tl.constexpr, BLOCK_R: tl.constexpr,
                         BLOCK_C: tl.constexpr):
        b = tl.program_id(0)
        r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)  # over 2D channels
        C = 2 * D
        cmask = c < C
        rows = H + T
        valid = r < rows
        in_hist = r < H
        hbase, par, first = _slot_bank(hist_ptr, calls_ptr, pos_ptr, slots_ptr, b, H, C, 1)
        old = _old_history(hbase, par, first, r, c, cmask, H, C).to(tl.float32)
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


# Elements per program of the staging kernels, and warps (benchmarks/codec_tune.py measures the step with larger
# tiles: 2-5 % slower on the H200; docs/benchmarks.md).
STAGE_TILE = 4096
STAGE_WARPS = 4


def _stage_blocks(rows: int, c: int) -> tuple[int, int]:
    block_c = min(pow2_at_least(c), 128)
    block_r = max(1, min(pow2_at_least(rows, 1), STAGE_TILE // block_c))
    return block_r, block_c


def _launch_stage(x, hist, calls, positions, slots, rate, snake, out):
    b, length, c = x.shape
    h = hist.shape[2]
    block_r, block_c = _stage_blocks(h + length, c)
    freq, inv = snake if snake is not None else (out, out)  # never read without SNAKE
    grid = (b, triton.cdiv(h + length, block_r), triton.cdiv(c, block_c))
    _stage_kernel[grid](x.contiguous(), hist, calls, positions, slots, freq, inv, out, length, h, c, rate,
                        SNAKE=snake is not None, FAST_SIN=FAST_SIN, BLOCK_R=block_r, BLOCK_C=block_c,
                        num_warps=STAGE_WARPS)


def _launch_restage(p, hist, calls, positions, slots, rate):
    b, rows, c = p.shape
    h = hist.shape[2]
    block_r, block_c = _stage_blocks(h, c)
    grid = (b, triton.cdiv(h, block_r), triton.cdiv(c, block_c))
    _restage_kernel[grid](p, hist, calls, positions, slots, rows - h, h, c, rate, BLOCK_R=block_r, BLOCK_C=block_c)


def _launch_restage_group(ps, hists, calls, positions, slots, rate, length, copy_in, copy_out):
    b, _, c = ps[0].shape
    heights = [h.shape[2] for h in hists]
    block_r, block_c = _stage_blocks(max(heights), c)
    c_blocks = triton.cdiv(c, block_c)
    pad = 4 - len(ps)  # unused pairs: height 0, never touched
    ps, hists, heights = [*ps, *[ps[0]] * pad], [*hists, *[hists[0]] * pad], [*heights, *[0] * pad]
    grid = (b, max(1, triton.cdiv(max(heights), block_r)), (4 - pad) * c_blocks)
    _restage_group_kernel[grid](*ps, *hists, *heights, calls, positions, slots, length, c, rate, c_blocks,
                                COPY_IN=copy_in, COPY_OUT=copy_out, BLOCK_R=block_r, BLOCK_C=block_c)


def _launch_codebook_stage(codes, tables, first, hist, calls, positions, slots, out):
    b, t, q = codes.shape
    size, d = tables.shape[1], tables.shape[2]
    h = hist.shape[2]
    block_r, block_c = _stage_blocks(h + t, 2 * d)
    grid = (b, triton.cdiv(h + t, block_r), triton.cdiv(2 * d, block_c))
    _codebook_kernel[grid](codes.contiguous(), tables, hist, calls, positions, slots, out, t, h, d, size, Q=q,
                           FIRST=first, BLOCK_R=block_r, BLOCK_C=block_c)


def _launch_dwln(p, weight, bias, length, eps, out):
    b, rows, c = p.shape
    block_c = pow2_at_least(c)
    block_t = max(1, min(16, 8192 // block_c))
    grid = (b, triton.cdiv(length, block_t))
    _dwln_kernel[grid](p, weight, bias, out, length, rows, c, eps, TAPS=weight.shape[1],
                       BLOCK_T=block_t, BLOCK_C=block_c, num_warps=8 if block_c >= 512 else 4)
