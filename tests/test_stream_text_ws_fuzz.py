"""Hostile sequences on the streaming-text WebSocket: bad JSON, unknown events, events out of order, huge texts,
binary where text is expected, cancels of unknown contexts, abrupt closes. Each sequence runs beside a control
context that must finish untouched; afterwards the socket still answers, no event is a server error, and every
slot, KV block and context is back. `LEGATO_FUZZ_EXAMPLES` sets the number of sequences (fuzz_scale.py)."""

from __future__ import annotations

import json
import random
import time

import pytest
from fastapi.testclient import TestClient
from fuzz_scale import count_case, fuzz_examples
from server_helpers import local_client, server_settings, tiny_loaded
from ws_helpers import WsClient

from legato.server.app import build_app
from legato.server.ws_protocol import STREAM_PATH, WsLimits

TYPES = ["session.update", "input_text.append", "input_text.flush", "input_text.end", "response.cancel"]


def hostile(rng: random.Random) -> tuple[str, str | bytes]:
    """One message and its label."""
    cid = rng.choice(["x", "y", "z", "control", "", "bad id", "é", "x" * 70, 5, None])
    kind = rng.choice([*TYPES, "nope", "", None, 3])
    roll = rng.random()
    if roll < 0.08:
        return "binary", bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
    if roll < 0.16:
        return "junk", rng.choice(["", "{", "null", "[]", '"s"', "1e999", "{" * 50, '{"type": }', "\udcff"])
    if roll < 0.22:
        text = "w " * rng.randrange(200, 900)
        return "huge", json.dumps({"type": "input_text.append", "context_id": "x", "text": text})
    event: dict = {"type": kind}
    if rng.random() < 0.9:
        event["context_id"] = cid
    if kind == "input_text.append" or rng.random() < 0.1:
        event["text"] = rng.choice(["Hello ", "there, ", "wor", "ld. ", "", " ", "\n", 7, None, "你好，", "🎉 "])
    if kind == "session.update" or rng.random() < 0.05:
        event["session"] = rng.choice([{}, {"voice": "nobody"}, {"temperature": -1}, {"input": "x"}, "s",
                                       {"audio_transport": "base64"}, {"response_format": "flac"},
                                       {"max_new_tokens": 10 ** 9}, {"seed": -3}, {"non_streaming_mode": True}])
    if rng.random() < 0.1:
        event["event_id"] = rng.choice(["e1", "", "x" * 200, 3])
    if rng.random() < 0.05:
        event["surprise"] = True
    return f"event:{kind}", json.dumps(event)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return tiny_loaded(tmp_path_factory.mktemp("ws-fuzz-models"), "custom_voice")


def test_hostile_sequences_leave_the_server_and_other_contexts_unharmed(loaded):
    client = local_client(loaded)
    settings = server_settings(loaded, default_max_new_tokens=6, max_new_tokens_limit=64, max_input_chars=600)
    app = build_app(client, settings, ws_limits=WsLimits(max_message_bytes=4096, max_contexts=4))
    speaker = client.info.speakers[0]
    with TestClient(app) as http:
        for seed in range(fuzz_examples()):
            rng = random.Random(seed)
            with http.websocket_connect(STREAM_PATH) as ws:
                c = WsClient(ws)
                c.send(type="session.update", session={"voice": speaker, "max_new_tokens": 6})
                c.event("session.updated")
                c.send(type="input_text.append", context_id="control", text="A control context ")
                for _ in range(rng.randrange(1, 25)):
                    label, msg = hostile(rng)
                    count_case(f"ws:{label}")
                    (ws.send_bytes if isinstance(msg, bytes) else ws.send_text)(msg)
                abrupt = rng.random() < 0.2
                if not abrupt:
                    # the socket still answers, and the control context ends as asked (unless the sequence
                    # cancelled or ended it: then its own reply is there)
                    c.send(type="session.update", session={"voice": speaker, "audio_transport": "binary"},
                           event_id="sentinel")
                    c.until(lambda m: m["type"] == "session.updated" or
                            (m["type"] == "error" and m.get("event_id") == "sentinel"), "the sentinel", errors_ok=True)
                    c.send(type="input_text.end", context_id="control")
                    c.until(lambda m: m.get("context_id") == "control" and m["type"] in (
                            "response.audio.done", "response.cancelled", "error"), "the control context's end",
                        errors_ok=True)
                    errors = [e for e in c.events if e["type"] == "error"]
                    assert all(e["error"]["type"] != "server_error" for e in errors), (seed, errors)
                c.close_and_wait(http)  # abrupt: closed with the messages sent to it unread
        deadline = time.monotonic() + 60
        while True:
            s = client.stats()
            metrics = http.get("/metrics").text
            if (s.running == s.waiting == 0 and s.free_kv_blocks == s.num_kv_blocks
                    and "legato_ws_contexts 0.0" in metrics and "legato_ws_open_sockets 0.0" in metrics):
                break
            assert time.monotonic() < deadline, (s, [m for m in metrics.splitlines() if "legato_ws" in m])
            time.sleep(0.02)
        assert client.is_alive()
