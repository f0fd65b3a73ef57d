"""Resampling the model's audio to a response's sample rate, chunk by chunk as it streams.

A polyphase windowed-sinc filter for the ratio out/in = L/M in lowest terms (24 kHz -> 44.1 kHz is 147/80).
Output sample j sits at input time j * M / L; the filter is centred on it, so the output is not delayed,
and it keeps the input it still needs between chunks, so a stream resampled in any chunking equals the
whole signal resampled at once. The FFT resampler of the model side (audio.resample) needs the whole
signal, which a stream does not have.
"""

from __future__ import annotations

from math import gcd

import numpy as np

ZERO_CROSSINGS = 16  # each side of the filter, counted at the lower of the two rates
ROLLOFF = 0.92  # the passband edge, as a share of the lower rate's Nyquist frequency
KAISER_BETA = 8.6  # about 90 dB of stopband


class StreamResampler:
    """`process(chunk)` returns the output the input so far determines; `flush()` the rest (the input's
    end padded with silence). Together they give ceil(n * out / in) samples for n input samples."""

    def __init__(self, rate_in: int, rate_out: int) -> None:
        if rate_in <= 0 or rate_out <= 0:
            raise ValueError(f"bad sample rates {rate_in} -> {rate_out}")
        g = gcd(rate_in, rate_out)
        self.up, self.down = rate_out // g, rate_in // g
        self.phases, self.taps, self.centre = _filter_bank(self.up, self.down)
        k = self.taps
        self._buf = np.zeros(k - 1)  # input from absolute index `_base` on (silence before the start)
        self._base = -(k - 1)
        self._n_in = 0
        self._next = 0  # the next output sample's index

    @property
    def identity(self) -> bool:
        return self.up == self.down

    def process(self, chunk: np.ndarray) -> np.ndarray:
        if self.identity:
            return np.asarray(chunk, dtype=np.float32)
        self._buf = np.concatenate([self._buf, np.asarray(chunk, dtype=np.float64)])
        self._n_in += len(chunk)
        # Output j needs input up to (j * M + centre) // L.
        end = (self._n_in * self.up - 1 - self.centre) // self.down + 1
        return self._emit(end)

    def flush(self) -> np.ndarray:
        if self.identity:
            return np.zeros(0, dtype=np.float32)
        total = -(-self._n_in * self.up // self.down)
        pad = (total * self.down + self.centre) // self.up + 1 - (self._base + len(self._buf))
        self._buf = np.concatenate([self._buf, np.zeros(max(0, pad))])
        return self._emit(total)

    def _emit(self, end: int) -> np.ndarray:
        if end <= self._next:
            return np.zeros(0, dtype=np.float32)
        js = np.arange(self._next, end, dtype=np.int64)
        s = js * self.down + self.centre
        newest = s // self.up - self._base  # the newest input sample each output uses, in the buffer
        window = self._buf[newest[:, None] - np.arange(self.taps)[None, :]]
        out = np.einsum("jk,jk->j", self.phases[s % self.up], window)
        self._next = end
        keep_from = (end * self.down + self.centre) // self.up - (self.taps - 1)  # the oldest input still needed
        drop = max(0, keep_from - self._base)
        self._buf, self._base = self._buf[drop:], self._base + drop
        return out.astype(np.float32)


def resample_all(samples: np.ndarray, rate_in: int, rate_out: int) -> np.ndarray:
    """A whole signal at `rate_out` (the same filter as a stream)."""
    r = StreamResampler(rate_in, rate_out)
    return np.concatenate([r.process(samples), r.flush()])


def _filter_bank(up: int, down: int) -> tuple[np.ndarray, int, int]:
    """The lowpass at the upsampled rate split into `up` phases of `taps` coefficients each (phase p, tap k is
    coefficient p + k * up), each phase scaled to a gain of exactly 1; and the filter's centre."""
    cutoff = 0.5 / max(up, down) * ROLLOFF  # cycles per upsampled sample
    half = ZERO_CROSSINGS * max(up, down)
    taps = -(-(2 * half + 1) // up)
    n = np.arange(taps * up)
    centre = half
    h = 2 * cutoff * np.sinc(2 * cutoff * (n - centre))
    inside = np.abs(n - centre) <= half
    h *= np.where(inside, np.kaiser(2 * half + 1, KAISER_BETA)[np.clip(n - centre + half, 0, 2 * half)], 0.0)
    phases = h.reshape(taps, up).T.copy()  # [up, taps]: phases[p, k] = h[p + k * up]
    phases /= phases.sum(axis=1, keepdims=True)
    return phases, taps, centre
