"""Slow clients at the connection level: a deadline on a request's head (line + headers), and a per-client
share of the connections still sending their request.

uvicorn has no header-read timeout: its keep-alive timer runs only between requests, and the first byte
of a request cancels it, so a client sending half a request line holds its connection (and a slot of
`limit_concurrency`) forever. `guarded_http` arms a timer while a connection is waiting for a request head
and closes the connection when it runs out. The body's deadlines are body_deadline.py's.

Both of uvicorn's HTTP/1.1 protocols are guarded alike: httptools' (the default: its C parser took ~15 % less of
the front's CPU per streamed request than h11's pure-Python one, docs/benchmarks.md) and h11's (`--http h11`).
The guard only asks the protocol where its current request stands (`_Guard`'s three questions).

Deadlines alone do not stop one client from filling `--max-connections`: it opens a new slow connection
for each one cut, and ~1,100 sockets sending a byte every 20 s left every other client with 503 (issue 20).
So a connection that has owed its request (head or body) for longer than `SLOW_AFTER_S` counts as slow
against its source address, and an address may hold `per_client` slow connections at once: one more gets
429 (OpenAI's error shape, `Retry-After`) and is closed. A request that arrives in less than that, however
many a client sends in parallel, never counts, and neither does a response being streamed.

A response has a deadline too: uvicorn waits for a client's send buffers to drain with no limit, so a client that
stops reading a streamed response (and keeps its connection open) held the request, its connection and all the
audio the engine went on making, for ever: `--request-timeout` is checked only between chunks. The guard arms a
timer whenever the transport pauses writing (its buffers full, the kernel's included) and disarms it when writing
resumes; a client that takes nothing for `send_timeout_s` has its connection aborted, which the app sees as a
disconnect (the request is aborted, counted 499). A client that reads, however slowly, drains the buffer and is
never cut.
"""

from __future__ import annotations

import asyncio
import json
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from legato.server.errors import error_body

log = logging.getLogger(__name__)

# A request still arriving after this long counts as slow (a request from any client that is not slow is
# whole in one round trip; a large upload on a slow link is slow, and its client may hold `per_client`).
SLOW_AFTER_S = 1.0


def check_limits(timeout_header_s: float, timeout_body_s: float, max_connections: int,
                 min_body_rate: float | None = None, slow_per_client: int | None = None,
                 timeout_send_s: float = 30.0) -> None:
    """Refuses limits that would disable a guard by accident (one line naming the flag)."""
    for flag, value in (("--timeout-header", timeout_header_s), ("--timeout-body", timeout_body_s),
                        ("--timeout-send", timeout_send_s)):
        if not value > 0:
            raise ValueError(f"{flag} must be a positive number of seconds, got {value!r}")
    if max_connections < 1:
        raise ValueError(f"--max-connections must be at least 1, got {max_connections!r}")
    if min_body_rate is not None and not min_body_rate > 0:
        raise ValueError(f"--min-body-rate must be a positive number of bytes a second, got {min_body_rate!r}")
    if slow_per_client is not None and slow_per_client < 1:
        raise ValueError(f"--max-slow-connections-per-client must be at least 1, got {slow_per_client!r}")


def default_slow_share(max_connections: int) -> int:
    """Slow connections one client address may hold by default: a sixteenth of `--max-connections` (64 of
    1,024), at least 4, so one address can never hold more than a small part of the server."""
    return max(4, max_connections // 16)


class SlowConnections:
    """Per server: each client address's slow connections (owing their request past SLOW_AFTER_S)."""

    def __init__(self, per_client: int) -> None:
        self.per_client = per_client
        self._by_client: dict[str, set[object]] = {}

    def admit(self, client: str, conn: object) -> bool:
        """Counts `conn` as slow for `client`; False (not counted) when the client already has its share."""
        held = self._by_client.setdefault(client, set())
        if conn not in held and len(held) >= self.per_client:
            return False
        held.add(conn)
        return True

    def release(self, client: str, conn: object) -> None:
        held = self._by_client.get(client)
        if held is not None:
            held.discard(conn)
            if not held:
                del self._by_client[client]

    def held(self, client: str) -> int:
        return len(self._by_client.get(client, ()))


class _Guard:
    """The request-head deadline and the slow-connection share, over a uvicorn HTTP protocol that says where its
    current request stands: `_owes_head` (a request head is due or part-way in), `_arriving` (a request's head or
    body is still on its way) and `_between_requests` (a kept-alive connection idle after a complete response,
    which uvicorn's keep-alive timer looks after)."""

    header_timeout_s = 10.0
    send_timeout_s = 30.0
    slow: SlowConnections | None = None  # set per server by `guarded_http`
    slow_after_s = SLOW_AFTER_S

    def _owes_head(self) -> bool:
        raise NotImplementedError

    def _arriving(self) -> bool:
        raise NotImplementedError

    def _between_requests(self) -> bool:
        raise NotImplementedError

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        self._head_timer: asyncio.TimerHandle | None = None
        self._slow_timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None
        self._counted_slow = False
        super().connection_made(transport)  # type: ignore[misc]
        self._arm_head_timer()  # a fresh connection owes us a request head, even if it sends nothing
        self._arm_slow_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)  # type: ignore[misc]
        if self.transport.get_protocol() is not self:
            # Upgraded to a WebSocket: the connection is no longer ours, and its request state stays where it was
            # (uvicorn hands over at the request head). Left armed, the timer counted every socket as slow
            # and never released it (connection_lost goes to the WebSocket protocol); past the client's share
            # the next one had a 429 written into its WebSocket stream.
            self._cancel_head_timer()
            self._not_slow()
            return
        # A head still owed: a first request, or the next one on a kept-alive connection, whose first bytes
        # cancelled uvicorn's keep-alive timer.
        if self._owes_head():
            self._arm_head_timer()
        else:
            self._cancel_head_timer()
        if self._arriving():
            self._arm_slow_timer()
        else:
            self._not_slow()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        self._cancel_send_timer()
        self._not_slow()
        super().connection_lost(exc)  # type: ignore[misc]

    # --- the response's deadline ----------------------------------------------------------------------

    def pause_writing(self) -> None:
        super().pause_writing()  # type: ignore[misc]
        if self._send_timer is None:
            self._send_timer = self.loop.call_later(self.send_timeout_s, self._send_timed_out)

    def resume_writing(self) -> None:
        self._cancel_send_timer()
        super().resume_writing()  # type: ignore[misc]

    def _cancel_send_timer(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _send_timed_out(self) -> None:
        self._send_timer = None
        log.warning("closing a connection to %s: it took none of its response for %g s", _peer(self.client),
                    self.send_timeout_s)
        # abort, not close: close waits to flush the very buffers the client does not read
        self.transport.abort()

    # --- the request head's deadline ----------------------------------------------------------------

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
        if not self._owes_head() or self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return
        log.info("closing a connection from %s: no complete request head within %g s",
                 _peer(self.client), self.header_timeout_s)
        self.transport.close()

    # --- the client's share of slow connections ------------------------------------------------------

    def _arm_slow_timer(self) -> None:
        if self.slow is not None and self._slow_timer is None and not self._counted_slow:
            self._slow_timer = self.loop.call_later(self.slow_after_s, self._became_slow)

    def _not_slow(self) -> None:
        if self._slow_timer is not None:
            self._slow_timer.cancel()
            self._slow_timer = None
        if self._counted_slow:
            self._counted_slow = False
            self.slow.release(_address(self.client), self)

    def _became_slow(self) -> None:
        self._slow_timer = None
        if self.transport.is_closing() or not self._arriving() or self._between_requests():
            return
        client = _address(self.client)
        if self.slow.admit(client, self):
            self._counted_slow = True
            return
        log.warning("refusing a connection from %s: it already holds %d connections still sending their request "
                    "(--max-slow-connections-per-client)", _peer(self.client), self.slow.per_client)
        self._refuse(client)

    def _refuse(self, client: str) -> None:
        """Answers 429 in OpenAI's error shape when no response has started, then closes the connection
        (its request is never read: the client has its share of slow connections already)."""
        if self.cycle is None or not self.cycle.response_started:
            message = (f"too many slow connections from {client}: it already holds {self.slow.per_client} "
                       "connections still sending their request; finish those first")
            body = json.dumps(error_body(429, message, "too_many_slow_connections")).encode()
            head = ("HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\nconnection: close\r\n"
                    f"retry-after: {max(1, round(self.slow_after_s))}\r\ncontent-length: {len(body)}\r\n\r\n")
            self.transport.write(head.encode() + body)
        self.transport.close()  # the app, if it runs, reads a disconnect next (uvicorn's connection_lost)


class _GuardedH11(_Guard, H11Protocol):
    """h11 keeps the request's state itself (`their_state`)."""

    def _owes_head(self) -> bool:
        return self.conn.their_state is h11.IDLE

    def _arriving(self) -> bool:
        return self.conn.their_state in (h11.IDLE, h11.SEND_BODY)

    def _between_requests(self) -> bool:
        return (self.conn.their_state is h11.IDLE and self.cycle is not None and self.cycle.response_complete
                and not self.conn.trailing_data[0])


class _GuardedHttpTools(_Guard, HttpToolsProtocol):
    """httptools reports a request's parts as callbacks; the guard keeps the phase of the latest one: `head` (owed,
    or part-way in), `body` (head done, body on its way), `done` (all in)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        self._phase = "head"
        self._head_started = False  # bytes of the owed head came (between requests: none yet)
        super().connection_made(transport)

    def on_message_begin(self) -> None:
        self._phase, self._head_started = "head", True
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._phase, self._head_started = "body", False
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._phase = "done"
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._phase == "done" and not self.pipeline:  # the next request's head is owed now
            self._phase = "head"

    def _owes_head(self) -> bool:
        return self._phase == "head"

    def _arriving(self) -> bool:
        return self._phase in ("head", "body")

    def _between_requests(self) -> bool:
        return (self._phase == "head" and not self._head_started and self.cycle is not None
                and self.cycle.response_complete)


PROTOCOLS = {"httptools": _GuardedHttpTools, "h11": _GuardedH11}


def guarded_http(header_timeout_s: float, slow_per_client: int | None = None, slow_after_s: float = SLOW_AFTER_S,
                 parser: str = "httptools", send_timeout_s: float = 30.0) -> type:
    """uvicorn's HTTP/1.1 protocol (`parser`: httptools or h11) with a request-head deadline, a response deadline
    (`send_timeout_s` without the client taking any of it) and, with `slow_per_client`, a per-client share of slow
    connections (one share table per call: one per server), for `uvicorn.Config(http=...)`."""
    base = PROTOCOLS[parser]
    slow = SlowConnections(slow_per_client) if slow_per_client is not None else None
    return type(base.__name__.lstrip("_"), (base,), {"header_timeout_s": header_timeout_s, "slow": slow,
                                                      "slow_after_s": slow_after_s, "send_timeout_s": send_timeout_s})


def _address(client: tuple[str, int] | None) -> str:
    return client[0] if client else "unknown"


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "an unknown peer"
