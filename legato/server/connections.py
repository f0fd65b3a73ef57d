"""Slow clients at the connection level: a deadline on a request's head (line + headers), and a per-client
share of the connections still sending their request.

uvicorn has no header-read timeout: its keep-alive timer runs only between requests, and the first byte
of a request cancels it, so a client sending half a request line holds its connection (and a slot of
`limit_concurrency`) forever. `guarded_h11` arms a timer while a connection is waiting for a request head
and closes the connection when it runs out. The body's deadlines are body_deadline.py's.

Deadlines alone do not stop one client from filling `--max-connections`: it opens a new slow connection
for each one cut, and ~1,100 sockets sending a byte every 20 s left every other client with 503 (issue 20).
So a connection that has owed its request (head or body) for longer than `SLOW_AFTER_S` counts as slow
against its source address, and an address may hold `per_client` slow connections at once: one more gets
429 (OpenAI's error shape, `Retry-After`) and is closed. A request that arrives in less than that, however
many a client sends in parallel, never counts, and neither does a response being streamed.
"""

from __future__ import annotations

import asyncio
import json
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from legato.server.errors import error_body

log = logging.getLogger(__name__)

# A request still arriving after this long counts as slow (a request from any client that is not slow is
# whole in one round trip; a large upload on a slow link is slow, and its client may hold `per_client`).
SLOW_AFTER_S = 1.0


def check_limits(timeout_header_s: float, timeout_body_s: float, max_connections: int,
                 min_body_rate: float | None = None, slow_per_client: int | None = None) -> None:
    """Refuses limits that would disable a guard by accident (one line naming the flag)."""
    for flag, value in (("--timeout-header", timeout_header_s), ("--timeout-body", timeout_body_s)):
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


class _GuardedH11(H11Protocol):
    header_timeout_s = 10.0
    slow: SlowConnections | None = None  # set per server by `guarded_h11`
    slow_after_s = SLOW_AFTER_S

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        self._head_timer: asyncio.TimerHandle | None = None
        self._slow_timer: asyncio.TimerHandle | None = None
        self._counted_slow = False
        super().connection_made(transport)  # type: ignore[arg-type]
        self._arm_head_timer()  # a fresh connection owes us a request head, even if it sends nothing
        self._arm_slow_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.transport.get_protocol() is not self:
            # Upgraded to a WebSocket: the connection is no longer ours, and its h11 state stays in SEND_BODY
            # (uvicorn hands over at the request head). Left armed, the timer counted every socket as slow
            # and never released it (connection_lost goes to the WebSocket protocol); past the client's share
            # the next one had a 429 written into its WebSocket stream.
            self._cancel_head_timer()
            self._not_slow()
            return
        # IDLE: the request head is not complete yet (a first request, or the next one on a kept-alive
        # connection, whose first bytes cancelled uvicorn's keep-alive timer).
        if self.conn.their_state is h11.IDLE:
            self._arm_head_timer()
        else:
            self._cancel_head_timer()
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY):  # the request is still on its way
            self._arm_slow_timer()
        else:
            self._not_slow()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        self._not_slow()
        super().connection_lost(exc)

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
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
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
        if self.transport.is_closing() or self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
            return
        if self.conn.their_state is h11.IDLE and self.cycle is not None and self.cycle.response_complete \
                and not self.conn.trailing_data[0]:
            return  # a kept-alive connection between requests: uvicorn's keep-alive timer has it
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


def guarded_h11(header_timeout_s: float, slow_per_client: int | None = None,
                slow_after_s: float = SLOW_AFTER_S) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a request-head deadline and, with `slow_per_client`, a per-client share of
    slow connections (one share table per call: one per server), for `uvicorn.Config(http=...)`."""
    slow = SlowConnections(slow_per_client) if slow_per_client is not None else None
    return type("GuardedH11", (_GuardedH11,), {"header_timeout_s": header_timeout_s, "slow": slow,
                                                "slow_after_s": slow_after_s})


def _address(client: tuple[str, int] | None) -> str:
    return client[0] if client else "unknown"


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "an unknown peer"
