"""What a run shows while it goes: requests done, audio frames received, and, as soon as the pace shows it,
a warning that requests cannot finish within their timeout.

A CPU server given 48 requests at once decodes them all together, each at a 48th of its speed: every one
timed out after 300 s while the progress bar, counting finished requests only, sat at 0/48 (issue 20). The
frames show the server working; the pace check says within seconds what the timeout will do.

The check, made while requests are in flight: a request that has received `f` of its expected `F` frames
in `e` seconds since it was sent finishes, at that pace, after about `e * F / f` seconds. When that passes
the timeout for most requests in flight, the run cannot meet it; the frames all streams receive per second
(`R`) then say how many requests could run side by side and each still finish in time (`R * timeout / F`).
`F` is the request's fixed length (`--fixed-length`), else its text length times the frames per character
of the requests completed so far (the warm-ups first); with neither, the pace is not judged.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from .metrics import RequestRecord

FRAME_RATE_HZ = 12.5  # Qwen3-TTS 12 Hz codecs: 1920 samples a frame at 24 kHz
MIN_ELAPSED_S = 1.0  # a pace measured over less than this is mostly the first chunk's latency


@dataclass(frozen=True)
class PaceVerdict:
    """Why the run cannot meet its timeout, in numbers (see the module doc)."""

    in_flight: int
    expected_frames: float  # median F of the requests judged
    projected_s: float  # median e * F / f
    frames_per_s: float  # R, all streams together
    timeout_s: float

    @property
    def fitting_concurrency(self) -> int:
        """Requests that could run side by side at this pace and finish in 80 % of the timeout (>= 1)."""
        return max(1, math.floor(0.8 * self.frames_per_s * self.timeout_s / self.expected_frames))

    def message(self) -> str:
        return (f"at the pace so far ({self.frames_per_s:.1f} audio frames/s over {self.in_flight} requests in "
                f"flight), a request of ~{self.expected_frames:.0f} frames takes ~{self.projected_s:.0f} s, past "
                f"the {self.timeout_s:g} s timeout: expect timeouts. About {self.fitting_concurrency} "
                f"request{'s' if self.fitting_concurrency != 1 else ''} at a time would fit (--max-concurrency), "
                "or give a longer --timeout")


class Pace:
    """Frames received and the pace check over one run's records (read by the progress ticker)."""

    def __init__(self, records: list[RequestRecord], timeout_s: float, sample_rate: int,
                 frames_per_char: float | None = None, frame_rate: float = FRAME_RATE_HZ) -> None:
        self.records = records
        self.timeout_s = timeout_s
        self.bytes_per_frame = 2 * sample_rate / frame_rate  # s16le mono
        self.frames_per_char = frames_per_char
        self.verdict: PaceVerdict | None = None  # the first one found: the run is warned once

    def frames(self, rec: RequestRecord) -> float:
        return sum(rec.chunk_bytes) / self.bytes_per_frame

    def total_frames(self) -> float:
        return sum(self.frames(r) for r in self.records)

    def expected_total(self) -> float | None:
        """Frames the whole run will bring, when every request asks for a fixed length."""
        if all(r.num_frames for r in self.records):
            return float(sum(r.num_frames for r in self.records))
        return None

    def expected(self, rec: RequestRecord, per_char: float | None = None) -> float | None:
        """`rec`'s fixed length, else its text length times `per_char` (default: the warm-ups')."""
        if rec.num_frames:
            return float(rec.num_frames)
        per_char = per_char or self.frames_per_char
        return per_char * rec.text_chars if per_char else None

    def check(self, now_s: float) -> PaceVerdict | None:
        """`now_s`: seconds since the run started (the records' clock). A verdict, the first time the requests
        in flight cannot finish within the timeout at their pace; None otherwise (and once one was given)."""
        if self.verdict is not None:
            return None
        flying = [r for r in self.records if r.sent_s is not None and r.end_s is None]
        per_char = self.frames_per_char or frames_per_char(self.records)  # no warm-ups: this run's own
        judged, rate = [], 0.0
        for r in flying:
            elapsed, got = now_s - r.sent_s, self.frames(r)
            rate += got / elapsed if elapsed > 0 else 0.0
            want = self.expected(r, per_char)
            if want is not None and got > 0 and elapsed >= MIN_ELAPSED_S and got < want:
                judged.append((elapsed * want / got, want))
        if not judged or 2 * len(judged) < len(flying):  # judge on most of what runs, not on a few
            return None
        projected = statistics.median(p for p, _ in judged)
        if projected <= self.timeout_s:
            return None
        self.verdict = PaceVerdict(len(flying), statistics.median(w for _, w in judged), projected, rate,
                                   self.timeout_s)
        return self.verdict


def frames_per_char(records: list[RequestRecord], frame_rate: float = FRAME_RATE_HZ) -> float | None:
    """Frames per text character of the completed requests (None without any): the model's own lengths."""
    done = [r for r in records if r.ok and r.text_chars > 0]
    if not done:
        return None
    return sum(r.audio_s * frame_rate for r in done) / sum(r.text_chars for r in done)
