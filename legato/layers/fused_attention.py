"""A decode token's whole attention in one kernel: q/k head RMSNorm, rotary, the KV write and the attention.

At one new token per row the attention block of a layer was ~10 small kernels on CUDA (two compiled
norm+rotary kernels, two cache writes, the attention, its transposes), and a frame runs 103 layer passes
(28 talker + 15 x 5 code predictor): the step was bound by kernel count, not math. Here one program per
(row, kv head) reads the packed q/k/v projection of its row, normalises and rotates q and k, writes k and v
into the cache, and attends over the row's cached positions plus the new one with an online softmax, writing
the output in the layout `o_proj` reads.

Two cache layouts share the kernel: the talker's paged cache ([blocks, block_size, kv_heads, D], a block table
per row) and the code predictor's contiguous per-frame cache ([B, kv_heads, capacity, D], every row at the
same position). The new key is used from registers after the rounding the cache applies, never read back.

`fused_decode_attention_reference` is the same contract in PyTorch (the composition the unfused path runs):
the oracle the kernel is tested against, on the CPU under Triton's interpreter and on the GPU. Rounding
follows the eager path: q and k are rounded to the activation dtype after the norm, after the weight and after
each rotary product, as `rms_norm_rope` does eagerly; the scores, softmax and weighted sum run in fp32.
"""

from __future__ import annotations

import torch

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


def fused_decode_attention(
    qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float, cos: torch.Tensor,
    sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int, *,
    block_tables: torch.Tensor | None = None, context_lens: torch.Tensor | None = None, position: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One Triton launch for the contract of `fused_decode_attention_reference` (see there)."""
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
    _fused_decode_kernel[(b, kv_heads)](
        qkv, q_weight, k_weight, cos, sin, k_cache, v_cache, out, tables, lens,
        eps, d**-0.5, position,
        qkv.stride(0), cos.stride(0), sin.stride(0), stride_kb, stride_kp, stride_kh, tables_stride, out.stride(0),
        HEADS=heads, KV_HEADS=kv_heads, GROUP=group, GROUP_PAD=max(triton.next_power_of_2(group), 1),
        HEAD_DIM=d, BLOCK_SIZE=block_size if paged else 16, PAGED=paged,
    )
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
    def _fused_decode_kernel(
        qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, lens_ptr,
        eps, scale, position,
        stride_row, stride_cos, stride_sin, stride_kb, stride_kp, stride_kh, stride_tb, stride_out,
        HEADS: tl.constexpr, KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAGED: tl.constexpr,
    ):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        d = tl.arange(0, HEAD_DIM)
        half: tl.constexpr = HEAD_DIM // 2
        dp = (d + half) % HEAD_DIM
        is_low = d < half
        g = tl.arange(0, GROUP_PAD)
        g_mask = g < GROUP
        row = qkv_ptr + b * stride_row
        heads = kvh * GROUP + g
        q = tl.load(row + heads[:, None] * HEAD_DIM + d[None, :], mask=g_mask[:, None], other=0.0).to(tl.float32)
        qp = tl.load(row + heads[:, None] * HEAD_DIM + dp[None, :], mask=g_mask[:, None], other=0.0).to(tl.float32)
        k_off = HEADS * HEAD_DIM + kvh * HEAD_DIM
        v_off = (HEADS + KV_HEADS) * HEAD_DIM + kvh * HEAD_DIM
        k = tl.load(row + k_off + d).to(tl.float32)[None, :]
        kp = tl.load(row + k_off + dp).to(tl.float32)[None, :]
        v = tl.load(row + v_off + d)
        cos = tl.load(cos_ptr + b * stride_cos + d)
        sin = tl.load(sin_ptr + b * stride_sin + d)
        q = _norm_rope(q, qp, tl.load(qw_ptr + d).to(tl.float32), tl.load(qw_ptr + dp).to(tl.float32),
                       cos, sin, is_low, eps, HEAD_DIM, qkv_ptr)
        k = _norm_rope(k, kp, tl.load(kw_ptr + d).to(tl.float32), tl.load(kw_ptr + dp).to(tl.float32),
                       cos, sin, is_low, eps, HEAD_DIM, qkv_ptr)
        k_new = tl.sum(k, axis=0)  # [D]: the one row
        k_new = k_new.to(k_ptr.dtype.element_ty)
        v_new = v.to(v_ptr.dtype.element_ty)

        # Where this row's new token goes, and how many cached positions precede it.
        if PAGED:
            pos = tl.load(lens_ptr + b) - 1
            blk = tl.load(tables_ptr + b * stride_tb + pos // BLOCK_SIZE).to(tl.int64)
            new_addr = blk * stride_kb + (pos % BLOCK_SIZE) * stride_kp + kvh * stride_kh
        else:
            pos = position
            new_addr = b.to(tl.int64) * stride_kb + pos * stride_kp + kvh * stride_kh
        tl.store(k_ptr + new_addr + d, k_new)
        tl.store(v_ptr + new_addr + d, v_new)

        # The new token first (from registers), then the cached ones with an online softmax.
        m_i = tl.sum(q * k_new.to(tl.float32)[None, :], axis=1) * scale  # [GROUP_PAD]
        l_i = tl.full([GROUP_PAD], 1.0, tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32) + v_new.to(tl.float32)[None, :]
        s = tl.arange(0, BLOCK_SIZE)
        for start in range(0, pos, BLOCK_SIZE):
            p_idx = start + s
            valid = p_idx < pos
            if PAGED:
                blk_i = tl.load(tables_ptr + b * stride_tb + start // BLOCK_SIZE).to(tl.int64)
                base = blk_i * stride_kb + kvh * stride_kh + s[:, None] * stride_kp
            else:
                base = b.to(tl.int64) * stride_kb + kvh * stride_kh + p_idx[:, None] * stride_kp
            keys = tl.load(k_ptr + base + d[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
            vals = tl.load(v_ptr + base + d[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
            scores = tl.sum(q[:, None, :] * keys[None, :, :], axis=2) * scale  # [GROUP_PAD, BLOCK_SIZE]
            scores = tl.where(valid[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * vals[None, :, :], axis=1)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(out_ptr + b * stride_out + heads[:, None] * HEAD_DIM + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=g_mask[:, None])
