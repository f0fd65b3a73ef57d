"""Stored user data obeys a request's rules: an upload cannot poison the voice list (the probe's charset +
lone-surrogate upload), and a bad voice file found at start-up is quarantined, never served."""

from __future__ import annotations

import json

import torch
from fastapi import FastAPI
from fastapi.testclient import TestClient
from safetensors.torch import save_file
from voice_helpers import CLIP, HIDDEN, FakeClient

from legato.server.errors import install_error_handlers
from legato.server.media import MediaPolicy
from legato.server.voices import QUARANTINE_DIR, VoiceStore
from legato.server.voices_api import build_voices_router

URL = "/v1/audio/voices"


def app_for(store: VoiceStore) -> TestClient:
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(build_voices_router(store, MediaPolicy(max_bytes=1 << 22)))
    return TestClient(app)


def multipart(fields: dict[str, bytes], charset: str | None) -> tuple[bytes, dict[str, str]]:
    """A hand-built form body: the probe's clients choose the charset parameter themselves."""
    boundary = "legatoBoundary7"
    parts = []
    for name, value in fields.items():
        disposition = f'form-data; name="{name}"'
        if name == "file":
            disposition += '; filename="v.wav"'
        parts.append(f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + value + b"\r\n")
    body = b"".join(parts) + f"--{boundary}--\r\n".encode()
    ctype = f"multipart/form-data; boundary={boundary}" + (f"; charset={charset}" if charset else "")
    return body, {"content-type": ctype}


def test_the_probes_poisoned_upload_is_refused_and_the_list_stays_healthy(tmp_path):
    store = VoiceStore(tmp_path / "voices", FakeClient())
    http = app_for(store)
    clip = CLIP.read_bytes()
    body, headers = multipart({"name": b"poison", "ref_text": b"\\ud800 hello", "file": clip}, "unicode_escape")
    resp = http.post(URL, content=body, headers=headers)
    assert resp.status_code == 415 and "UTF-8" in resp.json()["error"]["message"], resp.text
    assert http.get(URL).status_code == 200 and len(store) == 0
    # The same bytes as UTF-8 are a literal backslash: harmless text, stored and listed as sent.
    body, headers = multipart({"name": b"literal", "ref_text": b"\\ud800 hello", "file": clip}, "utf-8")
    assert http.post(URL, content=body, headers=headers).status_code == 201
    listed = http.get(URL).json()["voices"]
    assert [v["ref_text"] for v in listed] == ["\\ud800 hello"]
    # A JSON escape is a real lone surrogate: refused like a speech request's text.
    raw = b'{"name": "j", "ref_audio": "data:audio/wav;base64,AAAA", "ref_text": "\\ud800 x"}'
    resp = http.post(URL, content=raw, headers={"content-type": "application/json"})
    assert resp.status_code == 400 and len(store) == 1, resp.text
    for charset in ("latin-1", "utf-16", "no-such-codec"):
        body, headers = multipart({"name": b"x", "file": clip}, charset)
        assert http.post(URL, content=body, headers=headers).status_code == 415
    print(f"\npoisoned upload: 415; list after it: 200 with {len(store)} voice(s)")


def test_loose_form_and_json_booleans_are_refused(tmp_path):
    http = app_for(VoiceStore(tmp_path / "voices", FakeClient()))
    emb = json.dumps([0.1] * HIDDEN)
    assert http.post(URL, json={"name": "a", "speaker_embedding": [0.1] * HIDDEN, "replace": "yes"}).status_code == 400
    assert http.post(URL, data={"name": "a", "speaker_embedding": emb, "replace": "yes"}).status_code == 400
    assert http.post(URL, data={"name": "a", "speaker_embedding": emb, "replace": "true"}).status_code == 201


def write_voice(root, key: str, name: str, ref_text: object, with_code: bool = True) -> None:
    tensors = {"speaker_embedding": torch.zeros(HIDDEN)}
    if with_code:
        tensors["ref_code"] = torch.zeros(3, 16, dtype=torch.int64)
    meta = {"format": "1", "name": name, "created_at": "1.0", "source": "audio", "ref_text": json.dumps(ref_text)}
    save_file(tensors, str(root / f"{key}.safetensors"), metadata=meta)


def test_bad_voice_files_are_quarantined_at_start_up(tmp_path, caplog):
    root = tmp_path / "voices"
    root.mkdir()
    write_voice(root, "good", "good", "hello there")
    write_voice(root, "surrogate", "surrogate", "\ud800")  # what the old server stored for the probe
    write_voice(root, "huge", "huge", "x" * 5000)
    write_voice(root, "codeless", "codeless", None)  # reference codes without their transcript
    (root / "garbage.safetensors").write_bytes(b"not a safetensors file")
    store = VoiceStore(root, FakeClient())
    assert [v.name for v in store.list()] == ["good"]
    quarantined = sorted(p.name.split(".")[0] for p in (root / QUARANTINE_DIR).iterdir())
    assert quarantined == ["codeless", "garbage", "huge", "surrogate"]
    assert [p.name for p in root.glob("*.safetensors")] == ["good.safetensors"]
    assert sum("quarantined voice file" in r.message for r in caplog.records) == 4
    http = app_for(store)
    assert http.get(URL).status_code == 200
    # A restart finds a clean store: nothing is quarantined twice, the good voice is still there.
    again = VoiceStore(root, FakeClient())
    assert [v.name for v in again.list()] == ["good"]
