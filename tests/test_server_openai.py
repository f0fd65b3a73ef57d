"""The official `openai` SDK, unmodified, against a live server (uvicorn on 127.0.0.1, tiny CPU model):
files in every format and streamed responses, each holding exactly the frames the server reports."""

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


@pytest.mark.parametrize("fmt", ["wav", "pcm", "flac"])
def test_sdk_files_hold_the_reported_frames(sdk, fmt):
    raw = sdk.audio.speech.with_raw_response.create(
        model="qwen3-tts-tiny", voice="Ryan", input="Hello from the SDK.", response_format=fmt,
        extra_body={"max_new_tokens": 12, "seed": 21},
    )
    audio = raw.parse()  # what `client.audio.speech.create` returns
    frames = int(raw.headers["x-usage-output-tokens"])
    samples = _samples(fmt, audio.content)
    assert frames >= 1 and len(samples) == frames * SAMPLES_PER_FRAME
    assert float(raw.headers["x-audio-seconds"]) == pytest.approx(frames * SAMPLES_PER_FRAME / 24000)
    assert raw.headers["x-seed"] == "21" and raw.headers["x-request-id"]
    plain = sdk.audio.speech.create(model="qwen3-tts-tiny", voice="ryan", input="Hello from the SDK.",
                                    response_format=fmt, extra_body={"max_new_tokens": 12, "seed": 21})
    assert np.array_equal(_samples(fmt, plain.content), samples)  # same seed, same audio


@pytest.mark.parametrize("fmt", ["pcm", "wav"])
def test_sdk_streaming_response_is_incremental_and_complete(sdk, fmt):
    body = {"max_new_tokens": 16, "seed": 8, "first_chunk_frames": 1}
    reference = sdk.audio.speech.with_raw_response.create(
        model="qwen3-tts-tiny", voice="serena", input="Streaming, one chunk at a time.", response_format="pcm",
        extra_body=body)
    frames = int(reference.headers["x-usage-output-tokens"])
    with sdk.audio.speech.with_streaming_response.create(
        model="qwen3-tts-tiny", voice="serena", input="Streaming, one chunk at a time.", response_format=fmt,
        extra_body={**body, "stream": True},
    ) as response:
        assert response.headers["content-type"] == f"audio/{fmt}"
        assert response.headers["x-seed"] == "8"
        parts = [p for p in response.iter_bytes(chunk_size=None) if p]
    data = b"".join(parts)
    if fmt == "wav":
        assert data[:4] == b"RIFF" and data[40:44] == b"\xff\xff\xff\xff"
        data = data[44:]
    assert len(data) == frames * SAMPLES_PER_FRAME * 2
    assert data == reference.parse().content
    assert len(parts) > 1  # delivered as it was decoded (first chunk of one frame), not in one piece


def test_sdk_sse_stream_reports_usage_in_the_done_event(sdk):
    with sdk.audio.speech.with_streaming_response.create(
        model="qwen3-tts-tiny", voice="eric", input="Events.", stream_format="sse",
        extra_body={"max_new_tokens": 10},
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[len("data: "):]) for line in response.iter_lines() if line.startswith("data: ")]
    done = events[-1]
    assert done["type"] == "speech.audio.done"
    audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert len(audio) == done["usage"]["output_tokens"] * SAMPLES_PER_FRAME * 2 > 0
    assert done["usage"]["total_tokens"] == done["usage"]["input_tokens"] + done["usage"]["output_tokens"]


def test_sdk_sees_openai_errors(sdk):
    with pytest.raises(openai.BadRequestError) as e:
        sdk.audio.speech.create(model="qwen3-tts-tiny", voice="alloy", input="Hi.")
    assert "unknown voice 'alloy'" in e.value.message and "ryan" in e.value.message
    assert e.value.code == "unknown_voice"
    with pytest.raises(openai.NotFoundError):
        sdk.audio.speech.create(model="tts-1", voice="ryan", input="Hi.")
    models = sdk.models.list()
    assert [m.id for m in models.data] == ["qwen3-tts-tiny"]
