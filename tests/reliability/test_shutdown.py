"""SIGTERM/SIGINT on a real `legato serve` process: new work is refused at once, streams get the grace, the
requests still running at its end get their format's error ending (counted as shutdown 503s, not client
disconnects), the process exits 0 with a clean log, and a second signal exits at once.

Every wait polls against a generous hang guard: nothing here assumes how fast the loaded box runs."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
from serve_process import LONG, ServeProcess, raw_request, read_head, read_to_eof, speech_body
from server_helpers import wait_until

pytestmark = pytest.mark.slow

DIRTY = ("Traceback", "CancelledError", "Exception in ASGI application", "returned without completing")


def _open_stream(srv: ServeProcess, rid: str, frames: int, sse: bool):
    """A speech stream whose response head (and first audio) has arrived: it is running in the engine."""
    sock = raw_request(srv.port, "POST", "/v1/audio/speech", json.dumps(speech_body(frames, sse=sse)).encode(),
                       {"Content-Type": "application/json", "X-Request-Id": rid})
    status, rest = read_head(sock)
    assert status == 200
    while not rest:
        rest += sock.recv(65536)
    return sock, rest


def _events(body: bytes) -> list[dict]:
    """The SSE events of a body (chunked framing included: events are found by their `data: ` lines)."""
    events = []
    for line in body.split(b"\n"):
        if line.startswith(b"data: "):
            events.append(json.loads(line[6:]))
    return events


def _wait_status(url: str, path: str, status: int, timeout: float = 60.0) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while True:
        try:
            r = httpx.get(url + path, timeout=5)
            if r.status_code == status or time.monotonic() > deadline:
                return r
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.05)


def _running(srv: ServeProcess) -> int:
    return httpx.get(f"{srv.url}/health", timeout=5).json()["engine"]["running"]


def _speech_lines(srv: ServeProcess, rid: str) -> list[dict]:
    return [x for x in srv.log_lines() if x.get("request_id") == rid and str(x["msg"]).startswith("speech ")]


def test_draining_refuses_new_work_and_health_until_the_streams_end(tmp_path):
    with ServeProcess(tmp_path, "--shutdown-grace", "120") as srv:
        sock, _ = _open_stream(srv, "drain-sse", LONG, sse=True)
        srv.signal(signal.SIGTERM)
        health = _wait_status(srv.url, "/health", 503)
        assert health.status_code == 503 and health.json()["status"] == "stopping"

        r = httpx.post(f"{srv.url}/v1/audio/speech", json=speech_body(2), timeout=30)
        assert r.status_code == 503
        assert r.json()["error"] == {"message": "server is shutting down", "type": "service_unavailable_error",
                                     "param": None, "code": "shutting_down"}
        assert "retry-after" not in r.headers
        assert r.headers["connection"] == "close"  # the client should reconnect to another server
        v = httpx.post(f"{srv.url}/v1/audio/voices", json={"name": "x", "speaker_embedding": [0.0]}, timeout=30)
        assert v.status_code == 503 and v.json()["error"]["code"] == "shutting_down"
        assert httpx.get(f"{srv.url}/metrics", timeout=30).status_code == 200  # still observable

        sock.close()  # the last in-flight request ends: the server may go
        assert srv.wait_exit() == 0
    log = srv.log_text()
    assert not [d for d in DIRTY if d in log], log[-3000:]
    assert any(x["msg"] == "engine stopped" for x in srv.log_lines())


def test_streams_past_the_grace_end_with_their_formats_error_ending(tmp_path):
    with ServeProcess(tmp_path, "--shutdown-grace", "1") as srv:
        sse, sse_start = _open_stream(srv, "cut-sse", LONG, sse=True)
        raw, raw_start = _open_stream(srv, "cut-pcm", LONG, sse=False)
        whole = {}
        file_request = threading.Thread(target=lambda: whole.update(r=httpx.post(
            f"{srv.url}/v1/audio/speech", json=speech_body(LONG, stream=False, response_format="wav"),
            headers={"X-Request-Id": "cut-file"}, timeout=120)))
        file_request.start()
        # A whole-file request says nothing until it is done: wait until the engine runs all three.
        assert wait_until(lambda: _running(srv) == 3, timeout=60, interval=0.05)
        srv.signal(signal.SIGTERM)
        sse_body = read_to_eof(sse, sse_start)
        raw_body = read_to_eof(raw, raw_start)
        file_request.join(120)
        assert srv.wait_exit() == 0

    assert whole["r"].status_code == 503
    assert whole["r"].json()["error"]["code"] == "shutting_down"
    assert "shutting down" in whole["r"].json()["error"]["message"]

    events = _events(sse_body)
    assert events[0]["type"] == "speech.audio.delta"
    last = events[-1]
    assert last["type"] == "speech.audio.error" and last["request_id"] == "cut-sse"
    assert last["error"]["code"] == 503 and last["error"]["type"] == "service_unavailable_error"
    assert "shutting down" in last["error"]["message"] and last["error"]["partial_audio"] is True
    assert sse_body.endswith(b"0\r\n\r\n")  # the event stream itself ended properly

    assert raw_body and not raw_body.endswith(b"0\r\n\r\n"), "a cut raw stream must lack the final chunk"

    for rid, mode in (("cut-sse", "sse"), ("cut-pcm", "audio"), ("cut-file", "file")):
        lines = _speech_lines(srv, rid)
        assert len(lines) == 1, lines  # one outcome, the shutdown's, not a client disconnect (499)
        assert lines[0]["status"] == 503 and lines[0]["abort_reason"] == "shutdown" and lines[0]["mode"] == mode
    cuts = [x for x in srv.log_lines() if x["msg"].startswith("cutting the audio stream")]
    assert [x["request_id"] for x in cuts] == ["cut-pcm"]  # one logged reason for the truncated body
    log = srv.log_text()
    assert not [d for d in DIRTY if d in log], log[-3000:]


def test_a_stream_that_ends_within_the_grace_completes_after_sigterm(tmp_path):
    with ServeProcess(tmp_path, "--shutdown-grace", "300") as srv:
        sock, start = _open_stream(srv, "short-sse", 30, sse=True)
        srv.signal(signal.SIGTERM)
        body = read_to_eof(sock, start)
        assert srv.wait_exit() == 0
    events = _events(body)
    assert events[-1]["type"] == "speech.audio.done" and events[-1]["usage"]["output_tokens"] == 30
    assert [x["status"] for x in _speech_lines(srv, "short-sse")] == [200]
    log = srv.log_text()
    assert not [d for d in DIRTY if d in log], log[-3000:]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_second_signal_exits_at_once(tmp_path, sig):
    with ServeProcess(tmp_path, "--shutdown-grace", "300") as srv:
        sock, _ = _open_stream(srv, "stuck", LONG, sse=False)
        srv.signal(sig)
        assert _wait_status(srv.url, "/health", 503).status_code == 503  # draining, with 300 s to go
        srv.signal(sig)
        assert srv.wait_exit(timeout=60) == 128 + sig
        sock.close()
    assert f"second {signal.Signals(sig).name}: exiting now" in srv.log_text()
