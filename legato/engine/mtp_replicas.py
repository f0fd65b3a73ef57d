"""Code-predictor replicas inside one engine (`EngineConfig.mtp_replicas = K`).

The running batch is split into K replica groups; a request belongs for its whole life to group
`crc32(request_id) % K` (`replica_group`). A group is the execution state of one code-predictor replica:
the same weights (talker and code predictor are shared, as is the paged KV pool), but its own CUDA stream,
its own graph memory pool with one captured decode step per batch bucket, its own static input/output
buffers, and its own scratch slot and scratch KV block for padded rows. Groups touch disjoint slot rows
and KV blocks, so their steps can run concurrently: while one group's code predictor runs, another's
talker step can use the rest of the GPU. On the CPU (or with K = 1) a group has no stream and the groups
run one after another through exactly the same code.

Why separate pools: graphs of one pool share their intermediate memory, which is only safe when they are
replayed one at a time. Each group's buckets top out at ceil(limit / K), so the K pools together hold
about what one pool for the full batch holds.
"""

from __future__ import annotations

import contextlib
import functools
import zlib
from collections.abc import Callable

import numpy as np
import torch

from legato.engine.graph_capture import capture
from legato.engine.kv_cache import PagedKVCache

# Batch sizes captured as CUDA graphs (each group's cap is added to those below it).
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)

StepFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
InputsFn = Callable[..., tuple[torch.Tensor, ...]]


def replica_group(request_id: str, k: int) -> int:
    """The replica group a request is pinned to for its whole life: crc32 of its id, modulo K."""
    return zlib.crc32(request_id.encode()) % k


def group_buckets(limit: int, k: int) -> list[int]:
    """Graph batch sizes of one group, largest first: the bucket scheme up to ceil(limit / k), plus that cap,
    so that K groups together cover a decode batch of `limit` rows."""
    cap = -(-limit // k)
    return sorted({b for b in BUCKETS if b <= cap} | {cap}, reverse=True)


class Replica:
    """One replica group's execution state. `run` executes the group's rows of a decode step on its stream
    and returns [n, 17] (16 codes + the next codebook 0) on the device, in the order of the rows given."""

    def __init__(self, index: int, kv: PagedKVCache, scratch_slot: int, scratch_block: int,
                 stream: torch.cuda.Stream | None) -> None:
        self.index = index
        # A view of the shared cache (same k/v tensors) with its own attention metadata, so groups never
        # share the mutable `meta` attribute.
        self.kv = kv
        self.scratch_slot = scratch_slot
        self.scratch_block = scratch_block
        self.stream = stream
        self.graphs: dict[int, DecodeGraph] = {}
        self.rows = 0
        """Real (unpadded) rows this group has decoded: the stats of how the batch was split."""

    def on_stream(self) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def capture(self, sizes: list[int], no_rows: tuple[np.ndarray, ...], make_inputs: InputsFn, step: StepFn) -> None:
        """Captures one graph per size (largest first) into this group's own memory pool; `no_rows` is an
        empty (slots, positions, tables) triple, so every captured row starts as padding."""
        pool = torch.cuda.graph_pool_handle()
        for b in sorted(sizes, reverse=True):
            inputs = make_inputs(*no_rows, b, self)
            self.graphs[b] = DecodeGraph(functools.partial(step, self.kv), inputs, pool, self.stream)

    def run(self, rows: tuple[np.ndarray, np.ndarray, np.ndarray], graph_limit: int, make_inputs: InputsFn,
            step: StepFn, main: torch.cuda.Stream | None, fixed_rows: int | None = None) -> torch.Tensor:
        """rows: (slots [n], positions [n], block tables [n, W]). Up to `graph_limit` rows run as graph
        replays (several, in chunks of the largest bucket, when the group outgrew it); beyond that, or without
        graphs, as one eager step. With `fixed_rows` (batch invariance) every chunk is exactly that many rows,
        padded, graphs or not."""
        slots, positions, tables = rows
        n = len(slots)
        self.rows += n
        if fixed_rows is not None:
            use_graphs, chunk = fixed_rows in self.graphs, fixed_rows
        else:
            use_graphs = bool(self.graphs) and n <= graph_limit
            chunk = max(self.graphs) if use_graphs else n
        with self.on_stream():
            if self.stream is not None:
                self.stream.wait_stream(main)  # slot resets and prefills of this step ran on the main stream
            # Every chunk's inputs go to the device before the first launch: a copy from pageable host memory
            # may wait for the stream, which must not hold up the launches behind it.
            spans = [(lo, min(n, lo + chunk)) for lo in range(0, n, chunk)]
            inputs = [make_inputs(slots[lo:hi], positions[lo:hi], tables[lo:hi], self._padded(hi - lo, use_graphs,
                                                                                          fixed_rows), self)
                      for lo, hi in spans]
            outs = []
            for (lo, hi), chunk_inputs in zip(spans, inputs, strict=True):
                padded = chunk_inputs[0].shape[0]
                codes, nxt = self.graphs[padded].replay(chunk_inputs) if use_graphs else step(self.kv, *chunk_inputs)
                # A copy out of the static outputs, queued before the next replay of this pool can reuse them.
                outs.append(torch.cat([codes[: hi - lo], nxt[: hi - lo, None]], dim=1))
            return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _padded(self, rows: int, use_graphs: bool, fixed_rows: int | None) -> int:
        if fixed_rows is not None:
            return fixed_rows
        return min(b for b in self.graphs if b >= rows) if use_graphs else rows


class DecodeGraph:
    """A captured decode step for one padded batch size, with static input and output tensors."""

    def __init__(self, step: Callable[..., tuple[torch.Tensor, torch.Tensor]], inputs: tuple[torch.Tensor, ...],
                 pool: tuple[int, int], stream: torch.cuda.Stream | None) -> None:
        self.inputs = inputs
        # The warm-up's padded rows only touch the group's scratch slot and scratch block.
        self.graph, self.outputs = capture(lambda: step(*inputs), pool, stream)

    def replay(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """Replays on the current stream (the group's)."""
        copy_inputs(self.inputs, inputs)
        self.graph.replay()
        return self.outputs


def copy_inputs(statics: tuple[torch.Tensor, ...], inputs: tuple[torch.Tensor, ...]) -> None:
    """A step's inputs into a graph's static tensors. A block table narrower than the captured one fills the
    first columns only: the rest is never read (the kernels stop at each row's context length)."""
    for static, new in zip(statics, inputs, strict=True):
        if new.shape != static.shape:
            static = static[:, : new.shape[1]]
        static.copy_(new, non_blocking=True)
