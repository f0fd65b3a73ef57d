"""End to end through the real server (`build_app`) on the tiny Base model: upload a voice, speak with it,
restart the server over the same voices directory and speak with it again (same seed, same audio), delete
it; the encoders run once, at upload, never when a saved voice speaks. Reference audio naming a local file
outside the allowed directory is refused by /v1/audio/speech and its WebSocket, by the voices route's code."""

from __future__ import annotations

import base64
import io
import os
from collections import Counter

import pytest
import soundfile as sf
import torch
from fastapi.testclient import TestClient
from voice_helpers import CLIP
from ws_helpers import WsClient

from legato.engine.config import EngineConfig
from legato.models.qwen3_tts import inputs
from legato.models.qwen3_tts.loader import load_model
from legato.pipeline.local import LocalEngineClient
from legato.server.app import build_app
from legato.server.settings import ServerSettings
from legato.server.voices import VoiceStore
from legato.server.ws_protocol import STREAM_PATH

SPEECH = "/v1/audio/speech"
VOICES = "/v1/audio/voices"


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint):
    torch.set_num_threads(1)
    return load_model(tiny_checkpoint)


@pytest.fixture
def encoder_calls(monkeypatch) -> Counter:
    """Counts runs of the speaker + codec encoders, wherever they are called from."""
    calls: Counter = Counter()
    real = inputs.extract_voice

    def counted(*args, **kwargs):
        calls["extract_voice"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(inputs, "extract_voice", counted)  # build_spec's path and the engine's VoiceCache
    return calls


@pytest.fixture
def dirs(tmp_path):
    media = tmp_path / "media"
    media.mkdir()
    (media / "clip.wav").write_bytes(CLIP.read_bytes())
    (tmp_path / "private").mkdir()
    (tmp_path / "private" / "secret.wav").write_bytes(CLIP.read_bytes())
    return tmp_path / "voices", media, tmp_path / "private"


def server(loaded, settings: ServerSettings) -> TestClient:
    """A fresh server process, as far as the voices are concerned: a new engine client and a new store."""
    client = LocalEngineClient(loaded, EngineConfig(device="cpu", dtype="float32", max_num_seqs=4,
                                                    num_kv_blocks=64, max_model_len=1024))
    return TestClient(build_app(client, settings, VoiceStore(settings.voices_dir, client)))


def speak(http: TestClient, **fields):
    body = {"input": "Hello there.", "max_new_tokens": 6, "seed": 7, "language": "english", "response_format": "wav",
            "stream": False, **fields}
    return http.post(SPEECH, json=body)


def wav_of(resp) -> tuple[int, int]:
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("audio/wav")
    samples, rate = sf.read(io.BytesIO(resp.content), dtype="float32")
    return len(samples), rate


def test_voice_survives_a_restart_and_speaks(loaded, dirs, encoder_calls):
    voices_dir, media, _ = dirs
    settings = ServerSettings(voices_dir=str(voices_dir), allowed_local_media_path=str(media))

    with server(loaded, settings) as http:
        r = http.post(VOICES, data={"name": "Alice", "ref_text": "Hello, this is my voice."},
                      files={"file": ("voice01.wav", CLIP.read_bytes(), "audio/wav")})
        assert r.status_code == 201, r.text
        assert r.json()["ref_frames"] == 51 and encoder_calls["extract_voice"] == 1
        first = speak(http, voice="alice")
        n, rate = wav_of(first)
        assert rate == 24000 and n > 0 and n % 1920 == 0
        assert encoder_calls["extract_voice"] == 1  # the saved voice needed no encoder run
        assert "Alice" in http.get("/v1/models").json()["data"][0]["voices"]
        listed = http.get(VOICES).json()["voices"]

    with server(loaded, settings) as http:  # restarted over the same directory
        assert http.get(VOICES).json()["voices"] == listed
        again = speak(http, voice="ALICE")
        wav_of(again)
        assert again.content == first.content  # same voice, same seed: the same audio
        assert encoder_calls["extract_voice"] == 1
        assert http.delete(f"{VOICES}/alice").json()["deleted"] is True
        gone = speak(http, voice="alice")
        assert gone.status_code == 400 and "unknown voice" in gone.json()["error"]["message"]

    with server(loaded, settings) as http:  # and the deletion is durable
        assert http.get(VOICES).json()["voices"] == []
    assert os.listdir(voices_dir) == []


def test_speech_ref_audio_obeys_the_local_media_policy(loaded, dirs, encoder_calls):
    voices_dir, media, private = dirs
    os.symlink(private / "secret.wav", media / "link.wav")
    settings = ServerSettings(voices_dir=str(voices_dir), allowed_local_media_path=str(media))
    with server(loaded, settings) as http:
        ok = speak(http, ref_audio=f"file://{media}/clip.wav", ref_text="Hello, this is my voice.")
        wav_of(ok)
        assert encoder_calls["extract_voice"] == 1
        for url in (f"file://{private}/secret.wav", f"file://{media}/../private/secret.wav",
                    f"file://{media}/link.wav", "file:///etc/passwd"):
            r = speak(http, ref_audio=url, x_vector_only_mode=True)
            assert r.status_code == 403, (url, r.text)
            assert "outside" in r.json()["error"]["message"]
            assert r.json()["error"]["code"] == "forbidden_media"  # the voices route's name for it
        plain = speak(http, ref_audio=str(private / "secret.wav"), x_vector_only_mode=True)
        assert plain.status_code == 400 and "file://" in plain.json()["error"]["message"]
        assert plain.json()["error"]["code"] == "invalid_ref_audio"
        r = http.post(VOICES, json={"name": "sneaky", "ref_audio": f"file://{private}/secret.wav"})
        assert r.status_code == 403 and http.get(VOICES).json()["voices"] == []
        assert r.json()["error"]["code"] == "forbidden_media"
        with http.websocket_connect(STREAM_PATH) as ws:  # the streaming route refuses it by the same name
            c = WsClient(ws)
            c.send(type="session.update", session={"ref_audio": f"file://{private}/secret.wav",
                                                   "x_vector_only_mode": True})
            c.event("session.updated")
            c.send(type="input_text.append", context_id="a", text="Hello there.")
            c.send(type="input_text.end", context_id="a")
            err = c.until(lambda e: e["type"] == "error", "the refusal", errors_ok=True)["error"]
            assert err["code"] == "forbidden_media" and err["param"] == "ref_audio", err
            c.close_and_wait(http)
        assert encoder_calls["extract_voice"] == 1

    no_files = ServerSettings(voices_dir=str(voices_dir))  # no allowed directory: no file:// at all
    with server(loaded, no_files) as http:
        r = speak(http, ref_audio=f"file://{media}/clip.wav", x_vector_only_mode=True)
        assert r.status_code == 403 and "allowed-local-media-path" in r.json()["error"]["message"]
        assert r.json()["error"]["code"] == "forbidden_media"


def test_an_inline_clip_sent_again_is_neither_decoded_nor_hashed_nor_encoded_again(loaded, dirs, encoder_calls,
                                                                                   monkeypatch):
    """The server decodes a data URL once and hands the engine the clip's voice key with it, so the engine's
    voice cache finds the voice without hashing the samples again; both requests give the same audio."""
    import base64

    hashed = Counter()
    real_key = inputs.voice_key
    monkeypatch.setattr(inputs, "voice_key", lambda *a: hashed.update(["engine"]) or real_key(*a))
    voices_dir, media, _ = dirs
    url = "data:audio/wav;base64," + base64.b64encode(CLIP.read_bytes()).decode()
    with server(loaded, ServerSettings(voices_dir=str(voices_dir))) as http:
        first = speak(http, ref_audio=url, x_vector_only_mode=True)
        again = speak(http, ref_audio=url, x_vector_only_mode=True)
        clips = http.app.state.speech.clips
    assert wav_of(first) == wav_of(again) and first.content == again.content
    assert encoder_calls["extract_voice"] == 1  # the voice cache's miss; the second request hits it
    assert hashed["engine"] == 0  # the key came with the request
    assert (clips.hits, clips.misses) == (1, 1)


def test_a_too_large_clip_has_one_code_on_both_routes(loaded, dirs):
    """The speech route once named a clip over the media policy's limit `invalid_ref_audio`, the voices route
    `too_large`; both now say `request_too_large`, as the server's other 413s do."""
    voices_dir, _, _ = dirs
    settings = ServerSettings(voices_dir=str(voices_dir), max_ref_audio_bytes=64 * 1024)
    clip = "data:audio/wav;base64," + base64.b64encode(CLIP.read_bytes()).decode()  # ~190 KB, over 64 KiB
    with server(loaded, settings) as http:
        spoken = speak(http, ref_audio=clip, x_vector_only_mode=True)
        saved = http.post(VOICES, json={"name": "big", "ref_audio": clip})
    for r in (spoken, saved):
        assert r.status_code == 413, r.text
        assert r.json()["error"]["code"] == "request_too_large" and r.json()["error"]["param"] == "ref_audio"
