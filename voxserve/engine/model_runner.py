"""Runs the talker and code predictor for one scheduled step.

Prefill chunks run eagerly, one request's chunk at a time (prompt lengths differ; this is not the per-frame
hot path). Decode runs every running request together: one batched code-predictor frame loop (15 steps),
then one batched talker step, then codebook-0 sampling. On CUDA that whole decode step is one CUDA graph
per batch-size bucket (captured largest first into one memory pool, padded rows pointing at a scratch slot
and a scratch KV block); on the CPU it runs eagerly through the same function.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from voxserve.engine.config import EngineConfig
from voxserve.engine.kv_cache import DecodeMeta, PagedKVCache, PrefillMeta
from voxserve.engine.sampler import Sampler
from voxserve.engine.slot_state import SlotState
from voxserve.models.qwen3_tts.decoder_layer import pack_projections
from voxserve.models.qwen3_tts.talker import Talker

log = logging.getLogger(__name__)


@dataclass
class PrefillWork:
    slot: int
    embeds: torch.Tensor  # [n, H]: this chunk's prompt embeddings
    start: int
    block_table: list[int]
    is_last: bool


@dataclass
class DecodeWork:
    slot: int
    position: int  # position of the talker token written this step
    block_table: list[int]


class ModelRunner:
    def __init__(self, talker: Talker, config: EngineConfig, num_kv_blocks: int, tts_pad: torch.Tensor) -> None:
        self.talker = talker
        self.config = config
        tc = talker.config
        weight = talker.codec_head.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.block_size = config.block_size
        self.max_blocks_per_seq = -(-config.max_model_len // config.block_size)
        # One extra block past the allocator's range is the scratch block of padded rows.
        self.scratch_block = num_kv_blocks
        self.kv = PagedKVCache(
            tc.num_hidden_layers, num_kv_blocks + 1, config.block_size, tc.num_key_value_heads, tc.head_dim,
            self.dtype, self.device,
        )
        self.slots = SlotState(config.max_num_seqs, tc.hidden_size, tc.vocab_size, config.max_text_tokens,
                               self.dtype, self.device)
        self.tts_pad = tts_pad.to(device=self.device, dtype=self.dtype)
        # The fused (compiled) sampler is what makes sampling cheap inside the CUDA graph.
        self.sampler = Sampler.from_talker_config(tc, compile=self.device.type == "cuda")
        if self.device.type == "cuda":
            pack_projections(talker)
        self.graphs: dict[int, _DecodeGraph] = {}
        self.graph_pool = None
        if self.device.type == "cuda" and not config.enforce_eager:
            self._capture_graphs()

    # --- prefill --------------------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, work: list[PrefillWork]) -> dict[int, int]:
        """Writes each chunk's KV; for chunks that end a prompt, samples codebook 0 of frame 0.
        Returns {slot: first codebook-0 token} for those."""
        last_hidden, last_slots = [], []
        for w in work:
            n = w.embeds.shape[0]
            positions = torch.arange(w.start, w.start + n, device=self.device)
            table = torch.tensor(w.block_table, dtype=torch.long, device=self.device)
            self.kv.meta = PrefillMeta(self._slot_mapping(table, positions), table, w.start)
            hidden = self.talker(w.embeds.to(self.dtype).unsqueeze(0), positions.unsqueeze(0), self.kv)
            if w.is_last:
                last_hidden.append(hidden[0, -1])
                last_slots.append(w.slot)
        self.kv.meta = None
        if not last_slots:
            return {}
        slots = torch.tensor(last_slots, dtype=torch.long, device=self.device)
        hidden = torch.stack(last_hidden)
        st = self.slots.gather_params(slots, torch.zeros_like(slots))
        tokens = self.sampler.sample_codebook0(self.talker.logits(hidden), st, self.slots.seen, slots)
        self.slots.past_hidden[slots] = hidden
        self.slots.last_c0[slots] = tokens
        return dict(zip(last_slots, tokens.tolist(), strict=True))

    # --- decode ---------------------------------------------------------------------------------------

    @torch.inference_mode()
    def decode(self, work: list[DecodeWork]) -> tuple[torch.Tensor, torch.Tensor]:
        """One frame for every request in `work`: returns (codes [B, 16], next codebook 0 [B]) on the CPU."""
        bsz = len(work)
        bucket = next((b for b in sorted(self.graphs) if b >= bsz), None)
        inputs = self._decode_inputs(work, bucket or bsz)
        if bucket is not None:
            codes, nxt = self.graphs[bucket].replay(inputs)
        else:
            codes, nxt = self._decode_step(*inputs)
        # One device-to-host copy per step.
        host = torch.cat([codes[:bsz], nxt[:bsz, None]], dim=1).cpu()
        return host[:, :-1], host[:, -1]

    def _decode_inputs(self, work: list[DecodeWork], padded: int) -> tuple[torch.Tensor, ...]:
        # Host-side metadata is built in numpy: one vectorised pass instead of a tensor op per request.
        n = len(work)
        slots = np.full(padded, self.slots.scratch, dtype=np.int64)
        positions = np.zeros(padded, dtype=np.int64)
        tables = np.full((padded, self.max_blocks_per_seq), self.scratch_block, dtype=np.int32)
        for i, w in enumerate(work):
            slots[i] = w.slot
            positions[i] = w.position
            tables[i, : len(w.block_table)] = w.block_table
        blocks = tables[np.arange(padded), positions // self.block_size].astype(np.int64)
        slot_mapping = blocks * self.block_size + positions % self.block_size
        context_lens = (positions + 1).astype(np.int32)
        if n < padded:
            slot_mapping[n:] = self.scratch_block * self.block_size
        dev = self.device
        return tuple(
            torch.from_numpy(a).to(dev, non_blocking=True)
            for a in (slots, positions, slot_mapping, tables, context_lens)
        )

    def _decode_step(
        self,
        slots: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole per-frame computation on device tensors only (graph-capturable)."""
        s, talker = self.slots, self.talker
        frame = s.frames[slots]
        st = s.gather_params(slots, frame)
        c0 = s.last_c0[slots]
        residual = talker.code_predictor.predict_residuals(
            s.past_hidden[slots], talker.embed_codec(c0), lambda logits, g: self.sampler.sample_residual(logits, st, g)
        )
        codes = torch.cat([c0.unsqueeze(1), residual], dim=1)
        embeds = talker.embed_frame(codes) + s.text_for(slots, frame, self.tts_pad)
        self.kv.meta = DecodeMeta(slot_mapping, block_tables, context_lens)
        hidden = talker(embeds.unsqueeze(1), positions.unsqueeze(1), self.kv)[:, 0]
        self.kv.meta = None
        st.frame = frame + 1
        nxt = self.sampler.sample_codebook0(talker.logits(hidden), st, s.seen, slots)
        s.past_hidden[slots] = hidden
        s.last_c0[slots] = nxt
        s.frames[slots] = frame + 1
        return codes, nxt

    def _slot_mapping(self, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    # --- CUDA graphs ----------------------------------------------------------------------------------

    def _capture_graphs(self) -> None:
        limit = min(self.config.cuda_graph_max_batch, self.config.max_num_seqs)
        sizes = sorted({b for b in (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
                        if b <= limit} | {limit}, reverse=True)
        for b in sizes:
            graph = _DecodeGraph(self, b)
            self.graphs[b] = graph
            self.graph_pool = graph.pool
        log.info("captured decode CUDA graphs for batch sizes %s", sorted(self.graphs))


class _DecodeGraph:
    """A captured decode step for one padded batch size, with static input and output tensors."""

    def __init__(self, runner: ModelRunner, batch: int) -> None:
        self.inputs = runner._decode_inputs([], batch)
        # Warm up on the side stream (kernel selection, Triton compilation) before capturing; the padded
        # rows only touch the scratch slot and the scratch block.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(2):
                runner._decode_step(*self.inputs)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(self.graph, pool=runner.graph_pool):
            self.outputs = runner._decode_step(*self.inputs)
        self.pool = self.graph.pool()

    def replay(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        for static, new in zip(self.inputs, inputs, strict=True):
            static.copy_(new, non_blocking=True)
        self.graph.replay()
        return self.outputs
