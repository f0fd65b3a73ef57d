"""An `EngineClient` whose engine runs in its own worker process (`legato.pipeline.worker`).

The server side binds two ZMQ sockets on IPC paths derived from (instance id, worker index), so many
servers and workers share a host without fixed ports: a PUSH socket for commands (any thread may send,
under a lock) and a PULL socket for everything the worker says, read by one I/O thread. That thread hands
each request's chunks to the request's asyncio queue with `call_soon_threadsafe` (as `LocalEngineClient`
does: one hand-over per event loop for all it read in one pass), so the client works from any event loop,
and it watches the worker: a process that exits or stops heart-beating is dead, and each of its in-flight
requests ends with an error chunk saying so.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
import zmq

from legato.engine.config import EngineConfig
from legato.models.qwen3_tts.config import load_model_config, load_speech_tokenizer_config
from legato.models.qwen3_tts.inputs import VoiceFeatures
from legato.models.qwen3_tts.loader import resolve_model_dir
from legato.pipeline import ipc
from legato.pipeline import messages as m
from legato.pipeline.client import (
    ENDING_WAIT_S,
    ENGINE_UNAVAILABLE,
    SHUTTING_DOWN,
    EngineClient,
    EngineStats,
    ModelInfo,
    RequestRejected,
    StreamChunk,
    SynthesisRequest,
    refused_stream,
)
from legato.pipeline.client import put_all as _put_all
from legato.pipeline.front_links import front_endpoints
from legato.pipeline.ipc import zmq_endpoint
from legato.pipeline.kv_links import KVLinkSpec, socket_path
from legato.pipeline.launchers import Launcher, LocalLauncher
from legato.pipeline.liveness import Liveness
from legato.pipeline.threads import name_native_thread
from legato.pipeline.worker import WorkerSpec, receive_limit

log = logging.getLogger(__name__)

BATCH_ITEMS = 256  # the most chunks the I/O thread holds before handing them over, however busy the socket
SHUTDOWN_SEND_S = 5.0  # how long a stop keeps offering a live worker its Shutdown before it terminates it


def new_instance_id() -> str:
    """A short id unique on this host: it names the IPC addresses of one server's workers (see ipc.py)."""
    return f"{os.getpid()}-{uuid.uuid4().hex[:6]}"


def model_info(model_path: str | Path, name: str) -> ModelInfo:
    """What the server needs to know about a model, from its config files alone (no weights loaded)."""
    path = resolve_model_dir(model_path)
    cfg, speech = load_model_config(path), load_speech_tokenizer_config(path)
    return ModelInfo.from_configs(name, cfg, speech)


class StreamSink(Protocol):
    """Where a pushed stream's items go (`ProcessEngineClient.push_stream`), on its event loop: each StreamChunk,
    the last one finished, or a RequestRejected instead."""

    def put_nowait(self, item: StreamChunk | RequestRejected) -> None: ...


class _Pushed:
    """A pushed stream's items into its sink; `ended` is set on the last (an abandoned stream's retry waits on it)."""

    def __init__(self, sink: StreamSink) -> None:
        self.sink = sink
        self.ended = asyncio.Event()

    def put_nowait(self, item: StreamChunk | RequestRejected) -> None:
        try:
            self.sink.put_nowait(item)
        except Exception:  # the other streams handed over in the same batch still get theirs
            log.exception("a stream's sink failed on its item")
        finally:
            if isinstance(item, RequestRejected) or item.finished:
                self.ended.set()


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue | _Pushed
    # Its reader left before its end (client gone): the worker was told to abort it, and the stream stays listed
    # until the worker's last chunk for it comes, so that a new request under its id is not handed that chunk.
    abandoned: bool = False


class ProcessEngineClient(EngineClient):
    def __init__(
        self,
        model_path: str | Path,
        engine_config: EngineConfig,
        device: str | None = None,
        name: str = "legato",
        instance_id: str | None = None,
        worker_index: int = 0,
        *,
        torch_threads: int | None = None,
        start_timeout_s: float = 300.0,
        heartbeat_s: float = 0.5,
        heartbeat_timeout_s: float = 15.0,
        kv: KVLinkSpec | None = None,
        role: str = "engine",
        max_message_bytes: int = m.MAX_MESSAGE_BYTES,
        launcher: Launcher | None = None,
        worker_name: str | None = None,
        front: int = 0,
        fronts: int = 1,
    ) -> None:
        self.model_path = str(resolve_model_dir(model_path))
        self.role = role  # "engine", or "codec": the split topology's codec worker (see codec_process.py)
        self.config = dataclasses.replace(engine_config, device=device or engine_config.device)
        self.info = model_info(self.model_path, name)
        self.instance_id = instance_id or new_instance_id()
        self.worker_index = worker_index
        self.label = f"{self.instance_id}-{worker_index}" + (f"/front{front}" if front else "")
        # `legato serve --fronts N`: front 0 starts the worker; front k > 0 attaches to it over links of its own.
        self.front, self.fronts = front, fronts
        self.endpoints = front_endpoints((zmq_endpoint(self.instance_id, f"{worker_index}-cmd"),
                                          zmq_endpoint(self.instance_id, f"{worker_index}-out")), front)
        self.worker_pid: int | None = None  # from its Ready
        self.torch_threads = torch_threads
        self.start_timeout_s = start_timeout_s
        self.heartbeat_s = heartbeat_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.generation_defaults: dict = {}
        self.kv = kv
        self.max_message_bytes = max_message_bytes  # either way: a larger message is refused or dropped
        self.launcher = launcher or LocalLauncher()  # how the worker process is started and watched
        self.worker_name = worker_name or role  # the launcher's name for it (e.g. "decode0")
        self.links: dict[int, m.LinkStatus] = {}  # process MpNd: the worker's KV links, by peer index
        self.proc: subprocess.Popen | None = None  # or what the launcher gives that behaves as one
        self.dead_reason: str | None = None  # set once the worker is found dead
        # Until the first heartbeat: an idle engine, every block free (a router must not read it as full).
        blocks = self.config.num_kv_blocks or 0
        self._stats = EngineStats(num_kv_blocks=blocks, free_kv_blocks=blocks)
        self._streams: dict[str, _Stream] = {}
        self._calls: dict[str, asyncio.Future] = {}
        self._lock = threading.Lock()  # guards the command socket and the two tables above
        self._ready = threading.Event()
        self._closing = threading.Event()
        self._stopping = False
        self._liveness = Liveness(heartbeat_timeout_s)  # silence as the I/O thread watched it (liveness.py)
        self._log_tail: collections.deque[str] = collections.deque(maxlen=40)
        self._ctx: zmq.Context | None = None
        self._cmd: zmq.Socket | None = None
        self._out: zmq.Socket | None = None
        self._threads: list[threading.Thread] = []
        # I/O thread: chunks read but not yet handed to their event loops (see _deliver), and how many.
        self._pending: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, StreamChunk | RequestRejected]]] = {}
        self._batched = 0

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else self.worker_pid

    @property
    def attached(self) -> bool:
        """A front other than the first: the worker is not its child, and it neither starts nor stops it."""
        return self.front > 0

    # --- life cycle -----------------------------------------------------------------------------------

    async def start(self) -> None:
        """Spawns the worker and waits (bounded) for its Ready; a worker that fails to start is an error
        carrying the tail of its log."""
        self._ctx = zmq.Context()
        self._cmd = self._ctx.socket(zmq.PUSH)
        self._out = self._ctx.socket(zmq.PULL)
        for sock in (self._cmd, self._out):
            sock.setsockopt(zmq.LINGER, 0)
        self._out.setsockopt(zmq.MAXMSGSIZE, receive_limit(self.max_message_bytes))
        if self.attached:
            await self._attach()
            return
        try:
            await self._launch()
        except BaseException:  # not placed or not spawned: nothing runs, give back what was taken
            for sock in (self._cmd, self._out):
                sock.close()
            self._ctx.term()
            await self.launcher.release(self.worker_name)
            raise
        self._threads = [threading.Thread(target=self._read_log, name=f"worker-log-{self.label}", daemon=True),
                         threading.Thread(target=self._io_loop, name=f"worker-io-{self.label}", daemon=True)]
        for t in self._threads:
            t.start()
        deadline = time.monotonic() + self.start_timeout_s
        while not self._ready.is_set():
            if self.dead_reason is not None or time.monotonic() > deadline:
                why = self.dead_reason or f"no Ready within {self.start_timeout_s:.0f} s"
                await self._shutdown_process(0.0)
                tail = "\n".join(self._log_tail)
                raise RuntimeError(f"engine worker {self.label} failed to start ({why}); its log ends:\n{tail}")
            await asyncio.sleep(0.02)
        log.info("engine worker %s ready (pid %d)", self.label, self.proc.pid)

    async def _attach(self) -> None:
        """Front k > 0: binds this front's link and says Hello until the worker answers with Ready (it may still be
        loading, or not yet started by front 0)."""
        for sock, endpoint in zip((self._cmd, self._out), self.endpoints, strict=True):
            sock.bind(endpoint)
        self._threads = [threading.Thread(target=self._io_loop, name=f"worker-io-{self.label}", daemon=True)]
        self._threads[0].start()
        deadline = time.monotonic() + self.start_timeout_s
        next_hello, asked = 0.0, False
        # A Ready the worker queued at its start may come before its command link to us is up: ready once a Hello
        # went out (so commands reach it) and a Ready came in.
        while not (asked and self._ready.is_set()):
            now = time.monotonic()
            if now > deadline:
                await self._detach(0.0)
                raise RuntimeError(f"engine worker {self.label}: no Ready within {self.start_timeout_s:.0f} s")
            if not asked and now >= next_hello:  # unsent while no worker is connected: tried again until one is
                asked = self._send(m.Hello(self.front))
                next_hello = now + 0.1
            await asyncio.sleep(0.02)
        log.info("front %d attached to engine worker %s (pid %d)", self.front, self.label, self.worker_pid)

    async def _launch(self) -> None:
        placement = await self.launcher.place(self.worker_name)
        if placement.same_node:
            self._cmd.bind(self.endpoints[0])
            self._out.bind(self.endpoints[1])
        else:  # a worker on another node reaches us over TCP, on a port the kernel picks
            for sock in (self._cmd, self._out):
                sock.bind(f"tcp://{placement.server_host}:*")
            self.endpoints = tuple(s.getsockopt_string(zmq.LAST_ENDPOINT) for s in (self._cmd, self._out))
        if self.kv is not None:
            self.kv = await self.launcher.link(self.kv)
        spec = WorkerSpec(
            model_path=self.model_path, engine_config=dataclasses.asdict(self.config), name=self.info.name,
            label=self.label, cmd_endpoint=self.endpoints[0], out_endpoint=self.endpoints[1],
            parent_pid=os.getpid(), fronts=self.fronts, heartbeat_s=self.heartbeat_s, torch_threads=self.torch_threads,
            kv=None if self.kv is None else self.kv.to_dict(), role=self.role,
            max_message_bytes=self.max_message_bytes,
        )
        self.proc = await self.launcher.spawn(self.worker_name, spec.to_json(), self.torch_threads)

    async def stop(self, grace_s: float = 10.0) -> None:
        """Shutdown to the worker, wait for it to exit (grace + a margin), then terminate/kill; closes the
        sockets and removes their files."""
        self._stopping = True
        if self.attached:
            await self._detach(grace_s)
            return
        if self.proc is None or self._closing.is_set():  # never started, or already stopped
            await self.launcher.release(self.worker_name)  # a placed worker that never ran gives its place back
            return
        await self._shutdown_process(grace_s)

    async def _shutdown_process(self, grace_s: float) -> None:
        proc = self.proc
        steps = [(grace_s + 30.0, proc.terminate), (5.0, proc.kill), (5.0, None)]
        if proc.poll() is None and not await self._tell_shutdown(grace_s):
            steps = steps[1:]  # it cannot hear a Shutdown (still loading, or gone): terminate at once
            proc.terminate()
        loop = asyncio.get_running_loop()
        for wait_s, action in steps:
            try:
                await loop.run_in_executor(None, proc.wait, wait_s)
                break
            except subprocess.TimeoutExpired:
                if action is not None:
                    log.warning("engine worker %s did not exit in %.0f s: %s", self.label, wait_s, action.__name__)
                    action()
        await self._close_link("worker stopped")
        if self.kv is not None and self.kv.role == "decode":  # a killed decode worker leaves its listener behind
            ipc.remove(socket_path(self.kv.instance_id, self.kv.index))
        await self.launcher.release(self.worker_name)

    async def _detach(self, grace_s: float) -> None:
        """Front k > 0 stopping: the worker is front 0's to stop (it drains every front's requests at the same
        grace); this front waits that long for its own streams to end, aborts what is left, and closes its link."""
        if self._closing.is_set() or self._ctx is None:
            return
        deadline = time.monotonic() + grace_s + SHUTDOWN_SEND_S
        while self._streams and self.dead_reason is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        with self._lock:
            left = list(self._streams)
        for rid in left:
            self._send(m.Abort(rid, "server is shutting down"))
        with self._lock:
            self._cmd.setsockopt(zmq.LINGER, 1000)  # those aborts still reach the worker after the close
        await self._close_link("server is shutting down", SHUTTING_DOWN)

    async def _close_link(self, reason: str, code: str = ENGINE_UNAVAILABLE) -> None:
        """Stops the I/O thread, ends what is still open with `reason`, closes the sockets and their files."""
        self._closing.set()
        loop = asyncio.get_running_loop()
        for t in self._threads:
            await loop.run_in_executor(None, t.join, 10.0)
        self._holds_nothing()  # the worker's final Stats may be unread, and it is gone (or not ours) either way
        self._fail_all(reason, code)
        with self._lock:
            for sock in (self._cmd, self._out):
                sock.close()
            self._ctx.term()
        for endpoint in self.endpoints:
            ipc.remove(endpoint)

    async def _tell_shutdown(self, grace_s: float) -> bool:
        """Sends a ready worker its Shutdown, retrying a send refused for the moment (its command pipe full
        behind a worker a busy machine slows down) for up to SHUTDOWN_SEND_S: one refusal must not turn an
        orderly stop into a SIGTERM. False when the worker cannot hear it (still loading, or gone)."""
        if not self._ready.is_set():
            return False
        deadline = time.monotonic() + SHUTDOWN_SEND_S
        while not self._send(m.Shutdown(grace_s)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    # --- requests -------------------------------------------------------------------------------------

    def generate(self, req: SynthesisRequest) -> AsyncIterator[StreamChunk]:
        if req.text_open:
            # Sent now, not at the first iteration: text appended right after this call must follow the Submit.
            try:
                return self.stream(req.request_id, m.Submit(req))
            except RequestRejected as e:
                return refused_stream(e)
        return self._generate(req)

    async def _generate(self, req: SynthesisRequest) -> AsyncIterator[StreamChunk]:
        await self.until_ended(req.request_id)
        stream = self._open(req.request_id, m.Submit(req))
        # Closed with this generator (not whenever the loop finalizes it): a client leaving aborts at once.
        async with contextlib.aclosing(self._read(req.request_id, stream)) as chunks:
            async for chunk in chunks:
                yield chunk

    @property
    def takes_text_input(self) -> bool:
        """An engine worker of its own (not a prefill or decode worker of a PD deployment, whose handoff would
        not carry the text, nor a codec worker)."""
        return self.role == "engine" and self.kv is None

    async def append_text(self, request_id: str, text: str, close: bool = False) -> None:
        # Over the same socket as the Submit, so in order; a worker gone ends the request with an error anyway.
        self._send(m.AppendText(request_id, text, close))

    def await_handoff(self, request_id: str, peer: int, deadline_s: float) -> AsyncIterator[StreamChunk]:
        """Process MpNd, decode worker: arm its KV link from prefill worker `peer` now (raises RequestRejected
        if it cannot) and return the request's chunks, which flow once the handoff lands. Closing the
        iterator early aborts the request (and cancels the transfer if it is still in flight)."""
        return self.stream(request_id, m.AwaitHandoff(request_id, peer, deadline_s))

    def stream(self, request_id: str, opening: m.Message) -> AsyncIterator[StreamChunk]:
        """Sends `opening` now (raises RequestRejected if the worker cannot take it) and returns the chunks the
        worker then sends for `request_id`; closing the iterator early aborts it in the worker."""
        return self._read(request_id, self._open(request_id, opening))

    async def push_generate(self, req: SynthesisRequest, sink: StreamSink) -> Callable[[str], None]:
        """`generate`, pushed (see `push_stream`): raises RequestRejected if the worker cannot take it now."""
        if not req.text_open:  # as `generate`: a text_open request's Submit goes at once, its text behind it
            await self.until_ended(req.request_id)
        return self.push_stream(req.request_id, m.Submit(req), sink)

    def push_stream(self, request_id: str, opening: m.Message, sink: StreamSink) -> Callable[[str], None]:
        """`stream` without an iterator: sends `opening` now (raises RequestRejected if the worker cannot take it)
        and hands each of the worker's items for `request_id` to `sink.put_nowait` on this event loop, as they
        come, with no task to wake. Returns `leave(reason)`: called before the last item (its reader gone), it
        aborts the request in the worker, as closing `stream`'s iterator early does."""
        stream = self._open(request_id, opening, _Pushed(sink))

        def leave(reason: str = "client disconnected") -> None:
            if not stream.queue.ended.is_set():
                self._leave(request_id, stream, reason)

        return leave

    def post(self, msg: m.Message) -> bool:
        """Queues one more message to the worker (e.g. a stream's next input); False when it cannot."""
        return self._send(msg)

    async def until_ended(self, rid: str) -> None:
        """Waits (ENDING_WAIT_S at most) for the worker's last chunk of an abandoned earlier request under `rid`, so
        that a client retrying with the id it just dropped gets a request of its own, not the old one's end."""
        with self._lock:
            old = self._streams.get(rid)
        if old is None or not old.abandoned or old.loop is not asyncio.get_running_loop():
            return
        last = old.queue.ended.wait() if isinstance(old.queue, _Pushed) else _last_item(old.queue)
        try:
            await asyncio.wait_for(last, ENDING_WAIT_S)
        except (asyncio.TimeoutError, TimeoutError):
            pass  # _open refuses the id (409) while the old stream is still listed

    def _open(self, rid: str, msg: m.Message, pushed: _Pushed | None = None) -> _Stream:
        if not self.is_alive():
            raise self._unavailable()
        frames = self._encode(msg)
        stream = _Stream(asyncio.get_running_loop(), pushed or asyncio.Queue())
        with self._lock:
            old = self._streams.get(rid)
            if old is not None and old.abandoned:
                raise RequestRejected(409, f"request id {rid!r} is still ending (its earlier request was left and "
                                           "is being aborted); retry it shortly")
            if old is not None:
                raise RequestRejected(409, f"request id {rid!r} is already in flight")
            self._streams[rid] = stream
        if not self._send(msg, frames):
            self._streams.pop(rid, None)
            raise self._unavailable()
        return stream

    async def _read(self, rid: str, stream: _Stream) -> AsyncIterator[StreamChunk]:
        done = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, RequestRejected):
                    done = True
                    raise item
                done = item.finished
                yield item
                if done:
                    return
        finally:
            if not done:  # closed early (client gone): the worker frees the request's blocks
                self._leave(rid, stream)

    def _leave(self, rid: str, stream: _Stream, reason: str = "client disconnected") -> None:
        with self._lock:
            stream.abandoned = True  # listed until the worker's last chunk for it: see _Stream
        if not self._send(m.Abort(rid, reason)):
            with self._lock:  # the worker cannot hear it (gone): nothing more will come for it
                if self._streams.get(rid) is stream:
                    del self._streams[rid]

    async def abort(self, request_id: str, reason: str = "aborted") -> None:
        self._send(m.Abort(request_id, reason))

    async def extract_voice(self, samples: np.ndarray, sample_rate: int) -> VoiceFeatures:
        if not self.is_alive():
            raise self._unavailable()
        call_id = f"voice-{uuid.uuid4().hex}"
        msg = m.ExtractVoice(call_id, np.asarray(samples, np.float32), int(sample_rate))
        frames = self._encode(msg)
        fut = asyncio.get_running_loop().create_future()
        with self._lock:
            self._calls[call_id] = fut
        if not self._send(msg, frames):
            self._calls.pop(call_id, None)
            raise self._unavailable()
        try:
            return await fut
        finally:
            self._calls.pop(call_id, None)

    def stats(self) -> EngineStats:
        return self._stats

    def is_alive(self) -> bool:
        running = _pid_alive(self.worker_pid) if self.attached else self.proc is not None and self.proc.poll() is None
        return (self._ready.is_set() and self.dead_reason is None and not self._stopping and running
                and not self._liveness.expired)

    def _unavailable(self) -> RequestRejected:
        """The 503 of a request this worker cannot take now."""
        if self.dead_reason:
            return RequestRejected(503, f"engine worker {self.label} is not serving: {self.dead_reason}",
                                   code=ENGINE_UNAVAILABLE)
        if self._stopping:
            return RequestRejected.shutting_down()
        return RequestRejected(503, f"engine worker {self.label} is not running", code=ENGINE_UNAVAILABLE)

    def _encode(self, msg: m.Message) -> list[bytes | memoryview]:
        """The frames of a request's opening message; RequestRejected (413) when the worker would drop them as
        over its limit, which would leave the request waiting for an answer that never comes."""
        frames = m.encode(msg)
        size = sum(len(f) for f in frames)
        if size > self.max_message_bytes:
            raise RequestRejected(413, f"the request is {size} bytes on the worker link, over its limit of "
                                       f"{self.max_message_bytes}")
        return frames

    def _send(self, msg: m.Message, frames: list[bytes | memoryview] | None = None) -> bool:
        """Queues a message (or its frames, already encoded) to the worker; False when it cannot (no worker
        connected, or closed)."""
        frames = m.encode(msg) if frames is None else frames
        with self._lock:
            if self._closing.is_set() or self._cmd is None:
                return False
            try:
                self._cmd.send_multipart(frames, flags=zmq.NOBLOCK)
            except zmq.ZMQError:  # zmq.Again: no worker connected (it died); or the socket is closed
                return False
        return True

    # --- I/O thread -----------------------------------------------------------------------------------

    def _io_loop(self) -> None:
        name_native_thread()
        poller = zmq.Poller()
        poller.register(self._out, zmq.POLLIN)
        while True:
            if poller.poll(50):
                while True:
                    try:
                        frames = self._out.recv_multipart(flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._receive(frames)
                    if self._batched >= BATCH_ITEMS:
                        self._flush()
                self._flush()
            if self._closing.is_set():
                return
            self._watch()

    def _receive(self, frames: list[bytes]) -> None:
        """Decodes and dispatches one message; a bad one is logged and dropped: this thread also watches the
        worker, and its end would leave every request waiting forever."""
        try:
            self._dispatch(m.decode(frames, self.max_message_bytes))
        except m.MessageError as e:
            log.error("engine worker %s sent a malformed message: %s", self.label, e)
        except Exception:
            log.exception("engine worker %s: dropping a message that could not be handled", self.label)

    def _watch(self) -> None:
        """Declares the worker dead when its process exits or its heartbeats stop (then kills it)."""
        if self.dead_reason is not None or self._stopping:
            return
        if self.attached:  # not our child: seen through its pid and its heartbeats (front 0 kills a silent one)
            if self._ready.is_set() and not _pid_alive(self.worker_pid):
                self._died("worker died (its process is gone)")
            elif self._ready.is_set() and self._liveness.look():
                self._died(f"worker died (no heartbeat for {self.heartbeat_timeout_s:.0f} s)")
            return
        code = self.proc.poll()
        if code is not None:
            self._died(f"worker died ({getattr(self.proc, 'death', None) or f'exit code {code}'})")
        elif self._ready.is_set() and self._liveness.look():
            self._died(f"worker died (no heartbeat for {self.heartbeat_timeout_s:.0f} s)")
            self.proc.kill()

    def _died(self, reason: str) -> None:
        log.error("engine worker %s: %s", self.label, reason)
        self.dead_reason = reason
        self._holds_nothing()  # its last heartbeat is stale: everything it ran has failed
        self._fail_all(reason)

    def _holds_nothing(self) -> None:
        """The stats of a worker that is gone: no request, every block free (its counters as last reported)."""
        blocks = self._stats.num_kv_blocks
        self._stats = dataclasses.replace(self._stats, waiting=0, running=0, kv_usage=0.0, free_kv_blocks=blocks)

    def _fail_all(self, reason: str, code: str = ENGINE_UNAVAILABLE) -> None:
        """Ends every open stream and call with `reason`; a call's refusal is a 503 of `code`."""
        with self._lock:
            streams, self._streams = self._streams, {}
            calls, self._calls = self._calls, {}
        for s in streams.values():
            chunk = StreamChunk(np.zeros(0, np.float32), 0, finished=True, finish_reason="error", error=reason,
                                retryable=True)
            _call(s.loop, s.queue.put_nowait, chunk)
        for fut in calls.values():
            _settle(fut, error=RequestRejected(503, reason, code=code))

    def _dispatch(self, msg: m.Message) -> None:
        self._liveness.heard()  # any message, not only a heartbeat: a worker streaming chunks is alive
        if isinstance(msg, m.Heartbeat):
            return  # being heard was all it had to say
        if isinstance(msg, m.Stats):
            self._stats = msg.stats
        elif isinstance(msg, m.LinkStatus):
            self.links[msg.peer] = msg
        elif isinstance(msg, m.Chunk):
            self._chunk(msg.request_id, msg.chunk)
        elif isinstance(msg, m.Chunks):
            for rid, chunk in msg.chunks:
                self._chunk(rid, chunk)
        elif isinstance(msg, m.Rejected):
            with self._lock:
                stream = self._streams.pop(msg.request_id, None)
                fut = self._calls.pop(msg.request_id, None)
            error = RequestRejected(msg.status, msg.message, msg.retry_after, msg.code)
            if stream is not None:
                self._deliver(stream, error)
            if fut is not None:
                _settle(fut, error=error)
        elif isinstance(msg, m.VoiceResult):
            with self._lock:
                fut = self._calls.pop(msg.request_id, None)
            if fut is not None:
                _settle(fut, result=VoiceFeatures(torch.from_numpy(msg.speaker_embedding),
                                                  torch.from_numpy(msg.ref_code)))
        elif isinstance(msg, m.Ready):
            self.info = dataclasses.replace(msg.info, name=self.info.name)
            self.generation_defaults = msg.generation_defaults
            self.worker_pid = msg.pid
            self._ready.set()
        else:
            log.error("engine worker %s sent a %s: not a worker -> server message", self.label, type(msg).__name__)

    def _chunk(self, rid: str, chunk: StreamChunk) -> None:
        with self._lock:
            stream = (self._streams.pop if chunk.finished else self._streams.get)(rid, None)
        if stream is not None:
            self._deliver(stream, chunk)

    def _deliver(self, stream: _Stream, item: StreamChunk | RequestRejected) -> None:
        """I/O thread: queues `item` for its stream; `_flush` hands what was read in one pass to each event loop
        at once. One cross-thread call per chunk took the loop's lock and wrote its wake-up pipe per chunk, with
        this thread holding the GIL the event loop needs (as LocalEngineClient._deliver found per step)."""
        self._pending.setdefault(stream.loop, []).append((stream.queue, item))
        self._batched += 1

    def _flush(self) -> None:
        """I/O thread: the chunks read since the last flush, to their streams, in the order they were read."""
        pending, self._pending, self._batched = self._pending, {}, 0
        for loop, items in pending.items():
            _call(loop, _put_all, items)

    def _read_log(self) -> None:
        """Keeps the worker's last log lines (for start-up errors) and passes them on to our stderr."""
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            self._log_tail.append(line)
            print(line, file=sys.stderr, flush=True)
        self.proc.stdout.close()


def _pid_alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's (not expected, but not dead)
        return True
    return True


async def _last_item(queue: asyncio.Queue) -> None:
    """Reads an abandoned stream's queue until its last item (a finished chunk, or a refusal)."""
    while True:
        item = await queue.get()
        if isinstance(item, RequestRejected) or item.finished:
            return


def _call(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # that event loop is closed: nobody is left to tell
        pass


def _settle(fut: asyncio.Future, result=None, error: Exception | None = None) -> None:
    def apply() -> None:
        if not fut.done():
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)

    _call(fut.get_loop(), apply)
