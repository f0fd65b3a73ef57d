"""The Triton kernels that stage a causal conv's input (`causal_conv.py` holds the API and the PyTorch twins):
history rows from each slot's bank, the call's rows (through SnakeBeta where the conv has one), and the slot's next
history; the same for the codebook lookup of the decoder's first conv; and the ConvNeXt block's depthwise conv with
its LayerNorm. Math in fp32 whatever the storage."""

from __future__ import annotations

from legato.layers.conv_kernels import FAST_SIN, triton
from legato.layers.conv_tiles import pow2_at_least

if triton is not None:
    import triton.language as tl

    from legato.layers.conv_kernels import snake_fn


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
    def _store_staged(out_ptr, hbase, par, val, b, r, c, valid, cmask, rows, L, H, C):
        """Rows r of P (history, then the call's L rows) into `out`, and P's last H rows into the slot's next
        history (the other copy)."""
        tl.store(out_ptr + (b * rows + r)[:, None].to(tl.int64) * C + c[None, :], val,
                 mask=valid[:, None] & cmask[None, :])
        keep = valid & (r >= L)
        tl.store(hbase + (1 - par) * (H * C) + (r - L)[:, None] * C + c[None, :], val,
                 mask=keep[:, None] & cmask[None, :])

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
        _store_staged(out_ptr, hbase, par, val, b, r, c, valid, cmask, rows, L, H, C)

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
        _store_staged(out_ptr, hbase, par, val, b, r, c, valid, cmask, rows, T, H, C)

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
