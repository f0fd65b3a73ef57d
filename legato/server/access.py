"""Who may call the server: API keys, the Host a request names, and the web origins allowed to call it.

Three pure-ASGI checks, each answering in the OpenAI error shape:
- `HostCheck`: a server on loopback only answers requests whose `Host` is a loopback name (or one the
  operator lists). A page on an attacker's domain that rebinds its DNS to 127.0.0.1 sends its own Host,
  so it is refused (400) before anything runs.
- `OriginCheck`: a request from a web page carries `Origin`. Unless that origin is the server's own or one
  the operator allows (`--allowed-origins`, which also turns CORS on), it is refused (403). Form posts need
  no CORS preflight, so without this any page could create voices on a local server.
- `ApiKeyAuth`: with `--api-key`, every route but `/health` and `/metrics` needs `Authorization: Bearer <key>`
  (what the OpenAI SDK's `api_key=` sends); a missing or wrong key gets 401. Keys are compared in constant
  time. `/metrics` stays open as vLLM leaves it (Prometheus scrapers send no key) unless `--protect-metrics`.
Clients that are not browsers send no Origin and are not affected by `OriginCheck`.
"""

from __future__ import annotations

import hmac
import ipaddress
import re
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import urlsplit

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from legato.server.errors import error_body

OPEN_PATHS = frozenset({"/health"})  # load balancers probe it without credentials
METRICS_PATH = "/metrics"  # open too unless protected: scrapers expect it so, as vLLM serves it
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
_DEFAULT_PORTS = {"http": "80", "https": "443"}
# A Host's name (letters, digits, '-', '_', '.': DNS names and IPv4 addresses) and its port part (":digits",
# the digits optional as RFC 3986 allows them; at most 65535).
_REG_NAME = re.compile(r"[a-z0-9_.-]{1,253}")
_PORT = re.compile(r"(:(0|[1-9][0-9]{0,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5])?)?")


def load_api_keys(keys: Iterable[str], key_file: str | None = None) -> tuple[str, ...]:
    """The keys given on the command line plus those of `key_file` (one per line; blank lines and `#` comments
    skipped, a comment after a key too: keys hold no spaces). ValueError, naming the flag or the file's line, for
    an empty key or one with whitespace inside (a pasting mistake)."""
    found = [(k.strip(), "--api-key (or $LEGATO_API_KEY)") for k in keys]
    if key_file is not None:
        try:
            text = Path(key_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read the API key file {key_file!r}: {e}") from e
        from_file = len(found)
        for number, line in enumerate(text.splitlines(), 1):
            key = re.sub(r"(^|\s)#.*$", "", line).strip()
            if key:
                found.append((key, f"--api-key-file {key_file} line {number}"))
        if len(found) == from_file:  # the operator asked for keys: serving without any would be open to all
            raise ValueError(f"--api-key-file {key_file} holds no key (only blank lines or comments)")
    for key, where in found:
        if not key or any(c.isspace() for c in key) or not key.isprintable():
            raise ValueError(f"{where}: an API key must be a non-empty string of printable characters without spaces")
    return tuple(dict.fromkeys(k for k, _ in found))


def scope_header(scope: Scope, name: bytes) -> str | None:
    """The first value of header `name` (lower-case bytes) of an ASGI request, or None."""
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def host_name(host: str) -> str | None:
    """A `Host` header's host, lower-case and without its port ("[::1]:8000" -> "::1"), or None when the
    value is not an RFC 3986 authority without userinfo: `host [":" port]`, the host a DNS name, a dotted
    IPv4 address or a bracketed IPv6 address (in its one compressed spelling), the port digits up to 65535.
    Cutting the port off at a colon read `localhost:1@evil.example` as the host `localhost`; anything but this
    exact shape is refused."""
    host = host.strip().lower()
    if host.startswith("["):
        literal, bracket, port = host[1:].partition("]")
        try:
            name = str(ipaddress.IPv6Address(literal)) if bracket else None  # one spelling: "0::1" is "::1"
        except ValueError:
            return None
    else:
        name = host.partition(":")[0]
        port = host[len(name):]
        if not _REG_NAME.fullmatch(name):
            return None
    if name is None or not _PORT.fullmatch(port):
        return None
    return name


async def _refuse(scope: Scope, receive: Receive, send: Send, status: int, message: str, code: str,
                  headers: dict[str, str] | None = None) -> None:
    if scope["type"] == "websocket":
        # A WebSocket is refused before its handshake completes (the client sees HTTP 403); the close reason
        # carries the message (a close frame's reason holds 123 bytes).
        await receive()  # websocket.connect
        reason = f"{status} {code}: {message}".encode()[:123].decode("utf-8", "ignore")
        await send({"type": "websocket.close", "code": 1008, "reason": reason})
        return
    await JSONResponse(error_body(status, message, code), status_code=status, headers=headers)(scope, receive, send)


class HostCheck:
    """Answers only requests whose Host header names one of `allowed` (host names, no ports)."""

    def __init__(self, app: ASGIApp, allowed: Iterable[str]) -> None:
        self.app = app
        self.allowed = frozenset(_canonical(h.strip().lower().strip("[]")) for h in allowed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            hosts = [value for key, value in scope.get("headers", []) if key.lower() == b"host"]
            if len(hosts) > 1:  # RFC 9112: a 400; which of them a proxy or this check would read is anyone's guess
                await _refuse(scope, receive, send, 400, f"the request has {len(hosts)} Host headers; it may have "
                              "one", "invalid_host")
                return
            given = hosts[0].decode("latin-1") if hosts else ""
            host = host_name(given)
            if host is None:
                await _refuse(scope, receive, send, 400, f"Host {given[:100]!r} is not a host name with an optional "
                              "port", "invalid_host")
                return
            if host not in self.allowed:
                await _refuse(scope, receive, send, 400, f"Host {host[:100]!r} is not served here (--allowed-hosts)",
                              "invalid_host")
                return
        await self.app(scope, receive, send)


def _canonical(name: str) -> str:
    try:
        return str(ipaddress.IPv6Address(name))
    except ValueError:
        return name


def origin_key(origin: str) -> str | None:
    """'http://LocalHost:80' -> 'http://localhost' (what two spellings of one origin share); None if it is
    no http(s) origin ('null', a file:// page)."""
    try:
        parts = urlsplit(origin.strip().lower())
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in _DEFAULT_PORTS or not parts.hostname:
        return None
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    if port is not None and str(port) != _DEFAULT_PORTS[parts.scheme]:
        host += f":{port}"
    return f"{parts.scheme}://{host}"


class OriginCheck:
    """Refuses requests from web pages of other origins than the server's own and `allowed` ("*": any)."""

    def __init__(self, app: ASGIApp, allowed: Iterable[str]) -> None:
        self.app = app
        allowed = list(allowed)
        self.any = "*" in allowed
        self.allowed = frozenset(k for k in map(origin_key, allowed) if k is not None)

    def _allows(self, scope: Scope, origin: str) -> bool:
        if self.any:
            return True
        key = origin_key(origin)
        if key is None:
            return False
        if key in self.allowed:
            return True
        scheme = {"ws": "http", "wss": "https"}.get(scope.get("scheme", "http"), scope.get("scheme", "http"))
        own = origin_key(f"{scheme}://{scope_header(scope, b'host') or ''}")  # a WebSocket's page is http(s)
        return key == own  # our own pages (the API docs) post with an Origin too

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            origin = scope_header(scope, b"origin")
            if origin is not None and not self._allows(scope, origin):
                await _refuse(scope, receive, send, 403, f"requests from origin {origin[:100]!r} are not allowed "
                              "(--allowed-origins)", "origin_not_allowed")
                return
        await self.app(scope, receive, send)


class ApiKeyAuth:
    """Requires `Authorization: Bearer <one of keys>` on every path but OPEN_PATHS, and /metrics unless
    `protect_metrics`."""

    def __init__(self, app: ASGIApp, keys: Iterable[str], protect_metrics: bool = False) -> None:
        self.app = app
        self.keys = [k.encode() for k in keys]
        self.open_paths = OPEN_PATHS if protect_metrics else OPEN_PATHS | {METRICS_PATH}

    def _valid(self, given: str | None) -> bool:
        scheme, _, token = (given or "").strip().partition(" ")
        if scheme.lower() != "bearer":
            return False
        token_bytes = token.strip().encode("latin-1", "replace")
        # every key is compared, so the time taken does not say which key came close
        return sum(hmac.compare_digest(token_bytes, k) for k in self.keys) > 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and scope["path"] not in self.open_paths:
            given = scope_header(scope, b"authorization")
            if not self._valid(given):
                message = ("missing API key: send Authorization: Bearer <key>" if given is None
                           else "incorrect API key provided")
                await _refuse(scope, receive, send, 401, message, "invalid_api_key", {"WWW-Authenticate": "Bearer"})
                return
        await self.app(scope, receive, send)
