"""The codec's stream step as CUDA graphs, one per (stream-count bucket, chunk frames), over one state bank.

Each graph gathers its rows of the bank, runs `CodecDecoder.stream_step` and scatters the new state back;
a replay for fewer streams than its bucket pads with the bank's scratch row, whose state nothing reads.
`CodecStreamer` owns the bank and decides what to decode; this module only captures and looks graphs up.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from legato.engine.graph_capture import capture
from legato.layers.host import upload
from legato.models.qwen3_tts.codec_decoder import CodecDecoder
from legato.models.qwen3_tts.codec_streaming import CodecStreamState

log = logging.getLogger(__name__)

GRAPH_BATCHES = (1, 2, 4, 8, 16, 32, 64)  # stream counts captured as CUDA graphs (per chunk size)


def store_rows(bank: CodecStreamState, index: torch.Tensor, state: CodecStreamState) -> None:
    """Writes `state` (one row per entry of `index`) into the bank's rows `index`."""
    bank.position.index_copy_(0, index, state.position)
    for key, buf in bank.buffers.items():
        buf.index_copy_(0, index, state.buffers[key])


class ChunkGraph:
    """One codec step of `b` streams x `n` frames captured with its gather and scatter of bank rows."""

    def __init__(self, decoder: CodecDecoder, bank: CodecStreamState, scratch: int, b: int, n: int, pool,
                 stream: torch.cuda.Stream) -> None:
        dev = bank.position.device
        self.rows = torch.full((b,), scratch, dtype=torch.long, device=dev)
        self.codes = torch.zeros(b, n, 16, dtype=torch.long, device=dev)
        self.scratch = scratch

        def step() -> torch.Tensor:
            wav, new = decoder.stream_step(self.codes, bank.select(self.rows))
            store_rows(bank, self.rows, new)
            return wav

        self.graph, self.wav = capture(step, pool, stream)

    @property
    def batch(self) -> int:
        return self.rows.shape[0]

    @property
    def frames(self) -> int:
        return self.codes.shape[1]

    def replay(self, rows: list[int], codes: torch.Tensor) -> torch.Tensor:
        """codes [len(rows), n, 16] through bank rows `rows` -> wav [bucket, 1, n * spf] (the graph's buffer,
        rewritten by its next replay; rows past len(rows) are padding)."""
        b = len(rows)
        padded = rows + [self.scratch] * (self.batch - b)
        self.rows.copy_(upload(np.array(padded, dtype=np.int64), self.rows.device), non_blocking=True)
        self.codes[:b].copy_(codes)
        self.codes[b:].zero_()
        self.graph.replay()
        return self.wav


class CodecGraphs:
    """The captured graphs of one bank, looked up by stream count and chunk frames."""

    def __init__(self) -> None:
        self.graphs: dict[tuple[int, int], ChunkGraph] = {}

    def __bool__(self) -> bool:
        return bool(self.graphs)

    @property
    def max_batch(self) -> int:
        return max((b for b, _ in self.graphs), default=0)

    def capture(self, decoder: CodecDecoder, bank: CodecStreamState, scratch: int, capacity: int,
                sizes: list[int], stream: torch.cuda.Stream) -> None:
        """Captures every bucket up to `capacity` for each chunk size in `sizes`. A failure is logged and
        leaves no graphs: the codec then runs eagerly (they are a performance feature)."""
        pool = torch.cuda.graph_pool_handle()
        batches = sorted((x for x in GRAPH_BATCHES if x <= capacity), reverse=True)
        stream.wait_stream(torch.cuda.current_stream())  # the bank was zeroed on the default stream
        try:
            with torch.cuda.stream(stream), torch.inference_mode():
                for b in batches:
                    for n in sorted(sizes, reverse=True):
                        self.graphs[(b, n)] = ChunkGraph(decoder, bank, scratch, b, n, pool, stream)
        except RuntimeError:
            log.exception("capturing the codec's CUDA graphs failed; the codec runs eagerly")
            self.clear()
            return
        log.info("captured codec CUDA graphs: stream counts %s x chunk sizes %s", batches, sorted(sizes))

    def clear(self) -> None:
        self.graphs.clear()

    def exact(self, b: int, n: int) -> ChunkGraph | None:
        """The graph for `b` streams of exactly `n` frames."""
        return self.graphs.get((self._bucket(b), n))

    def longer(self, b: int, n: int) -> ChunkGraph | None:
        """The graph for `b` streams of the fewest frames above `n`."""
        bucket = self._bucket(b)
        sizes = sorted(m for (x, m) in self.graphs if x == bucket and m > n)
        return self.graphs[(bucket, sizes[0])] if sizes else None

    def pieces(self, b: int, n: int) -> list[int]:
        """Chunk sizes with a graph for `b` streams that add up to `n`, longest first (empty: none do)."""
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

    @staticmethod
    def _bucket(b: int) -> int | None:
        return next((x for x in GRAPH_BATCHES if x >= b), None)
