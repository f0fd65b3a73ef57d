"""The codec side of `split`, asynchronous: `LocalCodecClient` runs a `CodecEngine` (`codec_engine.py`) on a thread
of its own (and device), as `LocalEngineClient` runs an `Engine`: a command inbox, and each stream's outputs handed
to its asyncio queue through `call_soon_threadsafe`. A failed decode fails the streams batched into it, each with a
reason; the worker keeps serving. On a GPU it warms up before it serves, as the engine does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from legato.engine import compile_watch
from legato.engine.codec_streamer import StreamSchedule
from legato.engine.config import codec_dtype_name
from legato.models.qwen3_tts.codec_decoder import CodecDecoder
from legato.pipeline.client import SHUTTING_DOWN, put_all
from legato.pipeline.codec_engine import EMPTY_PCM, CodecEngine, CodecOutput
from legato.pipeline.threads import name_native_thread, set_gil_switch_interval

log = logging.getLogger(__name__)

WARM_UP_TIMEOUT_S = 600.0  # a codec warm-up takes about a second; past this something is stuck


# --- the asyncio side ---------------------------------------------------------------------------------


class CodecError(Exception):
    """A codec stream ended without its audio: it failed (`aborted` False) or was aborted."""

    def __init__(self, reason: str, aborted: bool = False, code: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.aborted = aborted
        self.code = code  # a refusal's RequestRejected.code (SHUTTING_DOWN while the codec drains), if known


@dataclass
class CodecChunk:
    audio: np.ndarray  # float32 PCM of `frames` frames
    frames: int
    last: bool  # the stream's final chunk (its tail, possibly empty)
    stages: dict[str, float] | None = None  # from a codec worker process, on its first audio: `codec_worker`


@dataclass
class CodecStats:
    streams: int = 0
    frames_decoded: int = 0
    failures: dict[str, int] = field(default_factory=dict)


@dataclass
class CodecSink:
    """Where a stream's `CodecOutput`s go: `queue.put_nowait(output)`, called on `loop` (an `asyncio.Queue`, or a
    codec worker process's own handler of every stream's outputs)."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue | _Receiver


class _Receiver(Protocol):
    def put_nowait(self, item: CodecOutput) -> None: ...


class LocalCodecClient:
    """A `CodecEngine` on a dedicated thread of this process. Call its methods from one event loop."""

    def __init__(self, decoder: CodecDecoder, schedule: StreamSchedule | None = None, name: str = "codec",
                 warm_up: bool = False, **engine_options) -> None:
        """`warm_up`: `start` runs `CodecEngine.warm_up` on the codec thread before it returns (on a GPU, so the
        first burst pays for no first use); the rest are `CodecEngine`'s options."""
        self.engine = CodecEngine(decoder, schedule, **engine_options)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, CodecSink] = {}  # codec thread only
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._stopping = False
        self._stopped = threading.Event()
        self._closed = False  # the thread has exited: the inbox takes nothing more
        self._inbox_lock = threading.Lock()
        self._deadline: float | None = None
        self._stats = CodecStats()
        self._warm_up = warm_up
        self._warmed = threading.Event()  # set once the thread has warmed up (or given up)
        self._warm_up_error: str | None = None

    async def start(self) -> None:
        """Starts the codec thread. With `warm_up`, that thread first runs `CodecEngine.warm_up` (on its own CUDA
        stream, as it serves), and this returns once it has; a warm-up that fails raises here. The process takes the
        engine's GIL switch interval: a codec worker process has no engine client to set it, and at Python's 5 ms
        its event loop could wait that long for the GIL at each hand-over of frames or PCM to the codec thread."""
        set_gil_switch_interval()
        self._thread.start()
        if self._warm_up:
            await asyncio.get_running_loop().run_in_executor(None, self._warmed.wait, WARM_UP_TIMEOUT_S)
            if not self._warmed.is_set():
                raise RuntimeError(f"the codec worker did not warm up within {WARM_UP_TIMEOUT_S:.0f} s")
            if self._warm_up_error is not None:
                raise RuntimeError(f"the codec worker's warm-up failed: {self._warm_up_error}")

    async def stop(self, grace_s: float = 10.0) -> None:
        """Lets open streams end for up to `grace_s`, then fails the rest and ends the thread."""
        self._stopping = True
        if self._thread.ident is None:
            return
        self._submit(("stop", grace_s))
        await asyncio.get_running_loop().run_in_executor(None, self._stopped.wait, grace_s + 30.0)

    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def stats(self) -> CodecStats:
        return self._stats

    async def abort(self, request_id: str, reason: str = "aborted") -> None:
        self._submit(("abort", request_id, reason))

    async def decode(self, request_id: str, frames: AsyncIterator[np.ndarray], ref_code: torch.Tensor | None = None,
                     first_chunk_frames: int | None = None) -> AsyncIterator[CodecChunk]:
        """Streams `frames` (arrays [n, 16]) into a new codec stream and yields its PCM chunks; the last has
        `last` set. Raises CodecError when the stream fails or is aborted; when `frames` raises, the stream
        is dropped and that exception is raised here. Closing this iterator early aborts the stream."""
        loop = asyncio.get_running_loop()
        sink = CodecSink(loop, asyncio.Queue())
        if self._stopping or not self._submit(("open", request_id, ref_code, first_chunk_frames, sink)):
            raise CodecError("the codec worker is not running")
        feeder = asyncio.create_task(self._feed(request_id, frames, sink))
        done = False
        try:
            while True:
                item = await sink.queue.get()
                if isinstance(item, Exception):
                    done = True
                    raise item
                if item.error is not None:
                    done = True
                    raise CodecError(item.error, item.aborted, item.code)
                done = item.finished
                yield CodecChunk(item.audio, item.frames, item.finished)
                if done:
                    return
        finally:
            feeder.cancel()
            if not done:
                self._submit(("abort", request_id, None))

    async def _feed(self, request_id: str, frames: AsyncIterator[np.ndarray], sink: CodecSink) -> None:
        try:
            async for codes in frames:
                self._submit(("push", request_id, codes))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the source failed: nothing more comes; drop the stream, tell the consumer
            self._submit(("abort", request_id, None))
            sink.queue.put_nowait(e)
            return
        self._submit(("end", request_id))

    def open_stream(self, request_id: str, sink: CodecSink, ref_code: torch.Tensor | None = None,
                    first_chunk_frames: int | None = None) -> bool:
        """`decode`'s stream without its tasks, for a caller that handles every stream's outputs itself (a codec
        worker process): the stream's `CodecOutput`s go to `sink`, the last one finished (with `error` set if it
        failed or was aborted); its frames come through `push_frames`. False when the worker is not running."""
        return not self._stopping and self._submit(("open", request_id, ref_code, first_chunk_frames, sink))

    def push_frames(self, entries: list[tuple[str, np.ndarray, bool]]) -> None:
        """Frames [n, 16] of streams opened with `open_stream`, as one hand-over to the codec thread; an entry whose
        flag is set is its stream's last (its tail is decoded next)."""
        self._submit(("frames", entries))

    def drop_stream(self, request_id: str) -> None:
        """Ends a stream opened with `open_stream` without a last output (its caller has given it up)."""
        self._submit(("abort", request_id, None))

    def _submit(self, cmd: tuple) -> bool:
        with self._inbox_lock:
            if self._closed:
                return False
            self._inbox.put(cmd)
            return True

    # --- codec thread ---------------------------------------------------------------------------------

    def _run(self) -> None:
        name_native_thread()
        try:
            with self._device_stream():
                if self._warm_up:
                    try:
                        with compile_watch.warming():  # what compiles after it, the warm-up missed
                            log.info("codec warmed up in %.1f s (every graph bucket replayed before serving)",
                                     self.engine.warm_up())
                    except Exception as e:  # start() raises it; the loop then ends as a crash
                        self._warm_up_error = f"{type(e).__name__}: {e}"
                        raise
                    finally:
                        self._warmed.set()
                while True:
                    self._drain()
                    if self._deadline is not None and (not self._sinks or time.monotonic() > self._deadline):
                        return
                    for outputs in self.engine.steps():  # each decode call's audio as soon as it is back
                        self._deliver_step(outputs)
                    self._refresh_stats()
        except Exception:  # the loop itself failing ends this worker: fail every stream loudly
            log.exception("codec worker loop crashed")
            self._fail_all("codec worker crashed")
        finally:
            with self._inbox_lock:
                self._closed = True
            self._fail_all("codec worker stopped")
            self._refuse_queued()
            self._refresh_stats()
            self._stopped.set()

    def _device_stream(self):
        """On CUDA, a side stream of its own, so codec kernels overlap a talker sharing the device."""
        device = self.engine.device
        if device.type != "cuda":
            return contextlib.nullcontext()
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))  # the weights were written on the default stream
        return torch.cuda.stream(side)

    def _drain(self) -> None:
        """Waits briefly for a command, then takes every queued one (they batch into the next step)."""
        try:
            cmd = self._inbox.get(timeout=0.05)
        except queue.Empty:
            return
        while True:
            self._handle(cmd)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "open":
            _, rid, ref_code, first, sink = cmd
            if self._deadline is not None:
                _put(sink, CodecOutput(rid, EMPTY_PCM, 0, True, "the codec worker is shutting down",
                                       code=SHUTTING_DOWN))
                return
            try:
                self.engine.open(rid, ref_code, first)
            except Exception as e:  # fails this stream only
                log.exception("opening codec stream %s failed", rid)
                self.engine.failures["codec error"] += 1
                _put(sink, CodecOutput(rid, EMPTY_PCM, 0, True, f"codec stream start failed: {type(e).__name__}: {e}"))
                return
            self._sinks[rid] = sink
        elif kind == "push":
            self._push(cmd[1], cmd[2])
        elif kind == "frames":
            for rid, codes, last in cmd[1]:
                if len(codes):
                    self._push(rid, codes)
                if last:
                    self.engine.end(rid)
        elif kind == "end":
            self.engine.end(cmd[1])
        elif kind == "abort":
            _, rid, reason = cmd  # reason None: the consumer itself is gone, nobody to tell
            if self.engine.abort(rid) and reason is not None:
                self._deliver(CodecOutput(rid, EMPTY_PCM, 0, True, reason, aborted=True))
            else:
                self._sinks.pop(rid, None)
        elif kind == "stop":
            self._stopping = True
            if self._deadline is None:
                self._deadline = time.monotonic() + cmd[1]

    def _push(self, rid: str, codes: np.ndarray) -> None:
        """A stream's frames into the engine; bad codes fail that stream alone."""
        try:
            self.engine.push(rid, codes)
        except ValueError as e:
            self.engine.abort(rid)
            self.engine.failures["codec error"] += 1
            self._deliver(CodecOutput(rid, EMPTY_PCM, 0, True, f"bad codes: {e}"))

    def _sink_for(self, out: CodecOutput) -> CodecSink | None:
        # A stream's last output takes its sink away.
        return (self._sinks.pop if out.finished else self._sinks.get)(out.request_id, None)

    def _deliver(self, out: CodecOutput) -> None:
        sink = self._sink_for(out)
        if sink is not None:
            _put(sink, out)

    def _deliver_step(self, outputs: list[CodecOutput]) -> None:
        """A step's outputs to their streams: one wake-up per event loop, not one per stream (each cross-thread
        call takes the loop's lock and writes its wake-up pipe while this thread holds the GIL)."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, CodecOutput]]] = {}
        for out in outputs:
            sink = self._sink_for(out)
            if sink is not None:
                batches.setdefault(sink.loop, []).append((sink.queue, out))
        for loop, items in batches.items():
            with contextlib.suppress(RuntimeError):  # that event loop is closed: nobody is left to tell
                loop.call_soon_threadsafe(put_all, items)

    def _fail_all(self, reason: str) -> None:
        for rid in list(self._sinks):
            self.engine.abort(rid)
            self._deliver(CodecOutput(rid, EMPTY_PCM, 0, True, reason))

    def _refuse_queued(self) -> None:
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "open":
                _put(cmd[4], CodecOutput(cmd[1], EMPTY_PCM, 0, True, "the codec worker is not running"))

    def _refresh_stats(self) -> None:
        e = self.engine
        self._stats = CodecStats(e.num_streams, e.frames_decoded, dict(e.failures))


def _put(sink: CodecSink, item: object) -> None:
    try:
        sink.loop.call_soon_threadsafe(sink.queue.put_nowait, item)
    except RuntimeError:  # that event loop is closed: nobody is left to tell
        pass


def codec_engine_options(config) -> dict:
    """A codec worker's `LocalCodecClient` options from an `EngineConfig`: the engine's stream capacity, codec
    dtype and CUDA graphs, so `split` decodes as `single` does, and on a GPU a warm-up before it serves, as the
    engine has."""
    dtype = getattr(torch, codec_dtype_name(config.codec_dtype, config.device))
    cuda = config.device.startswith("cuda")
    return dict(capacity=config.max_num_seqs, dtype=dtype, graphs=cuda and not config.enforce_eager, warm_up=cuda)
