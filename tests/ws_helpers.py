"""A streaming-text WebSocket client over Starlette's TestClient whose every wait has a deadline."""

from __future__ import annotations

import json
import time

import anyio

from legato.server.ws_protocol import split_binary_frame


async def _receive(rx, timeout_s: float):
    with anyio.fail_after(timeout_s):
        return await rx.receive()


class WsClient:
    def __init__(self, session, timeout_s: float = 60.0) -> None:
        self.ws = session
        self.timeout_s = timeout_s
        self.audio: dict[str, bytearray] = {}
        self.events: list[dict] = []

    def send(self, **event) -> None:
        self.ws.send_text(json.dumps(event))

    def receive(self) -> dict:
        """The next message: a text event as a dict, a binary audio frame as {"type": "audio", ...}, or a close
        as {"type": "close", ...}. Raises TimeoutError past the deadline instead of waiting forever."""
        msg = self.ws.portal.call(_receive, self.ws._send_rx, self.timeout_s)
        if msg["type"] == "websocket.close":
            return {"type": "close", "code": msg.get("code"), "reason": msg.get("reason")}
        if msg.get("bytes") is not None:
            cid, audio = split_binary_frame(msg["bytes"])
            self.audio.setdefault(cid, bytearray()).extend(audio)
            return {"type": "audio", "context_id": cid, "bytes": len(audio)}
        event = json.loads(msg["text"])
        self.events.append(event)
        return event

    def until(self, predicate, what: str, errors_ok: bool = False) -> dict:
        """Reads messages until one satisfies `predicate` (audio is collected on the way); an error event on the
        way fails, unless `errors_ok`."""
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            msg = self.receive()
            if predicate(msg):
                return msg
            if msg["type"] == "error" and not errors_ok:
                raise AssertionError(f"error event while waiting for {what}: {msg}")
            if msg["type"] == "close":
                raise AssertionError(f"socket closed ({msg}) while waiting for {what}")
        raise TimeoutError(f"no {what} within {self.timeout_s} s")

    def close_and_wait(self, http, timeout_s: float = 60.0) -> None:
        """Closes the socket and waits (polling /metrics, with a deadline) until the server has finished it.
        Starlette's TestClient cancels the app as soon as its `with` block ends; a socket whose session is
        still winding down then ends in a CancelledError instead of a clean finish."""
        self.ws.send({"type": "websocket.disconnect", "code": 1000})
        deadline = time.monotonic() + timeout_s
        while "legato_ws_open_sockets 0.0" not in (metrics := http.get("/metrics").text):
            if time.monotonic() > deadline:
                sockets = [line for line in metrics.splitlines() if line.startswith("legato_ws_open")]
                raise TimeoutError(f"the server did not finish the socket: {sockets}")
            time.sleep(0.01)

    def event(self, kind: str, context_id: str | None = None) -> dict:
        return self.until(lambda m: m["type"] == kind and (context_id is None or m.get("context_id") == context_id),
                          f"{kind} {context_id or ''}")
