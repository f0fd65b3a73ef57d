"""Packed prefill at fixed token counts: static buffers per token bucket, replayed as CUDA graphs.

Eagerly, a packed prefill forward is ~15 kernel launches per decoder layer, a few milliseconds of host
time per step whatever the token count; at 64 streams a prompt arrives almost every step, so that host
time was a fifth of the engine thread. Here a step's chunks are padded to the smallest bucket that holds
their tokens and run through fixed-size buffers, which makes the forward one graph replay.

Padding never changes a real token's result: padded tokens write their KV to the scratch block (which no
real block table reaches), and padded kernel tiles name an empty chunk, so they compute nothing. The
same padded forward runs eagerly on the CPU (`PrefillBuckets(..., graphs=False)`), which is what the CPU
tests compare with the unpadded path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from legato.engine.graph_capture import capture
from legato.layers.packed_prefill import PackedPrefill, max_tiles, packed_host_arrays

log = logging.getLogger(__name__)

# Forward(embeds [T, H], meta) -> final hidden states [T, H]; it sets and clears the cache's metadata.
Forward = Callable[[torch.Tensor, PackedPrefill], torch.Tensor]


def token_buckets(max_tokens: int, smallest: int = 32) -> list[int]:
    """Powers of two from `smallest`, the last one at least `max_tokens` (a step's prefill budget)."""
    sizes = [smallest]
    while sizes[-1] < max_tokens:
        sizes.append(sizes[-1] * 2)
    return sizes


class StaticPrefill:
    """Fixed-size device inputs of a packed prefill of up to `tokens` tokens in up to `max_seqs` chunks.

    Chunk index `max_seqs` is always empty (cu_seqlens holds `max_seqs + 2` entries); padded tiles name it.
    The int64 and int32 metadata are views of two flat buffers, so a step loads them in two copies."""

    def __init__(self, tokens: int, max_seqs: int, width: int, hidden: int, block_size: int, pad_block: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.tokens, self.max_seqs, self.width = tokens, max_seqs, width
        self.block_size, self.pad_block = block_size, pad_block
        self.num_tiles = max_tiles(tokens, max_seqs)
        s = max_seqs + 1  # chunks, counting the empty one
        # The block tables last: a step on CUDA loads only its chunks' rows, as wide as their longest (below).
        self._sizes32 = {"cu_seqlens": s + 1, "starts": s, "tiles": 2 * self.num_tiles, "block_tables": s * width}
        self._head32 = sum(self._sizes32.values()) - self._sizes32["block_tables"]
        # At 256 chunks of a 32k-token max_model_len a full table is 2 MB, which every prefill step filled, copied
        # and uploaded; the kernel reads only each chunk's own blocks, so stale entries elsewhere are never read.
        # The CPU path (no graphs: its reference attention takes whole rows) keeps loading the full table.
        self.narrow_tables = device.type == "cuda"
        self.embeds = torch.zeros(tokens, hidden, dtype=dtype, device=device)
        self.flat64 = torch.zeros(2 * tokens, dtype=torch.long, device=device)
        self.flat32 = torch.zeros(sum(self._sizes32.values()), dtype=torch.int32, device=device)
        views, at = {}, 0
        for name, size in self._sizes32.items():
            views[name] = self.flat32[at: at + size]
            at += size
        self.meta = PackedPrefill(
            slot_mapping=self.flat64[:tokens], positions=self.flat64[tokens:], cu_seqlens=views["cu_seqlens"],
            starts=views["starts"], block_tables=views["block_tables"].view(s, width),
            tiles=views["tiles"].view(self.num_tiles, 2), host_cu=[], host_starts=[],
        )
        self.load([], [], [], [])  # all padding: what a capture records

    def fits(self, num_tokens: int, num_seqs: int) -> bool:
        return num_tokens <= self.tokens and num_seqs <= self.max_seqs

    def load(self, embeds: list[torch.Tensor], lengths: list[int], starts: list[int], tables: list[list[int]]) -> None:
        """Queues the copies of one step's chunks into the buffers (nothing waits for the device)."""
        n, total = len(lengths), sum(lengths)
        narrow = self.narrow_tables and n > 0
        if n:
            host = packed_host_arrays(lengths, starts, tables, self.block_size, self.pad_block,
                                      None if narrow else self.width)
        else:
            host = {"slot_mapping": np.zeros(0, np.int64), "positions": np.zeros(0, np.int64),
                    "cu_seqlens": np.zeros(1, np.int32), "starts": np.zeros(0, np.int32),
                    "block_tables": np.zeros((0, self.width), np.int32), "tiles": np.zeros((0, 2), np.int32)}
        flat64 = np.zeros(2 * self.tokens, dtype=np.int64)
        flat64[:total] = host["slot_mapping"]
        flat64[total: self.tokens] = self.pad_block * self.block_size  # padded tokens: the scratch block
        flat64[self.tokens: self.tokens + total] = host["positions"]
        cu = np.full(self.max_seqs + 2, total, dtype=np.int32)
        cu[: n + 1] = host["cu_seqlens"]
        seq_starts = np.zeros(self.max_seqs + 1, dtype=np.int32)
        seq_starts[:n] = host["starts"]
        tiles = np.zeros((self.num_tiles, 2), dtype=np.int32)
        tiles[:, 0] = self.max_seqs  # the empty chunk
        tiles[: len(host["tiles"])] = host["tiles"]
        head = [cu, seq_starts, tiles.ravel()]
        if narrow:
            self._queue_copy(self.flat64, flat64)
            self._queue_copy(self.flat32[: self._head32], np.concatenate(head))
            rows = host["block_tables"]
            self._queue_copy(self.meta.block_tables[:n, : rows.shape[1]], rows)
        else:
            table = np.full((self.max_seqs + 1, self.width), self.pad_block, dtype=np.int32)
            table[:n] = host["block_tables"]
            self._queue_copy(self.flat64, flat64)
            self._queue_copy(self.flat32, np.concatenate([*head, table.ravel()]))
        if n:
            torch.cat([e.to(self.embeds.dtype) for e in embeds], out=self.embeds[:total])
        self.meta.host_cu = host["cu_seqlens"].tolist()
        self.meta.host_starts = list(starts)

    def _queue_copy(self, static: torch.Tensor, values: np.ndarray) -> None:
        src = torch.from_numpy(values)
        pin = static.device.type == "cuda"
        # A pinned source lives until its copy has run (PyTorch's caching host allocator), so it only queues.
        static.copy_(src.pin_memory() if pin else src, non_blocking=pin)


class _PrefillGraph:
    def __init__(self, static: StaticPrefill, forward: Forward, pool) -> None:
        self.static = static
        self.graph, self.hidden = capture(lambda: forward(static.embeds, static.meta), pool)


class PrefillBuckets:
    """One `StaticPrefill` per token bucket, each captured as a CUDA graph when `graphs` is set (CUDA only);
    without graphs the padded forward runs eagerly (the CPU test path)."""

    def __init__(self, forward: Forward, buckets: list[int], max_seqs: int, width: int, hidden: int,
                 block_size: int, pad_block: int, dtype: torch.dtype, device: torch.device, graphs: bool) -> None:
        self.forward = forward
        self.statics = {t: StaticPrefill(t, max_seqs, width, hidden, block_size, pad_block, dtype, device)
                        for t in sorted(buckets)}
        self.graphs: dict[int, _PrefillGraph] = {}
        self.graph_bytes = 0
        if graphs:
            before = torch.cuda.memory_reserved(device)
            pool = torch.cuda.graph_pool_handle()
            for t in sorted(buckets, reverse=True):  # largest first: the smaller ones reuse its pool
                self.graphs[t] = _PrefillGraph(self.statics[t], forward, pool)
            self.graph_bytes = torch.cuda.memory_reserved(device) - before
            log.info("captured packed-prefill CUDA graphs for token buckets %s (%.1f MiB reserved)",
                     sorted(buckets), self.graph_bytes / 2**20)

    def bucket_for(self, num_tokens: int, num_seqs: int) -> StaticPrefill | None:
        """The smallest bucket that holds a step of `num_tokens` tokens in `num_seqs` chunks (None: none)."""
        for static in self.statics.values():
            if static.fits(num_tokens, num_seqs):
                return static
        return None

    def run(self, static: StaticPrefill, embeds: list[torch.Tensor], lengths: list[int], starts: list[int],
            tables: list[list[int]]) -> torch.Tensor:
        """Final hidden states [bucket tokens, H] of one step's chunks, padded (rows past the real tokens
        are meaningless). The graph's output buffer: read it before the next prefill."""
        static.load(embeds, lengths, starts, tables)
        graph = self.graphs.get(static.tokens)
        if graph is None:
            return self.forward(static.embeds, static.meta)
        graph.graph.replay()
        return graph.hidden
