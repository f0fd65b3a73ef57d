"""The official `openai` SDK, unmodified, against a live server (uvicorn on 127.0.0.1, tiny CPU model):
its default (a streamed MP3), files in every format and streamed responses, each holding exactly the frames
the server reports, OpenAI's voice names, and its errors."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import openai
import pytest
import soundfile as sf
from server_helpers import SAMPLES_PER_FRAME, LiveServer, local_client, pcm_samples, server_settings, tiny_loaded

from legato.server.app import build_app
from legato.server.encoding import MEDIA_TYPES


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    loaded = tiny_loaded(tmp_path_factory.getbasetemp(), "custom_voice")
    app = build_app(local_client(loaded, name="qwen3-tts-tiny"), server_settings(loaded), None)
    with LiveServer(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def sdk(live):
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", timeout=60, max_retries=0)


def _samples(fmt: str, data: bytes) -> np.ndarray:
    if fmt == "pcm":
        return pcm_samples(data)
    samples, sr = sf.read(io.BytesIO(data), dtype="int16")
    assert sr == 24000
    return samples


def _reference_frames(sdk, voice: str, text: str, body: dict) -> tuple[int, bytes]:
    """Frames and PCM of a request as one file (stream=false carries the usage headers)."""
    raw = sdk.audio.speech.with_raw_response.create(model="qwen3-tts-tiny", voice=voice, input=text,
                                                    response_format="pcm", extra_body={**body, "stream": False})
    return int(raw.headers["x-usage-output-tokens"]), raw.parse().content


@pytest.mark.parametrize("fmt", ["mp3", "opus", "wav", "pcm", "flac"])
def test_sdk_files_hold_the_reported_frames(sdk, fmt):
    raw = sdk.audio.speech.with_raw_response.create(
        model="qwen3-tts-tiny", voice="Ryan", input="Hello from the SDK.", response_format=fmt,
        extra_body={"max_new_tokens": 12, "seed": 21, "stream": False},
    )
    audio = raw.parse()  # what `client.audio.speech.create` returns
    frames = int(raw.headers["x-usage-output-tokens"])
    samples = _samples(fmt, audio.content)
    assert frames >= 1 and len(samples) == frames * SAMPLES_PER_FRAME
    assert float(raw.headers["x-audio-seconds"]) == pytest.approx(frames * SAMPLES_PER_FRAME / 24000)
    assert raw.headers["x-seed"] == "21" and raw.headers["x-request-id"]
    plain = sdk.audio.speech.create(model="qwen3-tts-tiny", voice="ryan", input="Hello from the SDK.",
                                    response_format=fmt, extra_body={"max_new_tokens": 12, "seed": 21, "stream": False})
    assert np.array_equal(_samples(fmt, plain.content), samples)  # same seed, same audio


def test_sdk_default_is_a_playable_mp3(sdk):
    """A plain `client.audio.speech.create(model=..., voice=..., input=...)`, as the SDK sends it (no
    response_format, no stream): an MP3, streamed, that decodes to the request's audio (plus the MP3 encoder's
    delay and padding, under 100 ms)."""
    frames, pcm = _reference_frames(sdk, "ryan", "The default format.", {"seed": 3, "max_new_tokens": 14})
    raw = sdk.audio.speech.with_raw_response.create(model="qwen3-tts-tiny", voice="ryan", input="The default format.",
                                                    extra_body={"seed": 3, "max_new_tokens": 14})
    assert raw.headers["content-type"] == "audio/mpeg"
    assert "x-usage-output-tokens" not in raw.headers  # streamed: the usage is not known when headers leave
    samples = _samples("mp3", raw.parse().content)
    assert frames * SAMPLES_PER_FRAME <= len(samples) <= frames * SAMPLES_PER_FRAME + 2400
    assert len(pcm) == frames * SAMPLES_PER_FRAME * 2


@pytest.mark.parametrize("fmt", ["pcm", "wav", "mp3", "opus"])
def test_sdk_streaming_response_is_incremental_and_complete(sdk, fmt):
    """The SDK's `with_streaming_response` gets audio as it is made, by default (no `stream` flag): several
    pieces, every prefix decodable, the whole equal to the request's audio."""
    body = {"max_new_tokens": 16, "seed": 8, "first_chunk_frames": 1}
    frames, reference = _reference_frames(sdk, "serena", "Streaming, one chunk at a time.", body)
    with sdk.audio.speech.with_streaming_response.create(
        model="qwen3-tts-tiny", voice="serena", input="Streaming, one chunk at a time.", response_format=fmt,
        extra_body=body,
    ) as response:
        assert response.headers["content-type"].startswith(MEDIA_TYPES[fmt])
        assert response.headers["x-seed"] == "8"
        parts = [p for p in response.iter_bytes(chunk_size=None) if p]
    assert len(parts) > 1  # delivered as it was decoded (first chunk of one frame), not in one piece
    data = b"".join(parts)
    n = frames * SAMPLES_PER_FRAME
    if fmt == "pcm":
        assert data == reference
    elif fmt == "wav":
        assert data[:4] == b"RIFF" and data[40:44] == b"\xff\xff\xff\xff" and data[44:] == reference
    else:
        prefix_lengths = [len(_samples(fmt, b"".join(parts[:i]))) for i in range(2, len(parts) + 1)]
        assert prefix_lengths == sorted(prefix_lengths)  # decodable as it arrives, growing
        whole = _samples(fmt, data)
        assert len(whole) == n if fmt == "opus" else n <= len(whole) <= n + 2400


def test_sdk_sse_stream_reports_usage_in_the_done_event(sdk):
    with sdk.audio.speech.with_streaming_response.create(
        model="qwen3-tts-tiny", voice="eric", input="Events.", stream_format="sse", response_format="pcm",
        extra_body={"max_new_tokens": 10},
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[len("data: "):]) for line in response.iter_lines() if line.startswith("data: ")]
    done = events[-1]
    assert done["type"] == "speech.audio.done"
    assert {e["response_format"] for e in events[:-1]} == {"pcm"}
    audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert len(audio) == done["usage"]["output_tokens"] * SAMPLES_PER_FRAME * 2 > 0
    assert done["usage"]["total_tokens"] == done["usage"]["input_tokens"] + done["usage"]["output_tokens"]


def test_sdk_sse_deltas_carry_the_requested_format(sdk):
    """SSE in mp3 (the default format): the deltas' bytes, joined, are one decodable MP3."""
    with sdk.audio.speech.with_streaming_response.create(
        model="qwen3-tts-tiny", voice="eric", input="Events in mp3.", stream_format="sse",
        extra_body={"max_new_tokens": 10, "seed": 4},
    ) as response:
        events = [json.loads(line[len("data: "):]) for line in response.iter_lines() if line.startswith("data: ")]
    done, deltas = events[-1], events[:-1]
    assert done["type"] == "speech.audio.done" and {e["response_format"] for e in deltas} == {"mp3"}
    samples = _samples("mp3", b"".join(base64.b64decode(e["audio"]) for e in deltas))
    n = done["usage"]["output_tokens"] * SAMPLES_PER_FRAME
    assert n <= len(samples) <= n + 2400


def test_sdk_openai_voice_names_are_aliases(sdk):
    """OpenAI's voice names map to presets (alloy -> serena by default); an unknown voice gets a 400 that
    lists the voices and the aliases."""
    body = {"max_new_tokens": 8, "seed": 2, "stream": False}
    alias = sdk.audio.speech.create(model="qwen3-tts-tiny", voice="alloy", input="Hi.", response_format="pcm",
                                    extra_body=body)
    preset = sdk.audio.speech.create(model="qwen3-tts-tiny", voice="serena", input="Hi.", response_format="pcm",
                                     extra_body=body)
    assert alias.content == preset.content and alias.content
    # coral -> vivian, which the tiny model lacks: the next alike preset it has stands in
    stand_in = sdk.audio.speech.create(model="qwen3-tts-tiny", voice="coral", input="Hi.", response_format="pcm",
                                       extra_body=body)
    assert stand_in.content == preset.content
    with pytest.raises(openai.BadRequestError) as e:
        sdk.audio.speech.create(model="qwen3-tts-tiny", voice="bogus", input="Hi.")
    assert "unknown voice 'bogus'" in e.value.message and "'alloy'" in e.value.message and "'coral'" in e.value.message
    assert "ryan" in e.value.message


def test_sdk_sees_openai_errors(sdk):
    with pytest.raises(openai.BadRequestError) as e:
        sdk.audio.speech.create(model="qwen3-tts-tiny", voice="bogus", input="Hi.")
    assert "unknown voice 'bogus'" in e.value.message and "ryan" in e.value.message
    assert e.value.code == "unknown_voice"
    for speed in (0.5, 2.0):
        with pytest.raises(openai.BadRequestError) as e:
            sdk.audio.speech.create(model="qwen3-tts-tiny", voice="ryan", input="Hi.", speed=speed)
        assert e.value.code == "unsupported_speed" and "only supported speed is 1.0" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        sdk.audio.speech.create(model="qwen3-tts-tiny", voice="ryan", input="Hi.", response_format="aac")
    assert e.value.code == "unsupported_format" and "no AAC encoder" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:  # the 0.6B CustomVoice model has no instruction input
        sdk.audio.speech.create(model="qwen3-tts-tiny", voice="ryan", input="Hi.", instructions="Whisper.")
    assert e.value.code == "unsupported_field" and "0.6B CustomVoice" in e.value.message
    with pytest.raises(openai.NotFoundError):
        sdk.audio.speech.create(model="tts-2", voice="ryan", input="Hi.")
    # OpenAI's own model names run on the served model: code written for OpenAI's API works unchanged
    assert sdk.audio.speech.create(model="tts-1", voice="ryan", input="Hi.", response_format="pcm").content
    # /v1/models lists the served model first, then the OpenAI names it answers to, each retrievable
    ids = [m.id for m in sdk.models.list().data]
    assert ids[0] == "qwen3-tts-tiny" and {"tts-1", "tts-1-hd", "gpt-4o-mini-tts"} <= set(ids[1:])
    assert sdk.models.retrieve("tts-1").id == "tts-1"
