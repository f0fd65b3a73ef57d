"""How a stream is cut into chunks (`StreamSchedule`), and the audio a stream holds until its next chunk is
complete (`HeldAudio`, when the codec decodes every step). Host-side bookkeeping only; `CodecStreamer` decodes."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class StreamSchedule:
    """How a stream is cut into chunks, and the decode windows it follows (see `codec_streamer`'s module doc)."""

    first_chunk_frames: int = 1
    chunk_frames: int = 25
    chunk_ramp: bool = True
    window_frames: int | None = 300
    window_context: int = 25
    decode_every_step: bool = True

    def __post_init__(self) -> None:
        if self.first_chunk_frames < 1 or self.chunk_frames < 1:
            raise ValueError("chunk sizes must be >= 1")
        if self.window_frames is not None and not 0 <= self.window_context < self.window_frames:
            raise ValueError(f"the decode window needs 0 <= window_context < window_frames, got "
                             f"{self.window_context} and {self.window_frames}")

    @classmethod
    def of(cls, config) -> StreamSchedule:
        """The schedule an `EngineConfig` names."""
        return cls(config.first_chunk_frames, config.chunk_frames, config.chunk_ramp, config.codec_window_frames,
                   config.codec_window_context, config.codec_decode_every_step)

    def chunk_sizes(self) -> list[int]:
        """Every chunk size the schedule makes before a stream's tail (the sizes worth a CUDA graph)."""
        sizes, emitted, n = set(), 0, 0
        while emitted == 0 or n != self.chunk_frames:  # the ramp grows until it reaches the steady size
            n = next_chunk_frames(emitted, self.first_chunk_frames, self.chunk_frames, self.chunk_ramp)
            sizes.add(n)
            emitted += n
        return sorted(sizes)


def next_chunk_frames(emitted: int, first: int, steady: int, ramp: bool = False) -> int:
    """Frames of a stream's next chunk after `emitted` frames: `first`, then (ramp) as many as were already
    sent, capped at `steady`; without the ramp `steady` straight after the first chunk."""
    if emitted == 0:
        return first
    return min(steady, max(first, emitted)) if ramp else steady


@dataclass
class HeldAudio:
    """A stream's decoded PCM not delivered yet (`decode_every_step`): it goes out in the schedule's chunks."""

    first_chunk_frames: int
    parts: list[np.ndarray] = field(default_factory=list)
    frames: int = 0  # frames in `parts`
    delivered: int = 0  # frames delivered so far
    dropped: bool = False  # the stream was closed without its audio (aborted, failed)
    release: bool = False  # its input ran out (streaming text): what is held goes out now, not at a chunk's end

    def due(self, schedule: StreamSchedule) -> int:
        """Frames of the next chunk when it is complete, else 0."""
        need = next_chunk_frames(self.delivered, self.first_chunk_frames, schedule.chunk_frames, schedule.chunk_ramp)
        return need if self.frames >= need else 0

    def take(self, schedule: StreamSchedule, samples_per_frame: int, everything: bool) -> np.ndarray | None:
        """The PCM of the next chunk if complete (all that is held when the stream has ended), or None."""
        ready = self.frames if everything or self.release else self.due(schedule)
        if ready == 0:
            return None
        pcm = np.concatenate(self.parts) if len(self.parts) > 1 else self.parts[0]
        out, rest = pcm[: ready * samples_per_frame], pcm[ready * samples_per_frame:]
        self.parts = [rest] if rest.size else []
        self.frames -= ready
        self.delivered += ready
        return out
