"""Audio response formats: whole files (wav, pcm, flac) and the per-chunk bytes of streamed responses.

All formats carry 16-bit mono samples at the model's rate. Streams are PCM s16le, optionally behind a WAV
header whose sizes are left open (0xFFFFFFFF), which streaming players accept; FLAC cannot be streamed
chunk by chunk with soundfile, so it is file-only.
"""

from __future__ import annotations

import io

import numpy as np

from legato.models.qwen3_tts.audio import encode_wav, to_pcm16, wav_header

MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac"}
STREAMABLE = ("wav", "pcm")


def media_type(fmt: str) -> str:
    return MEDIA_TYPES[fmt]


def encode_file(samples: np.ndarray, sample_rate: int, fmt: str) -> bytes:
    """A complete response body in `fmt`."""
    if fmt == "wav":
        return encode_wav(samples, sample_rate)
    if fmt == "pcm":
        return to_pcm16(samples)
    if fmt == "flac":
        return _encode_flac(samples, sample_rate)
    raise ValueError(f"unsupported format {fmt!r}; supported: {', '.join(MEDIA_TYPES)}")


def stream_preamble(sample_rate: int, fmt: str) -> bytes:
    """Bytes sent once before the first PCM chunk of a raw stream."""
    if fmt == "wav":
        return wav_header(sample_rate, None)
    if fmt == "pcm":
        return b""
    raise ValueError(f"{fmt} cannot be streamed; streamable: {', '.join(STREAMABLE)}")


def encode_chunk(samples: np.ndarray) -> bytes:
    """One streamed chunk: PCM s16le (the same bytes whatever the stream's container)."""
    return to_pcm16(samples)


def _encode_flac(samples: np.ndarray, sample_rate: int) -> bytes:
    import soundfile as sf

    buf = io.BytesIO()
    pcm = np.frombuffer(to_pcm16(samples), dtype="<i2")  # the same quantisation as wav/pcm
    sf.write(buf, pcm, sample_rate, format="FLAC", subtype="PCM_16")
    return buf.getvalue()
