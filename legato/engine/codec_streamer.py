"""Streams codec frames into PCM chunks, batching every request whose chunk is due in the same call.

Each request keeps a stateful decoder state, so the chunks concatenate to exactly the whole-utterance
decode. The chunk schedule is `first_chunk_frames` (time to first audio), then chunks that double the
audio already sent (with `chunk_ramp`) up to `chunk_frames`; the tail goes out when the request finishes. The
ramp is what keeps a real-time player fed: after E frames (E x 80 ms of audio) the next chunk is E frames,
which the engine makes in far less than E x 80 ms, whereas a jump from 1 frame straight to 25 leaves the
player 80 ms of audio to cover 25 frames of generation. In-context clones first run their reference codes
through the state (output dropped), which equals the reference's decode-with-prefix-then-cut without re-decoding it.
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


@dataclass
class _Stream:
    state: CodecStreamState
    first_chunk_frames: int
    pending: list[torch.Tensor] = field(default_factory=list)  # [16] frames not decoded yet
    emitted_frames: int = 0


def next_chunk_frames(emitted: int, first: int, steady: int, ramp: bool = False) -> int:
    """Frames of a stream's next chunk after `emitted` frames: `first`, then (ramp) as many as were already
    sent, capped at `steady`; without the ramp `steady` straight after the first chunk."""
    if emitted == 0:
        return first
    return min(steady, max(first, emitted)) if ramp else steady


class CodecStreamer:
    def __init__(self, decoder: CodecDecoder, first_chunk_frames: int, chunk_frames: int,
                 chunk_ramp: bool = False) -> None:
        self.decoder = decoder
        self.first_chunk_frames = first_chunk_frames
        self.chunk_frames = chunk_frames
        self.chunk_ramp = chunk_ramp
        self.streams: dict[str, _Stream] = {}
        weight = next(decoder.parameters())
        self.device = weight.device

    @torch.inference_mode()
    def open(
        self, request_id: str, ref_code: torch.Tensor | None = None, first_chunk_frames: int | None = None
    ) -> None:
        state = self.decoder.new_stream_state(1)
        if ref_code is not None and ref_code.shape[0] > 0:
            codes = ref_code.to(self.device).T.unsqueeze(0)
            _, state = self.decoder.stream_step(codes, state)
        self.streams[request_id] = _Stream(state, first_chunk_frames or self.first_chunk_frames)

    def push(self, request_id: str, frame: torch.Tensor) -> None:
        self.streams[request_id].pending.append(frame)

    def close(self, request_id: str) -> None:
        self.streams.pop(request_id, None)

    @torch.inference_mode()
    def flush(self, finished: set[str]) -> tuple[dict[str, np.ndarray], dict[str, str]]:
        """Decodes every due chunk; requests in `finished` flush their tail and are closed.

        Returns (new PCM by request, failures by request). A decode that raises fails only the streams
        batched into it: they are closed and reported with the reason, the others still get their audio."""
        groups: dict[int, list[str]] = defaultdict(list)
        for rid, s in self.streams.items():
            need = next_chunk_frames(s.emitted_frames, s.first_chunk_frames, self.chunk_frames, self.chunk_ramp)
            n = len(s.pending)
            if rid in finished and n:
                groups[n].append(rid)
            elif n >= need:
                groups[need].append(rid)
        out: dict[str, np.ndarray] = {}
        failed: dict[str, str] = {}
        for n, rids in groups.items():
            streams = [self.streams[r] for r in rids]
            try:
                codes = torch.stack([torch.stack(s.pending[:n]) for s in streams]).to(self.device)  # [B, n, 16]
                state = CodecStreamState.cat([s.state for s in streams])
                wav, state = self.decoder.stream_step(codes.transpose(1, 2), state)
                wav = wav[:, 0].float().cpu().numpy()
            except Exception as e:
                log.exception("codec decode failed for %d streams", len(rids))
                for rid in rids:
                    failed[rid] = f"codec decode failed: {type(e).__name__}: {e}"
                    self.close(rid)
                continue
            for s, rid, st, w in zip(streams, rids, state.split(), wav, strict=True):
                s.state = st
                del s.pending[:n]
                s.emitted_frames += n
                out[rid] = w
        for rid in finished:
            self.close(rid)
        return out, failed
