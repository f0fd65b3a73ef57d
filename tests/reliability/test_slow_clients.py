"""Slow and misbehaving clients on a real `legato serve` process: a request head that never completes, a body
that stalls, more connections than allowed, and a client leaving mid-upload.

Timeouts are set small through the flags; assertions wait against generous hang guards and never assert
how fast the server reacted."""

from __future__ import annotations

import asyncio
import json
import select
import socket
import time

import httpx
import pytest
from serve_process import LONG, ServeProcess, raw_request, read_head, read_to_eof, speech_body

from legato.bench.speech_calls import KEEPALIVE_EXPIRY_S

pytestmark = pytest.mark.slow

HANG_GUARD = 30.0
DIRTY = ("Traceback", "Exception in ASGI application")


# Both HTTP parsers carry the same guards (connections.py): every server here runs once with each.
PARSERS = ["httptools", "h11"]


@pytest.fixture(scope="module", params=PARSERS)
def srv(tmp_path_factory, request):
    with ServeProcess(tmp_path_factory.mktemp("slow"), "--timeout-header", "0.5", "--timeout-body", "1",
                      "--http", request.param) as s:
        yield s


def _closed_by_server(sock: socket.socket) -> bool:
    """True once the server closes the connection (EOF or reset); False if the hang guard ran out first."""
    sock.settimeout(HANG_GUARD)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=HANG_GUARD)


def test_half_a_request_line_is_disconnected_after_the_header_timeout(srv):
    with _connect(srv.port) as sock:
        sock.sendall(b"GET /hea")
        assert _closed_by_server(sock)
    assert srv.healthy()


def test_a_connection_that_sends_nothing_is_disconnected(srv):
    with _connect(srv.port) as sock:
        assert _closed_by_server(sock)


def test_half_a_header_block_on_a_kept_alive_connection_is_disconnected(srv):
    with _connect(srv.port) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        status, _ = read_head(sock)
        assert status == 200
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")  # the next request's head stalls
        assert _closed_by_server(sock)


@pytest.mark.parametrize("path", ["/v1/audio/speech", "/v1/audio/voices"])
def test_a_stalled_body_gets_408_and_a_close(srv, path):
    with _connect(srv.port) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     "Content-Length: 200\r\n\r\n".encode() + b'{"input": "Hel')
        status, rest = read_head(sock)
        assert status == 408
        body = read_to_eof(sock, rest)  # and the server closes the connection
    error = json.loads(body)["error"]
    assert error["code"] == "request_timeout" and "stalled" in error["message"]


def test_a_streaming_response_is_not_cut_by_the_body_timeout(srv):
    # The response outlives --timeout-body while the server keeps waiting on `receive` for a disconnect.
    r = httpx.post(f"{srv.url}/v1/audio/speech", json=speech_body(12, sse=True), timeout=HANG_GUARD * 4)
    assert r.status_code == 200 and '"speech.audio.done"' in r.text


@pytest.mark.parametrize("path", ["/v1/audio/voices", "/v1/audio/speech"])
def test_a_client_leaving_mid_upload_is_one_quiet_log_line(srv, path):
    with _connect(srv.port) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     "Content-Length: 100000\r\n\r\n".encode() + b'{"name": "half", "ref_audio": "' + b"A" * 50000)
    gone = srv.wait_log(lambda x: x.get("msg") == f"client disconnected during the request body of POST {path}",
                        timeout=HANG_GUARD)
    assert gone is not None, srv.log_text()[-3000:]
    assert not [d for d in DIRTY if d in srv.log_text()], srv.log_text()[-3000:]
    r = httpx.post(f"{srv.url}/v1/audio/speech", json=speech_body(2, stream=False, response_format="wav"),
                   timeout=HANG_GUARD * 4)
    assert r.status_code == 200  # and the server keeps serving


@pytest.mark.parametrize("parser", PARSERS)
def test_connections_beyond_the_cap_get_503(tmp_path, parser):
    with ServeProcess(tmp_path, "--max-connections", "2", "--http", parser) as srv:
        streams = []
        for i in range(2):  # two connections held open by running streams
            sock = raw_request(srv.port, "POST", "/v1/audio/speech", json.dumps(speech_body(LONG)).encode(),
                               {"Content-Type": "application/json", "X-Request-Id": f"held-{i}"})
            assert read_head(sock)[0] == 200
            streams.append(sock)
        r = httpx.get(f"{srv.url}/health", timeout=HANG_GUARD)
        assert r.status_code == 503
        for sock in streams:
            sock.close()
        deadline = time.monotonic() + HANG_GUARD * 2
        while not srv.healthy():  # the cap frees up once the server has noticed the clients leave
            assert time.monotonic() < deadline, "connections stayed counted after their clients left"
            time.sleep(0.1)


# ---- a body with no overall deadline, and one client filling --max-connections (issue 20) ----------------

def _answer(sock: socket.socket, timeout: float) -> bytes | None:
    """What the server sent before closing, once it has closed (None: still open after `timeout`)."""
    ready, _, _ = select.select([sock], [], [], timeout)
    if not ready:
        return None
    sock.settimeout(HANG_GUARD)
    try:
        return read_to_eof(sock)
    except ConnectionResetError:
        return b""


@pytest.mark.parametrize("parser", PARSERS)
def test_a_body_dribbled_inside_the_pause_limit_is_cut_by_its_overall_deadline(tmp_path, parser):
    # One byte every 0.2 s never pauses for --timeout-body (1 s), so only the overall deadline (1 s plus one
    # second per 50 bytes received) can end it; before, such a client was never cut.
    flags = ("--timeout-body", "1", "--min-body-rate", "50", "--http", parser)
    with ServeProcess(tmp_path, *flags) as srv, _connect(srv.port) as sock:
        sock.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 10000\r\n\r\n")
        answer, sent, guard = None, 0, time.monotonic() + HANG_GUARD
        while answer is None and time.monotonic() < guard and sent < 10000:
            sock.sendall(b" ")
            sent += 1
            answer = _answer(sock, 0.2)
        assert answer is not None, f"still open after {sent} bytes"
        status = int(answer.split(b" ", 2)[1])
        error = json.loads(answer.partition(b"\r\n\r\n")[2])["error"]
        assert status == 408 and error["code"] == "request_timeout", answer
        assert "too slow" in error["message"] and "50 bytes/s" in error["message"]
        assert sent < 200  # cut long before the body could end (10,000 bytes at 5 a second)
        assert srv.healthy()


@pytest.mark.parametrize("parser", PARSERS)
def test_one_client_cannot_fill_max_connections_with_slow_requests(tmp_path, parser):
    # --max-connections 6: six connections that never finish their request (three heads, three bodies) used
    # to hold every slot, and the next request got 503. The client may hold 2 slow ones; the rest get 429.
    flags = ("--max-connections", "6", "--max-slow-connections-per-client", "2", "--timeout-header", "60",
             "--timeout-body", "60")
    with ServeProcess(tmp_path, *flags, "--http", parser) as srv:
        slow = [_connect(srv.port) for _ in range(6)]
        try:
            for i, sock in enumerate(slow):
                if i % 2:
                    sock.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 500\r\n\r\n{")
                else:
                    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            answers: dict[int, bytes] = {}
            guard = time.monotonic() + HANG_GUARD
            while len(answers) < 4 and time.monotonic() < guard:
                for i, sock in enumerate(slow):
                    if i not in answers and (answer := _answer(sock, 0.05)) is not None:
                        answers[i] = answer
            assert len(answers) == 4, f"{len(answers)} of the 6 slow connections were refused"
            for answer in answers.values():
                assert answer.startswith(b"HTTP/1.1 429 "), answer
                error = json.loads(answer.partition(b"\r\n\r\n")[2])["error"]
                assert error["code"] == "too_many_slow_connections" and error["type"] == "rate_limit_error"
            held = [sock for i, sock in enumerate(slow) if i not in answers]
            assert all(_answer(sock, 0) is None for sock in held)  # its share stays open
            r = httpx.get(f"{srv.url}/health", timeout=HANG_GUARD)  # and a request of the same client still runs
            assert r.status_code == 200
        finally:
            for sock in slow:
                sock.close()
    refused = [line for line in srv.log_lines() if "--max-slow-connections-per-client" in line.get("msg", "")]
    assert len(refused) == 4


@pytest.mark.parametrize("parser", PARSERS)
def test_fast_requests_in_parallel_never_count_as_slow(tmp_path, parser):
    with ServeProcess(tmp_path, "--max-slow-connections-per-client", "1", "--http", parser) as srv:
        async def burst() -> list[int]:
            limits = httpx.Limits(max_connections=16, keepalive_expiry=KEEPALIVE_EXPIRY_S)
            async with httpx.AsyncClient(timeout=HANG_GUARD, limits=limits) as c:
                return [r.status_code for r in await asyncio.gather(*(c.get(f"{srv.url}/v1/models")
                                                                      for _ in range(32)))]

        assert asyncio.run(burst()) == [200] * 32
