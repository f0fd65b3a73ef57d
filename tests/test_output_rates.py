"""A response's sample rate and mp3 bitrate (issue 20: mp3 was fixed at 80 kbit/s CBR at the model's 24 kHz):
every MPEG layer III bitrate libsndfile offers at every rate comes out exactly, the streaming resampler
equals the whole-signal one in any chunking, and the API takes both fields with clear 400s for the rest."""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile as sf
from fastapi.testclient import TestClient
from server_helpers import FakeClient, frames_chunk, server_settings

from legato.server.app import build_app
from legato.server.encoding import (
    _L3_KBPS,
    _MPEG_RATES,
    OUTPUT_RATES,
    StreamEncoder,
    _mpeg_frame_size,
    encode_file,
    mp3_bitrates,
)
from legato.server.resample import StreamResampler, resample_all

RATE = 24000


def _tone(seconds: float, hz: float = 440.0, rate: int = RATE) -> np.ndarray:
    return (0.4 * np.sin(2 * np.pi * hz * np.arange(int(seconds * rate)) / rate)).astype(np.float32)


def _frames(data: bytes) -> list[tuple[int, int]]:
    """(kbit/s, sample rate) of every MPEG frame of an mp3 file, walking frame by frame."""
    out, pos = [], 0
    while pos + 4 <= len(data):
        size = _mpeg_frame_size(data[pos:])
        if size is None:
            break
        version, bitrate_index, rate_index = (data[pos + 1] >> 3) & 3, data[pos + 2] >> 4, (data[pos + 2] >> 2) & 3
        out.append((_L3_KBPS[1 if version == 3 else 2][bitrate_index], _MPEG_RATES[version][rate_index]))
        pos += size
    return out


@pytest.mark.parametrize("rate", OUTPUT_RATES)
def test_every_mp3_bitrate_at_every_rate_comes_out_exactly(rate):
    audio = _tone(0.5, rate=rate)
    for kbps in mp3_bitrates(rate):
        frames = _frames(encode_file(audio, rate, "mp3", kbps))
        assert len(frames) > 3 and set(frames) == {(kbps, rate)}, (rate, kbps, set(frames))
    default = _frames(encode_file(audio, rate, "mp3"))
    assert {k for k, _ in default} == {80 if rate >= 16000 else 64}  # the documented default


def test_a_streamed_mp3_keeps_its_bitrate_and_decodes():
    audio = _tone(1.0, rate=44100)
    enc = StreamEncoder("mp3", 44100, 192)
    parts = [enc.start()] + [enc.encode(audio[i : i + 4410]) for i in range(0, len(audio), 4410)] + [enc.finish()]
    data = b"".join(parts)
    assert set(_frames(data)) == {(192, 44100)}
    decoded, sr = sf.read(io.BytesIO(data), dtype="float32")
    assert sr == 44100 and len(audio) <= len(decoded) <= len(audio) + 44100 // 10


@pytest.mark.parametrize("rate_out", [8000, 11025, 16000, 22050, 44100, 48000])
def test_the_resampler_is_exact_on_a_tone_and_the_same_in_any_chunking(rate_out):
    x = _tone(1.0, hz=1000.0)
    whole = resample_all(x, RATE, rate_out)
    assert len(whole) == -(-len(x) * rate_out // RATE)
    t = np.arange(len(whole)) / rate_out
    inner = slice(len(whole) // 10, -len(whole) // 10)  # away from the signal's own edges
    assert np.abs(whole[inner] - 0.4 * np.sin(2 * np.pi * 1000.0 * t[inner])).max() < 1e-3
    r, pos, parts = StreamResampler(RATE, rate_out), 0, []
    for n in [1, 1920, 7, 4 * 1920, 333, 25 * 1920, 10_000]:
        parts.append(r.process(x[pos : pos + n]))
        pos += n
    parts += [r.process(x[pos:]), r.flush()]
    np.testing.assert_allclose(np.concatenate(parts), whole, atol=1e-6)


def test_downsampling_removes_what_the_lower_rate_cannot_carry():
    above = resample_all(_tone(1.0, hz=10_000.0), RATE, 16000)  # above 8 kHz: would alias to 6 kHz
    assert np.abs(above[1000:-1000]).max() < 1e-3
    assert np.array_equal(resample_all(_tone(0.1), RATE, RATE), _tone(0.1))


# ---- the API -----------------------------------------------------------------------------------------

def app() -> TestClient:
    return TestClient(build_app(FakeClient(lambda req: [frames_chunk(5, 5, True, "stop")]), server_settings(), None))


def speak(c: TestClient, **body):
    return c.post("/v1/audio/speech", json={"input": "Hello.", "voice": "ryan", **body})


def test_a_file_at_another_rate_and_bitrate():
    with app() as c:
        r = speak(c, response_format="mp3", stream=False, sample_rate=44100, mp3_bitrate=128)
        wav = speak(c, response_format="wav", stream=False, sample_rate=16000)
    assert r.status_code == 200 and r.headers["x-sample-rate"] == "44100"
    assert set(_frames(r.content)) == {(128, 44100)}
    samples, sr = sf.read(io.BytesIO(wav.content), dtype="float32")
    assert sr == 16000 and len(samples) == 5 * 1920 * 16000 // RATE


@pytest.mark.parametrize("mode", ["audio", "sse"])
def test_a_stream_at_another_rate(mode):
    import base64
    import json

    body = {"response_format": "pcm", "sample_rate": 8000, "stream": True}
    with app() as c:
        if mode == "sse":
            r = speak(c, **body, stream_format="sse")
            events = [json.loads(b[6:]) for b in r.text.split("\n\n") if b.startswith("data: ")]
            data = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
            assert events[-1]["sample_rate"] == 8000
        else:
            r = speak(c, **body)
            data = r.content
    assert r.status_code == 200 and r.headers["x-sample-rate"] == "8000"
    assert len(data) == 2 * 5 * 1920 * 8000 // RATE  # every sample, none twice


@pytest.mark.parametrize("body, code, param, needle", [
    ({"response_format": "mp3", "mp3_bitrate": 100}, "unsupported_bitrate", "mp3_bitrate",
     "mp3 at 24000 Hz has no 100 kbit/s; its constant bitrates: 8, 16"),
    ({"response_format": "mp3", "mp3_bitrate": 320}, "unsupported_bitrate", "mp3_bitrate", "160"),
    ({"response_format": "mp3", "mp3_bitrate": 320, "sample_rate": 8000}, "unsupported_bitrate", "mp3_bitrate",
     "8000 Hz has no 320"),
    ({"response_format": "wav", "mp3_bitrate": 128}, "unsupported_bitrate", "mp3_bitrate", "this one is wav"),
    ({"response_format": "opus", "sample_rate": 44100}, "unsupported_sample_rate", "sample_rate",
     "8000, 12000, 16000, 24000, 48000"),
    ({"response_format": "pcm", "sample_rate": 96000}, "unsupported_sample_rate", "sample_rate", "44100, 48000"),
])
def test_rates_and_bitrates_outside_what_libsndfile_offers_are_400(body, code, param, needle):
    with app() as c:
        r = speak(c, stream=False, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == (code, param) and needle in err["message"], err
