"""Sliding-window attention of a streaming decoder, with each slot's keys and values in a ring buffer in place.

A call brings T new frames per stream, as the packed projection `qkv [B * T, (Hq + 2 * Hkv) * D]`. Frame t of
a stream at position p (frames before the call) has absolute position p + t: its query and key get RoPE
(rotate-half) there, its key and value are written to the ring at `(p + t) % R`, and it attends to the keys
of positions `p + t - (window - 1) .. p + t` that exist (>= 0). The ring holds R >= window - 1 + T positions,
so the call's writes never overwrite a key one of its queries still needs. A slot is reset by its position
alone: keys of positions before 0 are never read (masked by `where`, so whatever a reused ring holds cannot
reach the output).

`window_attention` runs a Triton kernel on CUDA (one program per stream and KV head, fp32 math whatever the
storage dtype) and a PyTorch twin elsewhere.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU build of torch ships no Triton
    triton = None


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [..., D] (rotate-half layout) in fp32 for integer `positions` [...]."""
    freqs = positions.float().unsqueeze(-1) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.to(x.dtype) + torch.cat((-x2, x1), dim=-1) * sin.to(x.dtype)


def window_attention(qkv: torch.Tensor, k_ring: torch.Tensor, v_ring: torch.Tensor, positions: torch.Tensor,
                     slots: torch.Tensor, frames: int, heads: int, window: int, inv_freq: torch.Tensor,
                     kernel: bool | None = None) -> torch.Tensor:
    """qkv [B * frames, (heads + 2 * kv_heads) * D] -> attention output [B * frames, heads * D] (qkv's dtype).

    `k_ring`, `v_ring [S, R, kv_heads, D]` are updated in place with the call's keys and values; `positions`
    [S] are the frames each slot decoded before the call; `slots` [B]."""
    kv_heads, dim = k_ring.shape[2], k_ring.shape[3]
    ring = k_ring.shape[1]
    if ring < window - 1 + frames:
        raise ValueError(f"a ring of {ring} positions cannot take {frames} frames with a window of {window}")
    b = slots.shape[0]
    out = torch.empty(b * frames, heads * dim, dtype=qkv.dtype, device=qkv.device)
    use_kernel = kernel if kernel is not None else (triton is not None and qkv.is_cuda)
    if use_kernel:
        _launch(qkv, k_ring, v_ring, positions, slots, frames, heads, window, inv_freq, out)
        return out
    q, k, v = qkv.view(b, frames, heads + 2 * kv_heads, dim).split([heads, kv_heads, kv_heads], dim=2)
    start = positions[slots]  # [B]
    qpos = start[:, None] + torch.arange(frames, device=qkv.device)  # [B, T]
    cos, sin = rope_tables(qpos, inv_freq)
    q = _rotate(q, cos[:, :, None], sin[:, :, None])
    k = _rotate(k, cos[:, :, None], sin[:, :, None])
    rows = slots[:, None]
    k_ring[rows, qpos % ring] = k.to(k_ring.dtype)
    v_ring[rows, qpos % ring] = v.to(v_ring.dtype)
    kpos = start[:, None] + torch.arange(-(window - 1), frames, device=qkv.device)  # [B, W - 1 + T]
    keys = k_ring[rows, kpos % ring]  # [B, W - 1 + T, kv_heads, D]
    values = v_ring[rows, kpos % ring]
    exists = (kpos >= 0)[:, :, None, None]
    zero = torch.zeros((), dtype=keys.dtype, device=keys.device)
    keys, values = torch.where(exists, keys, zero), torch.where(exists, values, zero)
    gap = qpos[:, :, None] - kpos[:, None, :]
    mask = ((gap >= 0) & (gap < window) & (kpos[:, None, :] >= 0))[:, None]
    o = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2).to(q.dtype),
                                       values.transpose(1, 2).to(q.dtype), attn_mask=mask,
                                       enable_gqa=heads != kv_heads)
    out.copy_(o.transpose(1, 2).reshape(b * frames, heads * dim))
    return out


if triton is not None:

    @triton.jit
    def _window_kernel(qkv_ptr, k_ptr, v_ptr, pos_ptr, slots_ptr, freq_ptr, out_ptr,
                       T, RING, WINDOW, SCALE, HEADS: tl.constexpr, KV_HEADS: tl.constexpr, D: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
        # One program per (stream, KV head). Few queries (T is 1 per step in the engine) against at most
        # window - 1 + T keys: vector math over key blocks with an online softmax, no matrix units.
        b = tl.program_id(0)
        kh = tl.program_id(1)
        half: tl.constexpr = D // 2
        group: tl.constexpr = HEADS // KV_HEADS
        width: tl.constexpr = (HEADS + 2 * KV_HEADS) * D
        slot = tl.load(slots_ptr + b)
        start = tl.load(pos_ptr + slot)
        dd = tl.arange(0, D)
        partner = (dd + half) % D  # rotate-half: element d pairs with d +- D/2
        sign = tl.where(dd < half, -1.0, 1.0)
        inv_freq = tl.load(freq_ptr + dd % half)
        kslot = slot * RING * KV_HEADS * D
        # The call's keys (rotated) and values into the ring; the barrier makes them visible to every thread
        # of this program before the window is read back.
        t = tl.arange(0, BLOCK_T)
        m2 = (t < T)[:, None]
        row = (b * T + t).to(tl.int64)[:, None] * width
        ang = (start + t).to(tl.float32)[:, None] * inv_freq[None, :]
        kcol = (HEADS + kh) * D
        k = tl.load(qkv_ptr + row + kcol + dd[None, :], mask=m2, other=0.0).to(tl.float32)
        kp = tl.load(qkv_ptr + row + kcol + partner[None, :], mask=m2, other=0.0).to(tl.float32)
        rdst = kslot + ((start + t) % RING).to(tl.int64)[:, None] * (KV_HEADS * D) + kh * D + dd[None, :]
        tl.store(k_ptr + rdst, (k * tl.cos(ang) + kp * tl.sin(ang) * sign[None, :]).to(k_ptr.dtype.element_ty),
                 mask=m2)
        v = tl.load(qkv_ptr + row + (HEADS + KV_HEADS + kh) * D + dd[None, :], mask=m2, other=0.0)
        tl.store(v_ptr + rdst, v.to(v_ptr.dtype.element_ty), mask=m2)
        tl.debug_barrier()
        j = tl.arange(0, BLOCK_K)
        for ti in range(0, T):
            qpos = start + ti
            qang = qpos.to(tl.float32) * inv_freq
            qcos = tl.cos(qang)
            qsin = tl.sin(qang) * sign
            qrow = (b * T + ti).to(tl.int64) * width
            first = qpos - (WINDOW - 1)
            first = tl.where(first > 0, first, 0)
            for g in tl.static_range(group):
                h = kh * group + g
                q = tl.load(qkv_ptr + qrow + h * D + dd).to(tl.float32)
                qp = tl.load(qkv_ptr + qrow + h * D + partner).to(tl.float32)
                q = (q * qcos + qp * qsin) * SCALE
                m_i = float("-inf")
                l_i = 0.0
                acc = tl.zeros([D], dtype=tl.float32)
                for k0 in range(0, WINDOW, BLOCK_K):
                    kpos = first + k0 + j
                    valid = kpos <= qpos
                    addr = kslot + (kpos % RING).to(tl.int64)[:, None] * (KV_HEADS * D) + kh * D + dd[None, :]
                    keys = tl.load(k_ptr + addr, mask=valid[:, None], other=0.0).to(tl.float32)
                    s = tl.where(valid, tl.sum(keys * q[None, :], axis=1), float("-inf"))
                    m_new = tl.maximum(m_i, tl.max(s, axis=0))
                    alpha = tl.exp(m_i - m_new)
                    p = tl.where(valid, tl.exp(s - m_new), 0.0)
                    vals = tl.load(v_ptr + addr, mask=valid[:, None], other=0.0).to(tl.float32)
                    acc = acc * alpha + tl.sum(tl.where(valid[:, None], vals, 0.0) * p[:, None], axis=0)
                    l_i = l_i * alpha + tl.sum(p, axis=0)
                    m_i = m_new
                tl.store(out_ptr + (b * T + ti).to(tl.int64) * (HEADS * D) + h * D + dd,
                         (acc / l_i).to(out_ptr.dtype.element_ty))


# Keys per block of the kernel's walk over the window, and its warps (benchmarks/codec_tune.py measures the step
# with others: 128-key blocks, with 2 or 4 warps, were 2-3 % slower on the H200; docs/benchmarks.md).
KEY_BLOCK = 32
WARPS = 2


def _launch(qkv, k_ring, v_ring, positions, slots, frames, heads, window, inv_freq, out):
    kv_heads, dim = k_ring.shape[2], k_ring.shape[3]
    block_t = max(2, 1 << (frames - 1).bit_length())
    grid = (slots.shape[0], kv_heads)
    _window_kernel[grid](qkv, k_ring, v_ring, positions, slots, inv_freq, out, frames, k_ring.shape[1], window,
                         1.0 / math.sqrt(dim), HEADS=heads, KV_HEADS=kv_heads, D=dim, BLOCK_T=block_t,
                         BLOCK_K=KEY_BLOCK, num_warps=WARPS)
