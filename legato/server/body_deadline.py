"""Slow request bodies: a deadline on each pause and on the whole body.

`--timeout-body` alone bounded only the pause between two chunks, so a client sending one byte every 20 s
was never cut, and enough such sockets filled `--max-connections` (issue 20). A body now also has an
overall deadline that grows with what has arrived: `--timeout-body` seconds plus one second per
`--min-body-rate` bytes received. A client sending at the minimum rate or faster never meets it, whatever
the body's size; one that falls behind by more than `--timeout-body` seconds gets 408, and a dribbling one
is cut `--timeout-body` seconds after its head. (The number of such connections one client address may hold
at once is bounded in connections.py.)
"""

from __future__ import annotations

import asyncio
import logging
import time

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from legato.server.timeouts import within

log = logging.getLogger("legato.server.connections")  # with the other slow-client lines


class BodyDeadline:
    """When a body's wait must end: `pause_s` after the last chunk, and `pause_s + received / min_rate`
    after the body began (None: no rate, pauses only). Times are `time.monotonic()` seconds."""

    def __init__(self, pause_s: float, min_rate: float | None, started: float) -> None:
        self.pause_s = pause_s
        self.min_rate = min_rate
        self.started = started
        self.received = 0
        self.last_chunk = started

    def chunk(self, size: int, now: float) -> None:
        self.received += size
        self.last_chunk = now

    def overall(self) -> float | None:
        if self.min_rate is None:
            return None
        return self.started + self.pause_s + self.received / self.min_rate

    def wait_s(self, now: float) -> float:
        """How long the next chunk may take."""
        overall = self.overall()
        return self.pause_s if overall is None else max(0.0, min(self.pause_s, overall - now))

    def stalled(self, now: float) -> bool:
        """Whether a wait that ran out at `now` was a pause (nothing for about `pause_s`) rather than a body
        falling behind the rate. A body that stops early meets both deadlines within a moment of each other
        (the overall one is `pause_s` plus a few bytes' worth after the head): that is a stall."""
        return now - self.last_chunk >= self.pause_s * 0.9


class BodyTimeoutMiddleware:
    """Fails a request whose body stalls for `timeout_s` between chunks, or arrives slower than `min_rate`
    bytes a second on average (after a grace of `timeout_s`), with 408 and `Connection: close` (raised as
    Starlette's HTTPException, which the app's error handlers turn into the OpenAI error shape). Once the body
    is complete, `receive` only waits for a disconnect, which may take as long as it likes."""

    def __init__(self, app: ASGIApp, timeout_s: float, min_rate: float | None = None) -> None:
        self.app = app
        self.timeout_s = timeout_s
        self.min_rate = min_rate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline = BodyDeadline(self.timeout_s, self.min_rate, time.monotonic())
        body_done = False

        async def guarded() -> Message:
            nonlocal body_done
            if body_done:
                return await receive()
            try:
                message = await within(receive(), deadline.wait_s(time.monotonic()))
            except asyncio.TimeoutError:
                raise self._timed_out(deadline) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            deadline.chunk(len(message.get("body", b"")), time.monotonic())
            return message

        await self.app(scope, guarded, send)

    def _timed_out(self, deadline: BodyDeadline) -> StarletteHTTPException:
        if deadline.stalled(time.monotonic()):
            log.info("request body stalled for %g s; answering 408", self.timeout_s)
            message = f"request body stalled for more than {self.timeout_s:g} s"
        else:
            elapsed = time.monotonic() - deadline.started
            log.info("request body too slow: %d bytes in %.1f s (minimum %g bytes/s after %g s); answering 408",
                     deadline.received, elapsed, self.min_rate, self.timeout_s)
            message = (f"request body too slow: {deadline.received} bytes in {elapsed:.0f} s; a body must arrive at "
                       f"{self.min_rate:g} bytes/s or faster (after {self.timeout_s:g} s)")
        return StarletteHTTPException(408, message, headers={"Connection": "close"})
