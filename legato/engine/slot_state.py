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

        def head() -> HeadTensors:
            return HeadTensors(
                do_sample=torch.zeros(n, dtype=torch.bool, device=device),
                temperature=torch.ones(n, dtype=torch.float32, device=device),
                top_k=torch.zeros(n, dtype=torch.long, device=device),
                top_p=torch.ones(n, dtype=torch.float32, device=device),
            )

        self.params = SamplingTensors(
            seed=torch.zeros(n, dtype=torch.long, device=device),
            frame=torch.zeros(n, dtype=torch.long, device=device),
            repetition_penalty=torch.ones(n, dtype=torch.float32, device=device),
            min_new_tokens=torch.zeros(n, dtype=torch.long, device=device),
            talker=head(),
            subtalker=head(),
        )

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
        p = self.params
        ints, floats, flags = [], [], []
        for a in items:
            q = a.params
            ints.append((a.seed, NEVER_EOS if a.ignore_eos else int(q.min_new_tokens), int(q.top_k),
                         int(q.subtalker_top_k), a.trailing_text.shape[0]))
            floats.append((float(q.repetition_penalty), float(q.temperature), float(q.top_p),
                           float(q.subtalker_temperature), float(q.subtalker_top_p)))
            flags.append((bool(q.do_sample), bool(q.subtalker_do_sample)))
        device = self.frames.device
        idx = upload(np.array([a.slot for a in items], dtype=np.int64), device)
        i = upload(np.array(ints, dtype=np.int64), device)
        f = upload(np.array(floats, dtype=np.float32), device)
        b = upload(np.array(flags, dtype=np.bool_), device)
        for dst, src in ((p.seed, i[:, 0]), (p.min_new_tokens, i[:, 1]), (p.talker.top_k, i[:, 2]),
                         (p.subtalker.top_k, i[:, 3]), (self.trailing_len, i[:, 4]),
                         (p.repetition_penalty, f[:, 0]), (p.talker.temperature, f[:, 1]), (p.talker.top_p, f[:, 2]),
                         (p.subtalker.temperature, f[:, 3]), (p.subtalker.top_p, f[:, 4]),
                         (p.talker.do_sample, b[:, 0]), (p.subtalker.do_sample, b[:, 1])):
            dst.index_copy_(0, idx, src)
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
        p = self.params

        def rows(h: HeadTensors) -> HeadTensors:
            return HeadTensors(h.do_sample[slots], h.temperature[slots], h.top_k[slots], h.top_p[slots])

        return SamplingTensors(
            seed=p.seed[slots],
            frame=frame,
            repetition_penalty=p.repetition_penalty[slots],
            min_new_tokens=p.min_new_tokens[slots],
            talker=rows(p.talker),
            subtalker=rows(p.subtalker),
        )

    def text_for(self, slots: torch.Tensor, step: torch.Tensor, tts_pad: torch.Tensor) -> torch.Tensor:
        """Text-track input of decode step `step` [B]: trailing text while it lasts, then tts_pad."""
        idx = step.clamp(max=self.max_text - 1)
        text = self.trailing[slots, idx]
        return torch.where((step < self.trailing_len[slots])[:, None], text, tts_pad)
