"""The connection guard (connections.py) over each HTTP parser, on a live uvicorn in this process: which
connections count as slow against their client's share, and when they stop counting. The behaviour on a real
`legato serve` (cuts, 408s, 429s) is tests/reliability/test_slow_clients.py, with both parsers too."""

from __future__ import annotations

import asyncio
import socket

import pytest
from server_helpers import LiveServer, wait_until

from legato.server.connections import guarded_http

PARSERS = ["httptools", "h11"]
SLOW_AFTER_S = 0.2
HANG_GUARD = 30.0


async def _app(scope, receive, send) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def _read_response(sock: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\r\n\r\nok"):
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection"
        data += chunk
    return data


def _server(parser: str):
    protocol = guarded_http(HANG_GUARD, slow_per_client=4, slow_after_s=SLOW_AFTER_S, parser=parser)
    return protocol, LiveServer(_app, http=protocol)


@pytest.mark.parametrize("parser", PARSERS)
def test_an_idle_kept_alive_connection_and_a_finished_request_never_count_as_slow(parser):
    protocol, server = _server(parser)
    with server, socket.create_connection(("127.0.0.1", server.port), timeout=HANG_GUARD) as sock:
        sock.sendall(b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\n{}")
        assert _read_response(sock).startswith(b"HTTP/1.1 200")
        # Idle between requests for several times the slow threshold: uvicorn's keep-alive timer's business.
        assert not wait_until(lambda: protocol.slow.held("127.0.0.1") > 0, timeout=4 * SLOW_AFTER_S)
        sock.sendall(b"GET /y HTTP/1.1\r\nHost: a\r\n\r\n")  # and the connection still serves
        assert _read_response(sock).startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize("parser", PARSERS)
@pytest.mark.parametrize("part", ["head", "body"])
def test_a_request_still_arriving_counts_as_slow_until_it_is_whole(parser, part):
    protocol, server = _server(parser)
    with server, socket.create_connection(("127.0.0.1", server.port), timeout=HANG_GUARD) as sock:
        # A first request, answered, so the stalled one is the next on a kept-alive connection.
        sock.sendall(b"GET /first HTTP/1.1\r\nHost: a\r\n\r\n")
        assert _read_response(sock).startswith(b"HTTP/1.1 200")
        if part == "head":
            sock.sendall(b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Le")
            rest = b"ngth: 2\r\n\r\n{}"
        else:
            sock.sendall(b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\n{")
            rest = b"}"
        assert wait_until(lambda: protocol.slow.held("127.0.0.1") == 1, timeout=HANG_GUARD)
        sock.sendall(rest)
        assert _read_response(sock).startswith(b"HTTP/1.1 200")
        assert wait_until(lambda: protocol.slow.held("127.0.0.1") == 0, timeout=HANG_GUARD)


@pytest.mark.parametrize("parser", PARSERS)
def test_a_client_that_stops_reading_a_response_is_cut_after_the_send_timeout(parser):
    """uvicorn waits for a client's buffers to drain with no limit: a client that stopped reading a streamed
    response held its request (and everything the engine made for it) for ever. The guard aborts the connection
    once nothing has drained for the send timeout, and the app sees the disconnect."""
    gone = []

    async def endless(scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await _app(scope, receive, send)
            return
        while (await receive()).get("more_body"):
            pass
        watcher = asyncio.ensure_future(receive())  # the request is whole: the next message is the disconnect
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"audio/pcm")]})
        chunk = b"\0" * 65536
        for _ in range(1 << 14):  # a GiB at most: far more than any socket buffers, and never an endless test
            if watcher.done():
                break
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await asyncio.wait_for(watcher, HANG_GUARD)
        gone.append(watcher.result()["type"])

    protocol = guarded_http(HANG_GUARD, parser=parser, send_timeout_s=0.5)
    with LiveServer(endless, http=protocol) as server, socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(HANG_GUARD)
        sock.connect(("127.0.0.1", server.port))
        sock.sendall(b"GET /audio HTTP/1.1\r\nHost: a\r\n\r\n")
        assert sock.recv(12).startswith(b"HTTP/1.1 200")  # then reads nothing more
        assert wait_until(lambda: gone, timeout=HANG_GUARD), "the connection of a client not reading was kept"
        assert gone == ["http.disconnect"]
