"""The HTTP API on tiny CPU models: formats and usage, streaming modes, OpenAI-shaped refusals, request ids,
limits, health/models/metrics, structured logs; failure paths (429, mid-stream errors, timeouts,
disconnects) through a scripted fake engine client; and `legato serve` shutting down gracefully."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf
from server_helpers import (
    SAMPLES_PER_FRAME,
    FakeClient,
    LiveServer,
    frames_chunk,
    local_client,
    pcm_samples,
    rejected,
    server_settings,
    tiny_loaded,
    wait_until,
)
from starlette.testclient import TestClient

from legato.pipeline.client import RequestRejected, StreamChunk
from legato.server.app import build_app
from legato.server.encoding import MEDIA_TYPES
from legato.server.voices import VoiceStore

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def cv_loaded(tmp_path_factory):
    return tiny_loaded(tmp_path_factory.getbasetemp(), "custom_voice")


@pytest.fixture(scope="module")
def cv(cv_loaded):
    app = build_app(local_client(cv_loaded), server_settings(cv_loaded, max_input_chars=200,
                                                             max_ref_audio_bytes=64 * 1024), None)
    with TestClient(app) as c:
        yield c


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    loaded = tiny_loaded(tmp_path_factory.getbasetemp(), "base")
    client = local_client(loaded)
    store = VoiceStore(tmp_path_factory.mktemp("voices"), client)
    app = build_app(client, server_settings(loaded), store)
    with TestClient(app) as c:
        yield c


def speak(c: TestClient, **body) -> httpx.Response:
    """One request; the whole file (stream=false, with the usage headers) unless the body says otherwise."""
    if "stream" not in body and body.get("stream_format") != "sse":
        body["stream"] = False
    return c.post("/v1/audio/speech", json={"input": "Hello there.", "voice": "ryan", **body})


def decode(fmt: str, data: bytes) -> np.ndarray:
    """16-bit samples of a response body."""
    if fmt == "pcm":
        return pcm_samples(data)
    samples, sr = sf.read(io.BytesIO(data), dtype="int16")
    assert sr == 24000
    return samples


def sse_events(text: str) -> list[dict]:
    return [json.loads(block[len("data: "):]) for block in text.split("\n\n") if block.startswith("data: ")]


def assert_error(r: httpx.Response, status: int, *needles: str, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and err["type"] and err["code"]
    for n in needles:
        assert n in err["message"], err["message"]
    if param is not None:
        assert err["param"] == param
    assert r.headers["x-request-id"]
    return err


# --- formats, usage, streaming modes ------------------------------------------------------------------


def test_each_file_format_holds_the_reported_frames(cv):
    decoded = {}
    for fmt in ("wav", "pcm", "flac", "mp3", "opus"):
        r = speak(cv, response_format=fmt, seed=5, max_new_tokens=10)
        assert r.status_code == 200, r.text
        assert r.headers["content-type"] == MEDIA_TYPES[fmt]
        frames = int(r.headers["x-usage-output-tokens"])
        assert 1 <= frames <= 9
        assert int(r.headers["x-usage-input-tokens"]) > 0
        assert r.headers["x-seed"] == "5"
        samples = decode(fmt, r.content)
        assert len(samples) == frames * SAMPLES_PER_FRAME
        assert float(r.headers["x-audio-seconds"]) == pytest.approx(len(samples) / 24000)
        decoded[fmt] = samples
    # one seed, one utterance: every lossless container carries the same samples, the lossy ones the same sound
    assert np.array_equal(decoded["wav"], decoded["pcm"]) and np.array_equal(decoded["flac"], decoded["pcm"])
    for lossy in ("mp3", "opus"):
        assert np.corrcoef(decoded[lossy].astype(float), decoded["pcm"].astype(float))[0, 1] > 0.5, lossy


def test_formats_stream_by_default_where_the_container_allows(cv):
    """No `stream` flag: mp3 (the default format), opus, wav (an open-length header) and pcm stream; flac
    comes whole; `stream: false` asks for the whole file; `stream: true` with flac, or sse with
    `stream: false`, are refused."""
    for fmt, streamed in (("mp3", True), ("opus", True), ("wav", True), ("pcm", True), ("flac", False)):
        r = cv.post("/v1/audio/speech", json={"input": "Hello there.", "voice": "ryan", "response_format": fmt,
                                              "max_new_tokens": 6, "seed": 1})
        assert r.status_code == 200, (fmt, r.text)
        assert ("x-usage-output-tokens" not in r.headers) == streamed, fmt
    r = cv.post("/v1/audio/speech", json={"input": "Hi.", "voice": "ryan", "max_new_tokens": 6})
    assert r.status_code == 200 and r.headers["content-type"] == "audio/mpeg"
    assert_error(speak(cv, stream_format="sse", stream=False), 400, "always streams", param="stream")


def test_raw_stream_sends_an_open_ended_wav_header_then_the_same_pcm(cv):
    whole = speak(cv, response_format="pcm", seed=9, max_new_tokens=12)
    with cv.stream("POST", "/v1/audio/speech", json={"input": "Hello there.", "voice": "ryan", "seed": 9,
                                                     "max_new_tokens": 12, "stream": True,
                                                     "response_format": "wav"}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"] == "audio/wav" and r.headers["x-seed"] == "9"
        parts = list(r.iter_bytes())
    data = b"".join(parts)
    assert data[:4] == b"RIFF" and data[4:8] == b"\xff\xff\xff\xff" and data[40:44] == b"\xff\xff\xff\xff"
    assert data[44:] == whole.content


def test_sse_streams_deltas_then_done_with_usage(cv):
    whole = speak(cv, response_format="pcm", seed=4, max_new_tokens=14, first_chunk_frames=2)
    r = speak(cv, stream_format="sse", response_format="pcm", seed=4, max_new_tokens=14, first_chunk_frames=2)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    deltas, done = events[:-1], events[-1]
    assert deltas and all(e["type"] == "speech.audio.delta" for e in deltas)
    assert done["type"] == "speech.audio.done" and done["request_id"] == r.headers["x-request-id"]
    audio = b"".join(base64.b64decode(e["audio"]) for e in deltas)
    assert audio == whole.content
    assert done["usage"]["output_tokens"] * SAMPLES_PER_FRAME * 2 == len(audio)
    assert done["usage"]["input_tokens"] == int(whole.headers["x-usage-input-tokens"])
    assert done["seed"] == 4


def test_fixed_length_requests_for_benchmarks(cv):
    for same_length in ({}, {"max_new_tokens": 8}):  # num_frames N and max_new_tokens N + 1 agree
        r = speak(cv, response_format="pcm", ignore_eos=True, num_frames=7, **same_length)
        assert r.status_code == 200, r.text
        assert r.headers["x-usage-output-tokens"] == "7" and len(r.content) == 7 * SAMPLES_PER_FRAME * 2


def test_max_new_tokens_n_gives_at_most_n_minus_1_frames_as_the_readme_says(cv):
    """`max_new_tokens` counts codec tokens as the reference does, the last one the end-of-speech token's place,
    so N gives at most N - 1 audio frames: a request that never ends (ignore_eos) gives exactly N - 1, and the
    usage's output tokens are those frames. The README states the rule where it documents the field."""
    for n in (2, 9):
        r = speak(cv, response_format="pcm", ignore_eos=True, max_new_tokens=n, seed=3)
        assert r.status_code == 200, r.text
        assert r.headers["x-usage-output-tokens"] == str(n - 1) and len(r.content) == (n - 1) * SAMPLES_PER_FRAME * 2
        assert r.headers["x-finish-reason"] == "length"
    readme = (Path(__file__).parent.parent / "README.md").read_text(encoding="utf-8")
    assert re.search(r"`max_new_tokens: N`[^.;]*at most N [−-] 1 audio frames", readme)


# --- refusals -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("body, status, needles, param", [
    ({"voice": "bogus"}, 400, ["unknown voice 'bogus'", "ryan", "serena", "alias", "'alloy'"], "voice"),
    ({"voice": None}, 400, ["voice is required", "ryan"], "voice"),
    ({"voice": {"id": "Serena"}, "response_format": "aac"}, 400, ["aac is not supported", "mp3"],
     "response_format"),
    ({"voice": "ryan", "response_format": "ogg"}, 400, ["'ogg' is not a format", "mp3, opus, wav, pcm, flac"],
     "response_format"),
    ({"speed": 1.5}, 400, ["speed 1.5 is not supported", "only supported speed is 1.0"], "speed"),
    ({"speed": 9}, 400, ["speed 9 is not supported"], "speed"),
    ({"speed": 0.25}, 400, ["speed 0.25 is not supported"], "speed"),
    ({"instructions": "Whisper."}, 400, ["0.6B CustomVoice model takes no instructions"], "instructions"),
    ({"response_format": "flac", "stream": True}, 400, ["cannot be streamed", "mp3, opus, wav, pcm"],
     "response_format"),
    ({"response_format": "flac", "stream_format": "sse"}, 400, ["cannot be streamed"], "response_format"),
    ({"task_type": "Base"}, 400, ["does not match", "CustomVoice"], "task_type"),
    ({"model": "tts-2"}, 404, ["'tts-2' is not served", "tiny", "tts-1"], "model"),
    ({"input": "x" * 201}, 400, ["201 characters", "limit is 200"], "input"),
    ({"max_new_tokens": 65}, 400, ["exceeds the limit of 64"], "max_new_tokens"),
    ({"num_frames": 64, "ignore_eos": True}, 400, ["limit of 63"], "num_frames"),
    # num_frames once silently overrode a max_new_tokens of another length
    ({"num_frames": 5, "max_new_tokens": 4, "ignore_eos": True}, 400, ["different lengths", "give one"],
     "max_new_tokens"),
    ({"num_frames": 5, "max_new_tokens": 20}, 400, ["num_frames 5 and max_new_tokens 20"], "max_new_tokens"),
    ({"ref_audio": "data:audio/wav;base64,AAAA"}, 400, ["for Base"], "ref_audio"),
    ({"language": "klingon"}, 400, ["unsupported language", "english"], "language"),
    ({"input": "   "}, 400, ["blank"], "input"),
    ({"input": ""}, 400, ["at least 1 character"], "input"),
    ({"temperature": 0}, 400, ["greater than or equal to 0.01"], "temperature"),
    ({"seed": -1}, 400, ["greater than or equal to 0"], "seed"),
    ({"top_k": "many"}, 400, ["valid integer"], "top_k"),
    ({"first_chunk_frames": 0}, 400, ["greater than or equal to 1"], "first_chunk_frames"),
    ({"frobnicate": 1}, 400, ["Extra inputs are not permitted"], "frobnicate"),
])
def test_rejections_are_openai_shaped_4xx(cv, body, status, needles, param):
    assert_error(speak(cv, **body), status, *needles, param=param)


def test_null_for_a_field_is_its_default(cv):
    """A client that writes every field sends null for those it leaves unset: the defaults apply, as when the
    field is left out. A required field's null is still missing, and an unknown field's null still unknown."""
    plain = speak(cv, response_format="pcm", num_frames=3, ignore_eos=True, seed=2)
    nulls = speak(cv, response_format="pcm", num_frames=3, ignore_eos=True, seed=2, speed=None, stream_format=None,
                  x_vector_only_mode=None, top_k=None, temperature=None, language=None)
    assert plain.status_code == nulls.status_code == 200 and plain.content == nulls.content
    r = speak(cv, input="hi there", response_format=None, stream=False, num_frames=3, ignore_eos=None)
    assert r.status_code == 200 and r.headers["content-type"] == "audio/mpeg"  # mp3, the default format
    assert_error(speak(cv, input=None), 400, "input", "Field required", param="input")
    assert_error(speak(cv, frobnicate=None), 400, "Extra inputs are not permitted", param="frobnicate")


@pytest.mark.parametrize("model", ["tts-1", "tts-1-hd", "gpt-4o-mini-tts"])
def test_openais_model_names_are_taken_as_the_served_model(cv, model):
    """Code written for OpenAI's API names OpenAI's models: they run on the model served here."""
    r = speak(cv, model=model, response_format="pcm", num_frames=2, ignore_eos=True)
    assert r.status_code == 200 and len(r.content) == 2 * SAMPLES_PER_FRAME * 2


def test_malformed_json_and_non_finite_numbers_are_400(cv):
    r = cv.post("/v1/audio/speech", content=b'{"input": "hi", "voice": "ryan", "temperature": NaN}',
                headers={"content-type": "application/json"})
    assert_error(r, 400, "finite")
    r = cv.post("/v1/audio/speech", content=b'{"input": ', headers={"content-type": "application/json"})
    assert assert_error(r, 400, "not valid JSON (at character 10)")["param"] is None  # an offset, not a field
    for body, needle in ((b'{"input": "caf\xe9", "voice": "ryan"}', "not UTF-8 text"), (b"[" * 100_000, "nested"),
                         (b'{"input": "hi", "seed": ' + b"1" * 5000 + b"}", "more than 4300 digits")):
        r = cv.post("/v1/audio/speech", content=body, headers={"content-type": "application/json"})
        assert_error(r, 400, "not valid JSON", needle)  # not FastAPI's "There was an error parsing the body"
    r = cv.post("/v1/audio/speech", content=b'{"voice": "ryan"}', headers={"content-type": ""})
    assert_error(r, 400, "must be a JSON object", "Content-Type: application/json")
    r = cv.post("/v1/audio/speech", content=b'[1, 2]', headers={"content-type": "application/json"})
    assert_error(r, 400, "must be a JSON object")
    r = cv.post("/v1/audio/speech", content=b'', headers={"content-type": "application/json"})
    assert assert_error(r, 400, "no body")["param"] is None
    assert_error(cv.get("/v1/nothing"), 404)
    assert_error(cv.get("/v1/audio/speech"), 405)


def test_the_speech_body_is_parsed_by_the_fast_parser(cv, monkeypatch):
    from legato.server import json_body

    monkeypatch.setattr(json_body.json, "loads", lambda *a, **k: pytest.fail("the body went to json.loads"))
    r = cv.post("/v1/audio/speech", content=b'{"input": "Hi.", "voice": "ryan", "max_new_tokens": 3}',
                headers={"content-type": "application/json"})
    assert r.status_code == 200 and r.content


def test_oversized_bodies_are_413_before_parsing(cv):
    huge = "A" * (64 * 1024 * 4 // 3 + 1024 * 1024 + 10)
    assert_error(speak(cv, input=huge), 413, "exceeds the limit")


def test_a_prompt_over_the_engine_s_text_buffer_at_admission_is_text_too_long(cv_loaded):
    """The streamed-text overflow is `text_too_long`; a prompt already over `max_text_tokens` when it is admitted
    is the same fault of the client's, so the same code (it was a bare `invalid_request`)."""
    app = build_app(local_client(cv_loaded, max_text_tokens=8), server_settings(cv_loaded), None)
    with TestClient(app) as c:
        for stream in (False, True):
            # non_streaming_mode false: the text is fed a token a frame from the engine's text buffer
            err = assert_error(speak(c, input="A sentence of rather more than eight text tokens, surely.",
                                     non_streaming_mode=False, stream=stream), 400, "max_text_tokens")
            assert err["code"] == "text_too_long" and err["type"] == "invalid_request_error"
            assert err["param"] == "input"  # the field to fix, as the WebSocket's error names `text`


def test_request_ids_are_echoed_generated_or_refused(cv):
    r = cv.post("/v1/audio/speech", json={"input": "Hi.", "voice": "ryan", "max_new_tokens": 3},
                headers={"X-Request-Id": "client-7:a.b_c"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "client-7:a.b_c"
    r = speak(cv, max_new_tokens=3)
    assert len(r.headers["x-request-id"]) == 32 and int(r.headers["x-request-id"], 16) >= 0
    r = cv.post("/v1/audio/speech", json={"input": "Hi.", "voice": "ryan"}, headers={"X-Request-Id": "bad id!"})
    assert_error(r, 400, "X-Request-Id", param="X-Request-Id")


def test_a_request_id_with_a_line_break_is_refused_not_echoed():
    """`$` also matches before a final newline: an id like "abc\\n" must not reach a response header."""
    from legato.server.app import RequestIdMiddleware

    async def ok(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b""}

    scope = {"type": "http", "method": "GET", "path": "/", "headers": [(b"x-request-id", b"abc\n")]}
    asyncio.run(RequestIdMiddleware(ok)(scope, receive, send))
    assert sent[0]["status"] == 400
    echoed = dict(sent[0]["headers"])[b"x-request-id"]
    assert b"\n" not in echoed and len(echoed) == 32


# --- models, health, metrics, logs --------------------------------------------------------------------


def test_models_health_and_metrics(cv):
    models = cv.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny"
    assert models["data"][0]["task_type"] == "CustomVoice" and "ryan" in models["data"][0]["voices"]
    speak(cv, max_new_tokens=4)
    health = cv.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert health.json()["engine"]["num_kv_blocks"] == 512
    # the engine renews its stats before it hands a request's last chunk over: settled when the response is
    assert health.json()["engine"]["free_kv_blocks"] == 512
    head = cv.head("/health")  # load balancers that probe with HEAD get the status
    assert head.status_code == 200 and head.content == b""
    for path in ("/v1/models", "/metrics", "/", "/demo"):  # every GET answers HEAD too (voices: test_voices_api)
        got, head = cv.get(path, follow_redirects=False), cv.head(path, follow_redirects=False)
        assert (head.status_code, head.content) == (got.status_code, b""), path
        assert head.headers.get("content-type") == got.headers.get("content-type"), path
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # FastAPI warns of a duplicate operation id when it builds the schema
        paths = cv.get("/openapi.json").json()["paths"]
    ids = [op["operationId"] for ops in paths.values() for op in ops.values()]
    assert len(ids) == len(set(ids)) and not any("head" in ops for ops in paths.values())
    root = cv.get("/", follow_redirects=False)  # a browser at the server's address lands on the demo page
    assert root.status_code == 307 and root.headers["location"] == "/demo"
    assert speak(cv, voice="nobody").status_code == 400  # counted below, whatever ran before this test
    text = cv.get("/metrics").text
    for name in ("legato_time_to_first_audio_seconds_bucket", "legato_real_time_factor_bucket",
                 "legato_e2e_latency_seconds_count", "legato_num_requests_waiting",
                 "legato_num_requests_running", "legato_kv_cache_usage_ratio",
                 'legato_requests_total{status="200"}', 'legato_requests_total{status="400"}',
                 "legato_kv_handoffs_recomputed_total 0.0", "legato_engine_steps_total",
                 "legato_engine_decode_rows_total",
                 "legato_engine_step_host_seconds_total", "legato_engine_loop_other_seconds_total",
                 # vLLM's names, for routers that balance model servers on them
                 'vllm:num_requests_waiting{model_name="tiny"} 0.0', 'vllm:num_requests_running{model_name="tiny"}',
                 'vllm:kv_cache_usage_perc{model_name="tiny"}', 'vllm:gpu_cache_usage_perc{model_name="tiny"}',
                 'vllm:time_to_first_token_seconds_bucket{le="0.005",model_name="tiny"}',
                 'vllm:e2e_request_latency_seconds_count{model_name="tiny"}'):
        assert name in text, name


def test_model_retrieve_answers_the_listed_card_and_404s_an_unknown_id(cv):
    """The OpenAI SDK's `models.retrieve` GETs /v1/models/{id}: it was a 404 for the served model too."""
    listed = cv.get("/v1/models").json()["data"][0]
    got = cv.get("/v1/models/tiny")
    assert got.status_code == 200 and got.json() == listed
    missing = cv.get("/v1/models/tts-9")
    assert missing.status_code == 404
    err = missing.json()["error"]  # the speech route's code for an unknown model, in the usual error body
    assert err["code"] == "model_not_found" and err["type"] == "not_found_error" and "'tiny'" in err["message"]


def test_openais_model_names_are_listed_and_retrieved_as_cards_of_the_served_model(cv):
    """The speech route takes OpenAI's model names as the served model, yet /v1/models listed only the served
    name and /v1/models/tts-1 was a 404: a client that checks its configured model against the list (or
    retrieves it) refused a name the server accepts. Each is its own card, `root` naming the served model."""
    cards = cv.get("/v1/models").json()["data"]
    ids = [c["id"] for c in cards]
    assert ids[0] == "tiny" and sorted(ids[1:]) == ["gpt-4o-mini-tts", "tts-1", "tts-1-hd"]
    assert all(c["root"] == "tiny" and c["task_type"] == "CustomVoice" for c in cards)
    for card in cards:
        got = cv.get(f"/v1/models/{card['id']}")
        assert got.status_code == 200 and got.json() == card
    assert "'tts-1-hd'" in cv.get("/v1/models/tts-9").json()["error"]["message"]  # the 404 names them too


def test_a_served_name_that_is_an_openai_name_is_listed_once(cv_loaded):
    app = build_app(local_client(cv_loaded), server_settings(cv_loaded, model_name="tts-1"), None)
    with TestClient(app) as c:
        ids = [card["id"] for card in c.get("/v1/models").json()["data"]]
    assert ids[0] == "tts-1" and sorted(ids) == ["gpt-4o-mini-tts", "tts-1", "tts-1-hd"]


def test_model_retrieve_takes_a_hub_id_with_its_slash(cv_loaded):
    """A served name defaults to a hub id ("Qwen/..."): its slash must not split the route."""
    app = build_app(local_client(cv_loaded), server_settings(cv_loaded, model_name="Qwen/tiny"), None)
    with TestClient(app) as c:
        got = c.get("/v1/models/Qwen/tiny")
        assert got.status_code == 200 and got.json()["id"] == "Qwen/tiny"
        assert c.get("/v1/models/Qwen").json()["error"]["code"] == "model_not_found"


def test_logs_carry_the_request_id_and_usage(cv, caplog):
    with caplog.at_level(logging.INFO, logger="legato.server"):
        r = cv.post("/v1/audio/speech", json={"input": "Hi.", "voice": "ryan", "max_new_tokens": 5, "stream": False},
                    headers={"X-Request-Id": "log-check-1"})
    assert r.status_code == 200
    done = [rec for rec in caplog.records if getattr(rec, "request_id", None) == "log-check-1"]
    assert done and done[-1].status == 200
    assert done[-1].frames == int(r.headers["x-usage-output-tokens"])
    # Where the TTFP went on the engine's side, beside it: each stage within it.
    stages = [done[-1].prepare_s, done[-1].inbox_s, done[-1].engine_s]
    assert min(stages) >= 0 and sum(stages) <= done[-1].ttfp_s + 1e-3
    # The front's share: headers in -> handed to the engine client, then -> first audio pulled (which holds the
    # engine-side stages and the ways there and back).
    assert done[-1].front_in_s >= 0 and done[-1].reply_s >= sum(stages) - 1e-3
    assert done[-1].front_in_s + done[-1].reply_s <= done[-1].ttfp_s + 1e-3


def test_json_log_lines_hold_request_id_and_extras():
    from legato.server.logs import JsonFormatter, RequestIdFilter, current_request_id

    record = logging.makeLogRecord({"name": "x", "levelname": "INFO", "msg": "speech %s", "args": ("done",),
                                    "frames": 12})
    token = current_request_id.set("rid-42")
    try:
        RequestIdFilter().filter(record)
    finally:
        current_request_id.reset(token)
    line = json.loads(JsonFormatter().format(record))
    assert line["request_id"] == "rid-42" and line["msg"] == "speech done" and line["frames"] == 12


# --- Base (voice clone) model -------------------------------------------------------------------------


def test_base_model_voice_sources(base):
    hidden = 64
    r = base.post("/v1/audio/speech", json={"input": "Hi.", "speaker_embedding": [0.1] * hidden,
                                            "max_new_tokens": 4, "response_format": "pcm", "stream": False})
    assert r.status_code == 200, r.text
    assert len(r.content) == int(r.headers["x-usage-output-tokens"]) * SAMPLES_PER_FRAME * 2
    assert_error(base.post("/v1/audio/speech", json={"input": "Hi.", "speaker_embedding": [0.1] * 3}), 400,
                 "has 3 values", "needs 64", param="speaker_embedding")
    clip = "data:audio/wav;base64," + base64.b64encode((DATA / "voice01.wav").read_bytes()).decode()
    r = base.post("/v1/audio/speech", json={"input": "Hi.", "ref_audio": clip, "ref_text": "Some words.",
                                            "max_new_tokens": 4})
    assert r.status_code == 200, r.text
    assert_error(base.post("/v1/audio/speech", json={"input": "Hi.", "ref_audio": clip}), 400, "ref_text",
                 param="ref_text")
    assert_error(base.post("/v1/audio/speech", json={"input": "Hi.", "ref_audio": "not audio!",
                                                     "x_vector_only_mode": True}), 400,
                 param="ref_audio")
    assert_error(base.post("/v1/audio/speech", json={"input": "Hi."}), 400, "clones a voice")
    assert_error(base.post("/v1/audio/speech", json={"input": "Hi.", "voice": "x", "speaker_embedding": [0.0]}),
                 400, "only one voice source")
    assert_error(base.post("/v1/audio/speech", json={"input": "Hi.", "speaker_embedding": [0.1] * hidden,
                                                     "instructions": "happy"}), 400, "no instructions")


def test_base_model_speaks_in_a_saved_voice(base):
    r = base.post("/v1/audio/voices", json={"name": "Narrator", "speaker_embedding": [0.2] * 64})
    assert r.status_code == 201, r.text
    r = base.post("/v1/audio/speech", json={"input": "Hi.", "voice": "narrator", "max_new_tokens": 4})
    assert r.status_code == 200, r.text
    assert_error(base.post("/v1/audio/speech", json={"input": "Hi.", "voice": "nobody"}), 400,
                 "unknown voice 'nobody'", "Narrator", param="voice")
    assert "Narrator" in base.get("/v1/models").json()["data"][0]["voices"]
    # An error names a long voice in brief, and the first 20 saved voices (a probe's 200,000-character name came
    # back whole, beside every one of 1,000 saved names)
    for i in range(25):
        assert base.post("/v1/audio/voices", json={"name": f"v{i:02d}", "speaker_embedding": [0.2] * 64}
                         ).status_code == 201
    err = assert_error(base.post("/v1/audio/speech", json={"input": "Hi.", "voice": "z" * 200_000}), 400,
                       "unknown voice 'zzz", "and 6 more (GET /v1/audio/voices)", param="voice")
    assert len(err["message"]) < 600
    for i in range(25):
        base.delete(f"/v1/audio/voices/v{i:02d}")


def test_voice_design_model_needs_a_description(tmp_path_factory):
    loaded = tiny_loaded(tmp_path_factory.getbasetemp(), "voice_design")
    with TestClient(build_app(local_client(loaded), server_settings(loaded), None)) as c:
        r = c.post("/v1/audio/speech", json={"input": "Hi.", "instructions": "A calm, low voice.",
                                             "max_new_tokens": 4, "task_type": "VoiceDesign"})
        assert r.status_code == 200, r.text
        assert_error(c.post("/v1/audio/speech", json={"input": "Hi."}), 400, "needs instructions",
                     param="instructions")
        assert_error(c.post("/v1/audio/speech", json={"input": "Hi.", "voice": "ryan", "instructions": "Calm."}),
                     400, "no voices", param="voice")
        # the OpenAI SDK requires a voice: one of OpenAI's names stands beside the instructions, the same request
        sdk = {"input": "Hi.", "instructions": "A calm, low voice.", "max_new_tokens": 4, "seed": 3,
               "response_format": "pcm"}
        plain, named = c.post("/v1/audio/speech", json=sdk), c.post("/v1/audio/speech", json={**sdk, "voice": "Alloy"})
        assert named.status_code == 200 and named.content == plain.content, named.text
        assert_error(c.post("/v1/audio/speech", json={"input": "Hi.", "voice": "alloy"}), 400, "needs instructions")


# --- failure paths through a scripted fake client -----------------------------------------------------


def fake_app(script, **settings):
    client = FakeClient(script)
    return client, build_app(client, server_settings(**settings), None)


def test_full_queue_is_429_with_retry_after():
    client, app = fake_app(lambda req: [rejected(429, "server busy: waiting queue is full", retry_after=2.0)])
    with TestClient(app) as c:
        r = speak(c)
        assert_error(r, 429, "server busy")
        assert r.headers["retry-after"] == "2"
        assert_error(speak(c, stream=True), 429)
        assert 'legato_requests_total{status="429"} 2.0' in c.get("/metrics").text


@pytest.mark.parametrize("refusal, code", [
    (rejected(503, "no engine replica is serving"), "engine_unavailable"),
    (rejected(503, "engine worker abc-0 is not serving: worker died (exit code -9)"), "engine_unavailable"),
    (rejected(503, "the codec worker is not running"), "engine_unavailable"),
    (RequestRejected.shutting_down(), "shutting_down"),
    (RequestRejected.shutting_down("the worker is shutting down"), "shutting_down"),
    # the code is the one the refusal carries, never read out of its text
    (rejected(503, "a worker said shutting down while it died"), "engine_unavailable"),
    (rejected(503, "draining", code="shutting_down"), "shutting_down"),
])
def test_a_503_says_whether_the_server_drains_or_an_engine_is_down(refusal, code):
    """A dead worker's 503 carried `shutting_down`, which a balancer reads as the server leaving (an outside probe)."""
    client, app = fake_app(lambda req: [refusal])
    with TestClient(app) as c:
        err = assert_error(speak(c), 503, refusal.message)
        assert err["code"] == code


def test_health_says_degraded_while_an_engine_of_the_deployment_is_down(monkeypatch):
    """A dead replica left /health "ok" with its blocks counted free (an outside probe): now 200 "degraded", its
    count in `engines_down` and in `legato_engines_down`."""
    from legato.pipeline.client import EngineStats

    client, app = fake_app(lambda req: [])
    monkeypatch.setattr(client, "stats", lambda: EngineStats(num_kv_blocks=8, free_kv_blocks=8, engines_down=1))
    with TestClient(app) as c:
        h = c.get("/health")
        assert h.status_code == 200 and h.json()["status"] == "degraded" and h.json()["engine"]["engines_down"] == 1
        assert "legato_engines_down 1.0" in c.get("/metrics").text


def test_engine_failure_fails_only_that_request():
    def script(req):
        if req.input.text == "fail":
            return [frames_chunk(1, 1), 0.05, frames_chunk(0, 1, True, "error", "engine step failed: boom")]
        return [0.02, frames_chunk(2, 2), 0.05, frames_chunk(1, 3, True, "stop")]

    client, app = fake_app(script)
    with TestClient(app) as c:
        results = {}

        def call(text, **body):
            results[text + str(body)] = speak(c, input=text, **body)

        threads = [threading.Thread(target=call, args=(t,), kwargs=kw)
                   for t, kw in [("fail", {}), ("ok", {}), ("fail", {"stream_format": "sse"})]]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        ok = results["ok{}"]
        assert ok.status_code == 200 and ok.headers["x-usage-output-tokens"] == "3"
        assert_error(results["fail{}"], 500, "engine step failed: boom")
        events = sse_events(results["fail{'stream_format': 'sse'}"].text)
        assert [e["type"] for e in events] == ["speech.audio.delta", "speech.audio.error"]
        assert events[-1]["error"]["message"] == "engine step failed: boom" and events[-1]["error"]["partial_audio"]
        assert c.get("/health").status_code == 200


def test_a_broken_engine_stream_is_reported_not_hung():
    def script(req):
        if req.input.text == "raise":
            return [frames_chunk(1, 1), RuntimeError("client bug")]
        return [frames_chunk(1, 1)]  # ends without a final chunk

    client, app = fake_app(script)
    with TestClient(app) as c:
        events = sse_events(speak(c, input="raise", stream_format="sse").text)
        assert events[-1]["type"] == "speech.audio.error" and "RuntimeError" in events[-1]["error"]["message"]
        assert_error(speak(c, input="truncated"), 500, "without a final chunk")
        events = sse_events(speak(c, input="truncated", stream_format="sse").text)
        assert events[-1]["error"]["message"] == "the engine stream ended without a final chunk"


def test_failure_before_any_audio_is_a_plain_http_error():
    client, app = fake_app(lambda req: [frames_chunk(0, 0, True, "abort", "server shutting down")])
    with TestClient(app) as c:
        assert_error(speak(c, stream=True), 503, "shutting down")
        assert_error(speak(c, stream_format="sse"), 503)


def codes_only(total: int) -> StreamChunk:
    """A chunk carrying new codec codes but no audio yet (the engine sends one per decoded frame)."""
    return StreamChunk(np.zeros(0, np.float32), total, num_prompt_tokens=7, seed=11,
                       codes=np.zeros((1, 16), np.int64))


def test_chunks_without_audio_add_nothing_to_any_stream():
    def script(req):
        return [codes_only(1), frames_chunk(2, 2), codes_only(3), frames_chunk(1, 3), codes_only(4),
                frames_chunk(0, 4, True, "stop")]

    client, app = fake_app(script)
    with TestClient(app) as c:
        events = sse_events(speak(c, stream_format="sse", response_format="pcm").text)
        assert [e["type"] for e in events] == ["speech.audio.delta"] * 2 + ["speech.audio.done"]
        assert [len(base64.b64decode(e["audio"])) for e in events[:-1]] == [2 * SAMPLES_PER_FRAME * 2,
                                                                           SAMPLES_PER_FRAME * 2]
        raw = speak(c, stream=True, response_format="pcm")
        assert raw.status_code == 200 and len(raw.content) == 3 * SAMPLES_PER_FRAME * 2
        whole = speak(c, response_format="pcm")
        assert whole.content == raw.content and whole.headers["x-usage-output-tokens"] == "4"


def test_failure_after_codes_but_before_any_audio_is_a_plain_http_error():
    client, app = fake_app(lambda req: [codes_only(1), codes_only(2),
                                        frames_chunk(0, 2, True, "error", "codec failed")])
    with TestClient(app) as c:
        for body in ({"stream": True}, {"stream_format": "sse"}, {}):
            assert_error(speak(c, **body), 500, "codec failed")


def test_a_deployment_s_failure_mid_stream_keeps_the_request_s_usage_and_seed(caplog):
    """A worker's death ends a request with a chunk of its own (0 frames, seed 0): the SSE error's usage and the
    log line read 0 output tokens and seed 0 after audio had gone out (an outside probe)."""
    died = StreamChunk(np.zeros(0, np.float32), 0, finished=True, finish_reason="error",
                       error="engine worker x-0 died (exit code -9)", retryable=True)
    client, app = fake_app(lambda req: [frames_chunk(1, 1), frames_chunk(2, 3), died])
    with TestClient(app) as c, caplog.at_level(logging.INFO, logger="legato.server"):
        events = sse_events(speak(c, stream_format="sse").text)
    assert events[-1]["type"] == "speech.audio.error" and events[-1]["usage"]["output_tokens"] == 3
    [done] = [rec for rec in caplog.records if getattr(rec, "status", None) == 500]
    assert (done.frames, done.seed) == (3, 11)


def test_timeouts_abort_and_report(tmp_path):
    client, app = fake_app(lambda req: [frames_chunk(1, 1), 5.0, frames_chunk(1, 2, True, "stop")],
                           request_timeout_s=0.3)
    with TestClient(app) as c:
        t0 = time.monotonic()
        assert_error(speak(c), 504, "timed out")
        events = sse_events(speak(c, stream_format="sse").text)
        assert events[-1]["type"] == "speech.audio.error" and events[-1]["error"]["code"] == 504
        assert time.monotonic() - t0 < 4.5  # without the timeouts the first stall alone is 5 s
        assert len(client.closed_early) == 2
        assert 'legato_request_aborts_total{reason="timeout"} 2.0' in c.get("/metrics").text


def test_a_timed_out_request_reaches_the_engine_s_abort_counts_as_a_timeout(cv_loaded):
    """The cancelled pull of a timed-out request closed its engine stream, which aborts as a client gone: the
    engine (/health `aborted`) counted "client disconnected" while the server's own metric said timeout. The
    engine's steps are held until the 504 is out, so the request cannot finish first."""
    client = local_client(cv_loaded)
    gate = threading.Event()
    step, add = client.engine.step, client.engine.add_request
    added = []

    def held_step():
        gate.wait(30)
        return step()

    def counted_add(req):
        added.append(req.request_id)
        return add(req)

    client.engine.step, client.engine.add_request = held_step, counted_add
    app = build_app(client, server_settings(cv_loaded, request_timeout_s=1.0), None)
    with TestClient(app) as c:
        try:
            assert_error(speak(c), 504, "timed out")
        finally:
            gate.set()
        # A machine busy enough to keep the request in admission for the whole second never hands it to the
        # engine, which then has nothing to abort (test_stream_text_ws holds admission to prove that path).
        if added:
            assert wait_until(lambda: c.get("/health").json()["engine"]["aborted"], timeout=30)
            assert c.get("/health").json()["engine"]["aborted"] == {"timeout": 1}
        else:
            assert c.get("/health").json()["engine"]["aborted"] == {}


def test_raw_stream_failure_cuts_the_connection_and_disconnects_abort():
    def script(req):
        if req.input.text == "fail":
            return [frames_chunk(1, 1), 0.05, frames_chunk(0, 1, True, "error", "boom")]
        return [frames_chunk(1, 1), 30.0, frames_chunk(1, 2, True, "stop")]

    client, app = fake_app(script)
    with LiveServer(app) as srv, httpx.Client(base_url=srv.url, timeout=10) as http:
        body = {"input": "fail", "voice": "ryan", "stream": True, "response_format": "pcm"}
        with pytest.raises(httpx.RemoteProtocolError):
            with http.stream("POST", "/v1/audio/speech", json=body) as r:
                assert r.status_code == 200
                for _ in r.iter_bytes():
                    pass
        # a client that leaves mid-stream, and one that leaves a non-streaming request, both abort at once
        with http.stream("POST", "/v1/audio/speech", json={**body, "input": "slow"}) as r:
            next(r.iter_bytes())
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/audio/speech", json={"input": "slow", "voice": "ryan"}, timeout=0.5)
        assert wait_until(lambda: len(client.closed_early) == 2, timeout=5)
        metrics = http.get("/metrics").text
        assert 'legato_request_aborts_total{reason="client_disconnect"} 2.0' in metrics
        assert 'legato_requests_total{status="500"} 1.0' in metrics


@pytest.mark.parametrize("mode", ["file", "sse"])
def test_a_cancelled_handler_ends_its_engine_stream_cleanly(mode):
    """Uvicorn cancels handlers still running when its graceful shutdown times out: the engine request must
    be closed, and the cancellation must stay a cancellation (not "generator already running")."""
    from types import SimpleNamespace

    from legato.models.qwen3_tts.inputs import SpeechInput
    from legato.models.qwen3_tts.sampling import SamplingParams
    from legato.pipeline.client import SynthesisRequest
    from legato.server.metrics import ServerMetrics
    from legato.server.streaming import SpeechResponder

    client = FakeClient(lambda req: [30.0])

    async def main():
        never = asyncio.Event()

        async def receive():
            await never.wait()

        request = SimpleNamespace(receive=receive, state=SimpleNamespace(started=time.perf_counter()))
        responder = SpeechResponder(client, server_settings(), ServerMetrics(client))
        req = SynthesisRequest("cancel-me", SpeechInput("Hi.", speaker="ryan"), SamplingParams())
        task = asyncio.create_task(responder.respond(req, "wav", mode, request))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert client.closed_early == ["cancel-me"]


@pytest.mark.parametrize("mode", ["audio", "sse"])
def test_a_client_gone_before_the_stream_body_starts_still_aborts(mode):
    """The body generator may never start (the client left between the first chunk and the response
    start): closing an unstarted generator skips its `finally`, so the response itself must end the request."""
    from types import SimpleNamespace

    from legato.models.qwen3_tts.inputs import SpeechInput
    from legato.models.qwen3_tts.sampling import SamplingParams
    from legato.pipeline.client import SynthesisRequest
    from legato.server.metrics import ServerMetrics
    from legato.server.streaming import SpeechResponder

    client = FakeClient(lambda req: [frames_chunk(1, 1), 30.0, frames_chunk(1, 2, True, "stop")])

    async def main():
        left = asyncio.Event()

        async def receive():
            await left.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            await asyncio.sleep(0)

        request = SimpleNamespace(receive=receive, state=SimpleNamespace(started=time.perf_counter()))
        responder = SpeechResponder(client, server_settings(), ServerMetrics(client))
        req = SynthesisRequest("left-early", SpeechInput("Hi.", speaker="ryan"), SamplingParams())
        response = await responder.respond(req, "pcm", mode, request)
        left.set()  # the client is gone before the body is sent
        await asyncio.wait_for(response({"type": "http"}, receive, send), 5)
        return request.state.generation, list(client.closed_early)

    gen, closed_early = asyncio.run(main())
    assert closed_early == ["left-early"]  # at once, not when the loop finalises leftover generators
    assert gen.outcome == 499


def test_health_is_503_when_the_engine_is_dead():
    client, app = fake_app(lambda req: [])
    with TestClient(app) as c:
        client.alive = False
        r = c.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "unavailable"
    assert client.started and client.stopped


# --- the CLI: start, serve, shut down gracefully ------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_cli_starts_on_the_default_model_and_shuts_down_gracefully(tmp_path):
    port = _free_port()
    env = {**os.environ, "LEGATO_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "legato.cli", "serve", "--port", str(port), "--log-format", "json",
         "--max-num-seqs", "4", "--chunk-frames", "2", "--shutdown-grace", "20"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_until(lambda: _healthy(url), timeout=120, interval=0.2), "server did not come up"
        got = bytearray()
        first = threading.Event()
        times = {}

        def stream() -> None:
            body = {"input": "Hello.", "voice": "ryan", "stream": True, "response_format": "pcm",
                    "ignore_eos": True, "num_frames": 60}
            with httpx.stream("POST", f"{url}/v1/audio/speech", json=body, timeout=60,
                              headers={"X-Request-Id": "graceful-1"}) as r:
                for part in r.iter_bytes():
                    got.extend(part)
                    first.set()
            times["done"] = time.monotonic()

        t = threading.Thread(target=stream)
        t.start()
        assert first.wait(60)
        proc.send_signal(signal.SIGTERM)  # mid-stream: the request must still finish whole
        times["signal"] = time.monotonic()
        t.join(60)
        assert proc.wait(60) == 0  # a graceful shutdown is a clean exit (lifecycle.GracefulServer)
    finally:
        if proc.poll() is None:
            proc.kill()
    _, err = proc.communicate()
    assert times["done"] > times["signal"], "the stream ended before the signal: nothing was shown"
    assert len(got) == 60 * SAMPLES_PER_FRAME * 2
    lines = [json.loads(x) for x in err.splitlines() if x.startswith("{")]
    assert any("RANDOM weights" in x["msg"] for x in lines)
    done = [x for x in lines if x.get("request_id") == "graceful-1" and x["msg"] == "speech done"]
    assert done and done[0]["frames"] == 60
    assert any(x["msg"] == "engine stopped" for x in lines)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
