"""A decode token's whole attention in one kernel: q/k head RMSNorm, rotary, the KV write and the attention.

At one new token per row the attention block of a layer was ~10 small kernels on CUDA (two compiled
norm+rotary kernels, two cache writes, the attention, its transposes), and a frame runs 103 layer passes
(28 talker + 15 x 5 code predictor): the step was bound by kernel count, not math. Here one program per
(row, kv head) reads the packed q/k/v projection of its row, normalises and rotates q and k, writes k and v
into the cache, and attends over the row's cached positions plus the new one with an online softmax, writing
the output in the layout `o_proj` reads. On the paged cache a row's positions are split over several programs
and a second kernel joins their partial softmaxes (see `SPLITS`).

Two cache layouts share the kernel: the talker's paged cache ([blocks, block_size, kv_heads, D], a block table
per row) and the code predictor's contiguous per-frame cache ([B, kv_heads, capacity, D], every row at the
same position). The new key is used from registers after the rounding the cache applies, never read back.

`fused_decode_attention_reference` is the same contract in PyTorch (the composition the unfused path runs):
the oracle the kernel is tested against, on the CPU under Triton's interpreter and on the GPU. Rounding
follows the eager path: q and k are rounded to the activation dtype after the norm, after the weight and after
each rotary product, as `rms_norm_rope` does eagerly; the scores, softmax and weighted sum run in fp32 (for
the talker's bf16/fp16 rows as tensor-core products: q.k in the cache's dtype with fp32 sums, p.v as three TF32
products, about fp32's precision).
"""

from __future__ import annotations

import torch

from legato.layers import pdl
from legato.layers.fused import rms_norm_rope

try:  # Triton ships with CUDA builds of torch; the CPU build has none.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

# The engine's decode path uses the kernel on CUDA when this is on (benchmarks turn it off to measure the
# unfused path in the same process).
ENABLED = True


def available(x: torch.Tensor) -> bool:
    return ENABLED and triton is not None and x.is_cuda


def split_qkv(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int):
    """qkv [B, (heads + 2 kv_heads) * D] -> q [B, heads, D], k and v [B, kv_heads, D] (views)."""
    b = qkv.shape[0]
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    return q.view(b, heads, head_dim), k.view(b, kv_heads, head_dim), v.view(b, kv_heads, head_dim)


def fused_decode_attention_reference(
    qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float, cos: torch.Tensor,
    sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int, *,
    block_tables: torch.Tensor | None = None, context_lens: torch.Tensor | None = None, position: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The kernel's contract in PyTorch -> [B, heads * D] (written into `out` when given).

    Paged (block_tables and context_lens given): k_cache [blocks, block_size, kv_heads, D]; row b's new token
    sits at position context_lens[b] - 1 of its block table. Contiguous (neither given): k_cache
    [B, kv_heads, capacity, D]; every row's new token sits at `position`. cos/sin [B, D] (fp32)."""
    b = qkv.shape[0]
    kv_heads, d = (k_cache.shape[2], k_cache.shape[3]) if block_tables is not None else k_cache.shape[1::2]
    q, k, v = split_qkv(qkv, heads, kv_heads, d)
    q = rms_norm_rope(q, q_weight, eps, cos[:, None], sin[:, None]).float()
    k = rms_norm_rope(k, k_weight, eps, cos[:, None], sin[:, None])
    group = heads // kv_heads
    attn = torch.empty(b, heads, d, dtype=torch.float32, device=qkv.device)
    for r in range(b):
        if block_tables is not None:
            pos = int(context_lens[r]) - 1
            bs = k_cache.shape[1]
            blk = block_tables[r, pos // bs]
            k_cache[blk, pos % bs] = k[r].to(k_cache.dtype)
            v_cache[blk, pos % bs] = v[r].to(v_cache.dtype)
            n_blocks = pos // bs + 1
            keys = k_cache[block_tables[r, :n_blocks].long()].flatten(0, 1)[: pos + 1]  # [T, kv_heads, D]
            vals = v_cache[block_tables[r, :n_blocks].long()].flatten(0, 1)[: pos + 1]
            keys, vals = keys.transpose(0, 1), vals.transpose(0, 1)
        else:
            pos = position
            k_cache[r, :, pos] = k[r].to(k_cache.dtype)
            v_cache[r, :, pos] = v[r].to(v_cache.dtype)
            keys, vals = k_cache[r, :, : pos + 1], v_cache[r, :, : pos + 1]  # [kv_heads, T, D]
        keys = keys.float().repeat_interleave(group, 0)
        vals = vals.float().repeat_interleave(group, 0)
        probs = torch.softmax(torch.einsum("hd,htd->ht", q[r], keys) * d**-0.5, dim=-1)
        attn[r] = torch.einsum("ht,htd->hd", probs, vals)
    result = out if out is not None else torch.empty(b, heads * d, dtype=qkv.dtype, device=qkv.device)
    result.copy_(attn.reshape(b, heads * d))
    return result


# The paged (talker) path splits each row's cached positions over up to SPLITS programs per (row, kv head),
# flash-decoding style, and a second small kernel combines their partial softmaxes. One program walking a
# ~200-token context alone was a chain of dependent loads: ~20 us at batch 1 and ~45 us at batch 64 per talker
# layer, most of the attention's time. From ONE_SPLIT_ROWS rows a launch has programs enough (rows x kv heads)
# without splitting, and the splits' partial results and combine only cost: measured on the H200
# (benchmarks/attention_tune.py, docs/benchmarks.md), one split took 27-35 % less time than 16 at 64 and 256 rows,
# about the same at 16 rows, and 40-140 % more at one row. The split count thus depends on the launch's row count,
# as cuBLAS's kernel choice does; `batch_invariant` runs fixed row counts, so its results stay batch-invariant.
SPLITS = 16
ONE_SPLIT_ROWS = 32
MIN_SPAN = 64  # cached positions a split takes at least, so short rows use few splits
BLOCK_N = 32  # positions per loop iteration of the paged path
# Warps per program: 4 below WIDE_ROWS rows, 2 from there. Measured on the H200 (benchmarks/attention_tune.py,
# docs/benchmarks.md): at 64 and 256 rows 2 warps took 2-30 % less time, at 1 and 16 rows 10-17 % more.
WARPS = (4, 2)
WIDE_ROWS = 32
# The talker's paged rows compute scores and weighted sums as tensor-core products (q padded to 16 rows): 3-18 %
# faster than CUDA-core reductions at 1-256 rows on the H200. The code predictor's rows (at most 16 positions)
# stay on the reductions, which were faster there (up to 33 % at 256 rows). fp32 caches stay on the reductions
# on CUDA, where the products' IEEE mode was never measured; the interpreter checks run it (DOT_FP32).
DOT = True
DOT_FP32 = False


def uses_dot(paged: bool, q_dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int) -> bool:
    """Tensor-core products for this launch: q must share the cache's dtype, so that its rounded values cast
    to it exactly."""
    return (DOT and paged and q_dtype == cache_dtype and (cache_dtype != torch.float32 or DOT_FP32)
            and head_dim >= 16 and head_dim & (head_dim - 1) == 0)


def warps(rows: int) -> int:
    return WARPS[rows >= WIDE_ROWS]


def splits(rows: int) -> int:
    """Programs a paged row's cached positions split over, in a launch of `rows` rows."""
    return SPLITS if rows < ONE_SPLIT_ROWS else 1


def fused_decode_attention(
    qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float, cos: torch.Tensor,
    sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int, *,
    block_tables: torch.Tensor | None = None, context_lens: torch.Tensor | None = None, position: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton launches for the contract of `fused_decode_attention_reference` (see there): one for the
    contiguous layout, two (split positions, then combine) for the paged one."""
    b = qkv.shape[0]
    paged = block_tables is not None
    if paged:
        _, block_size, kv_heads, d = k_cache.shape
        # Paged: the new token's address comes from the block table; positions live in context_lens.
        stride_kb, stride_kp, stride_kh = k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)
        tables, lens, tables_stride = block_tables, context_lens, block_tables.stride(0)
    else:
        _, kv_heads, capacity, d = k_cache.shape
        if not 0 <= position < capacity:
            raise RuntimeError(f"KV cache full: position {position}, capacity {capacity}")
        block_size = 1  # unused
        stride_kb, stride_kp, stride_kh = k_cache.stride(0), k_cache.stride(2), k_cache.stride(1)
        tables = lens = qkv  # unused pointers
        tables_stride = 0
    if k_cache.stride(-1) != 1 or v_cache.stride() != k_cache.stride() or qkv.stride(-1) != 1:
        raise ValueError("fused_decode_attention needs unit-stride head dims and k/v caches of one layout")
    group = heads // kv_heads
    if out is None:
        out = torch.empty(b, heads * d, dtype=qkv.dtype, device=qkv.device)
    elif out.shape != (b, heads * d) or out.stride(-1) != 1:
        raise ValueError(f"out must be [{b}, {heads * d}] with unit stride, got {tuple(out.shape)}")
    cos, sin = cos.float().expand(b, d), sin.float().expand(b, d)
    n_splits = splits(b) if paged else 1
    # Partial softmaxes of the splits: running max, sum and unnormalised output per (row, head, split).
    part_ml = torch.empty(b, heads, n_splits, 2, dtype=torch.float32, device=qkv.device) if n_splits > 1 else out
    part_acc = torch.empty(b, heads, n_splits, d, dtype=torch.float32, device=qkv.device) if n_splits > 1 else out
    group_pad = max(triton.next_power_of_2(group), 1)
    dot = uses_dot(paged, qkv.dtype, k_cache.dtype, d)
    meta = dict(HEADS=heads, KV_HEADS=kv_heads, GROUP=group, GROUP_PAD=max(group_pad, 16) if dot else group_pad,
                HEAD_DIM=d, BLOCK_SIZE=block_size if paged else 16, PAGED=paged, SPLITS=n_splits,
                MIN_SPAN=MIN_SPAN, BLOCK_N=BLOCK_N if paged else 16)
    exact = k_cache.dtype == torch.float32  # fp32 caches: fp32 products, as the eager path
    on = pdl.launch(qkv)
    _fused_decode_kernel[(b, kv_heads, n_splits)](
        qkv, q_weight, k_weight, cos, sin, k_cache, v_cache, out, tables, lens, part_ml, part_acc,
        eps, d**-0.5, position,
        qkv.stride(0), cos.stride(0), sin.stride(0), stride_kb, stride_kp, stride_kh, tables_stride, out.stride(0),
        **meta, DOT=dot, PRECISION="ieee" if exact else "tf32", PV_PRECISION="ieee" if exact else "tf32x3",
        PDL=on, num_warps=warps(b), **pdl.launch_options(on),
    )
    if n_splits > 1:
        _combine_splits_kernel[(b, kv_heads)](lens, part_ml, part_acc, out, out.stride(0),
                                              **{**meta, "GROUP_PAD": group_pad}, PDL=on, **pdl.launch_options(on))
    return out


if triton is not None:

    @triton.jit
    def _round(x, like_ptr):
        # The eager path rounds every intermediate to the activation dtype; so does the kernel (fp32 math).
        return x.to(like_ptr.dtype.element_ty).to(tl.float32)

    @triton.jit
    def _norm_rope(x, xp, w, wp, cos, sin, is_low, eps, HEAD_DIM: tl.constexpr, like_ptr):
        # x [R, D] and its rotate-half partner xp (x at (d + D/2) mod D), both raw; the norm's scale is one
        # per row, shared by the two. Returns the normalised, rotated rows, rounded as the eager path does.
        inv = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)
        xn = _round(w[None, :] * _round(x * inv[:, None], like_ptr), like_ptr)
        xpn = _round(wp[None, :] * _round(xp * inv[:, None], like_ptr), like_ptr)
        rot = tl.where(is_low[None, :], -xpn, xpn)
        c = _round(cos, like_ptr)
        s = _round(sin, like_ptr)
        return _round(_round(xn * c[None, :], like_ptr) + _round(rot * s[None, :], like_ptr), like_ptr)

    @triton.jit
    def _span(cached, SPLITS: tl.constexpr, MIN_SPAN: tl.constexpr, BLOCK_N: tl.constexpr):
        # A row's positions per split: at least MIN_SPAN, a multiple of BLOCK_N.
        span = tl.maximum((cached + SPLITS - 1) // SPLITS, MIN_SPAN)
        return (span + BLOCK_N - 1) // BLOCK_N * BLOCK_N

    @triton.jit
    def _kv_block(k_ptr, v_ptr, tables_ptr, b, kvh, start, hi, s, d, stride_kb, stride_kp, stride_kh, stride_tb,
                  BLOCK_SIZE: tl.constexpr, PAGED: tl.constexpr):
        # Keys and values [BLOCK_N, D] of cached positions start + s (zeros from hi on), in the cache's dtype.
        p_idx = start + s
        valid = p_idx < hi
        if PAGED:
            blk_i = tl.load(tables_ptr + b * stride_tb + p_idx // BLOCK_SIZE, mask=valid, other=0)
            base = blk_i.to(tl.int64) * stride_kb + kvh * stride_kh + (p_idx % BLOCK_SIZE) * stride_kp
            base = base[:, None]
        else:
            base = b.to(tl.int64) * stride_kb + kvh * stride_kh + p_idx[:, None] * stride_kp
        keys = tl.load(k_ptr + base + d[None, :], mask=valid[:, None], other=0.0)
        vals = tl.load(v_ptr + base + d[None, :], mask=valid[:, None], other=0.0)
        return keys, vals

    @triton.jit
    def _fused_decode_kernel(
        qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, lens_ptr, ml_ptr, acc_ptr,
        eps, scale, position,
        stride_row, stride_cos, stride_sin, stride_kb, stride_kp, stride_kh, stride_tb, stride_out,
        HEADS: tl.constexpr, KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAGED: tl.constexpr, SPLITS: tl.constexpr,
        MIN_SPAN: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
        PV_PRECISION: tl.constexpr, PDL: tl.constexpr = False,
    ):
        pdl.wait(PDL)  # the row's length, table and q/k/v come from the kernels before
        pdl.release(PDL)
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        # The row's new token sits at `pos`; positions [lo, hi) of the cached ones are this program's.
        if PAGED:
            pos = tl.load(lens_ptr + b) - 1
        else:
            pos = position
        if SPLITS > 1:
            span = _span(pos, SPLITS, MIN_SPAN, BLOCK_N)
            lo = split * span
            hi = tl.minimum(lo + span, pos)
        else:
            lo = 0
            hi = pos
        if (split == 0) | (lo < pos):  # a split past the row's end has nothing to do (the combine skips it)
            d = tl.arange(0, HEAD_DIM)
            s = tl.arange(0, BLOCK_N)
            # The first block of cached positions is requested before the q/k work, which it does not need.
            keys, vals = _kv_block(k_ptr, v_ptr, tables_ptr, b, kvh, lo, hi, s, d, stride_kb, stride_kp, stride_kh,
                                   stride_tb, BLOCK_SIZE, PAGED)
            half: tl.constexpr = HEAD_DIM // 2
            dp = (d + half) % HEAD_DIM
            is_low = d < half
            g = tl.arange(0, GROUP_PAD)
            g_mask = g < GROUP
            row = qkv_ptr + b * stride_row
            heads = kvh * GROUP + g
            q = tl.load(row + heads[:, None] * HEAD_DIM + d[None, :], mask=g_mask[:, None], other=0.0)
            qp = tl.load(row + heads[:, None] * HEAD_DIM + dp[None, :], mask=g_mask[:, None], other=0.0)
            k_off = HEADS * HEAD_DIM + kvh * HEAD_DIM
            v_off = (HEADS + KV_HEADS) * HEAD_DIM + kvh * HEAD_DIM
            k = tl.load(row + k_off + d).to(tl.float32)[None, :]
            kp = tl.load(row + k_off + dp).to(tl.float32)[None, :]
            v = tl.load(row + v_off + d)
            cos = tl.load(cos_ptr + b * stride_cos + d)
            sin = tl.load(sin_ptr + b * stride_sin + d)
            q = _norm_rope(q.to(tl.float32), qp.to(tl.float32), tl.load(qw_ptr + d).to(tl.float32),
                           tl.load(qw_ptr + dp).to(tl.float32), cos, sin, is_low, eps, HEAD_DIM, qkv_ptr)
            k = _norm_rope(k, kp, tl.load(kw_ptr + d).to(tl.float32), tl.load(kw_ptr + dp).to(tl.float32),
                           cos, sin, is_low, eps, HEAD_DIM, qkv_ptr)
            k_new = tl.sum(k, axis=0).to(k_ptr.dtype.element_ty)  # [D]: the one row
            v_new = v.to(v_ptr.dtype.element_ty)

            # Split 0 writes the new token into the cache and starts its softmax with it, from registers.
            if PAGED:
                blk = tl.load(tables_ptr + b * stride_tb + pos // BLOCK_SIZE).to(tl.int64)
                new_addr = blk * stride_kb + (pos % BLOCK_SIZE) * stride_kp + kvh * stride_kh
            else:
                new_addr = b.to(tl.int64) * stride_kb + pos * stride_kp + kvh * stride_kh
            first = split == 0
            tl.store(k_ptr + new_addr + d, k_new, mask=first & (d >= 0))
            tl.store(v_ptr + new_addr + d, v_new, mask=first & (d >= 0))
            m_new_tok = tl.sum(q * k_new.to(tl.float32)[None, :], axis=1) * scale  # [GROUP_PAD]
            m_i = tl.where(first, m_new_tok, float("-inf"))
            l_i = tl.where(first, 1.0, 0.0) + tl.zeros([GROUP_PAD], tl.float32)
            acc = tl.where(first, 1.0, 0.0) * v_new.to(tl.float32)[None, :] + tl.zeros([GROUP_PAD, HEAD_DIM],
                                                                                        tl.float32)
            for start in range(lo, hi, BLOCK_N):
                # The next block's loads go out before this block's math (the chain of dependent loads, not
                # bandwidth, is what a short span waits on).
                next_keys, next_vals = _kv_block(k_ptr, v_ptr, tables_ptr, b, kvh, start + BLOCK_N, hi, s, d,
                                                 stride_kb, stride_kp, stride_kh, stride_tb, BLOCK_SIZE, PAGED)
                valid = start + s < hi
                if DOT:  # q holds values of the cache's dtype already (rounded as the eager path rounds)
                    scores = tl.dot(q.to(keys.dtype), tl.trans(keys), input_precision=PRECISION) * scale
                else:
                    scores = tl.sum(q[:, None, :] * keys.to(tl.float32)[None, :, :], axis=2) * scale
                scores = tl.where(valid[None, :], scores, float("-inf"))  # [GROUP_PAD, BLOCK_N]
                m_new = tl.maximum(m_i, tl.max(scores, axis=1))
                alpha = tl.exp(m_i - m_new)
                p = tl.exp(scores - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                if DOT:  # fp32 probabilities: three TF32 products keep the sum at about fp32's precision
                    pv = tl.dot(p, vals.to(tl.float32), input_precision=PV_PRECISION)
                else:
                    pv = tl.sum(p[:, :, None] * vals.to(tl.float32)[None, :, :], axis=1)
                acc = acc * alpha[:, None] + pv
                m_i = m_new
                keys, vals = next_keys, next_vals
            if SPLITS == 1:
                out = acc / l_i[:, None]
                tl.store(out_ptr + b * stride_out + heads[:, None] * HEAD_DIM + d[None, :],
                         out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
            else:
                part = (b * HEADS + heads) * SPLITS + split  # [GROUP_PAD]
                tl.store(ml_ptr + part * 2, m_i, mask=g_mask)
                tl.store(ml_ptr + part * 2 + 1, l_i, mask=g_mask)
                tl.store(acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=g_mask[:, None])

    @triton.jit
    def _combine_splits_kernel(
        lens_ptr, ml_ptr, acc_ptr, out_ptr, stride_out,
        HEADS: tl.constexpr, KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAGED: tl.constexpr, SPLITS: tl.constexpr,
        MIN_SPAN: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr = False,
    ):
        # Joins the used splits' partial softmaxes of one (row, kv head): out = sum_s w_s acc_s / sum_s w_s l_s,
        # w_s = exp(m_s - max m).
        pdl.wait(PDL)
        pdl.release(PDL)
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        pos = tl.load(lens_ptr + b) - 1
        span = _span(pos, SPLITS, MIN_SPAN, BLOCK_N)
        used = tl.maximum((pos + span - 1) // span, 1)
        d = tl.arange(0, HEAD_DIM)
        g = tl.arange(0, GROUP_PAD)
        sp = tl.arange(0, SPLITS)
        heads = kvh * GROUP + g
        ok = (g < GROUP)[:, None] & (sp < used)[None, :]  # [GROUP_PAD, SPLITS]
        part = (b * HEADS + heads[:, None]) * SPLITS + sp[None, :]
        m = tl.load(ml_ptr + part * 2, mask=ok, other=float("-inf"))
        lsum = tl.load(ml_ptr + part * 2 + 1, mask=ok, other=0.0)
        top = tl.where(g < GROUP, tl.max(m, axis=1), 0.0)  # padded heads have no splits: keep them finite
        w = tl.where(ok, tl.exp(m - top[:, None]), 0.0)
        acc = tl.load(acc_ptr + part[:, :, None] * HEAD_DIM + d[None, None, :], mask=ok[:, :, None], other=0.0)
        num = tl.sum(w[:, :, None] * acc, axis=1)  # [GROUP_PAD, D]
        den = tl.sum(w * lsum, axis=1)
        out = num / tl.where(g < GROUP, den, 1.0)[:, None]
        tl.store(out_ptr + b * stride_out + heads[:, None] * HEAD_DIM + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=(g < GROUP)[:, None])
