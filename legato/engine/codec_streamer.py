"""Streams codec frames into PCM chunks, batching every request whose chunk is due in the same call.

Each request keeps a stateful decoder state, so the chunks concatenate to the decode of the whole
utterance. The chunk schedule is `first_chunk_frames` (time to first audio), then chunks that double the
audio already sent (with `chunk_ramp`) up to `chunk_frames`; the tail goes out when the request finishes. The
ramp is what keeps a real-time player fed: after E frames (E x 80 ms of audio) the next chunk is E frames,
which the engine makes in far less than E x 80 ms, whereas a jump from 1 frame straight to 25 leaves the
player 80 ms of audio to cover 25 frames of generation. In-context clones first run their reference codes
through the state (output dropped), which equals the reference's decode-with-prefix-then-cut without re-decoding it.

Long utterances follow the reference's windowed decode (`CodecDecoder.decode`): windows of `window_frames`
frames (300), each decoded from a fresh state that starts `window_context` frames (25) before the window,
whose output is dropped. Streaming keeps that exactly with a second state per stream: it starts, fresh, at
the last `window_context` frames of the current window (fed the same codes, output dropped) and takes over
at the window's end. Positions count the reference frames of an in-context clone, as the reference decodes
reference and generated codes as one sequence. `window_frames=None` streams with full context instead (the
whole-utterance `forward`), which differs from the reference past 300 frames.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch

from legato.models.qwen3_tts.codec_decoder import CodecDecoder
from legato.models.qwen3_tts.codec_streaming import CodecStreamState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamSchedule:
    """How a stream is cut into chunks, and the decode windows it follows (see the module doc)."""

    first_chunk_frames: int = 1
    chunk_frames: int = 25
    chunk_ramp: bool = False
    window_frames: int | None = 300
    window_context: int = 25

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
                   config.codec_window_context)


@dataclass
class _Stream:
    state: CodecStreamState
    first_chunk_frames: int
    pending: list[torch.Tensor] = field(default_factory=list)  # [16] frames not decoded yet
    emitted_frames: int = 0
    position: int = 0  # frames run through the decoder, reference frames included
    next_window: CodecStreamState | None = None  # primed on the next window's left context


def next_chunk_frames(emitted: int, first: int, steady: int, ramp: bool = False) -> int:
    """Frames of a stream's next chunk after `emitted` frames: `first`, then (ramp) as many as were already
    sent, capped at `steady`; without the ramp `steady` straight after the first chunk."""
    if emitted == 0:
        return first
    return min(steady, max(first, emitted)) if ramp else steady


class CodecStreamer:
    def __init__(self, decoder: CodecDecoder, schedule: StreamSchedule | None = None) -> None:
        self.decoder = decoder
        self.schedule = schedule or StreamSchedule()
        self.streams: dict[str, _Stream] = {}
        weight = next(decoder.parameters())
        self.device = weight.device

    @torch.inference_mode()
    def open(
        self, request_id: str, ref_code: torch.Tensor | None = None, first_chunk_frames: int | None = None
    ) -> None:
        stream = _Stream(self.decoder.new_stream_state(1), first_chunk_frames or self.schedule.first_chunk_frames)
        if ref_code is not None and ref_code.shape[0] > 0:
            self._decode_windowed(stream, ref_code.to(self.device))
        self.streams[request_id] = stream

    def push(self, request_id: str, frame: torch.Tensor) -> None:
        self.streams[request_id].pending.append(frame)

    def close(self, request_id: str) -> None:
        self.streams.pop(request_id, None)

    @torch.inference_mode()
    def flush(self, finished: set[str]) -> tuple[dict[str, np.ndarray], dict[str, str]]:
        """Decodes every due chunk; requests in `finished` flush their tail and are closed.

        Returns (new PCM by request, failures by request). A decode that raises fails only the streams
        batched into it: they are closed and reported with the reason, the others still get their audio."""
        sched = self.schedule
        groups: dict[int, list[str]] = defaultdict(list)  # chunk frames -> streams, batched per size
        windowed: list[tuple[str, int]] = []  # chunks that reach a window's left context: one call each
        for rid, s in self.streams.items():
            need = next_chunk_frames(s.emitted_frames, s.first_chunk_frames, sched.chunk_frames, sched.chunk_ramp)
            n = len(s.pending)
            if not (rid in finished and n) and n < need:
                continue
            n = n if rid in finished else need
            if self._in_one_window(s, n):
                groups[n].append(rid)
            else:
                windowed.append((rid, n))
        out: dict[str, np.ndarray] = {}
        failed: dict[str, str] = {}
        for n, rids in groups.items():
            streams = [self.streams[r] for r in rids]
            try:
                codes = torch.stack([torch.stack(s.pending[:n]) for s in streams]).to(self.device)  # [B, n, 16]
                wav, state = self.decoder.stream_step(codes, CodecStreamState.cat([s.state for s in streams]))
                wav = wav[:, 0].float().cpu().numpy()
            except Exception as e:
                self._fail(rids, e, failed)
                continue
            for s, rid, st, w in zip(streams, rids, state.split(), wav, strict=True):
                s.state = st
                s.position += n
                self._emitted(s, n)
                out[rid] = w
        for rid, n in windowed:
            s = self.streams[rid]
            try:
                out[rid] = self._decode_windowed(s, torch.stack(s.pending[:n]).to(self.device)).float().cpu().numpy()
            except Exception as e:
                self._fail([rid], e, failed)
                continue
            self._emitted(s, n)
        for rid in finished:
            self.close(rid)
        return out, failed

    def _in_one_window(self, s: _Stream, n: int) -> bool:
        """True when `n` more frames touch neither the next window's left context nor its start."""
        window = self.schedule.window_frames
        if window is None:
            return True
        boundary = (s.position // window + 1) * window
        # The last frame must lie before the next window's left context, and before the window's end
        # itself (where the state is swapped) when there is no context.
        return s.position + n <= min(boundary - self.schedule.window_context, boundary - 1)

    def _decode_windowed(self, s: _Stream, codes: torch.Tensor) -> torch.Tensor:
        """Runs frames [n, 16] through one stream's state(s), window by window; returns its PCM [n * spf]."""
        window, context = self.schedule.window_frames, self.schedule.window_context
        if window is None:
            wav, s.state = self.decoder.stream_step(codes[None], s.state)
            s.position += codes.shape[0]
            return wav[0, 0]
        pieces, i, n = [], 0, codes.shape[0]
        while i < n:
            boundary = (s.position // window + 1) * window
            context_start = boundary - context
            if s.position < context_start:
                m = min(n - i, context_start - s.position)
            else:  # inside the next window's left context: its state sees these frames too
                m = min(n - i, boundary - s.position)
                if s.next_window is None:
                    s.next_window = self.decoder.new_stream_state(1)
                _, s.next_window = self.decoder.stream_step(codes[None, i : i + m], s.next_window)
            wav, s.state = self.decoder.stream_step(codes[None, i : i + m], s.state)
            pieces.append(wav[0, 0])
            s.position += m
            i += m
            if s.position == boundary:
                s.state, s.next_window = s.next_window or self.decoder.new_stream_state(1), None
        return torch.cat(pieces)

    @staticmethod
    def _emitted(s: _Stream, n: int) -> None:
        del s.pending[:n]
        s.emitted_frames += n

    def _fail(self, rids: list[str], e: Exception, failed: dict[str, str]) -> None:
        log.exception("codec decode failed for %d streams", len(rids))
        for rid in rids:
            failed[rid] = f"codec decode failed: {type(e).__name__}: {e}"
            self.close(rid)
