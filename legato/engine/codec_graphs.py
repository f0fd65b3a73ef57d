"""The codec's step as CUDA graphs, one per (row-count bucket, frames), over the streaming decoder's slot bank.

A graph replays `StreamingCodecDecoder.step` on static slot and code buffers: the state is read and written
in place in the bank, so the graph holds the whole step and nothing is gathered or scattered around it. A
replay for fewer rows than its bucket pads with the bank's scratch slot, whose state nobody reads.
`CodecStreamer` owns the decoder and decides what to decode; this module only captures and looks graphs up.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from legato.engine.graph_capture import capture
from legato.layers.host import upload
from legato.models.qwen3_tts.streaming_codec import StreamingCodecDecoder

log = logging.getLogger(__name__)

GRAPH_FRAME_BUDGET = 512  # frames (rows x frames) of the largest graph: bounds its activations' memory


def graph_batches(capacity: int) -> list[int]:
    """Row counts captured as graphs: powers of two up to the first that holds `capacity` rows."""
    out, b = [], 1
    while True:
        out.append(b)
        if b >= capacity:
            return out
        b *= 2


class ChunkGraph:
    """One codec step of `b` rows x `n` frames."""

    def __init__(self, codec: StreamingCodecDecoder, scratch: int, b: int, n: int, pool,
                 stream: torch.cuda.Stream) -> None:
        dev = codec.device
        self.slots = torch.full((b,), scratch, dtype=torch.long, device=dev)
        self.codes = torch.zeros(b, n, codec.num_quantizers, dtype=torch.long, device=dev)
        self.scratch = scratch
        self.graph, self.wav = capture(lambda: codec.step(self.slots, self.codes), pool, stream)

    @property
    def batch(self) -> int:
        return self.slots.shape[0]

    @property
    def frames(self) -> int:
        return self.codes.shape[1]

    def replay(self, slots: list[int], codes: torch.Tensor) -> torch.Tensor:
        """codes [len(slots), n, Q] through `slots` -> wav [bucket, n * spf] (the graph's buffer, rewritten by its
        next replay; rows past len(slots) are padding)."""
        b = len(slots)
        padded = slots + [self.scratch] * (self.batch - b)
        self.slots.copy_(upload(np.array(padded, dtype=np.int64), self.slots.device), non_blocking=True)
        self.codes[:b].copy_(codes)
        self.codes[b:].zero_()
        self.graph.replay()
        return self.wav


class CodecGraphs:
    """The captured graphs of one decoder, looked up by row count and frames."""

    def __init__(self) -> None:
        self.graphs: dict[tuple[int, int], ChunkGraph] = {}

    def __bool__(self) -> bool:
        return bool(self.graphs)

    @property
    def max_batch(self) -> int:
        return max((b for b, _ in self.graphs), default=0)

    def capture(self, codec: StreamingCodecDecoder, scratch: int, capacity: int, sizes: list[int],
                stream: torch.cuda.Stream) -> None:
        """Captures every bucket up to `capacity` rows for each frame count in `sizes` (within the frame
        budget). A failure is logged and leaves no graphs: the codec then runs eagerly (they are a
        performance feature). The captures run real steps on the scratch slot only."""
        pool = torch.cuda.graph_pool_handle()
        batches = sorted(graph_batches(capacity), reverse=True)
        stream.wait_stream(torch.cuda.current_stream())  # the bank was written on the default stream
        try:
            with torch.cuda.stream(stream), torch.inference_mode():
                for b in batches:
                    for n in sorted(sizes, reverse=True):
                        if n == 1 or b * n <= GRAPH_FRAME_BUDGET:
                            self.graphs[(b, n)] = ChunkGraph(codec, scratch, b, n, pool, stream)
        except RuntimeError:
            log.exception("capturing the codec's CUDA graphs failed; the codec runs eagerly")
            self.clear()
            return
        log.info("captured %d codec CUDA graphs: row counts %s x frames %s", len(self.graphs), batches, sorted(sizes))

    def clear(self) -> None:
        self.graphs.clear()

    def exact(self, b: int, n: int) -> ChunkGraph | None:
        """The graph for `b` rows of exactly `n` frames."""
        return self.graphs.get((self._bucket(b), n))

    def longer(self, b: int, n: int) -> ChunkGraph | None:
        """The graph for `b` rows of the fewest frames above `n`."""
        bucket = self._bucket(b)
        sizes = sorted(m for (x, m) in self.graphs if x == bucket and m > n)
        return self.graphs[(bucket, sizes[0])] if sizes else None

    def pieces(self, b: int, n: int) -> list[int]:
        """Frame counts with a graph for `b` rows that add up to `n`, longest first (empty: none do)."""
        bucket = self._bucket(b)
        sizes = sorted((m for (x, m) in self.graphs if x == bucket), reverse=True)
        if not sizes or sizes[-1] != 1:  # without a one-frame graph not every length splits
            return []
        pieces = []
        for m in sizes:
            while n >= m:
                pieces.append(m)
                n -= m
        return pieces

    def _bucket(self, b: int) -> int | None:
        return next((x for x in sorted({x for x, _ in self.graphs}) if x >= b), None)
