"""The speech route's JSON body parser: pydantic-core's, with the standard library's answer wherever that one
refuses a body, so nothing the route accepted or refused before changes."""

from __future__ import annotations

import json
import re

import pytest

from legato.server import json_body
from legato.server.json_body import parse_json

BODIES = [
    b'{"input": "hi", "voice": "ryan", "temperature": 0.7, "seed": 12345678901234567890}',
    b' {"a": [1, 2.5, -0, 1e5, true, false, null], "b": {"c": "\\u00e9\\n"}} ',
    b'{"a": 1, "a": 2}',  # the last duplicate wins, as before
    b'{"a": Infinity, "b": 1.5e400}',
    b'\xef\xbb\xbf{"a": 1}',  # a UTF-8 byte-order mark: only json.loads takes it
    b'{"a": "\\ud800"}',  # a lone surrogate escape: only json.loads takes it
    '{"text": "naïve ☃"}'.encode(),
]


@pytest.mark.parametrize("body", BODIES)
def test_a_body_parses_as_json_loads_parses_it(body):
    assert parse_json(body) == json.loads(body)


@pytest.mark.parametrize("text", ['{"a": "\ud800"}', '{"a": "\udcff x"}', '{"text": "naïve ☃", "n": [1, 2.5]}'])
def test_a_text_message_parses_as_json_loads_parses_it(text):
    """A WebSocket's text arrives as a str, which may hold a lone surrogate (no UTF-8): pydantic-core refuses it."""
    assert parse_json(text) == json.loads(text)


@pytest.mark.parametrize("body", [b'{"input": ', b'{"a": 1,}', b'{"a": "x\x01y"}', b'{"a": 1} x', b""])
def test_a_bad_body_raises_json_loads_own_error(body):
    with pytest.raises(json.JSONDecodeError) as got:
        parse_json(body)
    with pytest.raises(json.JSONDecodeError) as want:
        json.loads(body)
    assert (got.value.msg, got.value.pos) == (want.value.msg, want.value.pos)


@pytest.mark.parametrize(("body", "needle"), [
    (b'{"input": "caf\xe9"}', "not UTF-8 text (byte 0xe9)"),
    (b'{"seed": ' + b"7" * 5000 + b"}", "a number of more than 4300 digits"),
    (b"[" * 100_000, "nested too deeply"),
])
def test_a_body_json_loads_refuses_otherwise_is_refused_as_bad_json(body, needle):
    """Not UTF-8, past the digit limit, past the recursion limit: json.loads raises no JSONDecodeError for these,
    and FastAPI answered them with its generic "There was an error parsing the body"."""
    with pytest.raises(json.JSONDecodeError, match=re.escape(needle)) as got:
        parse_json(body)
    assert got.value.pos == (14 if b"caf" in body else 0)  # characters before it, as for other bad JSON


def test_a_clip_sized_body_takes_the_fast_parser(monkeypatch):
    body = json.dumps({"input": "hi", "ref_audio": "data:audio/wav;base64," + "QUJD" * 130_000}).encode()
    monkeypatch.setattr(json_body.json, "loads", lambda *a, **k: pytest.fail("fell back to json.loads"))
    assert parse_json(body)["ref_audio"].endswith("QUJD")


def test_a_websocket_message_takes_the_fast_parser_and_keeps_json_loads_errors(monkeypatch):
    """The streaming-text socket's events (a session message may carry a clip inline) go through `parse_json`."""
    from legato.server.ws_protocol import ProtocolError, WsLimits, parse_event

    limits = WsLimits(max_message_bytes=2 * 1024 * 1024)
    raw = json.dumps({"type": "session.update", "session": {"ref_audio": "data:audio/wav;base64," + "QUJD" * 100_000}})
    bad = '{"type": "session.update", "session": {'
    with pytest.raises(json.JSONDecodeError) as want:
        json.loads(bad)
    with pytest.raises(ProtocolError) as got:
        parse_event(bad, limits)
    assert str(want.value)[:100] in str(got.value) and got.value.code == "invalid_json"
    monkeypatch.setattr(json_body.json, "loads", lambda *a, **k: pytest.fail("fell back to json.loads"))
    assert parse_event(raw, limits).session["ref_audio"].endswith("QUJD")
