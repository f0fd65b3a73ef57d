"""The codec worker of `split` in its own process: `ProcessCodecClient` (server side) and `serve_codec` (the
worker side, entered from `legato.pipeline.worker` when its spec's role is "codec").

The worker loads only the codec decoder of the model directory and runs a `LocalCodecClient` on its own
thread, so the codec's Python work never competes with the server's event loop for one interpreter. Each
request is one stream: CodecOpen, then its frames as the talker makes them (the last one marked), and the
worker answers with chunks carrying PCM on the `single` chunk schedule. Both directions batch per event-loop
pass: the frames of one talker step for every stream cross as one CodecFrameBatch, and the PCM of one codec step
as one Chunks message. Process management
(spawning, readiness, heartbeats, dead-worker detection, ordered shutdown) is `ProcessEngineClient`'s,
used with role "codec": a killed codec worker fails its open streams with "worker died".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import zmq.asyncio

from legato.engine.codec_schedule import StreamSchedule
from legato.engine.config import EngineConfig
from legato.pipeline import heap
from legato.pipeline import messages as m
from legato.pipeline.client import SHUTTING_DOWN, EngineStats, RequestRejected, StreamChunk
from legato.pipeline.codec_engine import CodecOutput, load_codec_decoder
from legato.pipeline.codec_worker import (
    CodecChunk,
    CodecError,
    CodecSink,
    CodecStats,
    LocalCodecClient,
    codec_engine_options,
)
from legato.pipeline.front_links import emit
from legato.pipeline.process_client import ProcessEngineClient, model_info
from legato.pipeline.worker import (
    ChunkOutbox,
    PassOutbox,
    WorkerSpec,
    handle_safely,
    heartbeats,
    incoming,
)

log = logging.getLogger("legato.codec_worker")

_NO_CODES = np.zeros((0, 16), np.int64)


class ProcessCodecClient:
    """`LocalCodecClient`'s interface, served by a codec worker process. Call it from one event loop."""

    def __init__(self, model_path: str | Path, config: EngineConfig, device: str | None = None,
                 name: str = "legato", instance_id: str | None = None, worker_index: int = 0,
                 **process_options) -> None:
        self.worker = ProcessEngineClient(model_path, config, device, name, instance_id, worker_index,
                                          role="codec", **process_options)
        self._frames_decoded = 0  # the frames whose PCM reached a consumer
        # Frames queued during one event-loop pass, posted as one message when it ends: the talker's step reaches
        # every stream in one pass, so a step's frames cross to the worker once, not once per stream.
        self._frames = PassOutbox(self._post_batch)

    async def start(self) -> None:
        await self.worker.start()

    async def stop(self, grace_s: float = 10.0) -> None:
        await self.worker.stop(grace_s)

    def is_alive(self) -> bool:
        return self.worker.is_alive()

    def stats(self) -> CodecStats:
        s = self.worker.stats()
        return CodecStats(streams=s.running, frames_decoded=self._frames_decoded, failures=dict(s.aborted))

    async def abort(self, request_id: str, reason: str = "aborted") -> None:
        self._frames.flush()  # the stream's frames before its end, as they were made
        await self.worker.abort(request_id, reason)

    def _post_batch(self, entries: list[tuple[str, np.ndarray, bool]]) -> None:
        self.worker.post(m.CodecFrames(*entries[0]) if len(entries) == 1 else m.CodecFrameBatch(entries))

    async def open_feed(self, request_id: str, ref_code: torch.Tensor | None = None,
                        first_chunk_frames: int | None = None) -> CodecFeed:
        """Opens a codec stream whose frames are pushed (`CodecFeed`) rather than read from an iterator by a task,
        and whose chunks `read` yields. Raises CodecError if the worker cannot take it. A stream just left under
        the same id (a client's retry) is waited for, as the talker's is."""
        await self.worker.until_ended(request_id)
        ref = None if ref_code is None else ref_code.detach().to("cpu", torch.int64).numpy()
        try:
            chunks = self.worker.stream(request_id, m.CodecOpen(request_id, ref, first_chunk_frames))
        except RequestRejected as e:
            raise CodecError(e.message, code=e.code) from None
        return CodecFeed(self, request_id, chunks)

    async def read(self, feed: CodecFeed) -> AsyncIterator[CodecChunk]:
        """`feed`'s PCM chunks, the last with `last` set. Raises CodecError when the stream fails or is aborted,
        or the exception the feed failed with (`CodecFeed.fail`); closing this iterator early aborts the stream."""
        emitted, failure = 0, None
        try:
            async with contextlib.aclosing(feed.chunks) as chunks:
                async for chunk in chunks:
                    if chunk.finish_reason in ("error", "abort"):
                        failure = feed.failure or CodecError(chunk.error or chunk.finish_reason,
                                                             aborted=chunk.finish_reason == "abort")
                        break
                    new, emitted = chunk.num_frames - emitted, chunk.num_frames
                    self._frames_decoded += new
                    yield CodecChunk(chunk.audio, new, chunk.finished, chunk.stages)
                    if chunk.finished:
                        return
        except RequestRejected as e:  # the worker refused the stream (shutting down, duplicate id)
            raise CodecError(e.message, code=e.code) from None
        if failure is not None:  # out here: a talker refusal reaches the caller as itself, not as a CodecError
            raise failure

    async def decode(self, request_id: str, frames: AsyncIterator[np.ndarray], ref_code: torch.Tensor | None = None,
                     first_chunk_frames: int | None = None) -> AsyncIterator[CodecChunk]:
        """As `LocalCodecClient.decode`: CodecError when the stream fails or is aborted, the exception of
        `frames` when that fails, and closing early aborts the stream."""
        feed = await self.open_feed(request_id, ref_code, first_chunk_frames)
        feeder = asyncio.create_task(_feed(feed, frames))
        try:
            async with contextlib.aclosing(self.read(feed)) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            # Not awaited: the caller's own abort of the source (SplitClient's "codec failed") goes first.
            feeder.cancel()
            feeder.add_done_callback(_failure)


class CodecFeed:
    """One codec stream's frames, pushed as they are made: each leaves with the event-loop pass's batch (one
    message for every stream's frames of a talker step). `end` marks the last; `fail` drops the stream in the
    worker and makes its reader raise the given exception. Nothing is sent after either."""

    def __init__(self, client: ProcessCodecClient, request_id: str, chunks: AsyncIterator[StreamChunk]) -> None:
        self._client, self.request_id, self.chunks = client, request_id, chunks
        self.failure: BaseException | None = None
        self.ended = False

    def push(self, codes: np.ndarray) -> None:
        if not self.ended:
            self._client._frames.put((self.request_id, np.asarray(codes, np.int64).reshape(-1, 16), False))

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            self._client._frames.put((self.request_id, _NO_CODES, True))

    def fail(self, error: BaseException) -> None:
        if not self.ended:
            self.ended, self.failure = True, error
            self._client._frames.flush()  # the stream's frames before its end, as they were made
            self._client.worker.post(m.Abort(self.request_id, "the code source failed"))


async def _feed(feed: CodecFeed, frames: AsyncIterator[np.ndarray]) -> None:
    """`frames` into `feed`; a source that fails fails the feed (its reader raises the source's exception)."""
    try:
        async for codes in frames:
            feed.push(codes)
    except asyncio.CancelledError:
        raise
    except Exception as e:
        feed.fail(e)
        raise
    feed.end()


def _failure(task: asyncio.Task) -> BaseException | None:
    """The exception `task` ended with (retrieving it), if it has ended with one."""
    if task.done() and not task.cancelled():
        return task.exception()
    return None


# --- the worker process -------------------------------------------------------------------------------


@dataclass
class _OpenStream:
    emitted: int = 0  # frames whose PCM went out
    first_frames_at: float | None = None  # its first frames' arrival: the start of its `codec_worker` stage
    stamped: bool = False  # its first audio carried that stage


class _CodecWorker:
    """The worker side: frames from the server go to the codec thread as one hand-over per message, and its outputs
    come back to `put_nowait` on this event loop, one call per decode for every stream, into the outbox (one
    message a pass). No task or queue per stream: at 64 streams, two tasks per stream woken per frame cost about a
    quarter of this process's CPU besides the decode (`benchmarks/codec_worker_hop.py`)."""

    def __init__(self, spec: WorkerSpec, codec: LocalCodecClient, out: zmq.asyncio.Socket) -> None:
        self.spec, self.codec, self.out = spec, codec, out
        self.streams: dict[str, _OpenStream] = {}
        self.sink = CodecSink(asyncio.get_running_loop(), self)
        self.idle = asyncio.Event()  # no stream open (the drain waits for it)
        self.idle.set()
        self.stop = asyncio.Event()
        self.grace_s = 0.0
        self.draining = False
        # A codec step's PCM for all streams, one message; one ending a stream is preceded by fresh Stats.
        self.outbox = ChunkOutbox(lambda msg: emit(self.out, msg), lambda: m.Stats(self.stats()))

    async def send(self, msg: m.Message) -> None:
        self.outbox.flush()  # chunks queued before this message leave before it
        await self.out.send_multipart(m.encode(msg))

    def stats(self) -> EngineStats:
        return EngineStats(running=len(self.streams), aborted=dict(self.codec.stats().failures))

    async def serve(self, cmd: zmq.asyncio.Socket) -> None:
        # A codec thread that ended on its own (crashed) ends the worker, so the server sees it down.
        alive = lambda: self.draining or self.codec.is_alive()  # noqa: E731
        beats = asyncio.create_task(heartbeats(self.spec, self.send, self.stats, self.stop, alive=alive))
        receiving = asyncio.create_task(self.receive(cmd))
        await self.stop.wait()
        # Open streams end on their own within the grace (aborts still heard), then the codec fails the rest,
        # whose last chunks still go out.
        deadline = time.monotonic() + self.grace_s
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.idle.wait(), self.grace_s)
        receiving.cancel()
        await self.codec.stop(max(0.0, deadline - time.monotonic()))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.idle.wait(), 5.0)
        await self.send(m.Stats(self.stats()))
        beats.cancel()

    async def receive(self, cmd: zmq.asyncio.Socket) -> None:
        async for msg in incoming(cmd, self.spec.max_message_bytes):
            await handle_safely(self.handle, msg)

    async def handle(self, msg: m.Message) -> None:
        if isinstance(msg, m.CodecOpen):
            await self.open(msg)
        elif isinstance(msg, m.CodecFrames):
            self.frames([(msg.request_id, msg.codes, msg.last)])
        elif isinstance(msg, m.CodecFrameBatch):
            self.frames(msg.entries)
        elif isinstance(msg, m.Abort):
            if msg.request_id in self.streams:  # its last output (aborted) comes back through put_nowait
                await self.codec.abort(msg.request_id, msg.reason)
        elif isinstance(msg, m.Shutdown):
            log.info("shutdown requested (grace %.1f s)", msg.grace_s)
            self.grace_s, self.draining = msg.grace_s, True
            self.stop.set()
        else:
            log.error("dropping a %s: not a message for a codec worker", type(msg).__name__)

    async def open(self, msg: m.CodecOpen) -> None:
        rid = msg.request_id
        if self.draining or rid in self.streams:
            why = "the codec worker is shutting down" if self.draining else f"codec stream {rid!r} is open"
            await self.send(m.Rejected(rid, 503 if self.draining else 400, why,
                                       code=SHUTTING_DOWN if self.draining else None))
            return
        ref = None if msg.ref_code is None else torch.from_numpy(msg.ref_code)
        if not self.codec.open_stream(rid, self.sink, ref, msg.first_chunk_frames):
            await self.send(m.Chunk(rid, _end("error", "the codec worker is not running", 0)))
            return
        self.streams[rid] = _OpenStream()
        self.idle.clear()

    def frames(self, entries: list[tuple[str, np.ndarray, bool]]) -> None:
        now = time.perf_counter()
        taken = []
        for rid, codes, last in entries:
            st = self.streams.get(rid)
            if st is None:  # frames of a stream that ended (aborted, failed) are dropped
                continue
            if st.first_frames_at is None and len(codes):
                st.first_frames_at = now
            taken.append((rid, codes, last))
        if taken:
            self.codec.push_frames(taken)

    def put_nowait(self, out: CodecOutput) -> None:
        """One stream's output from the codec thread (as `CodecSink`'s receiver), on this event loop. The thread
        hands a decode call's outputs for every stream over in one call: one that cannot be passed on fails its
        own stream, and the others' still go out."""
        st = self.streams.get(out.request_id)
        if st is None:
            return
        try:
            self._pass_on(out, st)
        except Exception as e:
            log.exception("codec stream %s failed", out.request_id)
            self._close(out.request_id)
            if not out.finished:  # the codec thread still holds it: dropped there, nobody to tell
                self.codec.drop_stream(out.request_id)
            self.outbox.put((out.request_id, _end("error", f"codec worker error: {e}", st.emitted)))

    def _pass_on(self, out: CodecOutput, st: _OpenStream) -> None:
        rid = out.request_id
        if out.error is not None:
            chunk = _end("abort" if out.aborted else "error", out.error, st.emitted)
        else:
            chunk = StreamChunk(out.audio, st.emitted + out.frames, finished=out.finished,
                                finish_reason="stop" if out.finished else None)
            if out.audio.size and not st.stamped and st.first_frames_at is not None:  # its time in here
                chunk.stages, st.stamped = {"codec_worker": time.perf_counter() - st.first_frames_at}, True
            st.emitted = chunk.num_frames
        if chunk.finished:
            self._close(rid)
        self.outbox.put((rid, chunk))

    def _close(self, rid: str) -> None:
        self.streams.pop(rid, None)
        if not self.streams:
            self.idle.set()


def _end(reason: str, error: str, frames: int) -> StreamChunk:
    return StreamChunk(np.zeros(0, np.float32), frames, finished=True, finish_reason=reason, error=error)


async def serve_codec(spec: WorkerSpec, config: EngineConfig, out: zmq.asyncio.Socket,
                      cmd: zmq.asyncio.Socket) -> None:
    """The codec worker's life: load the decoder, say Ready, serve until Shutdown (or the server is gone)."""
    decoder = load_codec_decoder(spec.model_path, config.device)
    codec = LocalCodecClient(decoder, StreamSchedule.of(config), name=f"{spec.name}-codec",
                             **codec_engine_options(config))
    await codec.start()
    if codec.engine.device.type == "cuda":  # warmed up: the heap it leaves is never walked by a full collection
        heap.freeze_heap()
    worker = _CodecWorker(spec, codec, out)
    await worker.send(m.Ready(model_info(spec.model_path, spec.name), os.getpid(), {}))
    log.info("ready: codec decoder of %s on %s", spec.model_path, config.device)
    await worker.serve(cmd)
