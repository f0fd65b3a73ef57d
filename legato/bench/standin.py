"""`legato bench standin`: a server stand-in that streams pre-made PCM at a set pace, with no model behind it.

It answers what `legato bench serve` asks of a real server (`GET /v1/models`, `GET /health`,
`POST /v1/audio/speech` as a chunked s16le stream) so the bench client can be measured alone: if the client
cannot keep up with a stand-in that makes audio at the engine's rate, its numbers against the real server
say nothing about the server.

The stand-in paces like the engine: one ticker advances every open stream by one frame per step
(`frame_samples` at `sample_rate`, `speed` times real time), and a stream writes a chunk when its next
chunk is complete, on the engine's chunk schedule (first chunk, then the ramp 1, 1, 2, 4, ... up to
`chunk_frames`). A request's length is its body's `num_frames` (what `--fixed-length` sends) or
`default_frames`. Writes never wait for a slow reader (the ticker serves every stream); `/health` reports
how late the ticker ran and how many bytes sat unsent, so a run can show the stand-in was not the limit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import signal
import time
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class StandinConfig:
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port, read back from `StandinServer.port`
    sample_rate: int = 24000
    frame_samples: int = 1920  # 12.5 frames per second of audio at 24 kHz
    speed: float = 1.0  # audio made per second of wall time, per stream (1: real time)
    default_frames: int = 50  # a request's length when its body gives no `num_frames`
    max_frames: int = 4096
    first_chunk_frames: int = 1
    chunk_frames: int = 25
    chunk_ramp: bool = True
    decode_slots: int | None = None  # what /v1/models says (the bench's default concurrency)
    model: str = "legato-standin"

    def __post_init__(self) -> None:
        if not self.speed > 0 or self.frame_samples < 1 or self.sample_rate < 1:
            raise ValueError("speed, frame_samples and sample_rate must be > 0")
        if min(self.default_frames, self.max_frames, self.first_chunk_frames, self.chunk_frames) < 1:
            raise ValueError("frame counts must be >= 1")

    @property
    def step_s(self) -> float:
        return self.frame_samples / self.sample_rate / self.speed


@dataclass
class StandinStats:
    streams: int = 0  # open now
    requests: int = 0  # speech requests taken since start
    completed: int = 0  # streams whose last byte is written
    ticks: int = 0
    late_ticks: int = 0  # ticks that ran more than one step late
    max_lag_s: float = 0.0  # the most a tick ran behind its planned time
    busy_s: float = 0.0  # the ticker's own time in its ticks: near the wall time means the stand-in is the limit
    max_unsent_bytes: int = 0  # the most bytes one stream held unsent (its reader behind)


class _Stream:
    __slots__ = ("writer", "total", "made", "sent", "due", "done")

    def __init__(self, writer: asyncio.StreamWriter, total: int, first: int) -> None:
        self.writer = writer
        self.total = total
        self.made = 0  # frames made
        self.sent = 0  # frames written
        self.due = min(first, total)  # frames the next chunk ends at
        self.done = asyncio.get_running_loop().create_future()


class StandinServer:
    """The stand-in on the running event loop: `await StandinServer(cfg).start()`, then `close()`."""

    def __init__(self, cfg: StandinConfig) -> None:
        self.cfg = cfg
        self.port = cfg.port
        import numpy as np  # here, not at the top: `legato --help` reads this module's defaults

        from legato.engine.codec_schedule import next_chunk_frames

        self._next_chunk = next_chunk_frames
        self.stats = StandinStats()
        # Pre-made audio: a quiet tone, as s16le, long enough for the longest request.
        n = cfg.max_frames * cfg.frame_samples
        tone = (3000 * np.sin(np.arange(n) * (2 * math.pi * 220 / cfg.sample_rate))).astype("<i2")
        self._pcm = memoryview(tone.tobytes())
        self._streams: list[_Stream] = []
        self._wake = asyncio.Event()
        self._server: asyncio.AbstractServer | None = None
        self._ticker: asyncio.Task | None = None

    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.port}"

    async def start(self) -> StandinServer:
        self._server = await asyncio.start_server(self._handle, self.cfg.host, self.cfg.port, backlog=4096)
        self.port = self._server.sockets[0].getsockname()[1]
        self._ticker = asyncio.get_running_loop().create_task(self._tick_forever())
        return self

    async def close(self) -> None:
        self._ticker.cancel()
        self._server.close()
        for s in self._streams:
            s.writer.close()

    # --- pacing -------------------------------------------------------------------------------------------

    async def _tick_forever(self) -> None:
        step = self.cfg.step_s
        while True:
            if not self._streams:  # idle: the next stream starts a fresh schedule
                self._wake.clear()
                await self._wake.wait()
                planned = time.perf_counter() + step
            delay = planned - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            started = time.perf_counter()
            lag = started - planned
            self.stats.max_lag_s = max(self.stats.max_lag_s, lag)
            self.stats.late_ticks += lag > step
            self._tick()
            self.stats.ticks += 1
            self.stats.busy_s += time.perf_counter() - started
            planned += step
            if planned < started:  # more than a step late: lost steps are not made up in a burst
                planned = started + step

    def _tick(self) -> None:
        cfg, frame_bytes = self.cfg, self.cfg.frame_samples * 2
        still = []
        for s in self._streams:
            s.made += 1
            if s.made >= s.due:
                data = self._pcm[s.sent * frame_bytes:s.made * frame_bytes]
                s.writer.write(b"%x\r\n" % len(data))
                s.writer.write(data)
                s.writer.write(b"\r\n")
                s.sent = s.made
                s.due = min(s.made + self._next_chunk(s.made, cfg.first_chunk_frames, cfg.chunk_frames,
                                                      cfg.chunk_ramp), s.total)
                unsent = s.writer.transport.get_write_buffer_size()
                self.stats.max_unsent_bytes = max(self.stats.max_unsent_bytes, unsent)
            if s.made >= s.total:
                s.writer.write(b"0\r\n\r\n")
                s.done.set_result(None)
                self.stats.completed += 1
            else:
                still.append(s)
        self._streams = still
        self.stats.streams = len(still)

    # --- HTTP ---------------------------------------------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:  # keep-alive: many requests per connection
                line = await reader.readline()
                if not line:
                    break
                method, path, _ = line.decode("latin-1").split(" ", 2)
                length = 0
                while (h := await reader.readline()) not in (b"\r\n", b"\n", b""):
                    k, _, v = h.decode("latin-1").partition(":")
                    if k.strip().lower() == "content-length":
                        length = int(v)
                body = await reader.readexactly(length)
                await self._route(method, path.split("?", 1)[0], body, writer)
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            writer.close()

    async def _route(self, method: str, path: str, body: bytes, writer: asyncio.StreamWriter) -> None:
        if method == "GET" and path == "/v1/models":
            card = {"id": self.cfg.model, "object": "model", "created": 0, "owned_by": "legato",
                    "task_type": "CustomVoice", "sample_rate": self.cfg.sample_rate, "languages": ["auto"],
                    "voices": ["ryan"], "max_num_seqs": self.cfg.decode_slots, "decode_slots": self.cfg.decode_slots}
            await _json(writer, "200 OK", {"object": "list", "data": [card]})
        elif method == "GET" and path == "/health":
            await _json(writer, "200 OK", {"status": "ok", "standin": {**asdict(self.stats),
                                                                        "config": asdict(self.cfg)}})
        elif method == "POST" and path == "/v1/audio/speech":
            await self._speech(json.loads(body or b"{}"), writer)
        else:
            await _json(writer, "404 Not Found", {"error": {"message": f"no route {method} {path}", "code": 404}})

    async def _speech(self, body: dict, writer: asyncio.StreamWriter) -> None:
        frames = body.get("num_frames")
        frames = frames if isinstance(frames, int) and frames >= 1 else self.cfg.default_frames
        stream = _Stream(writer, min(frames, self.cfg.max_frames), self.cfg.first_chunk_frames)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: audio/pcm\r\ntransfer-encoding: chunked\r\n"
                     b"x-sample-rate: %d\r\n\r\n" % self.cfg.sample_rate)
        self.stats.requests += 1
        self._streams.append(stream)
        self.stats.streams = len(self._streams)
        self._wake.set()
        await stream.done
        await writer.drain()


async def _json(writer: asyncio.StreamWriter, status: str, obj: dict) -> None:
    data = json.dumps(obj).encode()
    writer.write(b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                 % (status.encode(), len(data)) + data)
    await writer.drain()


async def serve_forever(cfg: StandinConfig) -> None:
    server = await StandinServer(cfg).start()
    print(f"legato bench standin: {server.url}, one {cfg.frame_samples}-sample frame per stream every "
          f"{cfg.step_s * 1000:.1f} ms ({cfg.speed:g}x real time)", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.close()


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = StandinConfig()
    p.add_argument("--host", default=d.host, help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0: a free one)")
    p.add_argument("--speed", type=float, default=d.speed, help="audio per stream per wall second (x real time)")
    p.add_argument("--sample-rate", type=int, default=d.sample_rate, help="PCM sample rate")
    p.add_argument("--frame-samples", type=int, default=d.frame_samples, help="samples per frame (one step)")
    p.add_argument("--default-frames", type=int, default=d.default_frames, help="frames when a body has no num_frames")
    p.add_argument("--first-chunk-frames", type=int, default=d.first_chunk_frames, help="frames in the first chunk")
    p.add_argument("--chunk-frames", type=int, default=d.chunk_frames, help="frames in each later chunk")
    p.add_argument("--chunk-ramp", action=argparse.BooleanOptionalAction, default=d.chunk_ramp,
                   help="grow chunks 1, 1, 2, 4, ... up to --chunk-frames, as the engine does")
    p.add_argument("--decode-slots", type=int, default=None, help="the concurrency /v1/models advertises")


def config_from_args(args: argparse.Namespace) -> StandinConfig:
    return StandinConfig(host=args.host, port=args.port, sample_rate=args.sample_rate,
                         frame_samples=args.frame_samples, speed=args.speed, default_frames=args.default_frames,
                         first_chunk_frames=args.first_chunk_frames, chunk_frames=args.chunk_frames,
                         chunk_ramp=args.chunk_ramp, decode_slots=args.decode_slots)
