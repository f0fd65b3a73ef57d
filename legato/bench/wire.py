"""The bench client's HTTP/1.1: one keep-alive connection per in-flight slot, read by an asyncio `Protocol`.

A general client (httpx: httpcore, anyio, h11) spent about 2 ms of CPU per streamed request here, all on the
one event loop that also timestamps every chunk; at 256 streams arriving at once the client itself was most
of the TTFP it reported (docs/benchmarks.md, "the bench client"). This reads the response in the protocol's
`data_received` callback: each network read is timestamped there, and its chunked transfer-encoding framing
is undone in place, so a chunk costs no task wake-up; the request's coroutine wakes twice, at the headers
and at the end. It speaks only what the bench needs: a POST with a JSON body, a status line and headers,
a chunked or `content-length` or close-delimited body. Everything else (the server card, `/health`) still
goes through httpx.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from urllib.parse import urlsplit


class TransportError(Exception):
    """The connection failed or closed before the response was complete."""


class Response:
    """What arrived for one request: status, headers, and the body's reads (time, payload bytes), appended as
    they arrive to `times` and `sizes` (the caller's lists, so it can watch a stream in progress); times are
    perf_counter seconds after `origin`."""

    def __init__(self, times: list[float] | None = None, sizes: list[int] | None = None,
                 origin: float = 0.0) -> None:
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.times = [] if times is None else times
        self.sizes = [] if sizes is None else sizes
        self.origin = origin
        self.body = bytearray()  # the payload, kept when asked (`keep`) or when it is an error's text
        self.keep = False
        self.keep_alive = True
        self.end: float | None = None  # perf_counter when the body ended


class _Protocol(asyncio.Protocol):
    """Parses one response at a time off its connection (see the module doc)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._resp: Response | None = None
        self._head = bytearray()
        self._headers_done: asyncio.Future | None = None
        self._body_done: asyncio.Future | None = None
        self._mode = ""  # chunked | length | close
        self._left = 0  # length mode: bytes to go; chunked: bytes left in the current chunk
        self._state = "size"  # chunked: size | data | data_crlf | trailer
        self._line = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._mode == "close" and self._body_done is not None and self._resp is not None \
                and self._resp.status is not None:
            self._resp.end = time.perf_counter()
            _settle(self._body_done)  # a close-delimited body ends with its connection
        why = TransportError(f"connection closed{f': {exc}' if exc else ''}")
        for fut in (self._headers_done, self._body_done):
            _settle(fut, why)

    def begin(self, resp: Response) -> tuple[asyncio.Future, asyncio.Future]:
        loop = asyncio.get_running_loop()
        self._resp, self._head, self._mode, self._state = resp, bytearray(), "", "size"
        self._headers_done, self._body_done = loop.create_future(), loop.create_future()
        return self._headers_done, self._body_done

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        resp = self._resp
        if resp is None:  # nothing asked: a server talking out of turn
            self.transport.close()
            return
        if resp.status is None:
            self._head += data
            end = self._head.find(b"\r\n\r\n")
            if end < 0:
                return
            data = bytes(self._head[end + 4:])
            try:
                self._parse_head(bytes(self._head[:end]))
            except ValueError as e:
                _settle(self._headers_done, TransportError(f"bad response head: {e}"))
                self.transport.close()
                return
            _settle(self._headers_done)
            if self._mode == "length" and self._left == 0:
                resp.end = now
                _settle(self._body_done)
                return
        if not data:
            return
        try:
            payload = self._payload(data, now)
        except ValueError as e:
            _settle(self._body_done, TransportError(f"bad chunked framing: {e}"))
            self.transport.close()
            return
        if payload:
            resp.times.append(now - resp.origin)
            resp.sizes.append(payload)

    def _parse_head(self, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
            raise ValueError(f"status line {lines[0][:80]!r}")
        resp = self._resp
        for line in lines[1:]:
            k, _, v = line.partition(":")
            resp.headers[k.strip().lower()] = v.strip()
        resp.status = int(parts[1])
        ctype = resp.headers.get("content-type", "")
        if not 200 <= resp.status < 300 or ctype.startswith(("application/json", "text/")):
            resp.keep = True  # not audio: its text is what the caller reports
        resp.keep_alive = resp.headers.get("connection", "").lower() != "close" and parts[0] == "HTTP/1.1"
        if "chunked" in resp.headers.get("transfer-encoding", "").lower():
            self._mode = "chunked"
        elif "content-length" in resp.headers:
            self._mode, self._left = "length", int(resp.headers["content-length"])
        else:
            self._mode, resp.keep_alive = "close", False

    def _payload(self, data: bytes, now: float) -> int:
        """Takes a read's body bytes; returns how many payload bytes it carried (framing excluded)."""
        if self._mode != "chunked":
            take = data if self._mode == "close" else data[:self._left]
            self._left -= len(take)
            self._keep(take)
            if self._mode == "length" and self._left <= 0:
                self._resp.end = now
                _settle(self._body_done)
            return len(take)
        got, i, n = 0, 0, len(data)
        while i < n:
            if self._state == "data":
                take = data[i:i + self._left]
                self._keep(take)
                got += len(take)
                self._left -= len(take)
                i += len(take)
                if self._left == 0:
                    self._state = "data_crlf"
                continue
            j = data.find(b"\n", i)
            if j < 0:
                self._line += data[i:]
                break
            line = bytes(self._line + data[i:j]).strip()
            self._line.clear()
            i = j + 1
            if self._state == "data_crlf":
                if line:
                    raise ValueError("no CRLF after a chunk")
                self._state = "size"
            elif self._state == "size":
                self._left = int(line.split(b";", 1)[0], 16)
                self._state = "data" if self._left else "trailer"
            elif not line:  # trailer: the blank line ends the body
                self._state = "size"
                self._resp.end = now
                _settle(self._body_done)
                break
        return got

    def _keep(self, data: bytes) -> None:
        if self._resp.keep:
            self._resp.body += data


def _settle(fut: asyncio.Future | None, error: Exception | None = None) -> None:
    if fut is not None and not fut.done():
        if error is None:
            fut.set_result(None)
        else:
            fut.set_exception(error)
            fut.exception()  # marked retrieved: a future nobody awaits any more must not log


class Connection:
    """One keep-alive connection to `base_url`, opened on first use and again after a failure."""

    def __init__(self, base_url: str, headers: dict[str, str] | None = None,
                 tls: ssl.SSLContext | None = None) -> None:
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https"):
            raise ValueError(f"unsupported URL scheme in {base_url!r}")
        self.host = url.hostname or "127.0.0.1"
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self.prefix = url.path.rstrip("/")
        self.tls = (tls or ssl.create_default_context()) if url.scheme == "https" else None
        netloc = self.host if url.port is None else f"{self.host}:{url.port}"
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._head = f"Host: {netloc}\r\nAccept: */*\r\nContent-Type: application/json\r\n{extra}"
        self._proto: _Protocol | None = None

    async def post(self, path: str, body: dict, resp: Response) -> asyncio.Future:
        """Sends the request, waits for the response's head (filled into `resp`), and returns the future of its
        body's end. Raises TransportError when the connection fails first."""
        if self._proto is None or self._proto.closed:
            try:
                _, self._proto = await asyncio.get_running_loop().create_connection(
                    _Protocol, self.host, self.port, ssl=self.tls, server_hostname=self.host if self.tls else None)
            except OSError as e:
                raise TransportError(f"{type(e).__name__}: {e}") from None
        data = json.dumps(body).encode()
        head, done = self._proto.begin(resp)
        self._proto.transport.write(f"POST {self.prefix}{path} HTTP/1.1\r\n{self._head}"
                                    f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        await head
        return done

    def finish(self, resp: Response, complete: bool) -> None:
        """After a response: the connection stays for the next one only when it ended cleanly and may be kept."""
        if self._proto is not None and not (complete and resp.keep_alive):
            self.close()

    def close(self) -> None:
        if self._proto is not None and self._proto.transport is not None:
            self._proto.transport.close()
        self._proto = None
