"""The Triton kernels of the codec's conv GEMMs (`causal_conv.py` holds the API and the PyTorch twins).

- `_conv_kernel`: one causal conv (taps x dilation, or a transposed conv as phases) as an implicit GEMM over
  the staged input P, with its epilogue. Where the output has too few tiles to fill the GPU (the decoder's
  first convs see 64 rows at one frame per call, with K up to 7 x 1024) it runs split-K: each part writes fp32
  partial sums and `_split_reduce_kernel` adds them, the bias and the epilogue.
- `_column_kernel`: a conv with one output channel (the decoder's last conv), a dot product per row.
- `_unit_kernel`: a whole residual unit of a narrow block (C <= 256), `x += conv1x1(snake(conv7(P)))`: the
  7-tap conv's tile covers every channel, so its SnakeBeta'd output stays in registers as the A operand of the
  1x1 conv, instead of a round trip through memory and a second launch. It rounds that intermediate to the
  storage dtype first, as the two-kernel path does.

Math is fp32 whatever the storage (bf16 on the GPU, fp32 under the interpreter in the CPU tests).
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch

from legato.layers.conv_tiles import conv_blocks, pow2_at_least

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU build of torch ships no Triton
    triton = None

EPILOGUES = ("none", "snake", "gelu", "residual", "clamp")
# The interpreter (TRITON_INTERPRET=1, the CPU tests of the kernels) runs no inline PTX.
FAST_SIN = os.environ.get("TRITON_INTERPRET") != "1"
# Widest channel count whose residual unit runs as one kernel: its tiles hold every channel (acc [BM, C] twice).
UNIT_MAX_CHANNELS = 256
# Split-K switch (benchmarks/codec_step.py measures with and without it).
SPLIT_K = True
# (rows, channels per load, warps) of `_column_kernel` (benchmarks/codec_tune.py measures the step).
COLUMN_TILE = (128, 32, 4)


@lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    if not torch.cuda.is_available():
        return 132  # the interpreter: any count works, this one matches the H100/H200 the tiles were tuned on
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def split_k(programs: int, iters: int, sms: int) -> int:
    """How many K parts a conv of `programs` output tiles and `iters` K steps runs in: enough to fill about one
    wave of `sms` programs, each part keeping >= 16 K steps; 1 when the tiles already fill half the GPU. On the
    H200 (benchmarks/unit_tune.py) shorter parts lost more to the fp32 partial sums than they gained: K of 16-24
    steps ran 1.2-2.6x slower split, K of 64-112 steps 1.3-2.5x faster."""
    if not SPLIT_K or programs * 2 > sms:
        return 1
    split = min(sms // programs, iters // 16, 16)
    if split < 2:
        return 1
    per = -(-iters // split)
    return -(-iters // per)  # no empty part


if triton is not None:

    @triton.jit
    def snake_fn(x, freq, inv_mag, FAST_SIN: tl.constexpr):
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
    def _dot(a, b, acc, IEEE: tl.constexpr):
        """acc + a @ b: full fp32 products where IEEE (fp32 storage, the interpreter's exact path), else the
        matrix units' default precision."""
        if IEEE:
            return tl.dot(a, b, acc, input_precision="ieee")
        return tl.dot(a, b, acc)

    @triton.jit
    def _finish(acc, rn, nmask, bcol, optrs, omask, b_ptr, f_ptr, i_ptr, HAS_BIAS: tl.constexpr,
                EPILOGUE: tl.constexpr, FAST_SIN: tl.constexpr, orow, s_ptr, sf_ptr, si_ptr, LOUT, SH, COUT,
                STAGED: tl.constexpr, STAGED_SNAKE: tl.constexpr, KEEP_OUT: tl.constexpr):
        """Bias (column `bcol`), the epilogue, the store. STAGED: the stored rows (output rows `orow`, LOUT per
        stream) also go, through SnakeBeta (sf, si) where STAGED_SNAKE, into the next conv's staged input S
        [B, SH + LOUT, COUT] after its SH history rows, as `stage` would have put them there; not KEEP_OUT: they
        go there only (nothing reads the output itself)."""
        if HAS_BIAS:
            acc += tl.load(b_ptr + bcol, mask=nmask, other=0.0).to(tl.float32)[None, :]
        if EPILOGUE == 1:  # snake
            freq = tl.load(f_ptr + rn, mask=nmask, other=0.0)
            inv = tl.load(i_ptr + rn, mask=nmask, other=0.0)
            acc = snake_fn(acc, freq[None, :], inv[None, :], FAST_SIN)
        elif EPILOGUE == 2:  # exact GELU
            acc = 0.5 * acc * (1.0 + tl.erf(acc * 0.7071067811865476))
        elif EPILOGUE == 3:  # residual: the output already holds what this adds to
            acc += tl.load(optrs, mask=omask, other=0.0).to(tl.float32)
        elif EPILOGUE == 4:
            acc = tl.minimum(tl.maximum(acc, -1.0), 1.0)
        val = acc.to(optrs.dtype.element_ty)
        if KEEP_OUT:
            tl.store(optrs, val, mask=omask)
        if STAGED:
            sv = val.to(tl.float32)
            if STAGED_SNAKE:
                sfreq = tl.load(sf_ptr + rn, mask=nmask, other=0.0)
                sinv = tl.load(si_ptr + rn, mask=nmask, other=0.0)
                sv = snake_fn(sv, sfreq[None, :], sinv[None, :], FAST_SIN)
            srow = (orow // LOUT) * (SH + LOUT) + SH + orow % LOUT
            tl.store(s_ptr + srow[:, None].to(tl.int64) * COUT + rn[None, :], sv.to(s_ptr.dtype.element_ty),
                     mask=omask)

    @triton.jit
    def _implicit_gemm(p_ptr, w_ptr, prow, mmask, wcol, nmask, wcol2, nmask2, lo, hi, CIN, DIL, wstride,
                       KT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       IEEE: tl.constexpr, FLAT: tl.constexpr = False, VEC: tl.constexpr = 1,
                       BLOCK_N2: tl.constexpr = 0, KTOTAL=0):
        """K steps [lo, hi) of a causal conv over P; returns fp32 accumulators of weight columns `wcol`
        [BLOCK_N] and, with BLOCK_N2 > 0, of `wcol2` [BLOCK_N2] (a tile as wide as 64 + 32 channels, say, with no
        padded columns; the second accumulator means nothing without).

        Not FLAT: step `it` is tap `it // KT`, input channels of block `it % KT` (a channel count that is not a
        multiple of BLOCK_K pads every tap). FLAT: step `it` is K rows [it * BLOCK_K, +BLOCK_K) of the
        flattened (tap, channel) index up to KTOTAL, a block spanning taps where it falls so; VEC promises runs
        of VEC contiguous, VEC-aligned channels (CIN % VEC == 0) so its loads stay vectorised. Tap i reads P
        rows `prow + i * DIL`."""
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_M, BLOCK_N2 if BLOCK_N2 > 0 else 16], dtype=tl.float32)
        arow = prow[:, None].to(tl.int64) * CIN
        for it in range(lo, hi):
            if FLAT:
                kk = it * BLOCK_K + rk
                kmask = kk < KTOTAL
                tap = kk // CIN
                koff = tap * (DIL * CIN) + (kk - tap * CIN)
                koff = tl.max_contiguous(tl.multiple_of(koff, VEC), VEC)
                a_ptrs = p_ptr + arow + koff[None, :]
                wrow = kk
            else:
                tap = it // KT
                kk = (it - tap * KT) * BLOCK_K + rk
                kmask = kk < CIN
                a_ptrs = p_ptr + arow + (tap * DIL * CIN + kk)[None, :]
                wrow = tap * CIN + kk
            a = tl.load(a_ptrs, mask=mmask[:, None] & kmask[None, :], other=0.0)
            w = tl.load(w_ptr + wrow[:, None].to(tl.int64) * wstride + wcol[None, :],
                        mask=kmask[:, None] & nmask[None, :], other=0.0)
            acc = _dot(a, w, acc, IEEE)
            if BLOCK_N2 > 0:
                w2 = tl.load(w_ptr + wrow[:, None].to(tl.int64) * wstride + wcol2[None, :],
                             mask=kmask[:, None] & nmask2[None, :], other=0.0)
                acc2 = _dot(a, w2, acc2, IEEE)
        return acc, acc2

    @triton.jit
    def _finish_or_park(acc, rn, nmask, bcol, orow, mmask, part, ROWS, COUT, out_ptr, ws_ptr, b_ptr, f_ptr, i_ptr,
                        SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, EPILOGUE: tl.constexpr,
                        FAST_SIN: tl.constexpr, s_ptr, sf_ptr, si_ptr, LOUT, SH, STAGED: tl.constexpr,
                        STAGED_SNAKE: tl.constexpr, KEEP_OUT: tl.constexpr):
        """The finished tile into the output, or (split-K) its partial sums into [SPLIT, ROWS, COUT] fp32."""
        omask = mmask[:, None] & nmask[None, :]
        if SPLIT == 1:
            optrs = out_ptr + orow[:, None].to(tl.int64) * COUT + rn[None, :]
            _finish(acc, rn, nmask, bcol, optrs, omask, b_ptr, f_ptr, i_ptr, HAS_BIAS, EPILOGUE, FAST_SIN,
                    orow, s_ptr, sf_ptr, si_ptr, LOUT, SH, COUT, STAGED, STAGED_SNAKE, KEEP_OUT)
        else:
            wptrs = ws_ptr + (part * ROWS + orow)[:, None].to(tl.int64) * COUT + rn[None, :]
            tl.store(wptrs, acc, mask=omask)

    @triton.jit
    def _conv_kernel(p_ptr, w_ptr, b_ptr, out_ptr, f_ptr, i_ptr, ws_ptr,
                     M, L, PL, CIN, COUT, PHASES, OFF0, DIL,
                     TAPS: tl.constexpr, HAS_BIAS: tl.constexpr, EPILOGUE: tl.constexpr, SPLIT: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, KT: tl.constexpr,
                     IEEE: tl.constexpr, FAST_SIN: tl.constexpr, FLAT: tl.constexpr, VEC: tl.constexpr,
                     BLOCK_N2: tl.constexpr, s_ptr, sf_ptr, si_ptr, LOUT, SH, STAGED: tl.constexpr,
                     STAGED_SNAKE: tl.constexpr, KEEP_OUT: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        phase = tl.program_id(2) // SPLIT
        part = tl.program_id(2) % SPLIT
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * (BLOCK_N + BLOCK_N2) + tl.arange(0, BLOCK_N)
        mmask = rm < M
        nmask = rn < COUT
        prow = (rm // L) * PL + (rm % L) + OFF0  # P row of tap 0
        wcol = phase * COUT + rn
        wstride = PHASES * COUT
        steps = tl.cdiv(TAPS * CIN, BLOCK_K) if FLAT else TAPS * KT
        per = tl.cdiv(steps, SPLIT)
        lo = part * per
        hi = tl.minimum(lo + per, steps)
        rn2 = pid_n * (BLOCK_N + BLOCK_N2) + BLOCK_N + tl.arange(0, BLOCK_N2 if BLOCK_N2 > 0 else 16)
        nmask2 = rn2 < COUT
        wcol2 = phase * COUT + rn2
        acc, acc2 = _implicit_gemm(p_ptr, w_ptr, prow, mmask, wcol, nmask, wcol2, nmask2, lo, hi,
                                   CIN, DIL, wstride, KT, BLOCK_M, BLOCK_N, BLOCK_K, IEEE, FLAT, VEC, BLOCK_N2,
                                   TAPS * CIN)
        orow = rm * PHASES + phase
        _finish_or_park(acc, rn, nmask, wcol, orow, mmask, part, M * PHASES, COUT, out_ptr, ws_ptr, b_ptr, f_ptr,
                        i_ptr, SPLIT, HAS_BIAS, EPILOGUE, FAST_SIN, s_ptr, sf_ptr, si_ptr, LOUT, SH, STAGED,
                        STAGED_SNAKE, KEEP_OUT)
        if BLOCK_N2 > 0:
            _finish_or_park(acc2, rn2, nmask2, wcol2, orow, mmask, part, M * PHASES, COUT, out_ptr,
                            ws_ptr, b_ptr, f_ptr, i_ptr, SPLIT, HAS_BIAS, EPILOGUE, FAST_SIN, s_ptr, sf_ptr, si_ptr,
                            LOUT, SH, STAGED, STAGED_SNAKE, KEEP_OUT)

    @triton.jit
    def _split_reduce_kernel(ws_ptr, b_ptr, out_ptr, f_ptr, i_ptr, ROWS, COUT, PHASES,
                             SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, EPILOGUE: tl.constexpr,
                             BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, FAST_SIN: tl.constexpr, s_ptr, sf_ptr,
                             si_ptr, LOUT, SH, STAGED: tl.constexpr, STAGED_SNAKE: tl.constexpr,
                             KEEP_OUT: tl.constexpr):
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        rmask = r < ROWS
        cmask = c < COUT
        mask = rmask[:, None] & cmask[None, :]
        offs = r[:, None].to(tl.int64) * COUT + c[None, :]
        acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            acc += tl.load(ws_ptr + s * ROWS * COUT + offs, mask=mask, other=0.0)
        # The bias is per (phase, cout): a row's phase is its index modulo PHASES (rows are phase-interleaved).
        if HAS_BIAS:
            acc += tl.load(b_ptr + (r % PHASES)[:, None] * COUT + c[None, :], mask=mask, other=0.0).to(tl.float32)
        _finish(acc, c, cmask, c, out_ptr + offs, mask, b_ptr, f_ptr, i_ptr, False, EPILOGUE, FAST_SIN, r, s_ptr,
                sf_ptr, si_ptr, LOUT, SH, COUT, STAGED, STAGED_SNAKE, KEEP_OUT)

    @triton.jit
    def _column_kernel(p_ptr, w_ptr, b_ptr, out_ptr, f_ptr, i_ptr, M, L, PL, CIN, OFF0, DIL,
                       TAPS: tl.constexpr, HAS_BIAS: tl.constexpr, EPILOGUE: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_C: tl.constexpr, FAST_SIN: tl.constexpr):
        """A conv with one output channel (the decoder's last, 96 -> 1 over the output samples): a dot product
        per row on the vector units, where a GEMM tile would be 1/16 useful and read P at a fraction of the
        bandwidth."""
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        mmask = rm < M
        prow = ((rm // L) * PL + (rm % L) + OFF0).to(tl.int64)
        rc = tl.arange(0, BLOCK_C)
        acc = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
        for tap in tl.static_range(TAPS):
            for c0 in range(0, CIN, BLOCK_C):
                cmask = c0 + rc < CIN
                a = tl.load(p_ptr + (prow + tap * DIL)[:, None] * CIN + (c0 + rc)[None, :],
                            mask=mmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
                w = tl.load(w_ptr + tap * CIN + c0 + rc, mask=cmask, other=0.0).to(tl.float32)
                acc += a * w[None, :]
        # The GEMM's epilogue over a one-column tile.
        col = tl.zeros([1], dtype=tl.int32)
        cmask = col < 1
        _finish(tl.sum(acc, axis=1)[:, None], col, cmask, col, out_ptr + rm[:, None] + col[None, :],
                mmask[:, None] & cmask[None, :], b_ptr, f_ptr, i_ptr, HAS_BIAS, EPILOGUE, FAST_SIN, rm, out_ptr,
                f_ptr, i_ptr, 1, 0, 1, False, False, True)

    @triton.jit
    def _unit_kernel(p_ptr, w7_ptr, b7_ptr, f_ptr, i_ptr, w1_ptr, b1_ptr, x_ptr,
                     M, L, PL, C, OFF0, DIL,
                     TAPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
                     KT: tl.constexpr, CHUNK: tl.constexpr, IEEE: tl.constexpr, FAST_SIN: tl.constexpr):
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rc = tl.arange(0, BLOCK_C)
        mmask = rm < M
        cmask = rc < C
        prow = (rm // L) * PL + (rm % L) + OFF0
        acc, _ = _implicit_gemm(p_ptr, w7_ptr, prow, mmask, rc, cmask, rc, cmask, 0, TAPS * KT, C, DIL, C, KT,
                                BLOCK_M, BLOCK_C, BLOCK_K, IEEE)
        # Columns past C hold 0 (their weights, bias and SnakeBeta parameters read as 0), so they add nothing
        # to the 1x1 conv below.
        acc += tl.load(b7_ptr + rc, mask=cmask, other=0.0).to(tl.float32)[None, :]
        freq = tl.load(f_ptr + rc, mask=cmask, other=0.0)
        inv = tl.load(i_ptr + rc, mask=cmask, other=0.0)
        h = snake_fn(acc, freq[None, :], inv[None, :], FAST_SIN).to(x_ptr.dtype.element_ty)
        for j in tl.static_range(BLOCK_C // CHUNK):
            rn = j * CHUNK + tl.arange(0, CHUNK)
            nmask = rn < C
            w1 = tl.load(w1_ptr + rc[:, None] * C + rn[None, :], mask=cmask[:, None] & nmask[None, :], other=0.0)
            y = _dot(h, w1, tl.zeros([BLOCK_M, CHUNK], dtype=tl.float32), IEEE)
            y += tl.load(b1_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
            xptrs = x_ptr + rm[:, None].to(tl.int64) * C + rn[None, :]
            xmask = mmask[:, None] & nmask[None, :]
            y += tl.load(xptrs, mask=xmask, other=0.0).to(tl.float32)
            tl.store(xptrs, y.to(x_ptr.dtype.element_ty), mask=xmask)


def launch_conv(p, weight, bias, length, taps, dil, phases, epilogue, epi, out, config=None, split=None, flat=None,
                staged=None, keep_out=True):
    """`config`: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages[, BLOCK_N2[, SPLIT]]), else `conv_blocks`'
    choice (or, for one output channel, a dot product per row: `_column_kernel`); BLOCK_N2 0 is none, SPLIT 0
    leaves the K parts to `split_k`;
    `split`: K parts (overrides the config's), else the config's, else `split_k`'s choice;
    `flat`: K blocks over the flattened (tap, channel) index, else (None) where the channels are not a multiple
    of BLOCK_K (so no tap is padded) and are a multiple of 8;
    `staged`: (S, SnakeBeta or None), S [B, H + length * phases, Cout] the next conv's input, whose rows after
    its H history rows the epilogue also writes; `keep_out` False (with `staged`): it writes only those."""
    b, rows, cin = p.shape
    cout = weight.shape[1] // phases
    m = b * length
    if staged is not None:
        s_buf, s_snake = staged
        s_freq, s_inv = s_snake if s_snake is not None else (out, out)
        s_len = m * phases // s_buf.shape[0]  # S's streams, not necessarily P's (a 1x1 conv over [1, B * L, C])
        s_args = dict(s_ptr=s_buf, sf_ptr=s_freq, si_ptr=s_inv, LOUT=s_len, SH=s_buf.shape[1] - s_len, STAGED=True,
                      STAGED_SNAKE=s_snake is not None, KEEP_OUT=keep_out)
    else:
        s_args = dict(s_ptr=out, sf_ptr=out, si_ptr=out, LOUT=1, SH=0, STAGED=False, STAGED_SNAKE=False,
                      KEEP_OUT=True)
    freq, inv = epi if epi is not None else (out, out)
    bias_arg = bias if bias is not None else out
    if cout == 1 and phases == 1 and config is None and staged is None:
        block_m, block_c, warps = COLUMN_TILE
        block_c = min(pow2_at_least(cin), block_c)
        _column_kernel[(triton.cdiv(m, block_m),)](p, weight, bias_arg, out, freq, inv, m,
                                                   length, rows, cin, rows - length - (taps - 1) * dil, dil,
                                                   TAPS=taps, HAS_BIAS=bias is not None,
                                                   EPILOGUE=EPILOGUES.index(epilogue), BLOCK_M=block_m,
                                                   BLOCK_C=block_c, FAST_SIN=FAST_SIN, num_warps=warps)
        return
    block_m, block_n, block_k, warps, stages, block_n2, config_split = \
        (*(config or conv_blocks(m, cin, cout, taps, phases)), 0, 0)[:7]
    split = split or config_split or None
    kt = triton.cdiv(cin, block_k)
    if flat is None:
        flat = cin % block_k != 0 and cin % 8 == 0
    steps = triton.cdiv(taps * cin, block_k) if flat else taps * kt
    n_tiles = triton.cdiv(cout, block_n + block_n2)
    tiles = triton.cdiv(m, block_m) * n_tiles * phases
    if split is None:
        split = split_k(tiles, steps, _sm_count(p.device.index or 0) if p.is_cuda else 132)
    ws = torch.empty(split, m * phases, cout, dtype=torch.float32, device=p.device) if split > 1 else out
    code = EPILOGUES.index(epilogue)
    grid = (triton.cdiv(m, block_m), n_tiles, phases * split)
    _conv_kernel[grid](p, weight, bias_arg, out, freq, inv, ws,
                       m, length, rows, cin, cout, phases, rows - length - (taps - 1) * dil, dil,
                       TAPS=taps, HAS_BIAS=bias is not None, EPILOGUE=code, SPLIT=split,
                       BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, KT=kt,
                       IEEE=p.dtype == torch.float32, FAST_SIN=FAST_SIN, FLAT=flat, VEC=8 if cin % 8 == 0 else 1,
                       BLOCK_N2=block_n2, num_warps=warps, num_stages=stages, **s_args)
    if split > 1:
        block_c = min(pow2_at_least(cout), 128)
        block_r = max(1, 4096 // block_c)
        rgrid = (triton.cdiv(m * phases, block_r), triton.cdiv(cout, block_c))
        _split_reduce_kernel[rgrid](ws, bias_arg, out, freq, inv, m * phases, cout, phases, SPLIT=split,
                                    HAS_BIAS=bias is not None, EPILOGUE=code, BLOCK_R=block_r, BLOCK_C=block_c,
                                    FAST_SIN=FAST_SIN, **s_args)


def unit_blocks(c: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_C, BLOCK_K, num_warps, num_stages) of the fused residual unit at `c` channels."""
    block_c = pow2_at_least(c)
    block_k = 32 if c % 32 == 0 else min(block_c, 64)
    return (128 if block_c <= 128 else 64), block_c, block_k, 8, 3


def launch_unit(p, w7, b7, length, taps, dil, epi, w1, b1, x, config=None):
    b, rows, c = p.shape
    m = b * length
    block_m, block_c, block_k, warps, stages = config or unit_blocks(c)
    grid = (triton.cdiv(m, block_m),)
    _unit_kernel[grid](p, w7, b7, epi[0], epi[1], w1, b1, x, m, length, rows, c, rows - length - (taps - 1) * dil,
                       dil, TAPS=taps, BLOCK_M=block_m, BLOCK_C=block_c, BLOCK_K=block_k,
                       KT=triton.cdiv(c, block_k), CHUNK=min(block_c, 128), IEEE=p.dtype == torch.float32,
                       FAST_SIN=FAST_SIN, num_warps=warps, num_stages=stages)
