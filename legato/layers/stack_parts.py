"""Device functions of `decoder_stack`'s kernel: the grid barrier, activation rows and weight tiles in the spread
layout, dot products, RMSNorm, and a kv head's attention over a code predictor's few positions (with the o
projection's partials summed back into the residual row). Only the kernel in `decoder_stack` calls them."""

from __future__ import annotations

import os

import triton
import triton.language as tl

from legato.layers import fused_attention

_round = fused_attention._round
# Under Triton's interpreter (the CPU's path, where no layout exists) `_spread` loads one copy.
_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")
_norm_rope = fused_attention._norm_rope


@triton.jit
def _arrive(bar_ptr):
    # Every thread's stores are done (CTA barrier) before one release increment.
    tl.debug_barrier()
    tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")


@triton.jit
def _wait(bar_ptr, target, SPIN: tl.constexpr):
    # The acquire polls make the other programs' stores visible to the loads after it (an acquire at GPU scope
    # invalidates L1, so `_spread`'s plain loads read them too). Loads issued between `_arrive` and here (the
    # next phase's weights, which no program writes) are in flight while it polls: the release in `_arrive`
    # would have waited for them. Polling with thread 0's acquire loads in inline PTX instead of these scalar
    # atomics (each a read-modify-write, its value passed to the other threads through shared memory) was
    # measured and dropped: 123.4 against 122.3 us a pass (H100, 2026-12-06, stack_phases.py).
    seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    spins = 0
    while (seen < target) & (spins < SPIN):
        seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
        spins += 1
    if seen < target:
        tl.atomic_add(bar_ptr + 2, 1)
    tl.debug_barrier()


@triton.jit
def _span(pid, programs, n):
    # This program's outputs [lo, hi) of n: contiguous, sizes within one of each other.
    return (pid * n) // programs, ((pid + 1) * n) // programs


@triton.jit
def _part(lo, hi, part, BN: tl.constexpr):
    # Piece `part` of a span [lo, hi) cut into pieces of BN rows (empty past hi): a phase's passes over its rows.
    part_lo = tl.minimum(lo + part * BN, hi)
    return part_lo, tl.minimum(part_lo + BN, hi)


@triton.jit
def _vector(ptr, C: tl.constexpr, CP: tl.constexpr, KC: tl.constexpr):
    # An activation row of C * KC values as [CP, KC] fp32 (rows past C zero), read past L1: other programs
    # wrote it in this launch.
    c = tl.arange(0, CP)[:, None]
    k = tl.arange(0, KC)[None, :]
    return tl.load(ptr + c * KC + k, mask=c < C, other=0.0, cache_modifier=".cg").to(tl.float32)


@triton.jit
def _spread(ptr, BN: tl.constexpr, C: tl.constexpr, CP: tl.constexpr, KC: tl.constexpr):
    # An activation row as [BN, CP, KC] fp32, the same values for each of the BN weight rows, so it takes the
    # weight tile's layout: the compiler gives a load a layout from its shape alone, and a [CP, KC] row's
    # layout spread its sums across warps and needed a layout change before the product, each a trip
    # through shared memory with CTA barriers (9 BAR.SYNC for a q/k/v phase in the sm_90 SASS, against 1
    # here, the store's). With KC = SPREAD_WIDTH each weight row lies in one warp: its sums are shuffles.
    # The copies are plain loads: after a barrier's acquire (which invalidates L1) L1 serves them.
    if _INTERPRETED:  # one copy broadcasts to the same numbers, without BN times the interpreter's work
        r = tl.arange(0, 1)[:, None, None]
    else:
        r = tl.arange(0, BN)[:, None, None]
    c = tl.arange(0, CP)[None, :, None]
    k = tl.arange(0, KC)[None, None, :]
    return tl.load(ptr + (c * KC + k + 0 * r), mask=c < C, other=0.0).to(tl.float32)


@triton.jit
def _activation(ptr, BN: tl.constexpr, C: tl.constexpr, CP: tl.constexpr, KC: tl.constexpr,
                SPREAD: tl.constexpr):
    # An activation row as `_dot` takes it: [BN, CP, KC] (spread) or [CP, KC].
    if SPREAD:
        return _spread(ptr, BN, C, CP, KC)
    else:
        return _vector(ptr, C, CP, KC)


@triton.jit
def _tile(w_ptr, lo, hi, C: tl.constexpr, CP: tl.constexpr, KC: tl.constexpr, BN: tl.constexpr):
    # Weight rows lo..hi of W [N, C * KC] as [BN, CP, KC] (masked past hi and past C).
    return _strided_tile(w_ptr, lo, hi, C * KC, C, CP, KC, BN)


@triton.jit
def _strided_tile(w_ptr, lo, hi, STRIDE: tl.constexpr, C: tl.constexpr, CP: tl.constexpr, KC: tl.constexpr,
                  BN: tl.constexpr):
    # Rows lo..hi of the first C * KC columns of W [N, STRIDE] as [BN, CP, KC] (masked past hi and past C).
    n = lo + tl.arange(0, BN)
    c = tl.arange(0, CP)
    k = tl.arange(0, KC)
    off = n.to(tl.int64)[:, None, None] * STRIDE + (c * KC)[None, :, None] + k[None, None, :]
    # The mask varies along rows and chunks only, so each thread's contiguous K run loads as 16-byte vectors
    # (a mask term along K, even an always-true one, made every load a 2-byte one).
    mask = (n < hi)[:, None, None] & (c < C)[None, :, None]
    return tl.load(w_ptr + off, mask=mask, other=0.0)


@triton.jit
def _dot(w, a, SPREAD: tl.constexpr):
    # [BN, CP, KC] weights times an activation ([BN, CP, KC] spread, or [CP, KC]) -> [BN] fp32 sums.
    if SPREAD:
        return tl.sum(tl.sum(w.to(tl.float32) * a, axis=2), axis=1)
    else:
        return tl.sum(tl.sum(w.to(tl.float32) * a[None, :, :], axis=2), axis=1)


@triton.jit
def _rms(x, w_ptr, eps, n, like_ptr, BN: tl.constexpr, C: tl.constexpr, CP: tl.constexpr, KC: tl.constexpr,
         SPREAD: tl.constexpr):
    # RMSNorm of an activation row (as `_activation` gives it) as the eager path rounds it:
    # weight * (x * rsqrt(mean x^2 + eps)).to(dtype).
    if SPREAD:
        w = _spread(w_ptr, BN, C, CP, KC)
        inv = tl.rsqrt(tl.sum(tl.sum(x * x, axis=2), axis=1) / n + eps)[:, None, None]
    else:
        c = tl.arange(0, CP)[:, None]
        k = tl.arange(0, KC)[None, :]
        w = tl.load(w_ptr + c * KC + k, mask=c < C, other=0.0).to(tl.float32)
        inv = tl.rsqrt(tl.sum(tl.sum(x * x, axis=1), axis=0) / n + eps)
    return _round(w * _round(x * inv, like_ptr), like_ptr)


@triton.jit
def _when(hi, lo, phase, first, last):
    # A span's end, or its start (an empty span: the tile loads nothing) where `phase` is not run.
    return tl.where((phase >= first) & (phase <= last), hi, lo)


@triton.jit
def _input_row(x_in_ptr, code_ptr, i, HIDDEN: tl.constexpr, GATHER: tl.constexpr):
    # Activation row i of the launch's input: a row of x, or with GATHER the embedding table's row of code[i].
    if GATHER:
        return x_in_ptr + tl.load(code_ptr + i).to(tl.int64) * HIDDEN
    else:
        return x_in_ptr + i * HIDDEN


@triton.jit
def _new_key_value(row, kvh, t, cos_ptr, sin_ptr, kw, kwp, d, dp, is_low, eps, x_ptr, k_ptr, v_ptr,
                   WIDTH: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr):
    # Token t's key (normed, rotated) and value for kv head kvh, from its q/k/v row, in the caches' dtype.
    cos = tl.load(cos_ptr + t * HEAD_DIM + d)
    sin = tl.load(sin_ptr + t * HEAD_DIM + d)
    kcol = row + WIDTH + kvh * HEAD_DIM
    kn = tl.load(kcol + d, cache_modifier=".cg").to(tl.float32)[None, :]
    knp = tl.load(kcol + dp, cache_modifier=".cg").to(tl.float32)[None, :]
    k_new = _norm_rope(kn, knp, kw, kwp, cos, sin, is_low, eps, HEAD_DIM, x_ptr)
    k_new = tl.sum(k_new, axis=0).to(k_ptr.dtype.element_ty)  # [D]: the one row
    v_new = tl.load(kcol + KV_HEADS * HEAD_DIM + d, cache_modifier=".cg").to(v_ptr.dtype.element_ty)
    return k_new, v_new


@triton.jit
def _query(row, heads, t, cos_ptr, sin_ptr, qw, qwp, d, dp, is_low, eps, x_ptr, HEAD_DIM: tl.constexpr):
    # Token t's query heads `heads` [G, D] (normed, rotated, fp32) from its q/k/v row.
    cos = tl.load(cos_ptr + t * HEAD_DIM + d)
    sin = tl.load(sin_ptr + t * HEAD_DIM + d)
    q = tl.load(row + heads[:, None] * HEAD_DIM + d[None, :], cache_modifier=".cg").to(tl.float32)
    qp = tl.load(row + heads[:, None] * HEAD_DIM + dp[None, :], cache_modifier=".cg")
    return _norm_rope(q, qp.to(tl.float32), qw, qwp, cos, sin, is_low, eps, HEAD_DIM, x_ptr)


@triton.jit
def _attend(q, keys, vals, p, last, scale):
    # Softmax attention of q [G, D] over positions p <= last of keys/vals [P, D] (fp32) -> [G, D].
    scores = tl.sum(q[:, None, :] * keys[None, :, :], axis=2) * scale  # [G, P]
    scores = tl.where((p <= last)[None, :], scores, float("-inf"))
    e = tl.exp(scores - tl.max(scores, axis=1)[:, None])
    probs = e / tl.sum(e, axis=1)[:, None]
    return tl.sum(probs[:, :, None] * vals[None, :, :], axis=1)


@triton.jit
def _attention(qkv_ptr, attn_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, x_ptr, layer, r, kvh, rows, position, eps, scale,
               qw, qwp, kw, kwp, d, dp, is_low, write, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
               GROUP: tl.constexpr, CAP: tl.constexpr, CAP_P2: tl.constexpr, N_QKV: tl.constexpr,
               WIDTH: tl.constexpr, TOKENS: tl.constexpr):
    # Row r's tokens, kv head kvh: the group's query heads over the row's positions -> attn (rounded to its
    # dtype, as the unfused path stores it); the new keys and values go to the cache where `write`.
    g = tl.arange(0, GROUP)
    p = tl.arange(0, CAP_P2)
    heads = kvh * GROUP + g
    base = ((layer * rows + r) * KV_HEADS + kvh).to(tl.int64) * (CAP * HEAD_DIM)
    addr = base + p[:, None] * HEAD_DIM + d[None, :]
    if TOKENS == 1:
        # Cached positions [0, position) of this row, then the new token from registers.
        row = qkv_ptr + r * N_QKV
        q = _query(row, heads, 0, cos_ptr, sin_ptr, qw, qwp, d, dp, is_low, eps, x_ptr, HEAD_DIM)
        k_new, v_new = _new_key_value(row, kvh, 0, cos_ptr, sin_ptr, kw, kwp, d, dp, is_low, eps, x_ptr, k_ptr,
                                      v_ptr, WIDTH, KV_HEADS, HEAD_DIM)
        old = (p < position)[:, None]
        keys = tl.load(k_ptr + addr, mask=old, other=0.0, cache_modifier=".cg").to(tl.float32)
        vals = tl.load(v_ptr + addr, mask=old, other=0.0, cache_modifier=".cg").to(tl.float32)
        new = (p == position)[:, None]
        keys = tl.where(new, k_new.to(tl.float32)[None, :], keys)
        vals = tl.where(new, v_new.to(tl.float32)[None, :], vals)
        attn = _attend(q, keys, vals, p, position, scale)
        tl.store(attn_ptr + r * WIDTH + heads[:, None] * HEAD_DIM + d[None, :], attn)
        at = base + position * HEAD_DIM + d
        tl.store(k_ptr + at, k_new, mask=write & (d >= 0))
        tl.store(v_ptr + at, v_new, mask=write & (d >= 0))
    else:
        # Several tokens of a row (a frame's two prompt tokens): every token's key and value into the cache
        # first, then each token attends over the cache up to its own position. The CTA barrier makes the
        # stores visible to the whole program; the values read back are the rounded ones a later pass reads,
        # as the one-token branch merges them. Each program reads back what it stored itself, so every caller
        # writes here (programs sharing a kv head store the same bits).
        for t in tl.static_range(TOKENS):
            row = qkv_ptr + (r * TOKENS + t) * N_QKV
            k_new, v_new = _new_key_value(row, kvh, t, cos_ptr, sin_ptr, kw, kwp, d, dp, is_low, eps, x_ptr,
                                          k_ptr, v_ptr, WIDTH, KV_HEADS, HEAD_DIM)
            at = base + (position + t) * HEAD_DIM + d
            tl.store(k_ptr + at, k_new)
            tl.store(v_ptr + at, v_new)
        tl.debug_barrier()
        for t in tl.static_range(TOKENS):
            i = r * TOKENS + t
            row = qkv_ptr + i * N_QKV
            q = _query(row, heads, t, cos_ptr, sin_ptr, qw, qwp, d, dp, is_low, eps, x_ptr, HEAD_DIM)
            seen = (p <= position + t)[:, None]
            keys = tl.load(k_ptr + addr, mask=seen, other=0.0, cache_modifier=".cg").to(tl.float32)
            vals = tl.load(v_ptr + addr, mask=seen, other=0.0, cache_modifier=".cg").to(tl.float32)
            attn = _attend(q, keys, vals, p, position + t, scale)
            tl.store(attn_ptr + i * WIDTH + heads[:, None] * HEAD_DIM + d[None, :], attn)


@triton.jit
def _after_attention(res_row, part_row, col, mask, like_ptr, HIDDEN: tl.constexpr, KV_HEADS: tl.constexpr):
    # The residual row after attention, at `col`: res + o, o the kv heads' partials summed in head order (the
    # same order wherever it is computed), each rounded as the unfused path rounds o and the sum.
    o = tl.load(part_row + col, mask=mask, other=0.0, cache_modifier=".cg")
    for h in tl.static_range(1, KV_HEADS):
        o += tl.load(part_row + h * HIDDEN + col, mask=mask, other=0.0, cache_modifier=".cg")
    res = tl.load(res_row + col, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    return _round(res + _round(o, like_ptr), like_ptr)
