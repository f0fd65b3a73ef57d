"""Capturing one CUDA graph: warm the work up, then record it (shared by the decode and prefill graphs)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def capture(run: Callable[[], T], pool: tuple[int, int], stream: torch.cuda.Stream | None = None,
            ) -> tuple[torch.cuda.CUDAGraph, T]:
    """Runs `run` twice on `stream` (or a side stream) for kernel selection and Triton compilation, then
    captures it into `pool`; returns the graph and the outputs of the captured run (its static outputs)."""
    warm = stream if stream is not None else torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm), torch.inference_mode():
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(warm)
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(graph, pool=pool, stream=stream):
        outputs = run()
    return graph, outputs
