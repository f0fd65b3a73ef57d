"""How an engine thread's results reach asyncio event loops: per request an `EngineStream` (a queue, or a sink
shared by many requests), and per engine step one cross-thread call per event loop and per sink (`StepHandover`),
not one per chunk. At 64 streams a step's outputs were as many cross-thread callbacks, each taking the loop's lock
and writing its wake-up pipe while the engine thread held the GIL; at 256 a worker's event loop spent ~4.5 ms a
step waking one task per chunk, which a sink avoids.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from legato.pipeline.client import StreamChunk, put_all

# Takes one engine step's chunks of the requests that share it, [(request_id, chunk), ...] in the engine's order.
ChunkSink = Callable[[list[tuple[str, StreamChunk]]], None]


@dataclass
class EngineStream:
    """Where a request's chunks go, on `loop`: its `queue` (`generate`), or its `sink` (`generate_into`), which
    takes a step's chunks of every stream sharing it in one call, then `done` is set once its last chunk went."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue | None = None
    sink: ChunkSink | None = None
    done: asyncio.Future | None = None
    # perf_counter() stamps for the first audio chunk's `stages` (None: none wanted, or they went out): `marks`
    # from the caller's side (called; voice found, admission took it, prompt built), then the hand-off to the engine
    # thread and the engine's taking it.
    marks: dict[str, float] | None = None
    submitted: float = 0.0
    added: float = 0.0


class StepHandover:
    """One engine step's chunks, grouped by where they go; `send` makes one cross-thread call per group. A
    request's first chunk with audio (or, from a talker-only engine, with codes) gets its `stages` here."""

    def __init__(self) -> None:
        self._queued: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, StreamChunk]]] = {}
        self._sunk: dict[tuple[asyncio.AbstractEventLoop, Callable], tuple[list, list]] = {}

    def add(self, stream: EngineStream, request_id: str, chunk: StreamChunk) -> None:
        marks = stream.marks
        # The first audio; a talker-only engine (`split`) sends codes alone, and its first codes are what it gives.
        if marks is not None and "called" in marks and (chunk.audio.size or (chunk.codes is not None
                                                                             and chunk.codes.size)):
            called = marks["called"]
            chunk.stages = {"prepare": stream.submitted - called, "inbox": stream.added - stream.submitted,
                            "engine": time.perf_counter() - stream.added}
            if all(k in marks for k in ("voice", "taken", "built")):  # `prepare`, split
                chunk.stages.update(voice=marks["voice"] - called, queue=marks["taken"] - marks["voice"],
                                    build=marks["built"] - marks["taken"], resume=stream.submitted - marks["built"])
            stream.marks = None
        if stream.sink is None:
            self._queued.setdefault(stream.loop, []).append((stream.queue, chunk))
        else:
            items, done = self._sunk.setdefault((stream.loop, stream.sink), ([], []))
            items.append((request_id, chunk))
            if chunk.finished:
                done.append(stream.done)

    def send(self) -> None:
        for loop, items in self._queued.items():
            _call_on(loop, put_all, items)
        for (loop, sink), (items, done) in self._sunk.items():
            _call_on(loop, _sink_all, sink, items, done)


def _call_on(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # that event loop is closed: nobody is left to read or be told
        pass


def _sink_all(sink: Callable, items: list[tuple[str, StreamChunk]], done: list[asyncio.Future]) -> None:
    """On the event loop: a step's chunks into their sink, then the streams they ended are done (a failing sink
    still ends them: their callers must not wait forever)."""
    try:
        sink(items)
    finally:
        for fut in done:
            if not fut.done():
                fut.set_result(None)


def settle(fut: asyncio.Future, result=None, error: Exception | None = None) -> None:
    """Completes an event-loop future from the engine thread (ignored if the waiter is gone)."""

    def apply() -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    _call_on(fut.get_loop(), apply)
