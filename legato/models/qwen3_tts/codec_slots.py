"""The streaming codec decoder's state, one slot per stream, updated in place by each call.

A slot holds what its stream must remember between calls: its frame position, a call counter (whose parity
says which of the two history copies is current, see `legato/layers/causal_conv.py`), every causal conv's
last input samples and every attention layer's ring of keys and values. Nothing here is gathered or
scattered per call: kernels index the slot directly. Resetting a slot is writing its position to 0: a
history sample or key before the stream's start is masked, never read, so old contents cannot leak.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SlotLayout:
    """What a slot holds: conv histories by name -> (samples, channels), and the attention rings."""

    histories: dict[str, tuple[int, int]]
    layers: int
    ring: int  # positions per ring (>= window - 1 + the most frames one call takes)
    kv_heads: int
    head_dim: int


class CodecSlots:
    """`slots` streams' decoder state on one device, in one dtype (positions and counters in int64)."""

    def __init__(self, layout: SlotLayout, slots: int, dtype: torch.dtype, device: torch.device | str) -> None:
        self.layout = layout
        self.dtype = dtype
        self.device = torch.device(device)
        self.position = torch.zeros(slots, dtype=torch.long, device=device)
        self.calls = torch.zeros(slots, dtype=torch.long, device=device)
        self.hist = {name: torch.zeros(slots, 2, h, c, dtype=dtype, device=device)
                     for name, (h, c) in layout.histories.items()}
        ring = (layout.layers, slots, layout.ring, layout.kv_heads, layout.head_dim)
        self.keys = torch.zeros(ring, dtype=dtype, device=device)
        self.values = torch.zeros(ring, dtype=dtype, device=device)

    @property
    def size(self) -> int:
        return self.position.shape[0]

    def reset(self, slots: torch.Tensor) -> None:
        """Starts the streams of `slots` afresh (frame 0); nothing else needs clearing."""
        self.position.index_fill_(0, slots, 0)

    def advance(self, slots: torch.Tensor, frames: int) -> None:
        """After a call of `frames` frames: positions move on and the history copies swap."""
        self.position.index_add_(0, slots, torch.full_like(slots, frames))
        self.calls.index_add_(0, slots, torch.ones_like(slots))

    def resized(self, slots: int) -> CodecSlots:
        """A bank of `slots` slots holding this one's first min(size, slots) slots."""
        new = CodecSlots(self.layout, slots, self.dtype, self.device)
        n = min(slots, self.size)
        new.position[:n] = self.position[:n]
        new.calls[:n] = self.calls[:n]
        for name, buf in self.hist.items():
            new.hist[name][:n] = buf[:n]
        new.keys[:, :n] = self.keys[:, :n]
        new.values[:, :n] = self.values[:, :n]
        return new

    def nbytes_per_slot(self) -> int:
        tensors = [*self.hist.values(), self.keys, self.values]
        return sum(t.numel() * t.element_size() for t in tensors) // self.size
