"""Arrival counters for kernels whose last program to finish does the work that needs every program's result.

A split-K matmul at one row is some 128 programs, each a share of the product; the residual add and the RMSNorm
after it need the whole row. Instead of a second kernel, each program stores its share, counts itself in on an
int32 counter, and the program that counts last sums the shares and normalises (`small_matmul`). That program puts
the counter back to zero, so a counter is zero whenever no kernel holds it, and no memset is needed between uses.

Two kernels may share a counter only if they never run at once. Kernels launched eagerly on one stream run one
after another, so eager launches take one counter per stream. A kernel captured into a CUDA graph keeps its
counter for the graph's life, and graphs captured on the same stream may be replayed side by side (two engines of
one process, each capturing on torch's shared capture stream), so each captured launch takes a counter of its
own, never handed out again. Counters come from zeroed pools that are only made outside a capture; when a capture
finds none left, `take` says so (None) and the caller keeps the two-kernel path.
"""

from __future__ import annotations

import threading

import torch

POOL = 1 << 16  # counters a pool holds (256 KiB): thousands of captured launches per engine
EAGER = 1024  # counters a stream's eager launches share: the most one launch may take
_lock = threading.Lock()
_pools: dict[str, list[torch.Tensor]] = {}  # device -> pools, the last one handing out counters
_next: dict[str, int] = {}  # device -> the next unused counter of its last pool
_per_stream: dict[tuple[str, int], torch.Tensor] = {}  # (device, stream) -> the eager launches' counters


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def take(device: torch.device, n: int = 1) -> torch.Tensor | None:
    """n int32 counters (a tensor of n zeros) on `device` for a launch about to be made on the current stream,
    or None: more than `EAGER` asked, or a CUDA graph is being captured and no pool made before the capture has n
    left."""
    if not 0 < n <= EAGER:
        return None
    key = str(device)
    capturing = _capturing(device)
    with _lock:
        if not capturing:
            stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
            counters = _per_stream.get((key, stream))
            if counters is None:
                counters = _per_stream[(key, stream)] = _fresh(key, device, EAGER)
            if POOL - _next.get(key, POOL) < POOL // 4:  # a capture may follow: keep counters ready for it
                _new_pool(key, device)
            return counters[:n]
        if POOL - _next.get(key, POOL) < n:
            return None
        return _fresh(key, device, n)


def _fresh(key: str, device: torch.device, n: int) -> torch.Tensor:
    if POOL - _next.get(key, POOL) < n:
        _new_pool(key, device)
    i = _next[key]
    _next[key] = i + n
    return _pools[key][-1][i:i + n]


def _new_pool(key: str, device: torch.device) -> None:
    _pools.setdefault(key, []).append(torch.zeros(POOL, dtype=torch.int32, device=device))
    _next[key] = 0


def held() -> int:
    """Counters not at zero over every pool (0 whenever no kernel runs; tests read it)."""
    with _lock:
        return sum(int(pool.count_nonzero().item()) for pools in _pools.values() for pool in pools)
