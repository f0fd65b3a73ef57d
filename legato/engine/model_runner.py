"""Runs the talker and code predictor for one scheduled step.

Prefill runs every prompt chunk of the step in one packed, variable-length forward: on CUDA a CUDA graph
replay of the smallest token bucket that holds the step (`prefill_graphs.py`), eagerly otherwise. Decode runs
every running request together: one batched code-predictor frame loop (15 steps),
then one batched talker step, then codebook-0 sampling. On CUDA that whole decode step is one CUDA graph
per batch-size bucket (captured largest first into one memory pool, padded rows pointing at a scratch slot
and a scratch KV block); on the CPU it runs eagerly through the same function.

With `mtp_replicas = K > 1` the decode batch is split into K replica groups (see `mtp_replicas.py`), each
with its own stream, graphs, pool and scratch rows, launched back to back so their work overlaps on the
GPU; weights, per-slot state and the paged KV pool are shared (groups touch disjoint rows and blocks).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import numpy as np
import torch

from legato.engine.config import EngineConfig
from legato.engine.kv_cache import DecodeMeta, PagedKVCache
from legato.engine.mtp_replicas import Replica, group_buckets
from legato.engine.prefill_graphs import PrefillBuckets, token_buckets
from legato.engine.sampler import Sampler
from legato.engine.slot_state import SlotState
from legato.layers import decoder_stack, pdl
from legato.layers.host import upload
from legato.layers.packed_prefill import PackedPrefill
from legato.models.qwen3_tts.decoder_layer import pack_projections
from legato.models.qwen3_tts.talker import Talker

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
    group: int = 0  # replica group (`mtp_replicas.replica_group`), fixed for the request's life


class ModelRunner:
    def __init__(self, talker: Talker, config: EngineConfig, num_kv_blocks: int, tts_pad: torch.Tensor) -> None:
        self.talker = talker
        self.config = config
        tc = talker.config
        weight = talker.codec_head.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.block_size = config.block_size
        self.max_blocks_per_seq = -(-config.max_model_len // config.block_size)
        k = config.mtp_replicas
        # Past the allocator's range, each replica group has one scratch block and one scratch slot for its
        # padded rows, so concurrent groups never write the same padding memory.
        self.kv = PagedKVCache(
            tc.num_hidden_layers, num_kv_blocks + k, config.block_size, tc.num_key_value_heads, tc.head_dim,
            self.dtype, self.device,
        )
        self.slots = SlotState(config.max_num_seqs + k - 1, tc.hidden_size, tc.vocab_size, config.max_text_tokens,
                               self.dtype, self.device)
        self.tts_pad = tts_pad.to(device=self.device, dtype=self.dtype)
        # The fused (compiled) sampler is what makes sampling cheap inside the CUDA graph.
        self.sampler = Sampler.from_talker_config(tc, compile=self.device.type == "cuda")
        if self.device.type == "cuda":
            pack_projections(talker)
        # Replica groups run code-predictor passes on concurrent streams; the one-launch pass needs its programs
        # resident together, so it serves one group only. Asked for per call: another engine on the same weights
        # may have built the stack without this one wanting it.
        self.uses_stack = talker.code_predictor.stack is not None and k == 1 and config.code_predictor_stack
        if config.code_predictor_stack and not self.uses_stack:
            raise ValueError("code_predictor_stack: this code predictor's shapes have no one-launch pass "
                             "(decoder_stack.supported), or its weights are not CUDA half precision")
        self.narrow_tables = self.device.type == "cuda"  # decode block tables as wide as the step's longest row
        streams = self.device.type == "cuda" and k > 1
        self.replicas = [
            Replica(g, copy.copy(self.kv), config.max_num_seqs + g, num_kv_blocks + g,
                    torch.cuda.Stream(self.device) if streams else None)
            for g in range(k)
        ]
        # Decode batches up to this size run as graph replays (chunked per group when a group outgrows its
        # largest bucket); larger ones run eagerly.
        self.graph_limit = min(config.cuda_graph_max_batch or config.max_num_seqs, config.max_num_seqs)
        self.graph_bytes = 0
        self.prefill_buckets: PrefillBuckets | None = None
        if self.device.type == "cuda" and not config.enforce_eager:
            if not config.prefill_only:  # a prefill engine never decodes
                self._capture_graphs()
            if not config.batch_invariant:  # there each chunk runs alone, at its own length
                self.prefill_buckets = self.make_prefill_buckets(graphs=True)
                self.graph_bytes += self.prefill_buckets.graph_bytes

    def make_prefill_buckets(self, graphs: bool) -> PrefillBuckets:
        """Static packed-prefill inputs per token bucket up to the step's token budget; `graphs` captures
        them (CUDA), otherwise the padded forward runs eagerly."""
        return PrefillBuckets(self._packed_forward, token_buckets(self.config.max_num_batched_tokens),
                              self.config.max_num_seqs, self.max_blocks_per_seq, self.talker.config.hidden_size,
                              self.block_size, self.replicas[0].scratch_block, self.dtype, self.device, graphs)

    # --- prefill --------------------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, work: list[PrefillWork]) -> tuple[list[int], torch.Tensor]:
        """Writes each chunk's KV; for chunks that end a prompt, samples codebook 0 of frame 0.
        Returns (the slots of those chunks, their first codebook-0 tokens [n] on the device).

        Every chunk of the step runs in one packed forward (`PackedPrefill`), except in batch-invariant mode,
        where each chunk runs alone: a GPU matmul's result for a row can depend on how many rows it has."""
        last_hidden, last_slots = [], []
        groups = [[w] for w in work] if self.config.batch_invariant else [work]
        for chunks in groups:
            lengths = [w.embeds.shape[0] for w in chunks]
            starts, tables = [w.start for w in chunks], [w.block_table for w in chunks]
            static = (self.prefill_buckets.bucket_for(sum(lengths), len(chunks))
                      if self.prefill_buckets is not None else None)
            if static is not None:
                # The bucket's output buffer: its last rows are stacked below, before any other prefill runs.
                hidden = self.prefill_buckets.run(static, [w.embeds for w in chunks], lengths, starts, tables)
                cu = static.meta.host_cu
            else:
                meta = PackedPrefill.build(lengths, starts, tables, self.block_size,
                                           self.replicas[0].scratch_block, self.device)
                hidden = self._packed_forward(torch.cat([w.embeds for w in chunks]).to(self.dtype), meta)
                cu = meta.host_cu
            for i, w in enumerate(chunks):
                if w.is_last:
                    last_hidden.append(hidden[cu[i + 1] - 1])
                    last_slots.append(w.slot)
        if not last_slots:
            return [], torch.zeros(0, dtype=torch.long, device=self.device)
        # Batch invariance: each prompt's first token alone, so its logits never depend on how many
        # prompts ended in the same step.
        groups = [[i] for i in range(len(last_slots))] if self.config.batch_invariant else [range(len(last_slots))]
        tokens = []
        for rows in groups:
            slots = upload(np.array([last_slots[i] for i in rows], dtype=np.int64), self.device)
            hidden = torch.stack([last_hidden[i] for i in rows])
            st = self.slots.gather_params(slots, torch.zeros_like(slots))
            tokens.append(self.sampler.sample_codebook0(self.talker.logits(hidden), st, self.slots.seen, slots))
            self.slots.past_hidden[slots] = hidden
            self.slots.last_c0[slots] = tokens[-1]
        return last_slots, torch.cat(tokens)

    def _packed_forward(self, embeds: torch.Tensor, meta: PackedPrefill) -> torch.Tensor:
        """embeds [T, H] of a step's packed chunks -> final hidden states [T, H] (KV written)."""
        self.kv.meta = meta
        try:
            return self.talker(embeds.unsqueeze(0), meta.positions.unsqueeze(0), self.kv)[0]
        finally:
            self.kv.meta = None

    # --- decode ---------------------------------------------------------------------------------------

    def stack_gave_up_so_far(self) -> int:
        """The one-launch code predictor's barrier give-ups on this device so far (waits for the device)."""
        return int(decoder_stack.gave_up(self.device).item()) if self.uses_stack else 0

    @torch.inference_mode()
    def stack_gave_up_row(self) -> torch.Tensor:
        """[1, 17] int64 on the device, every column the one-launch code predictor's barrier give-ups so far: a
        row that goes to the host with a step's results (no sync of its own)."""
        return decoder_stack.gave_up(self.device).reshape(1, 1).expand(1, 17)

    @torch.inference_mode()
    def decode(self, work: list[DecodeWork]) -> torch.Tensor:
        """One frame for every request in `work`: [B, 17] on the device, in the order of `work` (16 codes,
        then the next frame's codebook 0). Nothing waits for the GPU here.

        Each replica group runs its rows on its own stream; the main stream joins them all."""
        if not work:
            return torch.zeros(0, 17, dtype=torch.long, device=self.device)
        slots, positions, tables, groups = self._host_rows(work)
        main = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        parts, order = [], []
        for rep in self.replicas:
            if len(self.replicas) == 1:
                rows = (slots, positions, tables)
            else:
                idx = np.flatnonzero(groups == rep.index)
                if not idx.size:
                    continue
                order.append(idx)
                rows = (slots[idx], positions[idx], tables[idx])
            parts.append(rep.run(rows, self.graph_limit, self._decode_inputs, self._decode_step, main,
                                 fixed_rows=self.config.invariant_rows if self.config.batch_invariant else None))
        if main is not None:
            for rep in self.replicas:
                if rep.stream is not None:
                    main.wait_stream(rep.stream)
        rows = parts[0] if len(parts) == 1 else torch.cat(parts)
        if order:  # back from group order to the order of `work`
            back = np.argsort(np.concatenate(order), kind="stable")
            rows = rows.index_select(0, upload(back, self.device))
        return rows

    @property
    def replica_rows(self) -> list[int]:
        """Real rows each replica group has decoded so far (one entry per group)."""
        return [rep.rows for rep in self.replicas]

    def _host_rows(self, work: list[DecodeWork]) -> tuple[np.ndarray, ...]:
        # Host-side metadata is built in numpy: one pass over the requests, the rest vectorised.
        n = len(work)
        slots = np.empty(n, dtype=np.int64)
        positions = np.empty(n, dtype=np.int64)
        groups = np.empty(n, dtype=np.int64)
        # Entries past a row's own blocks are never attended (the CUDA kernels stop at the context length, the
        # CPU path masks them), but must name a valid block: the first scratch block. On CUDA the table is only
        # as wide as the step's longest row: at max_model_len 32k a full row is 2,048 entries, and at 256 rows
        # the step's host time went into filling, copying and uploading those 2 MB (a graph's static table keeps
        # its full width; columns past this step's are never read). The CPU path keeps the full width, the
        # shape its reductions have always had.
        width = max(len(w.block_table) for w in work) if self.narrow_tables and n else self.max_blocks_per_seq
        tables = np.full((n, width), self.replicas[0].scratch_block, dtype=np.int32)
        for i, w in enumerate(work):
            slots[i] = w.slot
            positions[i] = w.position
            groups[i] = w.group
            tables[i, : len(w.block_table)] = w.block_table
        if not (0 <= groups.min() and groups.max() < len(self.replicas)):
            raise ValueError(f"decode work names a replica group outside [0, {len(self.replicas)})")
        return slots, positions, tables, groups

    def _decode_inputs(self, slots: np.ndarray, positions: np.ndarray, tables: np.ndarray, padded: int,
                       rep: Replica) -> tuple[torch.Tensor, ...]:
        """Device inputs of `len(slots)` rows padded to `padded`; padding reads and writes only the group's
        scratch slot and scratch block. Call on the group's stream."""
        n = len(slots)
        s = np.full(padded, rep.scratch_slot, dtype=np.int64)
        pos = np.zeros(padded, dtype=np.int64)
        s[:n], pos[:n] = slots, positions
        t = tables if n == padded else np.concatenate(
            [tables, np.full((padded - n, tables.shape[1]), rep.scratch_block, dtype=np.int32)])
        blocks = t[np.arange(padded), pos // self.block_size].astype(np.int64)
        slot_mapping = blocks * self.block_size + pos % self.block_size
        context_lens = (pos + 1).astype(np.int32)
        return tuple(upload(a, self.device) for a in (s, pos, slot_mapping, t, context_lens))

    def _decode_step(
        self,
        kv: PagedKVCache,
        slots: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole per-frame computation on device tensors only (graph-capturable). `kv` is the calling
        group's view of the shared cache. Our kernels in it launch with PDL where the GPU has it (`layers/pdl.py`)."""
        with pdl.scope():
            return self._frame(kv, slots, positions, slot_mapping, block_tables, context_lens)

    def _frame(self, kv: PagedKVCache, slots: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
               block_tables: torch.Tensor, context_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s, talker = self.slots, self.talker
        frame = s.frames[slots]
        st = s.gather_params(slots, frame)
        c0 = s.last_c0[slots]
        residual = talker.code_predictor.predict_residuals(
            s.past_hidden.index_select(0, slots), talker.embed_codec(c0),
            lambda logits, g: self.sampler.sample_residual(logits, st, g), stack=self.uses_stack,
        )
        codes = torch.cat([c0.unsqueeze(1), residual], dim=1)
        embeds = talker.embed_frame(codes) + s.text_for(slots, frame, self.tts_pad)
        kv.meta = DecodeMeta(slot_mapping, block_tables, context_lens)
        hidden = talker(embeds.unsqueeze(1), positions.unsqueeze(1), kv)[:, 0]
        kv.meta = None
        st.frame = frame + 1
        nxt = self.sampler.sample_codebook0(talker.logits(hidden), st, s.seen, slots)
        s.past_hidden[slots] = hidden
        s.last_c0[slots] = nxt
        s.frames[slots] = frame + 1
        return codes, nxt

    # --- CUDA graphs ----------------------------------------------------------------------------------

    def _capture_graphs(self) -> None:
        if self.config.batch_invariant:  # every step runs in chunks of exactly this many rows
            sizes = [self.config.invariant_rows]
        else:
            sizes = group_buckets(self.graph_limit, len(self.replicas))
        no_rows = (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, self.max_blocks_per_seq), np.int32))
        before = torch.cuda.memory_reserved(self.device)
        for rep in self.replicas:
            rep.capture(sizes, no_rows, self._decode_inputs, self._decode_step)
        self.graph_bytes = torch.cuda.memory_reserved(self.device) - before
        log.info("captured decode CUDA graphs for %d replica group(s), batch sizes %s each (%.1f MiB reserved)",
                 len(self.replicas), sorted(sizes), self.graph_bytes / 2**20)
