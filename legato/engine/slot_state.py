"""Per-slot device state of running requests.

Everything a decode step needs about a request lives in static tensors indexed by its slot (a small
integer the scheduler assigns for the request's life). A decode step therefore takes only slot indices,
positions and block tables from the host; the rest is gathered and scattered on the device, which is what
lets one CUDA graph per batch bucket serve any mix of requests. Row `scratch` is never assigned: padded
graph rows read and write it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from legato.engine.sampler import HeadTensors, SamplingTensors
from legato.layers.host import upload

# Frames of min_new_tokens that keep EOS masked for a whole request (benchmarks with fixed lengths).
NEVER_EOS = 1 << 62


# The rows of SlotState's knob tables, by dtype.
_INTS = ("seed", "min_new_tokens", "top_k", "subtalker_top_k")
_FLOATS = ("repetition_penalty", "temperature", "top_p", "subtalker_temperature", "subtalker_top_p")
_FLAGS = ("do_sample", "subtalker_do_sample")


def _knobs(ints: torch.Tensor, floats: torch.Tensor, flags: torch.Tensor, frame: torch.Tensor) -> SamplingTensors:
    """SamplingTensors viewing the rows of knob tables laid out as _INTS, _FLOATS and _FLAGS ([knob, column])."""
    return SamplingTensors(
        seed=ints[0], frame=frame, repetition_penalty=floats[0], min_new_tokens=ints[1],
        talker=HeadTensors(do_sample=flags[0], temperature=floats[1], top_k=ints[2], top_p=floats[2]),
        subtalker=HeadTensors(do_sample=flags[1], temperature=floats[3], top_k=ints[3], top_p=floats[4]),
    )


@dataclass
class SlotAssignment:
    """What a slot holds for a new request: its trailing text embeddings [n, H] and sampling knobs."""

    slot: int
    trailing_text: torch.Tensor
    params: object  # SamplingParams (duck-typed: the fields the sampler reads)
    seed: int
    ignore_eos: bool


class SlotState:
    def __init__(
        self,
        num_slots: int,
        hidden: int,
        vocab: int,
        max_text: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        n = num_slots + 1
        self.scratch = num_slots
        self.max_text = max_text
        self.past_hidden = torch.zeros(n, hidden, dtype=dtype, device=device)
        self.last_c0 = torch.zeros(n, dtype=torch.long, device=device)
        self.frames = torch.zeros(n, dtype=torch.long, device=device)
        self.seen = torch.zeros(n, vocab, dtype=torch.bool, device=device)
        self.trailing = torch.zeros(n, max_text, hidden, dtype=dtype, device=device)
        self.trailing_len = torch.zeros(n, dtype=torch.long, device=device)

        # The sampling knobs, one table per dtype with a row per knob and a column per slot: a step gathers
        # its slots' columns in three kernels (each knob a contiguous row of the result, as the draw reads
        # it) instead of one per knob; `params` views the rows.
        self._ints = torch.zeros(len(_INTS), n, dtype=torch.long, device=device)
        self._floats = torch.ones(len(_FLOATS), n, dtype=torch.float32, device=device)
        self._flags = torch.zeros(len(_FLAGS), n, dtype=torch.bool, device=device)
        self.params = _knobs(self._ints, self._floats, self._flags, torch.zeros(n, dtype=torch.long, device=device))

    def assign(self, slot: int, trailing_text: torch.Tensor, params: object, seed: int, ignore_eos: bool) -> None:
        """Resets `slot` for a new request (its trailing text embeddings [n, H] and sampling params)."""
        self.assign_many([SlotAssignment(slot, trailing_text, params, seed, ignore_eos)])

    def check(self, a: SlotAssignment) -> None:
        """Raises ValueError for an assignment the slot cannot hold (its trailing text is too long)."""
        n = a.trailing_text.shape[0]
        if n > self.max_text:
            raise ValueError(f"trailing text of {n} tokens exceeds max_text_tokens={self.max_text}")

    def assign_many(self, items: list[SlotAssignment]) -> None:
        """Resets every slot of `items` at once: the step's new requests cost three uploads and one scatter
        per field, not ~15 single-element writes each (which were a seventh of the engine thread at c=64)."""
        if not items:
            return
        for a in items:
            self.check(a)
        ints, floats, flags = [], [], []
        for a in items:  # in the order of _INTS, _FLOATS and _FLAGS, then the trailing text's length
            q = a.params
            ints.append((a.seed, NEVER_EOS if a.ignore_eos else int(q.min_new_tokens), int(q.top_k),
                         int(q.subtalker_top_k), a.trailing_text.shape[0]))
            floats.append((float(q.repetition_penalty), float(q.temperature), float(q.top_p),
                           float(q.subtalker_temperature), float(q.subtalker_top_p)))
            flags.append((bool(q.do_sample), bool(q.subtalker_do_sample)))
        device = self.frames.device
        idx = upload(np.array([a.slot for a in items], dtype=np.int64), device)
        i = upload(np.array(ints, dtype=np.int64).T.copy(), device)  # [knob, item]
        f = upload(np.array(floats, dtype=np.float32).T.copy(), device)
        b = upload(np.array(flags, dtype=np.bool_).T.copy(), device)
        self._ints.index_copy_(1, idx, i[: len(_INTS)])
        self._floats.index_copy_(1, idx, f)
        self._flags.index_copy_(1, idx, b)
        self.trailing_len.index_copy_(0, idx, i[len(_INTS)])
        self.frames.index_fill_(0, idx, 0)
        self.seen.index_fill_(0, idx, False)
        for a in items:
            n = a.trailing_text.shape[0]
            self.trailing[a.slot, :n] = a.trailing_text.to(self.trailing.dtype)

    def extend_text(self, slot: int, start: int, embeds: torch.Tensor) -> None:
        """Streaming text: `embeds` [n, H] become the slot's trailing text from index `start` on. Only rows no
        decode step has read yet are written, so a step in flight is unaffected."""
        end = start + embeds.shape[0]
        if end > self.max_text:
            raise ValueError(f"trailing text of {end} tokens exceeds max_text_tokens={self.max_text}")
        self.trailing[slot, start:end] = embeds.to(self.trailing.dtype)
        self.trailing_len[slot] = end

    def gather_params(self, slots: torch.Tensor, frame: torch.Tensor) -> SamplingTensors:
        """The sampling rows of `slots`, keyed to `frame` [B]."""
        return _knobs(self._ints.index_select(1, slots), self._floats.index_select(1, slots),
                      self._flags.index_select(1, slots), frame)

    def text_for(self, slots: torch.Tensor, step: torch.Tensor, tts_pad: torch.Tensor) -> torch.Tensor:
        """Text-track input of decode step `step` [B]: trailing text while it lasts, then tts_pad."""
        idx = step.clamp(max=self.max_text - 1)
        text = self.trailing[slots, idx]
        return torch.where((step < self.trailing_len[slots])[:, None], text, tts_pad)
