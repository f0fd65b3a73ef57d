"""What uvicorn logs about a client's protocol errors, on a live uvicorn in this process with the filters
`legato serve` installs: one line, no traceback, for what any client can send."""

from __future__ import annotations

import base64
import logging
import os
import socket
import struct

from server_helpers import LiveServer, wait_until

from legato.server.stream_response import install_uvicorn_log_filters


async def _echo_ws(scope, receive, send) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    assert scope["type"] == "websocket"
    while (msg := await receive())["type"] != "websocket.disconnect":
        if msg["type"] == "websocket.connect":
            await send({"type": "websocket.accept"})


def _masked_text_frame(payload: bytes) -> bytes:
    mask = os.urandom(4)
    return bytes([0x81, 0x80 | len(payload)]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def test_a_text_frame_that_is_not_utf8_logs_one_warning_and_no_traceback(caplog):
    logger = logging.getLogger("uvicorn.error")
    before = list(logger.filters)
    install_uvicorn_log_filters()
    try:
        _a_bad_frame(caplog)
    finally:  # the filters are the process's: leave it as it was
        logger.filters[:] = before


def _a_bad_frame(caplog) -> None:
    with LiveServer(_echo_ws) as server, caplog.at_level(logging.INFO, logger="uvicorn.error"):
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
            key = base64.b64encode(os.urandom(16)).decode()
            sock.sendall((f"GET /ws HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nUpgrade: websocket\r\n"
                          f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
                          ).encode())
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = sock.recv(4096)
                assert chunk, "the server closed the connection before the handshake's answer"
                head += chunk
            assert head.startswith(b"HTTP/1.1 101"), head
            sock.sendall(_masked_text_frame(b"\xc3"))
            rest = head.split(b"\r\n\r\n", 1)[1]
            while len(rest) < 4:
                chunk = sock.recv(4096)
                assert chunk, "the server closed the connection without a close frame"
                rest += chunk
            assert rest[0] & 0x0F == 0x8 and struct.unpack("!H", rest[2:4])[0] == 1007  # a close frame, 1007
        assert wait_until(lambda: any("not UTF-8" in r.getMessage() for r in caplog.records), timeout=10)
    bad = [r for r in caplog.records if "UTF-8" in r.getMessage()]
    assert [(r.levelno, r.exc_info) for r in bad] == [(logging.WARNING, None)]
    assert not any(r.exc_info for r in caplog.records), "a traceback reached the log"
