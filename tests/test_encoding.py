"""Response formats: files decode to exactly the audio, streams decode as they arrive (any prefix and the
whole), and the formats the server cannot make are refused with the reason."""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile as sf

from legato.server.encoding import (
    MEDIA_TYPES,
    STREAMABLE,
    StreamEncoder,
    _mpeg_frame_size,
    encode_file,
    format_problem,
)

RATE = 24000
FRAME = 1920


def _audio(frames: int, seed: int = 0) -> np.ndarray:
    t = np.arange(frames * FRAME) / RATE
    noise = np.random.default_rng(seed).standard_normal(t.shape) * 0.02
    return (0.3 * np.sin(2 * np.pi * 220 * t) + noise).astype(np.float32)


def _decode(data: bytes) -> np.ndarray:
    samples, rate = sf.read(io.BytesIO(data), dtype="float32")
    assert rate == RATE
    return samples


def _stream(fmt: str, audio: np.ndarray, chunk_frames: list[int]) -> list[bytes]:
    enc = StreamEncoder(fmt, RATE)
    parts, pos = [enc.start()], 0
    for n in chunk_frames:
        parts.append(enc.encode(audio[pos : pos + n * FRAME]))
        pos += n * FRAME
    assert pos == len(audio)
    parts.append(enc.finish())
    return parts


@pytest.mark.parametrize("fmt", ["mp3", "opus", "flac", "wav"])
@pytest.mark.parametrize("frames", [1, 13, 60])
def test_files_decode_to_exactly_the_audio(fmt, frames):
    audio = _audio(frames)
    got = _decode(encode_file(audio, RATE, fmt))
    assert got.shape == audio.shape
    corr = np.corrcoef(got, audio)[0, 1]
    assert corr > (0.999 if fmt in ("flac", "wav") else 0.9), corr


@pytest.mark.parametrize("fmt", ["mp3", "opus"])
def test_streams_decode_as_they_arrive(fmt):
    """The engine's chunk schedule (1 frame, then 4, then 25): every prefix of the stream decodes, it grows
    as chunks arrive, and the whole stream decodes to the audio (opus exactly; mp3 plus the encoder's delay
    and padding, under 100 ms)."""
    audio = _audio(55, seed=1)
    parts = _stream(fmt, audio, [1, 4, 25, 25])
    assert all(parts[1:-1]), "every chunk sends bytes at once"
    decoded = []
    for i in range(2, len(parts) + 1):
        decoded.append(len(_decode(b"".join(parts[:i]))))
    assert decoded == sorted(decoded) and decoded[-1] > decoded[0]
    whole = _decode(b"".join(parts))
    if fmt == "opus":
        assert whole.shape == audio.shape
    else:
        assert len(audio) <= len(whole) <= len(audio) + RATE // 10
    # The stream carries the same sound as the file.
    lag = len(whole) - len(audio)
    best = max(np.corrcoef(whole[k : k + len(audio)], audio)[0, 1] for k in range(0, lag + 1, 48))
    assert best > 0.9


def test_a_streamed_mp3_leaves_out_lame_s_header_frame():
    """The first frame of LAME's output is a placeholder for the header written at close: zeros in a stream,
    which would decode as silence. The stream starts with real audio frames instead."""
    audio = _audio(3)
    file = encode_file(audio, RATE, "mp3")
    stream = b"".join(_stream("mp3", audio, [1, 2]))
    head = _mpeg_frame_size(file)
    assert head is not None and file[4:head].count(0) < head - 4  # the file's header frame is filled in
    assert stream == file[head:]  # the same audio frames, without the header frame
    assert _mpeg_frame_size(stream) is not None and any(stream[4 : _mpeg_frame_size(stream)])


def test_pcm_and_wav_streams_are_plain_samples():
    audio = _audio(5)
    pcm = b"".join(_stream("pcm", audio, [1, 4]))
    assert pcm == encode_file(audio, RATE, "pcm")
    wav = b"".join(_stream("wav", audio, [2, 3]))
    assert wav[:4] == b"RIFF" and wav[40:44] == b"\xff\xff\xff\xff" and wav[44:] == pcm


def test_formats_the_server_cannot_make_are_refused_with_the_reason():
    assert "no AAC encoder" in format_problem("aac", RATE)
    assert "opus cannot carry 22050 Hz" in format_problem("opus", 22050)
    assert format_problem("mp3", RATE) is None and format_problem("opus", RATE) is None
    with pytest.raises(ValueError, match="cannot be streamed"):
        StreamEncoder("flac", RATE)
    assert set(STREAMABLE) <= set(MEDIA_TYPES) and "aac" not in MEDIA_TYPES


def test_closing_a_stream_while_a_worker_thread_encodes_is_safe():
    """A client that leaves mid-stream: the server closes the encoder while a worker thread may still be
    encoding for it; the calls take turns, and an encode after the close sends nothing."""
    import threading

    for fmt in ("mp3", "opus"):
        enc = StreamEncoder(fmt, RATE)
        enc.start()
        audio = _audio(25)
        worker = threading.Thread(target=lambda e=enc, a=audio: [e.encode(a) for _ in range(20)])
        worker.start()
        enc.close()
        worker.join(30)
        assert not worker.is_alive()
        assert enc.encode(audio) == b"" and enc.finish() == b""
