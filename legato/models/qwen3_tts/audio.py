"""Audio in and out: decoding reference clips, mixing to mono, resampling, WAV encoding.

Resampling uses band-limited FFT interpolation (numpy only), which is exact for band-limited signals and
good enough for reference clips; the model side always works at 24 kHz.
"""

from __future__ import annotations

import io
import re

import numpy as np


class AudioError(ValueError):
    """Audio that cannot be read or used; the message says why (a client error)."""


def read_audio(data: bytes) -> tuple[np.ndarray, int]:
    """Decodes WAV/FLAC/OGG bytes -> (mono float32 samples, sample rate)."""
    import soundfile as sf

    try:
        samples, sr = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except Exception as e:  # soundfile raises RuntimeError/LibsndfileError/TypeError for bad input
        # Its message names the buffer by repr ("Error opening <_io.BytesIO object at 0x...>"): not for users.
        why = re.sub(r"<[^<>]* object at 0x[0-9a-fA-F]+>", "the data", str(e))
        raise AudioError(f"cannot decode audio (WAV, FLAC or OGG): {why}") from e
    if samples.size == 0:
        raise AudioError("audio is empty")
    return samples.mean(axis=1).astype(np.float32), int(sr)


def read_audio_file(path: str) -> tuple[np.ndarray, int]:
    try:
        with open(path, "rb") as f:
            return read_audio(f.read())
    except OSError as e:
        raise AudioError(f"cannot read audio file {path}: {e}") from e


def resample(samples: np.ndarray, sr_in: int, sr_out: int) -> np.ndarray:
    """Resamples mono float audio by FFT interpolation; a no-op when the rates match."""
    if sr_in <= 0 or sr_out <= 0:
        raise AudioError(f"bad sample rate {sr_in} -> {sr_out}")
    if sr_in == sr_out:
        return samples.astype(np.float32, copy=False)
    n_out = int(round(len(samples) * sr_out / sr_in))
    if n_out < 1:
        raise AudioError("audio too short to resample")
    spec = np.fft.rfft(samples.astype(np.float64))
    n_bins = n_out // 2 + 1
    out_spec = np.zeros(n_bins, dtype=np.complex128)
    keep = min(n_bins, len(spec))
    out_spec[:keep] = spec[:keep]
    out = np.fft.irfft(out_spec, n=n_out) * (n_out / len(samples))
    return out.astype(np.float32)


def to_pcm16(samples: np.ndarray) -> bytes:
    """Float samples in [-1, 1] -> little-endian signed 16-bit PCM bytes."""
    clipped = np.clip(samples, -1.0, 1.0)
    return (clipped * 32767.0).round().astype("<i2").tobytes()


def encode_wav(samples: np.ndarray, sample_rate: int) -> bytes:
    """A complete 16-bit mono WAV file."""
    pcm = to_pcm16(samples)
    return wav_header(sample_rate, len(pcm)) + pcm


def wav_header(sample_rate: int, data_bytes: int | None) -> bytes:
    """A 44-byte 16-bit mono WAV header. `data_bytes=None` writes the open-ended sizes (0xFFFFFFFF) that
    streaming players accept when the length is not known yet."""
    data = 0xFFFFFFFF if data_bytes is None else data_bytes
    riff = 0xFFFFFFFF if data_bytes is None else 36 + data_bytes
    byte_rate = sample_rate * 2
    return (
        b"RIFF"
        + riff.to_bytes(4, "little")
        + b"WAVEfmt "
        + (16).to_bytes(4, "little")
        + (1).to_bytes(2, "little")
        + (1).to_bytes(2, "little")
        + sample_rate.to_bytes(4, "little")
        + byte_rate.to_bytes(4, "little")
        + (2).to_bytes(2, "little")
        + (16).to_bytes(2, "little")
        + b"data"
        + data.to_bytes(4, "little")
    )
