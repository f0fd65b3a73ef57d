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

Every function has a Triton kernel (CUDA, bf16 or fp32 storage, fp32 math: `conv_kernels.py` for the GEMMs,
`stage_kernels.py` for staging) and a plain PyTorch twin (the CPU path, the exact fp32 path on CUDA, and the
oracle of the kernel tests).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from legato.layers.conv_kernels import EPILOGUES, UNIT_MAX_CHANNELS, triton
from legato.layers.conv_kernels import launch_conv as _launch_conv
from legato.layers.conv_kernels import launch_unit as _launch_unit
from legato.layers.stage_kernels import (
    _launch_codebook_stage,
    _launch_dwln,
    _launch_restage,
    _launch_restage_group,
    _launch_stage,
)


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
        if copy_in:
            _history_in(hist, calls, positions, slots, rate, p)
        if copy_out:
            _history_out(hist, calls, slots, p)


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
    _history_in(hist, calls, positions, slots, rate, out)
    if x is not None:
        out[:, hist.shape[2]:] = x.to(out.dtype)
    _history_out(hist, calls, slots, out)
    return out


def _history_in(hist: torch.Tensor, calls: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, rate: int,
                out: torch.Tensor) -> None:
    """Each slot's current history (zero before the stream's start) into out's first H rows."""
    h = hist.shape[2]
    index = (positions[slots] * rate - h)[:, None] + torch.arange(h, device=out.device)
    old = hist[slots, calls[slots] & 1]
    out[:, :h] = torch.where((index >= 0)[:, :, None], old, torch.zeros((), dtype=old.dtype, device=old.device))


def _history_out(hist: torch.Tensor, calls: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> None:
    """out's last H rows become each slot's next history (the other copy)."""
    h = hist.shape[2]
    if h:
        hist[slots, 1 - (calls[slots] & 1)] = out[:, out.shape[1] - h:]


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

