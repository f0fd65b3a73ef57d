"""Streaming state of the codec decoder: what a request must remember between chunks of frames.

Every layer of the codec decoder is causal, so decoding an utterance chunk by chunk gives exactly the
whole-utterance waveform provided each layer is handed what it would have seen to its left:

- a causal conv keeps the last `(k - 1) * d` input samples (all its convs have stride 1);
- a causal transposed conv keeps its `k - stride` right-most output samples, which the whole-utterance
  forward trims and which the next chunk's first samples complete (stored without the bias, which the
  next chunk adds once);
- an attention layer keeps the keys and values (after RoPE) of the last `window - 1` frames, and the
  request keeps its absolute frame position, because the whole-utterance forward numbers frames 0..T-1.

`CodecStreamState` holds all of this for a batch of requests (batch-first tensors), so the engine can
keep one state per request and `cat` / `select` them into whatever batch it runs. `StreamContext` is the
per-step object that the decoder's layers read their old buffers from and write their new ones to.

Unequal chunk lengths in one batch: pass `lengths` (valid frames per request). Codes are right-padded
to the longest chunk with any valid code; because every layer is causal the padding can only change
samples after a request's valid end (the caller discards them), and every buffer is taken so that it
ends at the request's own valid end, so the padding never reaches the state. A length of 0 leaves that
request's state unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .codec_decoder import CodecDecoder


@dataclass
class CodecStreamState:
    """Decoder state of B requests between two streaming steps.

    `position` [B] (int64) counts the frames each request has decoded; `buffers` maps a layer's buffer
    name to a tensor whose first dimension is the request. A fresh state (`CodecDecoder.new_stream_state`)
    is all zeros, which is exactly the zero padding the whole-utterance forward applies on the left.
    """

    position: torch.Tensor
    buffers: dict[str, torch.Tensor]

    @property
    def batch_size(self) -> int:
        return self.position.shape[0]

    @staticmethod
    def cat(states: Sequence[CodecStreamState]) -> CodecStreamState:
        """Concatenates states along the request dimension (in order)."""
        if len(states) == 1:
            return states[0]
        keys = states[0].buffers.keys()
        return CodecStreamState(
            position=torch.cat([s.position for s in states]),
            buffers={k: torch.cat([s.buffers[k] for s in states]) for k in keys},
        )

    def select(self, index: torch.Tensor | Sequence[int]) -> CodecStreamState:
        """The state of the requests at `index` (a copy), in that order."""
        index = torch.as_tensor(index, dtype=torch.long, device=self.position.device)
        return CodecStreamState(
            position=self.position.index_select(0, index),
            buffers={k: v.index_select(0, index.to(v.device)) for k, v in self.buffers.items()},
        )

    def split(self) -> list[CodecStreamState]:
        """One single-request state per request (views into this state's tensors, no copy)."""
        return [
            CodecStreamState(self.position[i : i + 1], {k: v[i : i + 1] for k, v in self.buffers.items()})
            for i in range(self.batch_size)
        ]

    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.buffers.values())


class StreamContext:
    """One streaming step over `frames` frames: layers take their old buffer and keep their new one.

    `lengths` [B] gives the valid frames of each request when chunks were padded to `frames`; None means
    every request has all `frames` frames (the cheap path: plain slices instead of gathers).
    """

    def __init__(self, state: CodecStreamState, frames: int, lengths: torch.Tensor | None) -> None:
        self.state = state
        self.frames = frames
        self.lengths = lengths
        self.new_buffers: dict[str, torch.Tensor] = {}

    def take(self, key: str) -> torch.Tensor:
        return self.state.buffers[key]

    def keep(self, key: str, full: torch.Tensor, size: int, dim: int = -1) -> None:
        """Stores the `size` entries of `full` along `dim` that end at each request's valid end.

        `full` covers this step's frames at some fixed rate (entries per frame), possibly with a prefix
        (an old tail) and a suffix (a transposed conv's overhang); those are the same for all requests,
        so a request short of `frames` by m frames ends m * rate entries before the end of `full`.
        """
        dim = dim % full.ndim
        total = full.shape[dim]
        if self.lengths is None:
            self.new_buffers[key] = full.narrow(dim, total - size, size).clone()
            return
        rate = self._rate_of(full, dim, size)
        start = total - size - (self.frames - self.lengths) * rate  # [B]
        along = [1] * full.ndim
        along[dim] = size
        index = start.view([-1] + [1] * (full.ndim - 1)) + torch.arange(size, device=full.device).view(along)
        shape = list(full.shape)
        shape[dim] = size
        self.new_buffers[key] = torch.gather(full, dim, index.expand(shape))

    def _rate_of(self, full: torch.Tensor, dim: int, size: int) -> int:
        # The entries beyond the old tail / overhang are frames * rate; both kinds of extra are `size` long.
        body = full.shape[dim] - size
        if body % self.frames:
            raise ValueError(f"buffer source of length {full.shape[dim]} is not whole frames of {self.frames}")
        return body // self.frames

    def valid_mask(self, length: int) -> torch.Tensor | None:
        """[B, 1, length] bool: True where a sample lies before its request's valid end (None: all valid)."""
        if self.lengths is None:
            return None
        rate = length // self.frames
        positions = torch.arange(length, device=self.lengths.device)
        return (positions[None, :] < (self.lengths * rate)[:, None]).unsqueeze(1)

    def finish(self) -> CodecStreamState:
        advance = self.frames if self.lengths is None else self.lengths
        return CodecStreamState(position=self.state.position + advance, buffers=self.new_buffers)


@dataclass(frozen=True)
class ChunkSchedule:
    """How many frames each streaming step of one request decodes: `first` (latency of the first audio),
    then the `ramp` sizes, then `steady` from there on. The decoder itself accepts any sizes; this is
    only the caller's policy, e.g. ChunkSchedule(first=1, ramp=(4,), steady=25)."""

    first: int = 1
    ramp: tuple[int, ...] = (4,)
    steady: int = 25

    def __post_init__(self) -> None:
        if min((self.first, self.steady, *self.ramp)) < 1:
            raise ValueError("chunk sizes must be >= 1")

    def size(self, chunk_index: int) -> int:
        """Frames of the request's `chunk_index`-th chunk (0 = first)."""
        if chunk_index == 0:
            return self.first
        if chunk_index <= len(self.ramp):
            return self.ramp[chunk_index - 1]
        return self.steady

    def split(self, frames: int) -> list[int]:
        """The chunk sizes that cover `frames` frames (the last one takes what is left)."""
        sizes: list[int] = []
        while frames > 0:
            sizes.append(min(self.size(len(sizes)), frames))
            frames -= sizes[-1]
        return sizes


def decode_chunks(
    decoder: CodecDecoder, chunks: Sequence[torch.Tensor], states: Sequence[CodecStreamState]
) -> tuple[list[torch.Tensor], list[CodecStreamState]]:
    """Decodes one chunk for each of several requests in a single batched step.

    `chunks[i]` is request i's next codes, [n_i, num_quantizers] (n_i may differ, and may be 0);
    `states[i]` its single-request state. Returns the waveforms ([n_i * samples_per_frame] each) and
    the new states. Unequal chunks are right-padded with code 0 and decoded with `lengths`.
    """
    if len(chunks) != len(states):
        raise ValueError("one state per chunk")
    lengths = [c.shape[0] for c in chunks]
    frames = max(lengths)
    codes = torch.zeros(len(chunks), frames, decoder.num_quantizers, dtype=torch.long, device=chunks[0].device)
    for i, c in enumerate(chunks):
        codes[i, : c.shape[0]] = c
    uniform = all(n == frames for n in lengths)
    length_t = None if uniform else torch.tensor(lengths, device=codes.device)
    wav, state = decoder.stream_step(codes, CodecStreamState.cat(states), length_t)
    spf = decoder.samples_per_frame
    wavs = [wav[i, 0, : n * spf] for i, n in enumerate(lengths)]
    return wavs, state.split()
