"""Property-based fuzzing of the live server: schemathesis cases generated from the app's own OpenAPI
schema (valid and invalid), and hypothesis bodies that break a valid request one field at a time.

Every answer must be a success or a 4xx carrying an OpenAI-shaped error with a message; never a 5xx, never
a hang (each call is bounded). Small token caps keep accepted requests to a few frames."""

from __future__ import annotations

import json

import httpx
import pytest
import requests
import schemathesis
from fuzz_scale import count_case, fuzz_examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers import LiveServer, local_client, server_settings, tiny_loaded, wait_until

from legato.server.app import build_app
from legato.server.voices import VoiceStore

CALL_TIMEOUT = 20.0
OWN_ROUTES = ("/v1/audio/speech", "/v1/models", "/health")  # the voice routes document their own codes
FUZZ = settings(max_examples=fuzz_examples(), deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))


def _app(loaded, tmp, model_type):
    client = local_client(loaded, max_num_seqs=4)
    store = VoiceStore(tmp / "voices", client) if model_type == "base" else None
    limits = dict(default_max_new_tokens=4, max_new_tokens_limit=8, max_input_chars=300, request_timeout_s=15.0,
                  max_ref_audio_bytes=256 * 1024, max_ref_audio_seconds=5.0)
    return build_app(client, server_settings(loaded, **limits), store)


@pytest.fixture(scope="module", params=["custom_voice", "base"])
def live(request, tmp_path_factory):
    loaded = tiny_loaded(tmp_path_factory.getbasetemp(), request.param)
    app = _app(loaded, tmp_path_factory.mktemp(f"fuzz-{request.param}"), request.param)
    with LiveServer(app) as srv:
        yield srv, app


def check_answer(status: int, content_type: str, body: bytes) -> None:
    assert status < 500, f"{status}: {body[:500]!r}"
    if status >= 400:
        assert content_type.startswith("application/json"), content_type
        err = json.loads(body)["error"]
        assert isinstance(err["message"], str) and err["message"].strip()
        assert err["type"]


def _operations(app) -> list:
    schema = schemathesis.openapi.from_dict(app.openapi())
    return [op.ok() for op in schema.get_all_operations()]


def _fuzz_operation(op, mode, url: str, session: requests.Session, documented: set[str]) -> None:
    @FUZZ
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case) -> None:
        count_case(f"schemathesis {mode.value} {op.method.upper()} {op.path}")
        response = case.call(base_url=url, session=session, timeout=CALL_TIMEOUT)
        content_type = response.headers.get("content-type", [""])  # schemathesis: a list per header
        check_answer(response.status_code, content_type[0], response.content)
        if op.path in OWN_ROUTES:  # our routes answer only with the statuses their schema lists
            assert str(response.status_code) in documented, (response.status_code, documented)

    run()


@pytest.mark.parametrize("mode", [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE])
def test_schemathesis_cases_never_5xx(live, mode):
    srv, app = live
    session = requests.Session()
    ops = _operations(app)
    assert any(op.path == "/v1/audio/speech" for op in ops)
    for op in ops:
        if mode is schemathesis.GenerationMode.NEGATIVE and not op.get_request_payload_content_types():
            continue  # nothing schema-typed to break (no body; free-form path strings)
        documented = set(app.openapi()["paths"][op.path][op.method.lower()]["responses"])
        _fuzz_operation(op, mode, srv.url, session, documented)


VALID = {"input": "Fuzzing the server.", "voice": "ryan", "max_new_tokens": 4}
BASE_VALID = {"input": "Fuzzing the server.", "speaker_embedding": [0.05] * 64, "max_new_tokens": 4}
# any code point, lone surrogates and controls included, with the awkward ones drawn often
# (built from lists: st.text() would fold the alphabet into one character set and drop the surrogates)
_awkward = st.sampled_from(["\ud800", "\udfff", "\x00", "\u202e", "\U0001f600", "\n"])
any_text = st.lists(st.characters(exclude_categories=()) | _awkward, max_size=60).map("".join)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | any_text
    | st.sampled_from(["wav", "pcm", "flac", "mp3", "sse", "audio", "Base", "CustomVoice", "english", "RYAN",
                       "data:audio/wav;base64,UklGRg==", "file:///etc/passwd", "http://127.0.0.1:1/x.wav"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)
# In-range values, so that many mutated requests are accepted and really run through the engine.
PLAUSIBLE = {
    "input": any_text.filter(str.strip), "voice": st.sampled_from(["ryan", "SERENA", "Eric", "nobody"]),
    "response_format": st.sampled_from(["wav", "pcm", "flac"]), "stream": st.booleans(),
    "stream_format": st.sampled_from(["audio", "sse"]), "speed": st.sampled_from([1, 1.0]),
    "language": st.sampled_from(["auto", "English", "chinese", "Japanese"]), "instructions": any_text,
    "task_type": st.sampled_from(["Base", "CustomVoice"]), "non_streaming_mode": st.booleans(),
    "max_new_tokens": st.integers(2, 8), "num_frames": st.integers(1, 7), "ignore_eos": st.booleans(),
    "seed": st.integers(0, 2**63 - 1), "do_sample": st.booleans(), "subtalker_do_sample": st.booleans(),
    "temperature": st.floats(0.01, 100), "subtalker_temperature": st.floats(0.01, 100),
    "top_k": st.integers(0, 2**16), "subtalker_top_k": st.integers(0, 2**16),
    "top_p": st.floats(1e-6, 1.0), "subtalker_top_p": st.floats(1e-6, 1.0),
    "repetition_penalty": st.floats(0.01, 100), "first_chunk_frames": st.integers(1, 16),
    "x_vector_only_mode": st.booleans(), "ref_text": any_text,
    "speaker_embedding": st.lists(st.floats(-1e39, 1e39, allow_nan=False), min_size=64, max_size=64),
}


@st.composite
def bodies(draw, valid: dict) -> dict:
    """A valid request with a few fields set to in-range values and, half the time, one to any JSON value."""
    body = dict(valid)
    for name in draw(st.lists(st.sampled_from(sorted(PLAUSIBLE)), max_size=4, unique=True)):
        body[name] = draw(PLAUSIBLE[name])
    if draw(st.booleans()):
        body[draw(st.sampled_from([*sorted(PLAUSIBLE), "model", "ref_audio", "unknown_field"]))] = draw(json_values)
    return body


def _mutations(client: httpx.Client, valid: dict) -> list[int]:
    statuses = []

    @FUZZ
    @given(body=bodies(valid))
    def run(body: dict) -> None:
        count_case(f"mutated POST /v1/audio/speech ({'base' if valid is BASE_VALID else 'custom_voice'})")
        # json.dumps escapes to ASCII, so lone surrogates travel as "\ud800", as a hostile client sends them
        content = json.dumps(body).encode()
        with client.stream("POST", "/v1/audio/speech", content=content,
                           headers={"content-type": "application/json"}) as r:
            data = r.read()
        if r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"):
            last = [x for x in data.decode().split("\n\n") if x.startswith("data: ")][-1]
            assert json.loads(last[6:])["type"] == "speech.audio.done"
        check_answer(r.status_code, r.headers.get("content-type", ""), data)
        statuses.append(r.status_code)

    run()
    return statuses


def test_mutated_valid_requests_never_5xx(live):
    srv, app = live
    valid = BASE_VALID if app.state.client.info.model_type == "base" else VALID
    with httpx.Client(base_url=srv.url, timeout=CALL_TIMEOUT) as client:
        assert client.post("/v1/audio/speech", json=valid).status_code == 200
        statuses = _mutations(client, valid)
        assert statuses.count(200) >= 5, statuses  # the fuzzing reached the engine, not only the validators
        assert wait_until(lambda: client.get("/health").json()["engine"]["running"] == 0, timeout=10)
        assert client.get("/health").json()["status"] == "ok"


def test_voice_uploads_with_client_chosen_charsets_never_5xx(live):
    """The multipart charset fuzz of test_voices_api, through the live server and the real voice store: any
    charset, in the header or a part, is read as UTF-8 or refused, and the listing stays 200 after each."""
    from test_voices_api import CHARSET_FUZZ, multipart_with_charset

    srv, app = live
    if app.state.client.info.model_type != "base":
        pytest.skip("voice uploads are for Base models (the app mounts no voice store here)")
    statuses = []
    with httpx.Client(base_url=srv.url, timeout=CALL_TIMEOUT) as client:
        @FUZZ
        @given(case=CHARSET_FUZZ)
        def run(case) -> None:
            count_case("live multipart_with_charset POST /v1/audio/voices")
            body, content_type = multipart_with_charset(*case)
            try:
                r = client.post("/v1/audio/voices", content=body, headers={"content-type": content_type})
            except httpx.LocalProtocolError:  # the client library itself will not send it (a NUL in a header)
                return
            check_answer(r.status_code, r.headers.get("content-type", ""), r.content)
            statuses.append(r.status_code)
            assert client.get("/v1/audio/voices").status_code == 200

        run()
    assert 415 in statuses, statuses
