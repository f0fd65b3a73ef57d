"""Host-to-device copies that never make the host wait for the device.

A non-blocking copy from ordinary (pageable) host memory may be staged by the driver, which can make the
host wait for the stream to drain: in an engine that queues step t + 1 while step t runs, that wait would
undo the overlap. Copies go through pinned memory instead (PyTorch's caching host allocator keeps the
buffer alive until the copy has run), so they only queue.
"""

from __future__ import annotations

import numpy as np
import torch


def upload(data: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """`data` on `device`, queued behind the current stream's work without waiting for it."""
    t = torch.as_tensor(data)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
