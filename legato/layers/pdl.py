"""Programmatic dependent launch (PDL): a kernel's programs start while the kernel before it still runs.

A batch-1 frame is some 400 kernels in a CUDA graph, most of them a few microseconds long, and between two of them
the GPU sits idle while the next one launches and ramps up. Launched with PDL (Hopper and later), a kernel's
programs are scheduled as soon as every program of the kernel before has signalled (`release`), do what does not
depend on it (warm L2 with their weight strip: a prefetch is only a hint, and L2 is where every SM's reads and
writes meet, so it cannot return stale data), and only then wait for it to finish (`wait`: its writes are visible
after). So a matmul's weights stream while the norm or attention before it runs.

Each kernel here signals right after its own wait, so only the next kernel starts early. Signalling first thing
(the first form) let every kernel of a step launch at once, each prefetching its weights, and the 0.6B's stack
frame took 3.997 ms against 3.418 without PDL on an H100.

The contract every kernel launched with PDL keeps: each of its programs calls `wait` before it reads anything an
earlier kernel wrote and before it writes anything, and none returns before calling it (a kernel that ended
without waiting would let the next one's `wait` pass before the kernel before it had finished). Kernels launched
without PDL (torch's own, cuBLAS) start after the one before has finished, as always; one after a PDL kernel does
too.

Where it is on: the engine's decode step (`scope()`, around the talker and code-predictor frame, captured into
its CUDA graphs), on GPUs of compute capability 9.0 or later, never under Triton's interpreter (which has no inline
PTX). On an H100 it made the 0.6B's batch-1 frame 1.12x faster and batch 64 1.05x, with the same codes
(docs/benchmarks.md, session of 2026-12-07). Kernels launched outside a scope (the codec, prefill) keep plain
launches: no GPU run has tested them with it. `LEGATO_PDL=0` (or `ENABLED = False`) turns it off.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Iterator

import torch

try:  # Triton ships with CUDA builds of torch; the CPU build has none.
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - depends on the install
    triton = None

ENABLED = os.environ.get("LEGATO_PDL", "1") != "0"
# Triton picks its interpreter when a kernel is defined, so the environment at import is the one that counts.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_scopes = threading.local()  # per thread: the codec may launch on another thread while a decode step is captured


@contextlib.contextmanager
def scope() -> Iterator[None]:
    """Kernels this thread launches inside take PDL (where `launch` allows it)."""
    _scopes.depth = getattr(_scopes, "depth", 0) + 1
    try:
        yield
    finally:
        _scopes.depth -= 1


@functools.cache
def _hopper_or_later(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def launch(t: torch.Tensor) -> bool:
    """Whether a kernel about to run on `t`'s device is launched with PDL (its PDL constexpr, and `launch_pdl`)."""
    return (ENABLED and getattr(_scopes, "depth", 0) > 0 and triton is not None and t.is_cuda
            and not _INTERPRETED and _hopper_or_later(t.device.index or 0))


def launch_options(on: bool) -> dict:
    """The launch keyword that asks for PDL (none when off: the interpreter takes no such keyword)."""
    return {"launch_pdl": True} if on else {}


if triton is not None:

    @triton.jit
    def release(PDL: tl.constexpr):
        # Lets the next kernel's programs be scheduled once every program of this one has called it.
        if PDL:
            gdc_launch_dependents()

    @triton.jit
    def wait(PDL: tl.constexpr):
        # Until the kernel before has finished and its writes are visible (a no-op without PDL).
        if PDL:
            gdc_wait()

    @triton.jit
    def warm_l2(ptrs, PDL: tl.constexpr):
        # One L2 prefetch per address (each fetches its 128-byte line), for data no earlier kernel writes.
        if PDL:
            tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs], dtype=tl.int32,
                                      is_pure=False, pack=1)
