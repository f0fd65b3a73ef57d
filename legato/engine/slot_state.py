"""Per-slot device state of running requests.

Everything a decode step needs about a request lives in static tensors indexed by its slot (a small
integer the scheduler assigns for the request's life). A decode step therefore takes only slot indices,
positions and block tables from the host; the rest is gathered and scattered on the device, which is what
lets one CUDA graph per batch bucket serve any mix of requests. Row `scratch` is never assigned: padded
graph rows read and write it.
"""

from __future__ import annotations

import torch

from legato.engine.sampler import HeadTensors, SamplingTensors

# Frames of min_new_tokens that keep EOS masked for a whole request (benchmarks with fixed lengths).
NEVER_EOS = 1 << 62


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
        n = trailing_text.shape[0]
        if n > self.max_text:
            raise ValueError(f"trailing text of {n} tokens exceeds max_text_tokens={self.max_text}")
        self.trailing[slot, :n] = trailing_text.to(self.trailing.dtype)
        self.trailing_len[slot] = n
        self.frames[slot] = 0
        self.seen[slot] = False
        p = self.params
        p.seed[slot] = seed
        p.repetition_penalty[slot] = float(params.repetition_penalty)
        p.min_new_tokens[slot] = NEVER_EOS if ignore_eos else int(params.min_new_tokens)
        for head, prefix in ((p.talker, ""), (p.subtalker, "subtalker_")):
            head.do_sample[slot] = bool(getattr(params, prefix + "do_sample"))
            head.temperature[slot] = float(getattr(params, prefix + "temperature"))
            head.top_k[slot] = int(getattr(params, prefix + "top_k"))
            head.top_p[slot] = float(getattr(params, prefix + "top_p"))

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
