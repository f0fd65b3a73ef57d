"""A small fake streaming speech server for the bench tests: plain asyncio HTTP/1.1, no model.

`POST /v1/audio/speech` streams `num_frames` frames of s16le PCM (1920 samples each, one chunk per frame,
`frame_delay_s` apart). The `input` text picks a misbehaviour: `fail…` → 500, `hang…` → one chunk then
silence, `cut…` → two chunks then the connection is closed mid-body, `json…` → a 200 JSON body, `empty…` →
a 200 stream with no audio. `GET /health` answers 200.

Used in-process (`FakeSpeechServer.start()` inside a running loop) or as a subprocess standing in for
`legato serve` (`python tests/bench_fake_server.py --port P --topology T ...`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal

FRAME_SAMPLES = 1920


class FakeSpeechServer:
    def __init__(self, frame_delay_s: float = 0.01, host: str = "127.0.0.1", port: int = 0):
        self.frame_delay_s = frame_delay_s
        self.host, self.port = host, port
        self.bodies: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self._server: asyncio.AbstractServer | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> FakeSpeechServer:
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        self._server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:  # keep-alive: many requests per connection
                line = await reader.readline()
                if not line:
                    break
                method, path, _ = line.decode().split(" ", 2)
                headers = {}
                while (h := await reader.readline()) not in (b"\r\n", b"\n", b""):
                    k, _, v = h.decode().partition(":")
                    headers[k.strip().lower()] = v.strip()
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                if not await self._route(method, path, body, writer):
                    break
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _simple(self, writer, status: str, ctype: str, data: bytes) -> bool:
        writer.write(f"HTTP/1.1 {status}\r\ncontent-type: {ctype}\r\ncontent-length: {len(data)}\r\n\r\n".encode()
                     + data)
        await writer.drain()
        return True

    async def _route(self, method: str, path: str, raw: bytes, writer) -> bool:
        if method == "GET" and path == "/health":
            return await self._simple(writer, "200 OK", "application/json", b'{"status":"ok"}')
        if method != "POST" or path != "/v1/audio/speech":
            return await self._simple(writer, "404 Not Found", "application/json", b'{"error":"not found"}')
        body = json.loads(raw)
        self.bodies.append(body)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self._speech(body, writer)
        finally:
            self.in_flight -= 1

    async def _speech(self, body: dict, writer) -> bool:
        text = body.get("input", "")
        if text.startswith("fail"):
            return await self._simple(writer, "500 Internal Server Error", "application/json",
                                      b'{"error":{"message":"engine exploded","code":500}}')
        if text.startswith("json"):
            return await self._simple(writer, "200 OK", "application/json", b'{"audio":"nope"}')
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: audio/pcm\r\nx-sample-rate: 24000\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        await writer.drain()
        frames = 0 if text.startswith("empty") else int(body.get("num_frames") or 4)
        frame = bytes(range(256)) * (FRAME_SAMPLES * 2 // 256)
        for i in range(frames):
            await asyncio.sleep(self.frame_delay_s)
            writer.write(f"{len(frame):x}\r\n".encode() + frame + b"\r\n")
            await writer.drain()
            if text.startswith("hang"):
                await asyncio.sleep(3600)
            if text.startswith("cut") and i == 1:
                return False  # the caller closes the socket without the terminating chunk
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True


async def _serve_forever(args: argparse.Namespace) -> None:
    server = await FakeSpeechServer(args.frame_delay, args.host, args.port).start()
    print(f"fake server for topology {args.topology} on {server.url}", flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--topology", default="single")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--model", default=None)
    p.add_argument("--frame-delay", type=float, default=0.005)
    asyncio.run(_serve_forever(p.parse_args()))
