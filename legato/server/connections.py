"""Slow clients: a deadline on a request's head (line + headers) and on each pause in its body.

uvicorn has no header-read timeout: its keep-alive timer runs only between requests, and the first byte
of a request cancels it, so a client sending half a request line holds its connection (and a slot of
`limit_concurrency`) forever. `guarded_h11` arms a timer while a connection is waiting for a request head
and closes the connection when it runs out. `BodyTimeoutMiddleware` bounds the wait between two body
chunks and answers 408 (the body is not complete, so the response has not started).
"""

from __future__ import annotations

import asyncio
import logging

import h11
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)


def check_limits(timeout_header_s: float, timeout_body_s: float, max_connections: int) -> None:
    """Refuses limits that would disable a guard by accident (one line naming the flag)."""
    for flag, value in (("--timeout-header", timeout_header_s), ("--timeout-body", timeout_body_s)):
        if not value > 0:
            raise ValueError(f"{flag} must be a positive number of seconds, got {value!r}")
    if max_connections < 1:
        raise ValueError(f"--max-connections must be at least 1, got {max_connections!r}")


class _HeaderTimeoutH11(H11Protocol):
    header_timeout_s = 10.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        self._head_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)  # type: ignore[arg-type]
        self._arm_head_timer()  # a fresh connection owes us a request head, even if it sends nothing

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # IDLE: the request head is not complete yet (a first request, or the next one on a kept-alive
        # connection, whose first bytes cancelled uvicorn's keep-alive timer).
        if self.conn.their_state is h11.IDLE:
            self._arm_head_timer()
        else:
            self._cancel_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        # Requests on a kept-alive connection can be in between; only a connection still owing a head is cut.
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return
        log.info("closing a connection from %s: no complete request head within %g s",
                 _peer(self.client), self.header_timeout_s)
        self.transport.close()


def guarded_h11(header_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a request-head deadline, for `uvicorn.Config(http=...)`."""
    return type("HeaderTimeoutH11", (_HeaderTimeoutH11,), {"header_timeout_s": header_timeout_s})


class BodyTimeoutMiddleware:
    """Fails a request whose body stalls for `timeout_s` between chunks with 408 and `Connection: close`
    (raised as Starlette's HTTPException, which the app's error handlers turn into the OpenAI error shape).
    Once the body is complete, `receive` only waits for a disconnect, which may take as long as it likes."""

    def __init__(self, app: ASGIApp, timeout_s: float) -> None:
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body_done = False

        async def guarded() -> Message:
            nonlocal body_done
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.timeout_s)
            except asyncio.TimeoutError:
                log.info("request body stalled for %g s; answering 408", self.timeout_s)
                raise StarletteHTTPException(408, f"request body stalled for more than {self.timeout_s:g} s",
                                             headers={"Connection": "close"}) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        await self.app(scope, guarded, send)


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "an unknown peer"
