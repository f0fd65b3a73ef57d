"""Programmatic dependent launch (Hopper and later) for the decode step's own Triton kernels. Off by default:
not yet measured (docs/benchmarks.md says when it is).

A decode step is ~1,100 kernels, and each matmul pays a few microseconds of launch and ramp before its weight
streams (a 4 MB weight took 4.5 us on the H200, 1.3 us of it at full bandwidth). With PDL a kernel is launched
while the one before it still runs: its programs wait at `gdc_wait` for that kernel to finish, and a matmul first
asks L2 for its weight strip, which no earlier kernel writes.

The discipline every kernel launched this way keeps, so that it never reads what an unfinished kernel writes:
- before `gdc_wait` it reads nothing but weights and the step's host-uploaded inputs;
- it calls `gdc_launch_dependents` only after `gdc_wait`, so the kernel after it starts only once the kernel
  before it has finished, and nothing runs more than one kernel ahead.
A kernel the previous one does not signal (cuBLAS, torch.compile's) simply launches when that one ends; a kernel
launched without PDL after a PDL one waits for it to finish. So any mix of kernels stays ordered.
"""

from __future__ import annotations

import functools

import torch

try:  # Triton ships with CUDA builds of torch; the CPU build has none.
    import triton
except ImportError:  # pragma: no cover - depends on the install
    triton = None

ENABLED = False  # benchmarks/offline.py --pdl turns it on


@functools.cache
def _hopper_or_later(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def on(x: torch.Tensor) -> bool:
    """Whether kernels working on `x` launch with PDL."""
    return ENABLED and triton is not None and x.is_cuda and _hopper_or_later(x.device.index or 0)


def launch_args(enabled: bool) -> dict:
    """The Triton launch option for a kernel launched with PDL (nothing when not, so the interpreter never sees it)."""
    return {"launch_pdl": True} if enabled else {}


if triton is not None:
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def prefetch_l2(ptrs):
        """Asks L2 for the 128-byte lines at `ptrs` (a tensor of pointers) without waiting for them."""
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)

    @triton.jit
    def wait_then_release():
        """Waits for the kernel before to finish, then lets the kernel after launch (the order the module
        docstring's discipline needs)."""
        gdc_wait()
        gdc_launch_dependents()
