"""The codec side of `split`: a codec-only engine that turns streamed code frames into PCM on its own thread
(and device), and the asyncio client the split topology talks to.

`CodecEngine` is plain and synchronous, like `Engine`: `open` a stream per request, `push` frames as the
talker makes them, then `end` it (its tail is decoded) or `abort` it; `step()` decodes every stream's due
chunks, batched through the engine's own `CodecStreamer`. The chunk schedule (`StreamSchedule`) is the one
`single` streams: `first_chunk_frames`, then `chunk_frames` (or the ramp up to it), the tail when the stream
ends, in the same decode windows. Frames that arrive
in a burst are still cut at those boundaries, so the audio equals `single`'s (up to float rounding of other
batch make-ups).

`LocalCodecClient` runs a `CodecEngine` on a thread, as `LocalEngineClient` runs an `Engine`: a command
inbox, and each stream's outputs handed to its asyncio queue through `call_soon_threadsafe`. A failed
decode fails the streams batched into it, each with a reason; the worker keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from legato.engine.codec_graphs import graph_batches
from legato.engine.codec_streamer import CodecStreamer, StreamSchedule
from legato.engine.config import codec_dtype_name
from legato.models.qwen3_tts.codec_decoder import CodecDecoder
from legato.models.qwen3_tts.config import load_speech_tokenizer_config
from legato.models.qwen3_tts.loader import load_into, read_safetensors
from legato.pipeline.client import SHUTTING_DOWN, put_all
from legato.pipeline.threads import name_native_thread

log = logging.getLogger(__name__)

_EMPTY = np.zeros(0, np.float32)
WARM_UP_TIMEOUT_S = 600.0  # a codec warm-up takes about a second; past this something is stuck


def load_codec_decoder(model_dir: str | Path, device: str, dtype: torch.dtype = torch.float32) -> CodecDecoder:
    """Only the codec decoder of a model directory (`speech_tokenizer/`: config and `decoder.*` weights), for
    a codec worker that needs neither the talker nor the codec encoder. Keep it in fp32: the streamer folds
    its serving copy from it in the serving dtype."""
    path = Path(model_dir)
    decoder = CodecDecoder(load_speech_tokenizer_config(path).decoder_config)
    source = path / "speech_tokenizer" / "model.safetensors"
    tensors = read_safetensors(path / "speech_tokenizer")
    load_into(decoder, {k[len("decoder."):]: v for k, v in tensors.items() if k.startswith("decoder.")}, source)
    return decoder.to(device=device, dtype=dtype).eval()


@dataclass
class CodecOutput:
    """What one step produced for one stream: the PCM of `frames` new frames; the last says how it ended."""

    request_id: str
    audio: np.ndarray  # float32 PCM (empty on a failure, an abort or an empty tail)
    frames: int
    finished: bool = False
    error: str | None = None  # a failed or aborted stream (always finished)
    aborted: bool = False
    code: str | None = None  # CodecError.code of the failure


class CodecEngine:
    """Streams of code frames -> PCM chunks. Not thread-safe: one thread owns it."""

    def __init__(self, decoder: CodecDecoder, schedule: StreamSchedule | None = None, capacity: int = 64,
                 dtype: torch.dtype | None = None, graphs: bool = False) -> None:
        """`capacity`, `dtype` and `graphs` are the `CodecStreamer`'s (as the engine's: CUDA graphs on CUDA)."""
        self.streamer = CodecStreamer(decoder, schedule, capacity, graphs=graphs, dtype=dtype)
        if self.streamer.schedule.decode_every_step:  # frames come in bursts here, one at a time in `single`
            self.streamer.frames_per_call = 1
        self._pushed: dict[str, int] = {}  # frames received per open stream
        self._ended: set[str] = set()
        self.frames_decoded = 0
        self.failures: Counter[str] = Counter()

    @property
    def device(self) -> torch.device:
        return self.streamer.device

    @property
    def num_streams(self) -> int:
        return len(self._pushed)

    def open(self, request_id: str, ref_code: torch.Tensor | None = None,
             first_chunk_frames: int | None = None) -> None:
        """Starts a stream; an in-context clone's reference codes prime its state (this runs the decoder).
        Raises ValueError for a duplicate id or a bad chunk size, and whatever priming raises."""
        if request_id in self._pushed:
            raise ValueError(f"duplicate codec stream {request_id!r}")
        if first_chunk_frames is not None and not (isinstance(first_chunk_frames, int) and first_chunk_frames >= 1):
            raise ValueError("first_chunk_frames must be an integer >= 1")
        self.streamer.open(request_id, ref_code, first_chunk_frames)
        self._pushed[request_id] = 0

    def push(self, request_id: str, codes: np.ndarray | torch.Tensor) -> bool:
        """Appends frames [n, 16]; False for a stream that is not open (aborted, failed, ended)."""
        if request_id not in self._pushed or request_id in self._ended:
            return False
        codes = torch.as_tensor(codes, dtype=torch.long)
        if codes.ndim != 2 or codes.shape[1] != 16:
            raise ValueError(f"codes must be [n, 16], got {list(codes.shape)}")
        for frame in codes:
            self.streamer.push(request_id, frame)
        self._pushed[request_id] += codes.shape[0]
        return True

    def end(self, request_id: str) -> bool:
        """No more frames: the next step decodes the tail and finishes the stream."""
        if request_id not in self._pushed:
            return False
        self._ended.add(request_id)
        return True

    def abort(self, request_id: str) -> bool:
        self._ended.discard(request_id)
        self.streamer.close(request_id)
        return self._pushed.pop(request_id, None) is not None

    def warm_up(self) -> float:
        """Throwaway streams through the codec before it serves: for each row-count bucket of its CUDA graphs, that
        many streams of every chunk size and a tail, decoded as a burst is. The first burst then pays for none of
        what a first use costs (each graph's first replay, a pinned host buffer of each size for the read-back,
        the tail's path). Only while no stream is open; leaves none open and the counters at zero. Returns the
        seconds it took."""
        if self._pushed:
            raise RuntimeError("the codec warms up only while no stream is open")
        started = time.perf_counter()
        frames = sum(self.streamer.schedule.chunk_sizes()) + 1
        codes = np.zeros((frames, 16), np.int64)
        capacity = self.streamer.capacity
        for rows in sorted({min(b, capacity) for b in graph_batches(capacity)}):
            rids = [f"__warm_up_{rows}_{i}__" for i in range(rows)]
            for rid in rids:
                self.open(rid)
                self.push(rid, codes)
                self.end(rid)
            failed: list[str] = []
            for _ in range(frames + 2):  # one step normally ends them all; the bound keeps a stuck codec from hanging
                if not self._pushed:
                    break
                failed += [out.error for out in self.step() if out.error]
            if failed or self._pushed:  # not expected: a codec that cannot decode zeros cannot serve
                raise RuntimeError(f"codec warm-up failed: {failed[:1] or 'streams left open'}")
        self.frames_decoded = 0
        self.failures.clear()
        return time.perf_counter() - started

    def step(self) -> list[CodecOutput]:
        """Decodes every due chunk of every stream (several per stream after a burst, in schedule order, one
        frame a call where `single` decodes every step), then the tails of ended streams."""
        streams = self.streamer.streams
        spf = self.streamer.decoder.samples_per_frame
        outputs: list[CodecOutput] = []
        while True:
            audio, failed = self.streamer.flush(set())
            if not audio and not failed and not self.streamer.backlog():
                break
            for rid, pcm in audio.items():
                n = pcm.size // spf
                self.frames_decoded += n
                outputs.append(CodecOutput(rid, pcm, n))
            outputs += self._failed(failed)
        ended = self._ended & streams.keys()
        if ended:
            audio, failed = self.streamer.flush(ended)  # decodes the tails and closes these streams
            outputs += self._failed(failed)
            for rid in sorted(ended - failed.keys()):
                n = audio[rid].size // spf if rid in audio else 0
                self._pushed.pop(rid)
                self._ended.discard(rid)
                self.frames_decoded += n
                outputs.append(CodecOutput(rid, audio.get(rid, _EMPTY), n, finished=True))
        return outputs

    def _failed(self, failed: dict[str, str]) -> list[CodecOutput]:
        for rid in failed:
            self.abort(rid)
            self.failures["codec error"] += 1
        return [CodecOutput(rid, _EMPTY, 0, finished=True, error=why) for rid, why in failed.items()]


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


@dataclass
class CodecStats:
    streams: int = 0
    frames_decoded: int = 0
    failures: dict[str, int] = field(default_factory=dict)


@dataclass
class _Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class LocalCodecClient:
    """A `CodecEngine` on a dedicated thread of this process. Call its methods from one event loop."""

    def __init__(self, decoder: CodecDecoder, schedule: StreamSchedule | None = None, name: str = "codec",
                 warm_up: bool = False, **engine_options) -> None:
        """`warm_up`: `start` runs `CodecEngine.warm_up` on the codec thread before it returns (on a GPU, so the
        first burst pays for no first use); the rest are `CodecEngine`'s options."""
        self.engine = CodecEngine(decoder, schedule, **engine_options)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}  # codec thread only
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
        stream, as it serves), and this returns once it has; a warm-up that fails raises here."""
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
        sink = _Sink(loop, asyncio.Queue())
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

    async def _feed(self, request_id: str, frames: AsyncIterator[np.ndarray], sink: _Sink) -> None:
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
                    self._deliver_step(self.engine.step())
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
                _put(sink, CodecOutput(rid, _EMPTY, 0, True, "the codec worker is shutting down", code=SHUTTING_DOWN))
                return
            try:
                self.engine.open(rid, ref_code, first)
            except Exception as e:  # fails this stream only
                log.exception("opening codec stream %s failed", rid)
                self.engine.failures["codec error"] += 1
                _put(sink, CodecOutput(rid, _EMPTY, 0, True, f"codec stream start failed: {type(e).__name__}: {e}"))
                return
            self._sinks[rid] = sink
        elif kind == "push":
            _, rid, codes = cmd
            try:
                self.engine.push(rid, codes)
            except ValueError as e:
                self.engine.abort(rid)
                self.engine.failures["codec error"] += 1
                self._deliver(CodecOutput(rid, _EMPTY, 0, True, f"bad codes: {e}"))
        elif kind == "end":
            self.engine.end(cmd[1])
        elif kind == "abort":
            _, rid, reason = cmd  # reason None: the consumer itself is gone, nobody to tell
            if self.engine.abort(rid) and reason is not None:
                self._deliver(CodecOutput(rid, _EMPTY, 0, True, reason, aborted=True))
            else:
                self._sinks.pop(rid, None)
        elif kind == "stop":
            self._stopping = True
            if self._deadline is None:
                self._deadline = time.monotonic() + cmd[1]

    def _sink_for(self, out: CodecOutput) -> _Sink | None:
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
            self._deliver(CodecOutput(rid, _EMPTY, 0, True, reason))

    def _refuse_queued(self) -> None:
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "open":
                _put(cmd[4], CodecOutput(cmd[1], _EMPTY, 0, True, "the codec worker is not running"))

    def _refresh_stats(self) -> None:
        e = self.engine
        self._stats = CodecStats(e.num_streams, e.frames_decoded, dict(e.failures))


def _put(sink: _Sink, item: object) -> None:
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
