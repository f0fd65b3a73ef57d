"""The streaming-text WebSocket end to end on a tiny model: audio equal to the HTTP request of the whole text,
concurrent contexts with barge-in cancel, bad messages answered with errors on a socket that stays usable, the
HTTP access rules, and bounded buffers for a client that stops reading."""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient
from server_helpers import local_client, server_settings, tiny_loaded
from starlette.websockets import WebSocketDisconnect
from ws_helpers import WsClient

from legato.pipeline.client import StreamChunk
from legato.server.app import build_app
from legato.server.ws_protocol import STREAM_PATH, WsLimits
from legato.server.ws_session import StreamSession

TEXT = "Streaming text arrives word by word, while the voice is already speaking it."


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return tiny_loaded(tmp_path_factory.mktemp("ws-models"), "custom_voice")


def make_app(loaded, limits: WsLimits | None = None, **settings):
    client = local_client(loaded, frames_per_text_token=2.0)
    settings = {"default_max_new_tokens": 40, "max_new_tokens_limit": 512, **settings}
    app = build_app(client, server_settings(loaded, **settings), ws_limits=limits)
    return app, client


def words(text: str) -> list[str]:
    parts = text.split(" ")
    return [p + " " for p in parts[:-1]] + parts[-1:]


def test_streamed_text_speaks_the_audio_of_the_whole_text(loaded):
    app, client = make_app(loaded)
    speaker = client.info.speakers[0]
    with TestClient(app) as http:
        whole = http.post("/v1/audio/speech", json={"input": TEXT, "voice": speaker, "response_format": "pcm",
                                                    "seed": 3, "stream": False, "non_streaming_mode": False})
        assert whole.status_code == 200, whole.text
        with http.websocket_connect(STREAM_PATH) as ws:
            c = WsClient(ws)
            c.send(type="session.update", session={"voice": speaker, "response_format": "pcm", "seed": 3})
            assert c.event("session.updated")["session"]["audio_transport"] == "binary"
            for w in words(TEXT):
                c.send(type="input_text.append", context_id="a", text=w)
            c.send(type="input_text.end", context_id="a")
            done = c.event("response.audio.done", "a")
            # base64 deltas, chosen in the session, carry the same audio
            c.send(type="session.update", session={"audio_transport": "base64"})
            c.event("session.updated")
            c.send(type="input_text.append", context_id="b", text=TEXT)
            c.send(type="input_text.end", context_id="b")
            deltas = bytearray()
            c.until(lambda m: m["type"] == "response.audio.delta" and deltas.extend(base64.b64decode(m["audio"]))
                    is None and False or m["type"] == "response.audio.done", "context b's audio")
            c.close_and_wait(http)
        assert bytes(c.audio["a"]) == whole.content
        assert bytes(deltas) == whole.content
        assert done["finish_reason"] == whole.headers["x-finish-reason"]
        assert done["usage"]["audio_seconds"] == pytest.approx(len(whole.content) / 2 / 24000, abs=1e-3)
        stats = client.stats()
        assert stats.free_kv_blocks == stats.num_kv_blocks
        metrics = http.get("/metrics").text
        assert "legato_ws_contexts 0.0" in metrics and "legato_ws_open_sockets 0.0" in metrics


def test_session_updated_echoes_a_reference_url_but_not_inline_data():
    from legato.server.ws_protocol import default_session, session_config, session_echo

    url = session_config({"ref_audio": "file:///voices/a.wav", "ref_text": "Hi."}, default_session())
    assert session_echo(url, 24000) == {"ref_audio": "file:///voices/a.wav", "ref_text": "Hi.",
                                        "response_format": "pcm", "audio_transport": "binary", "sample_rate": 24000}
    inline = session_config({"ref_audio": "UklGR" + "A" * 100, "speaker_embedding": [0.1, 0.2]}, url)
    echo = session_echo(inline, 24000)
    assert echo["omitted"] == ["ref_audio", "speaker_embedding"] and echo["ref_text"] == "Hi."
    assert "ref_audio" not in echo and "speaker_embedding" not in echo
    assert inline.speech.ref_audio.startswith("UklGR")  # only the echo leaves it out: the session keeps it


def test_session_null_clears_the_audio_transport_and_refuses_an_unknown_field():
    from legato.server.ws_protocol import ProtocolError, default_session, session_config

    sent_as_text = session_config({"audio_transport": "base64", "seed": 3}, default_session())
    cleared = session_config({"audio_transport": None}, sent_as_text)  # null clears a field, this one too
    assert cleared.transport == "binary" and cleared.speech.seed == 3
    with pytest.raises(ProtocolError) as refused:  # a misspelt field is refused whatever its value
        session_config({"sede": None}, sent_as_text)
    assert refused.value.code == "invalid_session" and refused.value.param == "sede"


def test_cancel_stops_one_context_and_leaves_the_other(loaded):
    app, client = make_app(loaded)
    speaker = client.info.speakers[0]
    with TestClient(app) as http, http.websocket_connect(STREAM_PATH) as ws:
        c = WsClient(ws)
        c.send(type="session.update", session={"voice": speaker, "seed": 1, "max_new_tokens": 400})
        c.event("session.updated")
        for cid in ("keep", "stop"):
            c.send(type="input_text.append", context_id=cid, text="Hello there, this is a long answer ")
        c.until(lambda m: m["type"] == "audio" and m["context_id"] == "stop", "audio of the context to stop")
        c.send(type="response.cancel", context_id="stop", event_id="e1")
        cancelled = c.event("response.cancelled", "stop")
        sent = len(c.audio["stop"])
        assert cancelled["audio_ms_sent"] == round(sent / 2 * 1000 / 24000)
        c.send(type="input_text.append", context_id="keep", text="and it goes on to its end.")
        c.send(type="input_text.end", context_id="keep")
        done = c.event("response.audio.done", "keep")
        assert done["finish_reason"] in ("stop", "length")
        assert len(c.audio["stop"]) == sent  # nothing of the cancelled context after its reply
        c.send(type="response.cancel", context_id="stop")  # gone now: an error, the socket stays
        assert c.event("error")["error"]["code"] == "unknown_context"
        deadline = time.monotonic() + 30
        while client.stats().free_kv_blocks != client.stats().num_kv_blocks:
            assert time.monotonic() < deadline, "KV blocks not given back"
            time.sleep(0.01)
        c.close_and_wait(http)
        metrics = http.get("/metrics").text
        assert "legato_ws_cancels_total 1.0" in metrics
        assert 'legato_engine_aborts_total{reason="cancelled"} 1.0' in metrics


BAD = [
    ("not json", "invalid_json"),
    ("[1, 2]", "invalid_event"),
    ('{"type": "nope"}', "unknown_event"),
    ('{"type": "input_text.append", "context_id": "bad id!", "text": "x"}', "invalid_context_id"),
    ('{"type": "input_text.append", "context_id": "a", "text": ""}', "invalid_event"),
    ('{"type": "input_text.append", "context_id": "a", "text": "x", "extra": 1}', "invalid_event"),
    ('{"type": "input_text.flush", "context_id": "never"}', "unknown_context"),
    ('{"type": "input_text.end", "context_id": "never"}', "unknown_context"),
    ('{"type": "response.cancel", "context_id": "never"}', "unknown_context"),
    ('{"type": "session.update", "session": {"temperature": "hot"}}', "invalid_session"),
    ('{"type": "session.update", "session": {"input": "x"}}', "invalid_session"),
    ('{"type": "session.update", "session": {"response_format": "flac"}}', "unsupported_format"),
    ('{"type": "session.update", "session": {"audio_transport": "carrier pigeon"}}', "invalid_session"),
    ('{"type": "session.update", "session": {"voice": "nobody"}, "event_id": "e"}', None),
    ('{"type": "input_text.append", "context_id": "big", "text": "' + "x" * 300 + '"}', "text_too_long"),
    ("x" * 3000, "message_too_large"),
]


def test_bad_messages_get_errors_and_the_socket_stays_usable(loaded):
    app, client = make_app(loaded, WsLimits(max_message_bytes=2048, max_text_chars=200, max_contexts=2))
    with TestClient(app) as http, http.websocket_connect(STREAM_PATH) as ws:
        c = WsClient(ws)
        for raw, code in BAD:
            ws.send_text(raw)
            if code is None:  # a session with an unknown voice is taken; its first context says why
                c.event("session.updated")
                continue
            err = c.event("error")
            assert err["error"]["code"] == code, raw
            assert set(err["error"]) == {"message", "type", "param", "code"}
        c.send(type="input_text.append", context_id="v", text="Hello there ", event_id="ev-7")
        err = c.event("error")
        assert err["context_id"] == "v" and err["event_id"] == "ev-7" and err["error"]["param"] == "voice"
        ws.send_bytes(b"\x00\x01")
        assert c.event("error")["error"]["code"] == "binary_not_accepted"
        c.send(type="session.update", session={"voice": client.info.speakers[0], "max_new_tokens": 400})
        c.event("session.updated")
        c.send(type="input_text.append", context_id="one", text="Hel")
        c.send(type="input_text.append", context_id="two", text="Hel")
        c.send(type="input_text.append", context_id="three", text="Hel")
        assert c.event("error")["error"]["code"] == "too_many_contexts"
        c.send(type="input_text.end", context_id="two")
        c.send(type="input_text.append", context_id="two", text="more")
        assert c.event("error")["error"]["code"] == "context_ended"
        c.send(type="input_text.append", context_id="one", text="lo " + "y" * 200)
        assert c.event("error")["error"]["code"] == "text_too_long"
        c.send(type="input_text.end", context_id="one")
        done = {"one", "two"}
        c.until(lambda _: {e.get("context_id") for e in c.events if e["type"] == "response.audio.done"} == done,
                "both contexts done")
        c.close_and_wait(http)
        metrics = http.get("/metrics").text
        assert 'legato_ws_refused_messages_total{code="unknown_context"} 3.0' in metrics


def test_a_context_of_invisible_or_control_characters_is_refused_as_http_refuses_blank_input(loaded):
    """Zero-width spaces or control characters are no text to speak: HTTP answers 400 "input is blank", and a
    context of only those ends with an error at its end instead of being synthesized (an outside probe found it
    spoken: 33 frames of noise for two zero-width spaces)."""
    app, client = make_app(loaded)
    with TestClient(app) as http, http.websocket_connect(STREAM_PATH) as ws:
        c = WsClient(ws)
        c.send(type="session.update", session={"voice": client.info.speakers[0], "max_new_tokens": 40})
        c.event("session.updated")
        for i, text in enumerate(("\u200b\u200b", "\u0001\u0002", " \u2060 ")):
            c.send(type="input_text.append", context_id=f"b{i}", text=text)
            c.send(type="input_text.end", context_id=f"b{i}")
            err = c.event("error")
            assert err["context_id"] == f"b{i}" and err["error"]["code"] == "empty_text", text
        # invisible characters ahead of real words are kept, as HTTP keeps them
        c.send(type="input_text.append", context_id="real", text="\u200bHello there.")
        c.send(type="input_text.end", context_id="real")
        c.until(lambda e: e["type"] == "response.audio.done" and e.get("context_id") == "real", "the real one done")
        assert not [e for e in c.events if e["type"] == "response.audio.done" and e["context_id"] != "real"]
        c.close_and_wait(http)
    blank = http.post("/v1/audio/speech", json={"input": "\u200b\u200b", "voice": client.info.speakers[0]})
    assert blank.status_code == 400 and "blank" in blank.json()["error"]["message"]


def test_a_session_update_leaves_a_running_context_s_audio_transport_alone(loaded):
    """session.update applies to contexts started after it: a context that began with binary audio frames keeps
    them to its end after the session switches to base64 events, which the next context gets."""
    app, client = make_app(loaded)
    with TestClient(app) as http, http.websocket_connect(STREAM_PATH) as ws:
        c = WsClient(ws)
        c.send(type="session.update", session={"voice": client.info.speakers[0], "max_new_tokens": 60})
        c.event("session.updated")
        c.send(type="input_text.append", context_id="c1", text="Hello there, this is the first ")
        c.until(lambda m: m["type"] == "audio" and m["context_id"] == "c1", "c1's first audio")
        c.send(type="session.update", session={"voice": client.info.speakers[0], "max_new_tokens": 60,
                                               "audio_transport": "base64"})
        c.event("session.updated")
        c.send(type="input_text.append", context_id="c1", text="context, still speaking.")
        c.send(type="input_text.end", context_id="c1")
        c.event("response.audio.done", "c1")
        c.send(type="input_text.append", context_id="c2", text="And a second one.")
        c.send(type="input_text.end", context_id="c2")
        c.event("response.audio.done", "c2")
        c.close_and_wait(http)
    deltas = [e["context_id"] for e in c.events if e["type"] == "response.audio.delta"]
    assert "c1" not in deltas and "c2" in deltas and "c2" not in c.audio and len(c.audio["c1"]) > 0


def test_access_rules_are_those_of_http(loaded):
    app, _ = make_app(loaded, api_keys=("k1",), allowed_origins=("https://app.example",))
    with TestClient(app) as http:
        for headers in ({}, {"Authorization": "Bearer wrong"},
                        {"Authorization": "Bearer k1", "Origin": "https://evil.example"}):
            with pytest.raises(WebSocketDisconnect) as e, http.websocket_connect(STREAM_PATH, headers=headers):
                pass
            assert e.value.code == 1008
        with http.websocket_connect(STREAM_PATH, headers={"Authorization": "Bearer k1",
                                                          "Origin": "https://app.example"}) as ws:
            c = WsClient(ws)
            c.send(type="session.update", session={})
            c.event("session.updated")
            c.close_and_wait(http)


def test_an_idle_socket_is_closed(loaded):
    app, _ = make_app(loaded, WsLimits(idle_timeout_s=0.2))
    with TestClient(app) as http, http.websocket_connect(STREAM_PATH) as ws:
        c = WsClient(ws, timeout_s=30)
        assert c.receive() == {"type": "close", "code": 1000, "reason": "idle timeout"}
        c.close_and_wait(http)


def test_a_context_waiting_for_the_engine_keeps_its_socket_open_past_the_idle_timeout(loaded):
    """A context whose text has ended waits on the engine, not on its client: a socket with such a context is not
    idle even when nothing moves for longer than the idle timeout (a request queued behind a full batch). Once
    its audio is done, the idle timeout applies again. Before, the socket was closed under the waiting request."""
    _, client = make_app(loaded)

    class SlowFirstAudio:  # the engine client, holding each request's first chunk until `gate` opens
        def __init__(self, inner, gate: asyncio.Event) -> None:
            self._inner, self._gate = inner, gate

        def __getattr__(self, name):
            return getattr(self._inner, name)

        def generate(self, synthesis):
            return self._held(self._inner.generate(synthesis))  # the request takes text from this call on

        async def _held(self, inner):
            try:
                first = await inner.__anext__()
                await self._gate.wait()
                yield first
                async for chunk in inner:
                    yield chunk
            finally:
                await inner.aclose()

    async def main():
        await client.start()
        from legato.server.metrics import ServerMetrics
        from legato.server.speech import SpeechService

        gate = asyncio.Event()
        slow = SlowFirstAudio(client, gate)
        settings = server_settings(loaded, default_max_new_tokens=40, max_new_tokens_limit=512)
        inbox: asyncio.Queue = asyncio.Queue()
        sent: list = []
        closed: list = []

        async def send(data) -> None:
            sent.append(data)

        async def close(code, reason) -> None:
            closed.append((code, reason))
            await inbox.put({"type": "websocket.disconnect"})

        session = StreamSession(slow, SpeechService(slow, settings, None), ServerMetrics(client),
                                WsLimits(idle_timeout_s=0.2), inbox.get, send, send, close)
        run = asyncio.create_task(session.run())
        for event in ({"type": "session.update", "session": {"voice": client.info.speakers[0]}},
                      {"type": "input_text.append", "context_id": "a", "text": "Hello there, how are you?"},
                      {"type": "input_text.end", "context_id": "a"}):
            await inbox.put({"type": "websocket.receive", "text": json.dumps(event)})
        await asyncio.sleep(1.0)  # five idle timeouts with nothing sent: the watchdog had every chance to close
        held = list(closed)
        gate.set()
        deadline = time.monotonic() + 60
        while not closed:  # the audio, its done event, then the idle close once nothing runs
            assert time.monotonic() < deadline, "the socket was never closed for idleness"
            await asyncio.sleep(0.01)
        await asyncio.wait_for(run, 30)
        await client.stop()
        return held, closed, sent

    held, closed, sent = asyncio.run(main())
    assert held == []
    assert closed == [(1000, "idle timeout")]
    done = [json.loads(m) for m in sent if isinstance(m, str) and "response.audio.done" in m]
    assert len(done) == 1 and done[0]["finish_reason"] in ("stop", "length")
    assert any(isinstance(m, bytes) for m in sent)


def test_a_client_that_stops_reading_is_closed_and_its_requests_freed(loaded):
    """The outbox holds `send_queue` messages; a client that takes none for `send_timeout_s` is closed (1008)
    and its contexts aborted: nothing buffers without bound."""
    _, client = make_app(loaded)

    async def main():
        await client.start()
        from legato.server.metrics import ServerMetrics
        from legato.server.speech import SpeechService

        settings = server_settings(loaded, default_max_new_tokens=400, max_new_tokens_limit=512)
        inbox: asyncio.Queue = asyncio.Queue()
        closed: list = []
        never = asyncio.Event()

        async def stuck_send(_data) -> None:
            await never.wait()  # a client whose socket buffer is full: the send never completes

        async def close(code, reason) -> None:
            closed.append((code, reason))
            await inbox.put({"type": "websocket.disconnect"})

        session = StreamSession(client, SpeechService(client, settings, None), ServerMetrics(client),
                                WsLimits(send_queue=4, send_timeout_s=0.5), inbox.get, stuck_send, stuck_send, close)
        for event in ({"type": "session.update", "session": {"voice": client.info.speakers[0]}},
                      {"type": "input_text.append", "context_id": "a", "text": "Hello there, a long text "}):
            await inbox.put({"type": "websocket.receive", "text": json.dumps(event)})
        await asyncio.wait_for(session.run(), 60)
        deadline = time.monotonic() + 30
        while client.stats().free_kv_blocks != client.stats().num_kv_blocks or client.stats().running:
            assert time.monotonic() < deadline, "the slow client's request was not freed"
            await asyncio.sleep(0.01)
        await client.stop()
        return closed, session

    closed, session = asyncio.run(main())
    assert closed == [(1008, "client is not reading its messages")]
    assert not session.contexts and session._outbox.qsize() <= 4
    assert np.isfinite(session.limits.send_timeout_s)


def test_a_client_that_sends_but_never_reads_its_error_replies_is_closed_without_an_exception(loaded):
    """Replies to the client's own messages (errors here) fill the outbox as audio would: the socket is closed
    with 1008 once, and nothing escapes the session to the ASGI server (which would log a traceback)."""
    _, client = make_app(loaded)

    async def main():
        from legato.server.metrics import ServerMetrics
        from legato.server.speech import SpeechService

        inbox: asyncio.Queue = asyncio.Queue()
        closed: list = []
        never = asyncio.Event()

        async def stuck_send(_data) -> None:
            await never.wait()

        async def close(code, reason) -> None:
            closed.append((code, reason))
            await inbox.put({"type": "websocket.disconnect"})

        session = StreamSession(client, SpeechService(client, server_settings(loaded), None), ServerMetrics(client),
                                WsLimits(send_queue=2, send_timeout_s=0.3), inbox.get, stuck_send, stuck_send, close)
        for _ in range(20):
            await inbox.put({"type": "websocket.receive", "text": '{"type": "no.such.event"}'})
        await asyncio.wait_for(session.run(), 30)  # returns: no SlowClient out of run()
        return closed

    assert asyncio.run(main()) == [(1008, "client is not reading its messages")]


def test_streamed_text_past_the_engines_text_buffer_is_the_clients_error(loaded):
    client = local_client(loaded, frames_per_text_token=2.0, max_text_tokens=24)
    app = build_app(client, server_settings(loaded, default_max_new_tokens=40, max_new_tokens_limit=512))
    with TestClient(app) as http, http.websocket_connect(STREAM_PATH) as ws:
        c = WsClient(ws)
        c.send(type="session.update", session={"voice": "serena", "max_new_tokens": 400})
        c.event("session.updated")
        c.send(type="input_text.append", context_id="a", text="Hello there. ")
        for _ in range(8):
            c.send(type="input_text.append", context_id="a", text="and more words to say, ")
        c.send(type="input_text.end", context_id="a")
        err = c.until(lambda e: e["type"] == "error", "the overflow error", errors_ok=True)
        assert err["context_id"] == "a" and err["error"]["code"] == "text_too_long"
        assert err["error"]["type"] == "invalid_request_error" and "max_text_tokens" in err["error"]["message"]
        c.close_and_wait(http)


@pytest.mark.parametrize("error, code, event", [
    ("the text outgrew the buffer", "text_too_long", (400, "text_too_long", "text")),
    ("streamed text exceeds max_text_tokens=24 (as a message alone)", None, (500, "synthesis_failed", None)),
])
def test_a_failed_context_is_the_clients_error_by_the_chunks_code_not_its_message(error, code, event):
    """The session reports a context's failure as the client's 400 `text_too_long` by the code its last chunk
    carries; a message that reads like it, without the code, is the server's failure."""
    from server_helpers import FakeClient

    class TextClient(FakeClient):
        takes_text_input = True

        async def append_text(self, request_id: str, text: str, close: bool = False) -> None:
            pass

    end = StreamChunk(np.zeros(0, np.float32), 0, finished=True, finish_reason="error", error=error, error_code=code)
    app = build_app(TextClient(lambda req: [end]), server_settings())
    with TestClient(app) as http, http.websocket_connect(STREAM_PATH) as ws:
        c = WsClient(ws)
        c.send(type="session.update", session={"voice": "ryan"})
        c.event("session.updated")
        c.send(type="input_text.append", context_id="a", text="Hello there.")
        c.send(type="input_text.end", context_id="a")
        err = c.until(lambda e: e["type"] == "error", "the failure", errors_ok=True)
        assert err["context_id"] == "a"
        assert (err["error"]["code"], err["error"]["param"]) == event[1:]
        assert err["error"]["type"] == ("invalid_request_error" if event[0] == 400 else "server_error")
        c.close_and_wait(http)


def _open_context_until_it_times_out(ws, client) -> tuple[WsClient, int]:
    """Opens context "a" with text that stays open, on an app whose request timeout is 0.5 s, and reads up to its
    504 `timeout` error; returns the socket's client and the engine's decode rows before the context."""
    c = WsClient(ws)
    c.send(type="session.update", session={"voice": client.info.speakers[0]})
    c.event("session.updated")
    rows_before = client.stats().decode_rows
    c.send(type="input_text.append", context_id="a", text="Hello there, ")  # the text stays open
    err = c.until(lambda e: e["type"] == "error", "the timeout error", errors_ok=True)
    assert err["context_id"] == "a" and err["error"]["code"] == "timeout"
    assert "timed out after 0.5 s" in err["error"]["message"]
    return c, rows_before


def test_a_context_is_bounded_by_the_request_timeout_as_an_http_request_is(loaded):
    """--request-timeout aborts a context as it aborts an HTTP request: a context whose text never ends (a client
    keeping it open) gets a 504 `timeout` error and its request leaves the engine. Before, it ran on, holding its
    decode slot and KV blocks for as long as the client kept the socket busy."""
    app, client = make_app(loaded, request_timeout_s=0.5)
    with TestClient(app) as http, http.websocket_connect(STREAM_PATH) as ws:
        c, rows_before = _open_context_until_it_times_out(ws, client)
        deadline = time.monotonic() + 60
        while (s := client.stats()).running or s.waiting or s.free_kv_blocks != s.num_kv_blocks:
            assert time.monotonic() < deadline, f"the timed-out request still holds the engine: {s}"
            time.sleep(0.01)
        c.send(type="input_text.end", context_id="a")  # the context is gone
        reply = c.until(lambda e: e["type"] == "error", "the reply", errors_ok=True)
        assert reply["error"]["code"] == "unknown_context"
        c.close_and_wait(http)
        assert 'legato_request_aborts_total{reason="timeout"} 1.0' in http.get("/metrics").text
        # The engine heard why, not the cancelled pull's "client disconnected". On a loaded machine the 0.5 s can
        # run out while the request is still being admitted: then it never reaches the engine, which aborts
        # nothing (the next test holds admission to prove that path). A request that was decoded was in the engine.
        s = client.stats()
        assert s.aborted == {"timeout": 1} or (s.aborted == {} and s.decode_rows == rows_before), s


def test_a_context_timed_out_while_its_request_is_admitted_never_reaches_the_engine(loaded):
    """The timeout can fire before the request is admitted (its prompt still being built on the admission
    thread, on a busy machine): the client gets the same 504, and the request, once built, is dropped there
    instead of running to its frame cap for nobody, holding a slot and its blocks."""
    app, client = make_app(loaded, request_timeout_s=0.5)
    release, built = threading.Event(), threading.Event()
    build = client._engine_request

    def held_build(*args, **kwargs):  # admission thread: held until the client has had its timeout
        assert release.wait(60), "the test never released admission"
        try:
            return build(*args, **kwargs)
        finally:
            built.set()

    client._engine_request = held_build
    try:
        with TestClient(app) as http, http.websocket_connect(STREAM_PATH) as ws:
            c, rows_before = _open_context_until_it_times_out(ws, client)
            release.set()
            assert built.wait(60), "admission never finished the request"
            # Admission finished the request after its timeout; the context is gone, so a later message on it is
            # refused.
            c.send(type="input_text.end", context_id="a")
            assert c.until(lambda e: e["type"] == "error", "the reply", errors_ok=True)["error"]["code"] == \
                "unknown_context"
            c.close_and_wait(http)
            s = client.stats()
            assert s.aborted == {} and s.decode_rows == rows_before and not s.running and not s.waiting, s
            assert s.free_kv_blocks == s.num_kv_blocks
            assert 'legato_request_aborts_total{reason="timeout"} 1.0' in http.get("/metrics").text
    finally:
        release.set()


def test_a_session_update_with_audio_options_http_would_refuse_is_refused_then(loaded):
    app, _ = make_app(loaded)
    with TestClient(app) as http, http.websocket_connect(STREAM_PATH) as ws:
        c = WsClient(ws)
        for session, code in (({"sample_rate": 7}, "unsupported_sample_rate"),
                              ({"response_format": "pcm", "mp3_bitrate": 128}, "unsupported_bitrate")):
            c.send(type="session.update", session=session, event_id="ev")
            err = c.event("error")
            assert err["error"]["code"] == code and err["event_id"] == "ev", session
        c.send(type="session.update", session={"voice": "serena", "sample_rate": 16000})
        assert c.event("session.updated")["session"]["sample_rate"] == 16000
        c.send(type="session.update", session={"speed": 2.0, "response_format": "wav"})
        assert c.event("session.updated")["session"]["speed"] == 2.0
        c.send(type="session.update", session={"speed": None, "response_format": None})  # null: the defaults
        cleared = c.event("session.updated")["session"]
        assert cleared.get("speed", 1.0) == 1.0 and cleared["response_format"] == "pcm"
        c.close_and_wait(http)


def test_a_topology_without_text_input_refuses_a_context():
    from server_helpers import FakeClient

    app = build_app(FakeClient(lambda req: []), server_settings())
    with TestClient(app) as http, http.websocket_connect(STREAM_PATH) as ws:
        c = WsClient(ws)
        c.send(type="input_text.append", context_id="a", text="Hello there ")
        err = c.event("error")
        assert err["error"]["code"] == "unsupported_topology" and err["context_id"] == "a"
        c.send(type="input_text.append", context_id="a", text="again ")  # the context is gone: a new one, refused
        assert c.event("error")["error"]["code"] == "unsupported_topology"
        c.close_and_wait(http)


def test_a_plain_http_get_on_the_websocket_path_is_426_upgrade_required():
    """A browser or curl opening the stream URL without the handshake learns the route speaks WebSocket, in the
    server's error shape, instead of a 404 that says there is no such route."""
    from server_helpers import FakeClient

    with TestClient(build_app(FakeClient(lambda req: []), server_settings())) as http:
        for method in ("GET", "HEAD"):
            r = http.request(method, STREAM_PATH)
            assert r.status_code == 426, (method, r.text)
            assert r.headers["upgrade"] == "websocket" and "upgrade" in r.headers["connection"].lower()
        err = http.get(STREAM_PATH).json()["error"]
        assert err["code"] == "upgrade_required" and err["type"] == "invalid_request_error"
        assert "WebSocket" in err["message"] and STREAM_PATH in err["message"]


def test_a_draining_server_refuses_new_sockets(loaded):
    app, _ = make_app(loaded)
    with TestClient(app) as http:
        http.portal.call(app.state.lifecycle.begin_drain)  # on the app's loop, as a signal handler would
        with pytest.raises(WebSocketDisconnect) as e, http.websocket_connect(STREAM_PATH):
            pass
        assert e.value.code == 1013


def test_a_running_context_counts_in_flight_so_the_drain_lets_it_finish(loaded):
    """SIGTERM drains: requests in flight get the grace. A streaming-text context is one: the drain waits for it
    (the server then closes the socket), instead of finding nothing in flight and letting the socket be closed at
    once with no final event (an outside probe saw 1012 within 60 ms of the signal, no audio after it)."""
    app, client = make_app(loaded)
    lifecycle = app.state.lifecycle
    with TestClient(app) as http, http.websocket_connect(STREAM_PATH) as ws:
        c = WsClient(ws)
        c.send(type="session.update", session={"voice": client.info.speakers[0], "num_frames": 40,
                                               "ignore_eos": True})
        c.event("session.updated")
        assert lifecycle.in_flight == 0
        c.send(type="input_text.append", context_id="t", text="Hello there, this runs through the drain.")
        c.send(type="input_text.end", context_id="t")
        c.until(lambda m: m["type"] == "audio" and m["context_id"] == "t", "its first audio")
        assert lifecycle.in_flight == 1
        http.portal.call(lifecycle.begin_drain)  # as the first SIGTERM does
        assert not http.portal.call(lifecycle.wait_idle, 0.0)  # the drain has something to wait for
        done = c.event("response.audio.done", "t")
        assert done["finish_reason"] == "length" and done["usage"]["frames"] == 40  # it ran to its end
        deadline = time.monotonic() + 30
        while lifecycle.in_flight and time.monotonic() < deadline:
            time.sleep(0.01)
        assert lifecycle.in_flight == 0 and http.portal.call(lifecycle.wait_idle, 5.0)
        c.close_and_wait(http)


def test_a_context_the_drain_ends_at_its_grace_gets_an_error_not_a_done(loaded):
    """At the drain's grace the engine aborts what still runs; HTTP answers such a request 503 (SSE: an error
    event). A streaming-text context got `response.audio.done` with finish_reason "abort", read as the end of a
    turn by clients that look only at the event's type (the example client printed it as a success)."""
    app, client = make_app(loaded, shutdown_grace_s=0.2)
    lifecycle = app.state.lifecycle
    with TestClient(app) as http, http.websocket_connect(STREAM_PATH) as ws:
        c = WsClient(ws)
        c.send(type="session.update", session={"voice": client.info.speakers[0]})
        c.event("session.updated")
        c.send(type="input_text.append", context_id="t", text="Hello there, ")  # its text never ends
        c.until(lambda m: m["type"] == "audio" and m["context_id"] == "t", "its first audio")
        http.portal.call(lifecycle.begin_drain)  # as the first SIGTERM does: the engine stops at the grace
        end = c.until(lambda m: m["type"] in ("error", "response.audio.done"), "the context's end", errors_ok=True)
        assert end["type"] == "error" and end["context_id"] == "t", end
        assert end["error"]["code"] == "shutting_down" and end["error"]["type"] == "service_unavailable_error"


def test_the_servers_websocket_limits_come_from_its_settings_and_flags(loaded):
    """`legato serve --ws-*` reach the socket through ServerSettings; out-of-range values are refused naming
    the flag, before anything loads."""
    import argparse

    from legato.server.cli import ws_settings

    flags = argparse.Namespace(ws_max_message_bytes=4096, ws_max_contexts=1, ws_idle_timeout=0.3, ws_send_queue=8,
                               ws_send_timeout=2.0)
    app, client = make_app(loaded, **ws_settings(flags))
    with TestClient(app) as http, http.websocket_connect(STREAM_PATH) as ws:
        c = WsClient(ws)
        c.send(type="session.update", session={"voice": client.info.speakers[0]})
        c.event("session.updated")
        c.send(type="input_text.append", context_id="one", text="Hel")
        c.send(type="input_text.append", context_id="two", text="Hel")
        assert c.event("error")["error"]["code"] == "too_many_contexts"  # one context at a time
        c.send(type="input_text.append", context_id="one", text="x" * 5000)
        assert c.event("error")["error"]["code"] == "message_too_large"
        c.send(type="response.cancel", context_id="one")
        # idle 0.3 s once nothing runs: the socket is closed by the server
        closed = c.until(lambda m: m["type"] == "close", "the idle close")
        assert closed["reason"] == "idle timeout"
        c.close_and_wait(http)
    for name, value in (("ws_max_contexts", 0), ("ws_max_message_bytes", -1), ("ws_send_queue", 0),
                        ("ws_idle_timeout", 0.0), ("ws_send_timeout", float("inf"))):
        bad = argparse.Namespace(**{**vars(flags), name: value})
        with pytest.raises(ValueError, match="--" + name.replace("_", "-")):
            ws_settings(bad)
    with pytest.raises(ValueError, match="WebSocket limits"):
        server_settings(loaded, ws_max_contexts=0)
