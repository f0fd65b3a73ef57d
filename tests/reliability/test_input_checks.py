"""Input an outside probe sent that the checks let through or answered wrongly (issue 20): a bad
response_format whose error listed the refused aac, an input of invisible characters that was synthesized,
a gzip body parsed as plain JSON, a Host with userinfo that passed the loopback check, OpenAI voice names
refused on a model without their target voices, and /metrics hidden behind the API key."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from server_helpers import FakeClient, frames_chunk, server_settings

from legato.server.app import build_app

SPEECH = {"input": "Hello there.", "voice": "ryan", "stream": False, "response_format": "wav"}


def one_frame(req):
    return [frames_chunk(1, 1, True, "stop")]


def app(script=one_frame, client=None, **settings) -> TestClient:
    return TestClient(build_app(client or FakeClient(script), server_settings(**settings), None))


def assert_error(resp, status: int, code: str, *needles: str) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code and err["type"], err
    for needle in needles:
        assert needle in err["message"], err["message"]
    return err


@pytest.mark.parametrize("fmt", ["ogg", "MP3", 3, None, ["mp3"]])
def test_a_bad_format_lists_only_the_formats_that_work(fmt):
    with app() as c:
        err = assert_error(c.post("/v1/audio/speech", json={**SPEECH, "response_format": fmt}), 400,
                           "invalid_request", "mp3, opus, wav, pcm, flac")
    assert "aac" not in err["message"] and err["param"] == "response_format"


def test_aac_is_refused_with_its_reason():
    with app() as c:
        assert_error(c.post("/v1/audio/speech", json={**SPEECH, "response_format": "aac"}), 400,
                     "unsupported_format", "no AAC encoder")
