"""Packed (variable-length) prefill attention over the paged KV cache: every prompt chunk of a step in one
forward.

The chunks' tokens are concatenated ([T, heads, head_dim]); chunk i covers rows cu_seqlens[i] ..
cu_seqlens[i + 1] - 1 at positions starts[i] ... of its own request, whose KV (earlier chunks and this one)
is in the cache under block table i. Each query row attends causally over its request's positions.

Two implementations with one contract: a Triton kernel on CUDA, which walks each request's blocks in place
(one program per 64-row tile of one chunk and one head; the tiles are listed on the host, so the grid has no
empty programs and the launch shape depends only on the token count), and the per-chunk gather path of
`paged_attention.prefill_attention` on the CPU, which is also the kernel's test oracle.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from legato.layers.host import upload
from legato.layers.paged_attention import prefill_attention

try:  # Triton ships with CUDA builds of torch; the CPU build has none.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

BLOCK_M = 64  # query rows per kernel program


@dataclass
class PackedPrefill:
    """Attention metadata of one packed prefill forward (device tensors, plus the host copies the CPU path
    and the output gather use)."""

    slot_mapping: torch.Tensor  # [T] int64: flat cache slot of each packed token
    positions: torch.Tensor  # [T] int64
    cu_seqlens: torch.Tensor  # [S + 1] int32
    starts: torch.Tensor  # [S] int32: position of each chunk's first token
    block_tables: torch.Tensor  # [S, W] int32
    tiles: torch.Tensor  # [n_tiles, 2] int32: (chunk, 64-row tile of it)
    host_cu: list[int]
    host_starts: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.host_starts)

    @classmethod
    def build(cls, lengths: list[int], starts: list[int], tables: list[list[int]], block_size: int,
              pad_block: int, device: torch.device) -> PackedPrefill:
        """Metadata of chunks of `lengths` tokens starting at positions `starts` of requests with block
        tables `tables` (ragged; padded with `pad_block`, never read)."""
        host = packed_host_arrays(lengths, starts, tables, block_size, pad_block)

        def dev(a: np.ndarray) -> torch.Tensor:
            return upload(a, device)

        return cls(slot_mapping=dev(host["slot_mapping"]), positions=dev(host["positions"]),
                   cu_seqlens=dev(host["cu_seqlens"]), starts=dev(host["starts"]),
                   block_tables=dev(host["block_tables"]), tiles=dev(host["tiles"]),
                   host_cu=host["cu_seqlens"].tolist(), host_starts=list(starts))


def packed_host_arrays(lengths: list[int], starts: list[int], tables: list[list[int]], block_size: int,
                       pad_block: int, width: int | None = None) -> dict[str, np.ndarray]:
    """The host side of `PackedPrefill`'s tensors (block tables `width` wide, else as wide as the longest, padded
    with `pad_block`): slot_mapping and positions int64, the rest int32."""
    n = len(lengths)
    if width is None:
        width = max(len(t) for t in tables)
    cu = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=cu[1:])
    table = np.full((n, width), pad_block, dtype=np.int32)
    for i, t in enumerate(tables):
        table[i, : len(t)] = t
    positions = np.concatenate([np.arange(s, s + m) for s, m in zip(starts, lengths, strict=True)])
    seq_of = np.repeat(np.arange(n), lengths)
    blocks = table[seq_of, positions // block_size].astype(np.int64)
    slot_mapping = blocks * block_size + positions % block_size
    tiles = np.array([(i, t) for i, m in enumerate(lengths) for t in range(-(-m // BLOCK_M))], dtype=np.int32)
    return {"slot_mapping": slot_mapping, "positions": positions.astype(np.int64), "cu_seqlens": cu.astype(np.int32),
            "starts": np.asarray(starts, dtype=np.int32), "block_tables": table, "tiles": tiles.reshape(-1, 2)}


def max_tiles(tokens: int, seqs: int) -> int:
    """Most kernel tiles `seqs` chunks of `tokens` tokens in all can need (each chunk rounds up once)."""
    return -(-tokens // BLOCK_M) + min(seqs, tokens)


def packed_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PackedPrefill,
                             scale: float) -> torch.Tensor:
    """q [T, H, D] of every chunk, whose KV is already written -> [T, H, D]."""
    if q.is_cuda and triton is not None:
        return _packed_prefill_triton(q, k_cache, v_cache, meta, scale)
    return packed_prefill_reference(q, k_cache, v_cache, meta, scale)


def packed_prefill_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PackedPrefill,
                             scale: float) -> torch.Tensor:
    """Chunk by chunk through `prefill_attention`: exactly the per-request computation."""
    out = torch.empty_like(q)
    for i in range(meta.num_seqs):
        lo, hi = meta.host_cu[i], meta.host_cu[i + 1]
        out[lo:hi] = prefill_attention(q[lo:hi], k_cache, v_cache, meta.block_tables[i], meta.host_starts[i], scale)
    return out


if triton is not None:

    @triton.jit
    def _packed_prefill_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        out_ptr,
        tiles_ptr,
        cu_ptr,
        starts_ptr,
        tables_ptr,
        scale,
        stride_qt,
        stride_qh,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_tb,
        stride_ot,
        stride_oh,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        # One program per (tile of one chunk, query head): flash attention with an online softmax over the
        # request's cached positions, read through its block table BLOCK_N at a time.
        tile = tl.program_id(0)
        h = tl.program_id(1)
        seq = tl.load(tiles_ptr + tile * 2)
        mblk = tl.load(tiles_ptr + tile * 2 + 1)
        q0 = tl.load(cu_ptr + seq)
        q_len = tl.load(cu_ptr + seq + 1) - q0
        start = tl.load(starts_ptr + seq)
        offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = offs_m < q_len
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + (q0 + offs_m)[:, None] * stride_qt + h * stride_qh + d[None, :], mask=m_mask[:, None],
                    other=0.0)
        q_pos = start + offs_m
        kvh = h // GROUP
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        end = start + tl.minimum((mblk + 1) * BLOCK_M, q_len)  # keys [0, end) cover every row of the tile
        for n0 in range(0, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < end
            blk = tl.load(tables_ptr + seq * stride_tb + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
            row = blk * stride_kb + (offs_n % BLOCK_SIZE) * stride_ks + kvh * stride_kh
            kv_off = row[:, None] + d[None, :]
            k = tl.load(k_ptr + kv_off, mask=n_mask[:, None], other=0.0)
            v = tl.load(v_ptr + kv_off, mask=n_mask[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            visible = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
            scores = tl.where(visible, scores, float("-inf"))
            # Key 0 is visible to every row, so the first block makes each row's maximum finite.
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(out_ptr + (q0 + offs_m)[:, None] * stride_ot + h * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None])

    def _packed_prefill_triton(q, k_cache, v_cache, meta: PackedPrefill, scale: float) -> torch.Tensor:
        _, n_heads, head_dim = q.shape
        _, block_size, kv_heads, _ = k_cache.shape
        q = q.contiguous()
        out = torch.zeros_like(q)
        grid = (meta.tiles.shape[0], n_heads)
        _packed_prefill_kernel[grid](
            q, k_cache, v_cache, out, meta.tiles, meta.cu_seqlens, meta.starts, meta.block_tables, scale,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            meta.block_tables.stride(0), out.stride(0), out.stride(1),
            GROUP=n_heads // kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_M=BLOCK_M, BLOCK_N=64,
            # float32 engines get full-precision dots (Triton's default for them is tf32)
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        )
        return out
