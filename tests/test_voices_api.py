"""The /v1/audio/voices routes, through an app that mounts only them: upload (multipart and JSON) -> list
-> delete with the real encoders; every refusal a 4xx in the server's error shape; and property-based
fuzzing of all three routes (random names, bodies, files, content types) that must never reach a 5xx."""

from __future__ import annotations

import asyncio
import base64
import codecs
import json
from urllib.parse import quote

import pytest
import torch
from fastapi import FastAPI
from fastapi.testclient import TestClient
from fuzz_scale import count_case, fuzz_examples
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from voice_helpers import CLIP, HIDDEN, FakeClient

from legato.engine.config import EngineConfig
from legato.models.qwen3_tts.loader import load_model
from legato.pipeline.local import LocalEngineClient
from legato.server.errors import install_error_handlers
from legato.server.media import MediaPolicy
from legato.server.voices import NAME_PATTERN, VoiceStore
from legato.server.voices_api import build_voices_router

URL = "/v1/audio/voices"
CLIP_BYTES = CLIP.read_bytes()
DATA_URL = "data:audio/wav;base64," + base64.b64encode(CLIP_BYTES).decode()


def make_app(store: VoiceStore, policy: MediaPolicy) -> TestClient:
    app = FastAPI()
    install_error_handlers(app)  # as the server does: routing errors (405, unknown paths) share the shape
    app.include_router(build_voices_router(store, policy))
    return TestClient(app)


def assert_error(resp, status: int, needle: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    assert "code" in err
    if needle is not None:
        assert needle in err["message"], err["message"]
    return err


def embedding(seed: int = 0) -> list[float]:
    return torch.randn(HIDDEN, generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture
def media_dir(tmp_path):
    root = tmp_path / "media"
    root.mkdir()
    (root / "clip.wav").write_bytes(CLIP_BYTES)
    (tmp_path / "outside.wav").write_bytes(CLIP_BYTES)
    return root


@pytest.fixture
def fake_app(tmp_path, media_dir):
    client = FakeClient()
    store = VoiceStore(tmp_path / "voices", client)
    policy = MediaPolicy(allowed_local_media_path=str(media_dir), max_bytes=len(CLIP_BYTES) + 100)
    return make_app(store, policy), store, client


# --- the happy path, real engine ---------------------------------------------------------------------


def test_upload_list_delete_with_the_real_encoders(tiny_checkpoint, tmp_path, media_dir):
    torch.set_num_threads(1)
    engine = LocalEngineClient(load_model(tiny_checkpoint), EngineConfig(
        device="cpu", dtype="float32", max_num_seqs=4, num_kv_blocks=64, max_model_len=1024))
    asyncio.run(engine.start())
    try:
        store = VoiceStore(tmp_path / "voices", engine)
        http = make_app(store, MediaPolicy(allowed_local_media_path=str(media_dir)))
        r = http.post(URL, data={"name": "Alice", "ref_text": "Hello, this is my voice."},
                      files={"file": ("voice01.wav", CLIP_BYTES, "audio/wav")})
        assert r.status_code == 201, r.text
        alice = r.json()
        assert alice["name"] == "Alice" and alice["source"] == "audio"
        assert alice["has_ref_code"] is True and alice["ref_frames"] == 51
        assert alice["ref_text"] == "Hello, this is my voice." and alice["created_at"] > 0

        r = http.post(URL, json={"name": "bob", "ref_audio": DATA_URL, "x_vector_only": True})
        assert r.status_code == 201, r.text
        assert r.json()["has_ref_code"] is False and r.json()["ref_frames"] == 0
        r = http.post(URL, json={"name": "carol", "ref_audio": f"file://{media_dir}/clip.wav",
                                 "ref_text": "Words."})
        assert r.status_code == 201 and r.json()["ref_frames"] == 51
        r = http.post(URL, json={"name": "dan", "speaker_embedding": embedding()})
        assert r.status_code == 201 and r.json()["source"] == "embedding"

        # the same clip gives the same voice whether it came as an upload, a data URL or a file
        assert torch.equal(store.get("alice").speaker_embedding, store.get("bob").speaker_embedding)
        assert torch.equal(store.get("alice").ref_code, store.get("carol").ref_code)

        listing = http.get(URL).json()["voices"]
        assert [v["name"] for v in listing] == ["Alice", "bob", "carol", "dan"]
        assert listing[0] == alice

        r = http.delete(f"{URL}/ALICE")
        assert r.status_code == 200 and r.json()["deleted"] is True
        assert_error(http.delete(f"{URL}/alice"), 404, "not found")
        assert [v["name"] for v in http.get(URL).json()["voices"]] == ["bob", "carol", "dan"]
    finally:
        asyncio.run(engine.stop())


# --- refusals ----------------------------------------------------------------------------------------


def test_json_refusals(fake_app, media_dir):
    http, store, client = fake_app
    assert http.post(URL, json={"name": "taken", "speaker_embedding": embedding()}).status_code == 201
    cases = [
        (b"{not json", 400, "invalid request"),
        (json.dumps([1, 2]), 400, "invalid request"),
        (json.dumps({"ref_audio": DATA_URL}), 400, "name"),
        (json.dumps({"name": "x", "ref_audio": DATA_URL, "bogus": 1}), 400, "bogus"),
        (json.dumps({"name": "../etc", "speaker_embedding": embedding()}), 400, "name"),
        (json.dumps({"name": "x" * 65, "speaker_embedding": embedding()}), 400, "name"),
        (json.dumps({"name": "x"}), 400, "exactly one"),
        (json.dumps({"name": "x", "ref_audio": DATA_URL, "speaker_embedding": embedding()}), 400, "exactly one"),
        (json.dumps({"name": "x", "speaker_embedding": embedding()[:3]}), 400, "needs 64"),
        (json.dumps({"name": "x", "speaker_embedding": ["a"] * HIDDEN}), 400, "speaker_embedding"),
        (json.dumps({"name": "TAKEN", "speaker_embedding": embedding()}), 409, "exists"),
        (json.dumps({"name": "x", "ref_audio": "file:///etc/passwd"}), 403, "outside"),
        (json.dumps({"name": "x", "ref_audio": f"file://{media_dir}/../outside.wav"}), 403, "outside"),
        (json.dumps({"name": "x", "ref_audio": "https://example.com/a.wav"}), 403, "remote"),
        (json.dumps({"name": "x", "ref_audio": "/etc/passwd"}), 400, "file://"),
        (json.dumps({"name": "x", "ref_audio": base64.b64encode(b"garbage" * 99).decode()}), 400, "decode"),
        (json.dumps({"name": "x", "ref_audio": "data:audio/wav;base64,"
                     + base64.b64encode(CLIP_BYTES + bytes(2000)).decode()}), 413, "limit"),
    ]
    for body, status, needle in cases:
        assert_error(http.post(URL, content=body, headers={"content-type": "application/json"}), status, needle)
    assert [v.name for v in store.list()] == ["taken"] and client.calls == 0
    forbidden = assert_error(http.post(URL, json={"name": "x", "ref_audio": "file:///etc/passwd"}), 403)
    assert forbidden["param"] == "ref_audio" and forbidden["code"] == "forbidden_media"


def test_multipart_refusals(fake_app):
    http, store, client = fake_app
    wav = ("a.wav", CLIP_BYTES, "audio/wav")
    assert_error(http.post(URL, data={"name": "x"}, files={"file": ("a.wav", b"junk" * 50, "audio/wav")}), 400,
                 "decode")
    assert_error(http.post(URL, data={"name": "x", "file": "not a file"}), 400, "uploaded audio file")
    assert_error(http.post(URL, data={"name": "x"}, files=[("file", wav), ("audio_sample", wav)]), 400)
    assert_error(http.post(URL, data={"name": "x", "colour": "red"}, files={"file": wav}), 400, "unknown form field")
    assert_error(http.post(URL, data={"name": "x", "speaker_embedding": "[1, 2"}), 400, "JSON list")
    assert_error(http.post(URL, data={"name": "x", "ref_audio": DATA_URL}, files={"file": wav}), 400, "exactly one")
    assert_error(http.post(URL, data={"name": "x", "ref_audio": "file:///etc/passwd"}), 403, "outside")
    assert_error(http.post(URL, data={"name": "x", "x_vector_only": "maybe"}, files={"file": wav}), 400,
                 "x_vector_only")
    assert_error(http.post(URL, data={"name": "a/b"}, files={"file": wav}), 400, "name")
    assert_error(http.post(URL, content=b"--x\r\n", headers={"content-type": "multipart/form-data"}), 400,
                 "malformed")
    assert client.calls == 0 and len(store) == 0
    # the aliases other servers' clients send are understood
    r = http.post(URL, data={"name": "alias", "x_vector_only_mode": "true", "consent": "yes"},
                  files={"audio_sample": wav})
    assert r.status_code == 201 and r.json()["has_ref_code"] is False
    r = http.post(URL, data={"name": "form-emb", "speaker_embedding": json.dumps(embedding())})
    assert r.status_code == 201 and r.json()["source"] == "embedding"
    r = http.post(URL, data={"name": "form-url", "ref_audio": DATA_URL, "ref_text": "Words."})
    assert r.status_code == 201 and r.json()["ref_frames"] == 7


def test_deeply_nested_form_embedding_is_400(fake_app):
    """json.loads raises RecursionError (not ValueError) on deep nesting: still the client's fault."""
    http, store, _ = fake_app
    assert_error(http.post(URL, data={"name": "x", "speaker_embedding": "[" * 50_000}), 400, "JSON list")
    assert len(store) == 0


def test_body_size_caps(fake_app):
    http, store, _ = fake_app
    big = CLIP_BYTES + bytes(1000)  # 900 bytes over the policy's limit
    err = assert_error(http.post(URL, data={"name": "x"}, files={"file": ("a.wav", big, "audio/wav")}), 413)
    assert err["code"] == "request_too_large"
    # a body far over the cap is refused from its Content-Length, before it is read
    huge = b"x" * (len(CLIP_BYTES) + 400_000)
    assert_error(http.post(URL, content=huge, headers={"content-type": "multipart/form-data; boundary=b"}), 413)
    # without a Content-Length (chunked), the bytes actually read are counted

    def chunks():
        for _ in range(100):
            yield b"y" * 10_000

    assert_error(http.post(URL, content=chunks(), headers={"content-type": "application/json"}), 413,
                 "over the limit")
    assert_error(http.post(URL, content=b"{}", headers={"content-type": "application/json",
                                                        "content-length": "abc"}), 400, "Content-Length")
    assert len(store) == 0


def test_unsupported_content_type_and_methods(fake_app):
    http, _, _ = fake_app
    listed, head = http.get(URL), http.head(URL)  # HEAD as GET, no body (the route is an included router's)
    assert (listed.status_code, head.status_code, head.content) == (200, 200, b"")
    assert_error(http.post(URL, content=b"name=x", headers={"content-type": "text/plain"}), 415, "content type")
    assert http.put(URL, json={}).status_code == 405
    assert_error(http.delete(f"{URL}/nobody"), 404, "not found")
    assert_error(http.delete(f"{URL}/{quote('../../etc/passwd', safe='')}"), 404)


def test_a_name_that_only_lower_cases_to_a_voice_s_name_neither_finds_nor_deletes_it(fake_app):
    """str.lower() folds the Kelvin sign (U+212A) to "k": DELETE /v1/audio/voices/%E2%84%AAx deleted the voice
    "kx" (answering with the name it was given), and a speech request naming "\u212ax" spoke in it. Names are
    case-insensitive over the letters a name may hold, nothing else; a DELETE answers with the voice's name."""
    http, store, _ = fake_app
    assert http.post(URL, json={"name": "Kx", "speaker_embedding": embedding()}).status_code == 201
    assert store.get("\u212ax") is None
    assert_error(http.delete(f"{URL}/{quote(chr(0x212A) + 'x', safe='')}"), 404, "not found")
    assert [v["name"] for v in http.get(URL).json()["voices"]] == ["Kx"]
    assert http.delete(f"{URL}/kX").json() == {"deleted": True, "name": "Kx"}


def test_non_base_model_lists_presets_and_refuses_uploads(tmp_path):
    client = FakeClient(model_type="custom_voice", speakers=["ryan", "serena"])
    http = make_app(VoiceStore(tmp_path, client), MediaPolicy())
    assert http.get(URL).json() == {"voices": [{"name": "ryan", "source": "preset"},
                                               {"name": "serena", "source": "preset"}]}
    assert_error(http.post(URL, json={"name": "x", "ref_audio": DATA_URL}), 400, "Base")
    assert_error(http.post(URL, data={"name": "x"}, files={"file": ("a.wav", CLIP_BYTES, "audio/wav")}), 400, "Base")
    # whatever the body lacks, the first thing said is what no body can change (a newcomer's walkthrough)
    assert_error(http.post(URL, data={"name": "x"}), 400, "saved voices need a Base")
    assert_error(http.post(URL, json={"name": "x"}), 400, "saved voices need a Base")
    assert_error(http.delete(f"{URL}/ryan"), 400, "saved voices need a Base")  # a listed preset: not "not found"
    assert client.calls == 0


# --- fuzzing -----------------------------------------------------------------------------------------

_names = st.one_of(st.from_regex(NAME_PATTERN, fullmatch=True), st.text(max_size=80))
_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)
_audio_refs = st.one_of(
    st.sampled_from([DATA_URL, "file:///etc/passwd", "file://relative", "http://127.0.0.1:9/a.wav",
                     "data:audio/wav;base64,AAAA", "data:,", base64.b64encode(CLIP_BYTES[:300]).decode()]),
    st.text(max_size=60),
    st.binary(max_size=200).map(lambda b: base64.b64encode(b).decode()),
)
_valid_names = st.from_regex(NAME_PATTERN, fullmatch=True)
_plausible = st.one_of(  # well-formed creates, so the fuzz also walks the success and conflict paths
    st.fixed_dictionaries({"name": _valid_names, "ref_audio": st.just(DATA_URL)},
                          optional={"ref_text": st.text(max_size=40), "x_vector_only": st.booleans(),
                                    "replace": st.booleans()}),
    st.fixed_dictionaries({"name": _valid_names | st.sampled_from(["Ann", "ANN"]),
                           "speaker_embedding": st.lists(st.floats(-10, 10), min_size=HIDDEN, max_size=HIDDEN)},
                          optional={"replace": st.booleans()}),
)
_bodies = st.one_of(
    _plausible,
    st.builds(lambda known, extra: {**extra, **known}, st.fixed_dictionaries({}, optional={
        "name": _names,
        "ref_audio": _audio_refs | _json_values,
        "ref_text": st.text(max_size=40) | _json_values,
        "speaker_embedding": st.lists(st.floats(), min_size=HIDDEN, max_size=HIDDEN) | _json_values,
        "x_vector_only": st.booleans() | _json_values,
        "replace": st.booleans(),
    }), st.dictionaries(st.text(max_size=10), _json_values, max_size=2)),
    _json_values,
)
_FUZZ = settings(max_examples=fuzz_examples(), deadline=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture])


def check(resp) -> None:
    """Never a 5xx; a refusal is a 4xx with a message; a success is the voice."""
    event(f"status {resp.status_code}")  # see --hypothesis-show-statistics: both outcomes must occur
    assert resp.status_code < 500, resp.text
    if resp.status_code >= 400:
        assert_error(resp, resp.status_code)
    elif resp.request.method == "POST":
        assert resp.status_code == 201 and isinstance(resp.json()["name"], str)


@_FUZZ
@given(body=_bodies)
def test_fuzz_json_create(fake_app, body):
    count_case("voices json_create")
    http, _, _ = fake_app
    check(http.post(URL, content=json.dumps(body), headers={"content-type": "application/json"}))


@_FUZZ
@given(
    fields=st.dictionaries(st.sampled_from(["name", "ref_text", "x_vector_only", "speaker_embedding", "replace",
                                            "consent", "other", "ref_audio"]), st.text(max_size=40), max_size=5),
    name=_names,
    upload=st.one_of(st.none(), st.just(CLIP_BYTES), st.binary(max_size=600),
                     st.integers(1, len(CLIP_BYTES) - 1).map(lambda n: CLIP_BYTES[:n])),
    field=st.sampled_from(["file", "audio_sample", "name", "x"]),
)
def test_fuzz_multipart_create(fake_app, fields, name, upload, field):
    count_case("voices multipart_create")
    http, _, _ = fake_app
    data = {"name": name, **fields}
    files = {field: ("clip.wav", upload, "audio/wav")} if upload is not None else None
    check(http.post(URL, data=data, files=files))


@_FUZZ
@given(body=st.binary(max_size=400), content_type=st.sampled_from([
    "application/json", "multipart/form-data", "multipart/form-data; boundary=xyz", "text/plain", "",
    "application/x-www-form-urlencoded", "application/octet-stream", "application/ld+json"]))
def test_fuzz_raw_bodies(fake_app, body, content_type):
    count_case("voices raw_bodies")
    http, _, _ = fake_app
    check(http.post(URL, content=body, headers={"content-type": content_type}))


_SAVED = ["Ann", "bob.2", "c-d_e"]


@_FUZZ
@given(name=st.text(min_size=1, max_size=80) | st.sampled_from(_SAVED + [n.swapcase() for n in _SAVED]))
def test_fuzz_delete_and_list(fake_app, name):
    http, store, _ = fake_app
    for saved in _SAVED:
        if store.get(saved) is None:
            asyncio.run(store.create(saved, speaker_embedding=embedding()))
    # An HTTP client drops "." and ".." path segments (RFC 3986), so such a DELETE never names a voice; no
    # stored name can be one (NAME_PATTERN starts with a letter or digit).
    assume(name not in (".", ".."))
    count_case("voices delete_and_list")
    existed = store.get(name) is not None
    r = http.delete(f"{URL}/{quote(name, safe='')}")
    check(r)
    assert r.status_code == (200 if existed else 404)
    assert store.get(name) is None
    listing = http.get(URL)
    assert listing.status_code == 200 and all("name" in v for v in listing.json()["voices"])


# Charsets a client may name for form text: the two the server reads, and ones it must refuse (415) without
# ever decoding with them (unicode_escape turns plain ASCII into lone surrogates; rot13/base64 are not even
# text encodings), plus names that are no codec at all.
_CHARSETS = ["utf-8", "UTF-8", "utf8", '"utf-8"', "ascii", "us-ascii", "latin-1", "iso-8859-1", "cp1252",
             "utf-16", "utf-16-le", "utf-32", "shift_jis", "unicode_escape", "raw_unicode_escape", "rot13",
             "base64", "punycode", "idna", "bogus", "", "utf-8\x00", "x" * 200]
# Text with what an escape-decoding charset would turn into surrogates, real controls and odd code points.
_form_text = st.lists(st.sampled_from(["\\ud800", "\\udfff", "\\x00", "\\u202e", "\\N{SNOWMAN}", "\x00", "\x1b",
                                       "\r\n", "\u202e", "\U0001f600", "é", "Ann", "a"]) | st.characters(),
                      max_size=12).map("".join)


_BOUNDARY = "legato-fuzz-boundary"


def _codec_name(charset: str) -> str | None:
    try:
        return codecs.lookup(charset.strip('"').lower()).name
    except (LookupError, ValueError):
        return None


def _encode_part(text: str, charset: str) -> bytes:
    """The bytes a client would send for `text` claiming `charset` (UTF-8 when that is no usable codec)."""
    try:
        return text.encode(charset.strip('"'), errors="surrogatepass")
    except (LookupError, UnicodeError, TypeError, ValueError):
        return text.encode("utf-8", errors="surrogatepass")


def _multipart(fields: dict[str, str], charset: str, part_charset: bool, upload: bytes | None) -> bytes:
    out = bytearray()
    for key, value in fields.items():
        ctype = f"Content-Type: text/plain; charset={charset}\r\n" if part_charset else ""
        out += (f'--{_BOUNDARY}\r\nContent-Disposition: form-data; name="{key}"\r\n{ctype}\r\n').encode()
        out += _encode_part(value, charset) + b"\r\n"
    if upload is not None:
        out += (f'--{_BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
                "Content-Type: audio/wav\r\n\r\n").encode() + upload + b"\r\n"
    return bytes(out + f"--{_BOUNDARY}--\r\n".encode())


CHARSET_FUZZ = st.tuples(  # (charset, part_charset, fields, name, upload) for `multipart_with_charset`
    st.sampled_from(_CHARSETS), st.booleans(),
    st.dictionaries(st.sampled_from(["name", "ref_text", "x_vector_only", "speaker_embedding", "replace",
                                     "_charset_", "ref_audio"]), _form_text, max_size=4),
    _form_text | _valid_names, st.sampled_from([None, CLIP_BYTES, b"RIFF\x00\x00"]),
)


def multipart_with_charset(charset: str, part_charset: bool, fields: dict[str, str], name: str,
                           upload: bytes | None) -> tuple[bytes, str]:
    """A voice-upload form claiming `charset` in its Content-Type (and each part's, if `part_charset`)."""
    body = _multipart({"name": name, **fields}, charset, part_charset, upload)
    return body, f"multipart/form-data; boundary={_BOUNDARY}; charset={charset}"


@_FUZZ
@given(case=CHARSET_FUZZ)
def test_fuzz_multipart_with_client_chosen_charsets(fake_app, case):
    """A form naming any charset (header or part) is read as UTF-8 or refused: never a 5xx, never a stored
    name that is not valid UTF-8, and the listing keeps working after every case."""
    count_case("voices multipart_with_charset")
    http, _, _ = fake_app
    body, content_type = multipart_with_charset(*case)
    r = http.post(URL, content=body, headers={"content-type": content_type})
    check(r)
    if _codec_name(case[0]) not in ("utf-8", "ascii"):
        assert r.status_code == 415, r.text  # refused before the body is parsed with that charset
    listing = http.get(URL)
    assert listing.status_code == 200
    for voice in listing.json()["voices"]:
        voice["name"].encode("utf-8")  # raises on a lone surrogate
