"""Attention over a paged KV cache.

The cache of one layer is a pair of tensors [num_blocks, block_size, kv_heads, head_dim]; a request owns a
list of blocks (its block table). Decode attention has two implementations with one contract: a Triton
kernel on CUDA (reads the blocks in place, graph-capturable) and a gather-then-softmax path used on the
CPU and as the test oracle for the kernel.
"""

from __future__ import annotations

import torch

try:  # Triton ships with CUDA builds of torch; the CPU build has none.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Stores k/v [N, kv_heads, head_dim] at flat cache slots `slot_mapping` [N] (block * block_size + offset).

    Negative slots (padding rows) must not occur: padded rows point at a scratch block instead, which
    keeps this a single index_copy_ with no data-dependent branches."""
    kf = k_cache.view(-1, *k_cache.shape[2:])
    vf = v_cache.view(-1, *v_cache.shape[2:])
    kf.index_copy_(0, slot_mapping, k.to(kf.dtype))
    vf.index_copy_(0, slot_mapping, v.to(vf.dtype))


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` cached positions of one request: [length, kv_heads, head_dim]."""
    block_size = cache.shape[1]
    n_blocks = (length + block_size - 1) // block_size
    return cache[block_table[:n_blocks]].flatten(0, 1)[:length]


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    start: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of one request's prompt chunk q [L, H, D] at positions start..start+L-1, whose KV
    (and that of every earlier position) is already in the cache -> [L, H, D].

    Prefill runs once per request and chunk, eagerly; it is not on the per-frame hot path."""
    length, n_heads, _ = q.shape
    total = start + length
    keys = gather_kv(k_cache, block_table, total)
    vals = gather_kv(v_cache, block_table, total)
    group = n_heads // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, T, D]
    vals = vals.repeat_interleave(group, dim=1).transpose(0, 1)
    q_pos = torch.arange(start, total, device=q.device)
    k_pos = torch.arange(total, device=q.device)
    mask = k_pos[None, :] <= q_pos[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), keys.to(q.dtype), vals.to(q.dtype), attn_mask=mask, scale=scale
    )
    return out.transpose(0, 1)


def decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [B, H, D] attends to the first context_lens[b] cached positions of request b -> [B, H, D].

    Gathers every request's blocks up to the longest context, then masks: simple and exact, the CPU path."""
    bsz, n_heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    max_blocks = block_tables.shape[1]
    keys = k_cache[block_tables].reshape(bsz, max_blocks * block_size, kv_heads, head_dim)
    vals = v_cache[block_tables].reshape(bsz, max_blocks * block_size, kv_heads, head_dim)
    group = n_heads // kv_heads
    keys = keys.repeat_interleave(group, dim=2).transpose(1, 2)  # [B, H, T, D]
    vals = vals.repeat_interleave(group, dim=2).transpose(1, 2)
    scores = torch.einsum("bhd,bhtd->bht", q.float(), keys.float()) * scale
    pos = torch.arange(keys.shape[2], device=q.device)
    scores = scores.masked_fill(pos[None, None, :] >= context_lens[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("bht,bhtd->bhd", probs, vals.float()).to(q.dtype)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode attention for one new token per request; dispatches to the Triton kernel on CUDA."""
    if q.is_cuda and triton is not None:
        return _decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, scale)
    return decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens, scale)


if triton is not None:

    @triton.jit
    def _paged_decode_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        out_ptr,
        tables_ptr,
        lens_ptr,
        scale,
        stride_qb,
        stride_qh,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_tb,
        stride_ob,
        stride_oh,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
    ):
        # One program per (request, kv head): the GROUP query heads sharing that kv head read each cached
        # block once, with an online softmax over the blocks.
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        ctx = tl.load(lens_ptr + b)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, HEAD_DIM)
        s = tl.arange(0, BLOCK_SIZE)
        g_mask = g < GROUP
        q = tl.load(
            q_ptr + b * stride_qb + (kvh * GROUP + g)[:, None] * stride_qh + d[None, :],
            mask=g_mask[:, None],
            other=0.0,
        ).to(tl.float32)
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        n_blocks = tl.cdiv(ctx, BLOCK_SIZE)
        for i in range(0, n_blocks):
            blk = tl.load(tables_ptr + b * stride_tb + i).to(tl.int64)
            pos = i * BLOCK_SIZE + s
            valid = pos < ctx
            base = blk * stride_kb + kvh * stride_kh
            kv_off = base + s[:, None] * stride_ks + d[None, :]
            k = tl.load(k_ptr + kv_off, mask=valid[:, None], other=0.0).to(tl.float32)
            v = tl.load(v_ptr + kv_off, mask=valid[:, None], other=0.0).to(tl.float32)
            scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GROUP_PAD, BLOCK_SIZE]
            scores = tl.where(valid[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + b * stride_ob + (kvh * GROUP + g)[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=g_mask[:, None],
        )

    def _decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, scale):
        bsz, n_heads, head_dim = q.shape
        _, block_size, kv_heads, _ = k_cache.shape
        group = n_heads // kv_heads
        q = q.contiguous()
        out = torch.empty_like(q)
        _paged_decode_kernel[(bsz, kv_heads)](
            q,
            k_cache,
            v_cache,
            out,
            block_tables,
            context_lens,
            scale,
            q.stride(0),
            q.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            block_tables.stride(0),
            out.stride(0),
            out.stride(1),
            GROUP=group,
            GROUP_PAD=max(triton.next_power_of_2(group), 1),
            HEAD_DIM=head_dim,
            BLOCK_SIZE=block_size,
        )
        return out
