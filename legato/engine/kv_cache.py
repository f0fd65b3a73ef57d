"""The talker's paged KV cache: one tensor pair for all layers, plus the per-forward attention metadata.

It implements the model's `KVCache` contract, so the talker code is the same for the reference loop
(contiguous cache) and the engine (paged cache). The runner sets the metadata before each forward:
`DecodeMeta` for a batch of one new token per request, `PackedPrefill` for the prompt chunks of a step
in one packed forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from legato.engine.config import EngineConfig, codec_dtype_name
from legato.layers.fused_attention import fused_decode_attention
from legato.layers.packed_prefill import PackedPrefill, packed_prefill_attention
from legato.layers.paged_attention import decode_attention, write_kv
from legato.models.qwen3_tts.decoder_layer import KVCache, packed_bytes
from legato.models.qwen3_tts.loader import LoadedModel
from legato.models.qwen3_tts.streaming_codec import slot_bytes


@dataclass
class DecodeMeta:
    slot_mapping: torch.Tensor  # [B] flat cache slot of each row's new token
    block_tables: torch.Tensor  # [B, max_blocks] int32
    context_lens: torch.Tensor  # [B] int32, including the new token


class PagedKVCache(KVCache):
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (num_layers, num_blocks, block_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size
        self.scale = head_dim**-0.5
        self.meta: DecodeMeta | PackedPrefill | None = None

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = self.meta
        kc, vc = self.k[layer], self.v[layer]
        if isinstance(meta, DecodeMeta):
            # q [B, 1, H, D]
            write_kv(kc, vc, k[:, 0], v[:, 0], meta.slot_mapping)
            out = decode_attention(q[:, 0], kc, vc, meta.block_tables, meta.context_lens, self.scale)
            return out.unsqueeze(1)
        if isinstance(meta, PackedPrefill):
            # q [1, T, H, D]: the step's chunks back to back
            write_kv(kc, vc, k[0], v[0], meta.slot_mapping)
            return packed_prefill_attention(q[0], kc, vc, meta, self.scale).unsqueeze(0)
        raise RuntimeError("PagedKVCache used without attention metadata")

    def attend_fused(self, layer: int, qkv: torch.Tensor, attn, cos: torch.Tensor,
                     sin: torch.Tensor) -> torch.Tensor | None:
        meta = self.meta
        if not isinstance(meta, DecodeMeta) or qkv.shape[1] != 1:
            return None  # packed prefill keeps its own kernels
        out = fused_decode_attention(qkv[:, 0], attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps, cos[:, 0],
                                     sin[:, 0], self.k[layer], self.v[layer], attn.heads,
                                     block_tables=meta.block_tables, context_lens=meta.context_lens)
        return out.unsqueeze(1)


def profile_kv_blocks(loaded: LoadedModel, config: EngineConfig) -> int:
    """KV blocks that fit the memory budget: on CUDA, what is left of `gpu_memory_utilization` of the
    device after weights and a reserve for activations and graphs; on the CPU, enough for every slot
    to hold a full-length request capped at 4096 positions."""
    tc = loaded.config.talker_config
    dtype = loaded.talker.codec_head.weight.dtype
    per_block = PagedKVCache.bytes_per_block(tc.num_hidden_layers, config.block_size,
                                             tc.num_key_value_heads, tc.head_dim, dtype)
    device = loaded.talker.codec_head.weight.device
    if device.type != "cuda":
        per_seq = -(-min(config.max_model_len, 4096) // config.block_size)
        return config.max_num_seqs * per_seq
    free, total = torch.cuda.mem_get_info(device)
    # `gpu_memory_utilization` is this engine's share of the device (several engines may share one):
    # its own weights, activations and KV must fit in it, and the KV must fit in what is free now.
    own = sum(t.numel() * t.element_size() for m in (loaded.model, loaded.speech_tokenizer)
              for t in list(m.parameters()) + list(m.buffers())) + packed_bytes(loaded.talker)
    # Activations of the largest step, CUDA graphs, codec streaming state. With mtp_replicas = K there are K
    # graph pools, but each group's buckets stop at ceil(batch / K), so together they hold about one pool.
    reserve = 4 << 30
    if config.emit_audio and not config.prefill_only:
        # The streaming codec's slot bank: two slots a stream (window handover) and a scratch.
        codec_dtype = getattr(torch, codec_dtype_name(config.codec_dtype, config.device))
        reserve += (2 * config.max_num_seqs + 1) * slot_bytes(loaded.speech_config.decoder_config, codec_dtype)
    budget = min(int(total * config.gpu_memory_utilization) - own - reserve, free - reserve)
    if budget < per_block * 16:
        raise RuntimeError(f"not enough device memory for a KV cache (budget {budget / 2**30:.2f} GiB)")
    return budget // per_block
