"""The codec's audio on its way to the host: copied out without waiting (pinned memory behind a CUDA event),
handed out in the order it was decoded, and, for streams whose PCM is held (`decode_every_step`), cut into
the schedule's chunks, one chunk per stream per call, as when each chunk was decoded when due."""

from __future__ import annotations

import collections
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch

from legato.engine.codec_schedule import HeldAudio, StreamSchedule


@dataclass
class _Readback:
    """Decoded audio (`pcm` is complete once `event` has fired), or, with no rows, the mark that the streams in
    `closing` have nothing more coming (each with its held audio, or None). `holds` (one per row, or None) are
    where held streams collect their PCM."""

    rids: list[str]
    n: int
    pcm: torch.Tensor | None  # [B, n * spf] float32 on the host
    event: torch.cuda.Event | None
    closing: dict[str, HeldAudio | None] = field(default_factory=dict)
    holds: list[HeldAudio] | None = None


class AudioReadback:
    def __init__(self, schedule: StreamSchedule, samples_per_frame: int, cuda_stream: torch.cuda.Stream | None):
        self.schedule = schedule
        self.samples_per_frame = samples_per_frame
        self.cuda_stream = cuda_stream
        self._queue: collections.deque[_Readback] = collections.deque()
        self._backlog: dict[str, HeldAudio] = {}  # held streams with a complete chunk not delivered yet

    def send(self, rids: list[str], n: int, wav: torch.Tensor, holds: list[HeldAudio] | None) -> None:
        """Queues `n` frames of PCM per stream, wav [B, n * spf] on the decoder's device."""
        if self.cuda_stream is None:
            self._queue.append(_Readback(rids, n, wav.float(), None, holds=holds))
            return
        pcm = wav.float().to("cpu", non_blocking=True)  # into pinned memory, filled when the event fires
        event = torch.cuda.Event()
        event.record(self.cuda_stream)
        self._queue.append(_Readback(rids, n, pcm, event, holds=holds))

    def close(self, rid: str, held: HeldAudio | None) -> None:
        """Marks `rid` closed once everything it queued before has come back."""
        self._queue.append(_Readback([], 0, None, None, {rid: held}))

    def release(self, rid: str, held: HeldAudio) -> None:
        """A stream out of input delivers what it holds at the next `take`, whatever the chunk schedule says."""
        held.release = True
        self._backlog[rid] = held

    def holds(self, rid: str) -> bool:
        """Whether audio or a closing mark of `rid` is still queued here."""
        return rid in self._backlog or any(rid in rb.closing or rid in rb.rids for rb in self._queue)

    def take(self, wait: bool = False) -> tuple[dict[str, np.ndarray], set[str]]:
        """The audio that has come back, in order (waiting for all of it with `wait`), and the streams whose
        last audio is in it. Never blocks without `wait`."""
        audio: dict[str, list[np.ndarray]] = defaultdict(list)
        closed: set[str] = set()
        touched: dict[str, HeldAudio] = {}
        while self._queue:
            rb = self._queue[0]
            if rb.event is not None and not wait and not rb.event.query():
                break
            if rb.event is not None:
                rb.event.synchronize()
            self._queue.popleft()
            if rb.pcm is not None:
                pcm = rb.pcm.numpy()
                for i, (rid, w) in enumerate(zip(rb.rids, pcm, strict=True)):
                    held = rb.holds[i] if rb.holds is not None else None
                    if held is None:
                        audio[rid].append(w)
                    elif not held.dropped:
                        held.parts.append(w.copy())  # a view would keep the whole pinned buffer alive
                        held.frames += rb.n
                        touched[rid] = held
            touched.update((rid, held) for rid, held in rb.closing.items() if held is not None)
            closed |= rb.closing.keys()
        # One chunk per stream per call, as when each chunk was decoded when due; the rest waits in the backlog.
        for rid, held in {**self._backlog, **touched}.items():
            self._backlog.pop(rid, None)
            if held.dropped:
                continue
            if (part := held.take(self.schedule, self.samples_per_frame, everything=rid in closed)) is not None:
                audio[rid].append(part)
            if rid not in closed and (held.due(self.schedule) > 0 or (held.release and held.frames)):
                self._backlog[rid] = held
        return {rid: np.concatenate(parts) if len(parts) > 1 else parts[0] for rid, parts in audio.items()}, closed

    @property
    def pending(self) -> bool:
        """Audio queued that has not come back through `take`."""
        return bool(self._queue or self._backlog)
