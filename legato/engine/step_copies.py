"""Device-to-host copies of a step's results that the host reads one step later, and the step timers.

The asynchronous engine loop launches step t+1 before it reads step t's codes. Each step's small result
tensor goes to the host through a pinned buffer, copied on the compute stream behind the step's kernels,
with a CUDA event recorded after the copy: the host waits for that event only when it collects the step,
by which time the GPU is already running the next one. Two buffers alternate, so the copy of step t+1
never overwrites step t's results while the host reads them. On the CPU there is nothing to overlap: a
copy is the tensor itself.

`StepTimes` adds up, per engine, the host time of each step, the device time of each step's work on the
compute stream (CUDA events at its launch and after its copy: the device reaches the first only once the
previous step is done, so the span is this step's own), and the device's idle gap between two steps: what
the host did not hide. Busy = device time / (device time + gaps).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PendingCopy:
    """One step's results on their way to the host."""

    host: torch.Tensor  # a view of a pinned buffer (CUDA) or the result itself (CPU)
    event: torch.cuda.Event | None  # recorded after the copy
    launched: torch.cuda.Event | None  # recorded when the step's launch began

    def wait(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
        return self.host


@dataclass
class StepTimes:
    """Totals since the engine started (seconds); rates and means are for whoever reads them."""

    steps: int = 0
    decode_rows: int = 0  # streams decoded, summed over steps: / steps, the streams a step carries
    host_s: float = 0.0
    gpu_s: float = 0.0
    gap_s: float = 0.0

    @property
    def gpu_busy(self) -> float | None:
        total = self.gpu_s + self.gap_s
        return self.gpu_s / total if total > 0 else None


class StepCopies:
    def __init__(self, rows: int, width: int, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.width = width
        if self.cuda:
            self._buffers = [torch.empty(rows, width, dtype=torch.long, pin_memory=True) for _ in range(2)]
        self._next = 0
        self._last_end: torch.cuda.Event | None = None

    def begin(self) -> torch.cuda.Event | None:
        """Marks the start of a step's device work (call before queuing any of it)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def submit(self, rows: torch.Tensor, launched: torch.cuda.Event | None = None) -> PendingCopy:
        """Queues the copy of `rows` [n, width] (int64, on the device) behind the work already queued."""
        if not self.cuda:
            return PendingCopy(rows, None, None)
        i, n = self._next, rows.shape[0]
        self._next ^= 1
        if n > self._buffers[i].shape[0]:  # more rows than planned for: grow (rare; pinned memory is slow to get)
            self._buffers[i] = torch.empty(n, self.width, dtype=torch.long, pin_memory=True)
        host = self._buffers[i][:n]
        host.copy_(rows, non_blocking=True)
        event = torch.cuda.Event(enable_timing=launched is not None)
        event.record()
        return PendingCopy(host, event, launched)

    def account(self, copy: PendingCopy, times: StepTimes) -> None:
        """Adds a collected step's device time and the idle gap before it (after `copy.wait()`)."""
        if copy.launched is None:
            return
        times.gpu_s += copy.launched.elapsed_time(copy.event) / 1000.0
        if self._last_end is not None:
            times.gap_s += max(0.0, self._last_end.elapsed_time(copy.launched) / 1000.0)
        self._last_end = copy.event
