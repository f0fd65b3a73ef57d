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
from pathlib import Path

import numpy as np
import torch
import zmq.asyncio

from legato.engine.codec_schedule import StreamSchedule
from legato.engine.config import EngineConfig
from legato.pipeline import heap
from legato.pipeline import messages as m
from legato.pipeline.client import SHUTTING_DOWN, EngineStats, RequestRejected, StreamChunk
from legato.pipeline.codec_engine import load_codec_decoder
from legato.pipeline.codec_worker import (
    CodecChunk,
    CodecError,
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
    drain,
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

    async def decode(self, request_id: str, frames: AsyncIterator[np.ndarray], ref_code: torch.Tensor | None = None,
                     first_chunk_frames: int | None = None) -> AsyncIterator[CodecChunk]:
        """As `LocalCodecClient.decode`: CodecError when the stream fails or is aborted, the exception of
        `frames` when that fails, and closing early aborts the stream."""
        ref = None if ref_code is None else ref_code.detach().to("cpu", torch.int64).numpy()
        try:
            chunks = self.worker.stream(request_id, m.CodecOpen(request_id, ref, first_chunk_frames))
        except RequestRejected as e:
            raise CodecError(e.message, code=e.code) from None
        feeder = asyncio.create_task(self._feed(request_id, frames))
        emitted = 0
        try:
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    if chunk.finish_reason in ("error", "abort"):
                        source_failed = _failure(feeder)
                        if source_failed is not None:
                            raise source_failed
                        raise CodecError(chunk.error or chunk.finish_reason, aborted=chunk.finish_reason == "abort")
                    new, emitted = chunk.num_frames - emitted, chunk.num_frames
                    self._frames_decoded += new
                    yield CodecChunk(chunk.audio, new, chunk.finished, chunk.stages)
                    if chunk.finished:
                        return
        except RequestRejected as e:  # the worker refused the stream (shutting down, duplicate id)
            raise CodecError(e.message, code=e.code) from None
        finally:
            # Not awaited: the caller's own abort of the source (SplitClient's "codec failed") goes first.
            feeder.cancel()
            feeder.add_done_callback(_failure)

    async def _feed(self, request_id: str, frames: AsyncIterator[np.ndarray]) -> None:
        try:
            async for codes in frames:
                self._frames.put((request_id, np.asarray(codes, np.int64).reshape(-1, 16), False))
        except asyncio.CancelledError:
            raise
        except Exception:  # the source failed: the worker drops the stream, the consumer gets this exception
            self._frames.flush()
            self.worker.post(m.Abort(request_id, "the code source failed"))
            raise
        self._frames.put((request_id, _NO_CODES, True))


def _failure(task: asyncio.Task) -> BaseException | None:
    """The exception `task` ended with (retrieving it), if it has ended with one."""
    if task.done() and not task.cancelled():
        return task.exception()
    return None


# --- the worker process -------------------------------------------------------------------------------


class _StreamAborted(Exception):
    pass


class _CodecWorker:
    def __init__(self, spec: WorkerSpec, codec: LocalCodecClient, out: zmq.asyncio.Socket) -> None:
        self.spec, self.codec, self.out = spec, codec, out
        self.feeds: dict[str, asyncio.Queue] = {}  # open streams' frames, None ends one
        self.tasks: dict[str, asyncio.Task] = {}
        self.stop = asyncio.Event()
        self.grace_s = 0.0
        self.draining = False
        self.outbox = ChunkOutbox(lambda msg: emit(self.out, msg))  # a codec step's PCM for all streams, one message

    async def send(self, msg: m.Message) -> None:
        self.outbox.flush()  # chunks queued before this message leave before it
        await self.out.send_multipart(m.encode(msg))

    def stats(self) -> EngineStats:
        s = self.codec.stats()
        return EngineStats(running=s.streams, aborted=dict(s.failures))

    async def serve(self, cmd: zmq.asyncio.Socket) -> None:
        # A codec thread that ended on its own (crashed) ends the worker, so the server sees it down.
        alive = lambda: self.draining or self.codec.is_alive()  # noqa: E731
        beats = asyncio.create_task(heartbeats(self.spec, self.send, self.stats, self.stop, alive=alive))
        receiving = asyncio.create_task(self.receive(cmd))
        await self.stop.wait()
        await drain(self.tasks, self.grace_s, receiving, self.codec.stop)  # the codec fails what stays open
        if self.tasks:
            await asyncio.wait(list(self.tasks.values()), timeout=5.0)
        await self.send(m.Stats(self.stats()))
        beats.cancel()

    async def receive(self, cmd: zmq.asyncio.Socket) -> None:
        async for msg in incoming(cmd, self.spec.max_message_bytes):
            await handle_safely(self.handle, msg)

    async def handle(self, msg: m.Message) -> None:
        if isinstance(msg, m.CodecOpen):
            rid = msg.request_id
            if self.draining or rid in self.tasks:
                why = "the codec worker is shutting down" if self.draining else f"codec stream {rid!r} is open"
                await self.send(m.Rejected(rid, 503 if self.draining else 400, why,
                                           code=SHUTTING_DOWN if self.draining else None))
                return
            self.feeds[rid] = asyncio.Queue()
            self.tasks[rid] = asyncio.create_task(self.stream(msg))
        elif isinstance(msg, m.CodecFrames):
            self.frames(msg.request_id, msg.codes, msg.last)
        elif isinstance(msg, m.CodecFrameBatch):
            for rid, codes, last in msg.entries:
                self.frames(rid, codes, last)
        elif isinstance(msg, m.Abort):
            feed = self.feeds.get(msg.request_id)
            if feed is not None:
                # Both: the marker ends a stream still waiting for frames, the abort one decoding its tail.
                feed.put_nowait(_StreamAborted(msg.reason))
                await self.codec.abort(msg.request_id, msg.reason)
        elif isinstance(msg, m.Shutdown):
            log.info("shutdown requested (grace %.1f s)", msg.grace_s)
            self.grace_s, self.draining = msg.grace_s, True
            self.stop.set()
        else:
            log.error("dropping a %s: not a message for a codec worker", type(msg).__name__)

    def frames(self, rid: str, codes: np.ndarray, last: bool) -> None:
        feed = self.feeds.get(rid)
        if feed is not None:  # frames of a stream that ended (aborted, failed) are dropped
            feed.put_nowait(codes)
            if last:
                feed.put_nowait(None)

    async def stream(self, msg: m.CodecOpen) -> None:
        rid, feed = msg.request_id, self.feeds[msg.request_id]
        first_frames_at: float | None = None  # the start of its first audio's `codec_worker` stage

        async def frames() -> AsyncIterator[np.ndarray]:
            nonlocal first_frames_at
            while True:
                item = await feed.get()
                if item is None:
                    return
                if isinstance(item, _StreamAborted):
                    raise item
                if first_frames_at is None and len(item):
                    first_frames_at = time.perf_counter()
                yield item

        ref = None if msg.ref_code is None else torch.from_numpy(msg.ref_code)
        emitted, stamped = 0, False
        try:
            async with contextlib.aclosing(self.codec.decode(rid, frames(), ref, msg.first_chunk_frames)) as pieces:
                async for piece in pieces:
                    emitted += piece.frames
                    chunk = StreamChunk(piece.audio, emitted, finished=piece.last,
                                        finish_reason="stop" if piece.last else None)
                    if piece.audio.size and not stamped and first_frames_at is not None:  # its time in here
                        chunk.stages, stamped = {"codec_worker": time.perf_counter() - first_frames_at}, True
                    self.outbox.put((rid, chunk))
        except (CodecError, _StreamAborted) as e:
            aborted = isinstance(e, _StreamAborted) or e.aborted
            await self.send(m.Chunk(rid, _end("abort" if aborted else "error", str(e), emitted)))
        except Exception as e:  # fails this stream, with a reason, not the worker
            log.exception("codec stream %s failed", rid)
            await self.send(m.Chunk(rid, _end("error", f"codec worker error: {e}", emitted)))
        finally:
            self.feeds.pop(rid, None)
            self.tasks.pop(rid, None)
        await self.send(m.Stats(self.stats()))


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
