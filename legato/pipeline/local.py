"""An `EngineClient` that runs one `Engine` on a dedicated thread of this process (`single` topology).

The engine thread owns the engine: it drains a command inbox, steps, and hands each request's chunks to
that request's asyncio queue through `call_soon_threadsafe`. Nothing else touches the engine, so no locks
guard it. What a request needs before it can queue (tokenising, the voice features of its reference clip,
the prompt's embeddings) is prepared on an admission thread, so the engine thread spends its time stepping:
at 64 streams on an H200 that preparation was a quarter of the engine thread's time. A reference clip the
voice cache lacks is encoded before that, on an encoder thread, so admission never waits behind an encode.

The one lock guards the inbox's end of life: once the thread exits (stopped or crashed) nothing more is
queued and whatever was queued is refused with 503, so no caller waits forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Coroutine
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from legato.engine import compile_watch
from legato.engine.config import EngineConfig
from legato.engine.engine import (
    TEXT_TOO_LONG,
    Engine,
    EngineRequest,
    RequestIdEnding,
    RequestOutput,
    TextTooLongError,
    warm_up_input,
)
from legato.engine.scheduler import DuplicateRequestError, QueueFullError, RequestTooLargeError
from legato.kv_transfer.handoff import Handoff, LayoutMismatch
from legato.models.qwen3_tts.audio import AudioError
from legato.models.qwen3_tts.inputs import (
    SpeechInput,
    VoiceCache,
    VoiceFeatures,
    build_spec,
    extract_voice,
    reaches_voice,
    voice_key,
)
from legato.models.qwen3_tts.loader import LoadedModel
from legato.models.qwen3_tts.prompt import PromptError, open_text_missing, with_more_text
from legato.models.qwen3_tts.sampling import SamplingParams, SamplingParamsError
from legato.models.qwen3_tts.text_stream import segment_ids
from legato.pipeline import heap
from legato.pipeline.admission import Admission, AdmissionClosed
from legato.pipeline.client import (
    ENDING_WAIT_S,
    EngineClient,
    EngineStats,
    ModelInfo,
    RequestRejected,
    StreamChunk,
    SynthesisRequest,
)
from legato.pipeline.drain import DrainRate
from legato.pipeline.handover import ChunkSink, EngineStream, StepHandover, settle
from legato.pipeline.threads import (
    ENGINE_THREAD_NAME,
    name_native_thread,
    raise_engine_thread_priority,
    set_gil_switch_interval,
    side_stream_thread,
)

log = logging.getLogger(__name__)


def rejection(exc: Exception, retry_after: float = 1.0) -> RequestRejected:
    """Maps an engine-side refusal to an HTTP-style rejection; `retry_after` is what a 429 tells the client."""
    if isinstance(exc, RequestRejected):
        return exc
    if isinstance(exc, QueueFullError):
        return RequestRejected(429, f"server busy: {exc}", retry_after=retry_after)
    if isinstance(exc, DuplicateRequestError):
        return RequestRejected(409, str(exc))
    if isinstance(exc, LayoutMismatch):  # two workers of one deployment disagree: a deployment error
        return RequestRejected(500, f"KV layout mismatch between workers: {exc}")
    if isinstance(exc, TextTooLongError):
        return RequestRejected(400, str(exc), code=TEXT_TOO_LONG)
    if isinstance(exc, (PromptError, AudioError, SamplingParamsError, RequestTooLargeError, ValueError)):
        return RequestRejected(400, str(exc))
    return RequestRejected(500, f"internal error: {type(exc).__name__}: {exc}")


class _Admitting:
    """A request asked for and not yet handed to the engine thread. An abort in that time finds nothing in the
    engine to abort, so it is noted here, and the request ends with it instead of being added."""

    __slots__ = ("reason",)

    def __init__(self) -> None:
        self.reason: str | None = None


class LocalEngineClient(EngineClient):
    def __init__(self, loaded: LoadedModel, config: EngineConfig, name: str = "legato") -> None:
        self.loaded = loaded
        self.engine = Engine(loaded, config)
        self.voices = VoiceCache(config.voice_cache_size)  # used by the encoder and admission threads (thread-safe)
        # One thread: requests reach the engine in the order they arrived, as when the engine prepared them
        # (one with a new reference clip joins that order once its clip is encoded); prompts built in batches.
        self._admission = Admission(self.engine.prepare_prompts, lambda er: not open_text_missing(er.spec))
        # Reference clips the voice cache lacks are encoded here, so that admission, which every request passes
        # through, never waits behind an encode (see `_voice_of`).
        self._encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="voice-encoder",
                                           initializer=side_stream_thread,
                                           initargs=(self.engine.runner.device,))
        self.info = ModelInfo.from_configs(name, loaded.config, loaded.speech_config)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, EngineStream] = {}
        # Engine thread: requests whose id's earlier request is still ending (RequestIdEnding), with when they
        # give up; retried after each step until the old one's last output is out.
        self._deferred: list[tuple[tuple, float]] = []
        self._aborted: Counter[str] = Counter()
        self._loop_other_s = 0.0  # engine thread: host time outside engine.step() while work runs
        # A snapshot read from any thread; the engine thread renews it whenever what it reports changes. Taken
        # now, before the thread runs: a read before the first step must see the idle engine, every block free
        # (a router or a worker's heartbeat would take a zeroed snapshot for a full replica).
        self._stats = self._snapshot()
        self._thread = threading.Thread(target=self._run, name=ENGINE_THREAD_NAME, daemon=True)
        self._stopping = False
        self._stopped = threading.Event()
        self._closed = False  # the engine thread has exited: the inbox takes nothing more
        self._inbox_lock = threading.Lock()
        self._deadline: float | None = None  # engine thread: when shutdown aborts what is still running
        self._drain_rate = DrainRate()  # engine thread: finishes per second, for a 429's Retry-After
        # Streaming text that came while its request was still being admitted: it follows the request's "add".
        self._early_text: dict[str, list[tuple]] = {}
        # In-context clones whose open text does not fill their prompt yet: woken by text (or by an abort, which
        # puts its reason in place of the event).
        self._text_waits: dict[str, asyncio.Event | str] = {}
        # Requests from the moment they are asked for (not when their stream first runs: a worker process may hear
        # its front's Abort before the request's task has started) until they reach the engine thread.
        self._admitting: dict[str, _Admitting] = {}

    # --- server side ----------------------------------------------------------------------------------

    async def start(self) -> None:
        set_gil_switch_interval()
        if self.engine.runner.device.type == "cuda":  # where first uses compile and capture: before serving
            with compile_watch.warming():  # what compiles after it, the warm-up missed
                loop = asyncio.get_running_loop()
                seconds = await loop.run_in_executor(None, self.engine.warm_up)
                seconds += await self._warm_up_admission()
                if self.engine.codec is not None or self.loaded.model.speaker_encoder is not None:
                    # On the encoder thread, which runs every later encode: cuDNN and cuBLAS keep a handle per
                    # thread, and the first request with a voice would otherwise create them.
                    seconds += await loop.run_in_executor(self._encoder, self._warm_up_voices)
            log.info("engine warmed up in %.1f s (first-use compilation and graph capture done before serving)",
                     seconds)
            heap.watch_pauses()  # a worker process, one engine for life, also freezes its heap (worker.py)
        self._thread.start()

    async def _warm_up_admission(self) -> float:
        """Throwaway prompts built on the admission thread, which builds every prompt: what its first batches cost
        (that thread's cuBLAS handle, pinned host buffers of a full batch's size) is paid before serving, not by
        the first burst. A full batch's worth, queued at once (they form one or two batches)."""
        started = time.monotonic()
        req = SynthesisRequest("__warm_up_admission__", warm_up_input(self.loaded.config), SamplingParams())
        await asyncio.gather(*(self._admitted_request(lambda: self._engine_request(req))
                               for _ in range(self._admission.max_batch)))
        return time.monotonic() - started

    def _warm_up_voices(self) -> float:
        """The speaker and codec encoders' first run (Base models), outside the voice cache."""
        if self.loaded.model.speaker_encoder is None:
            return 0.0
        started = time.monotonic()
        noise = np.random.default_rng(0).standard_normal(24000).astype(np.float32) * 0.1
        extract_voice(self.loaded, noise, 24000)
        return time.monotonic() - started

    async def stop(self, grace_s: float = 10.0) -> None:
        self._stopping = True
        for waiting in self._text_waits.values():  # requests waiting for text before admission: refused now
            if isinstance(waiting, asyncio.Event):
                waiting.set()
        loop = asyncio.get_running_loop()
        if self._thread.ident is not None:  # never started: nothing runs, nothing to wait for
            self._submit(("stop", grace_s))
            await loop.run_in_executor(None, self._stopped.wait, grace_s + 30.0)
        await loop.run_in_executor(None, self._admission.close)
        self._encoder.shutdown(wait=False, cancel_futures=True)

    def generate(self, req: SynthesisRequest) -> AsyncIterator[StreamChunk]:
        marks = {"called": time.perf_counter()}  # the first audio's `stages` are measured from here
        # A text_open request takes text from the moment it is asked for, even before its stream is iterated:
        # what comes before it reaches the engine thread follows it there.
        owner = req.text_open and req.request_id not in self._early_text
        if owner:
            self._early_text[req.request_id] = []
        admitting = self._claim(req.request_id)
        return self._generate(req, owner, marks, admitting)

    async def _generate(self, req: SynthesisRequest, owner: bool, marks: dict[str, float],
                        admitting: _Admitting | None) -> AsyncIterator[StreamChunk]:
        prepared, then = await self._admit(req, owner, marks, admitting)
        if isinstance(prepared, StreamChunk):
            yield prepared
            return
        # Closed with this generator, not when the loop finalizes it: a client leaving aborts at once.
        async with contextlib.aclosing(self._stream("add", prepared, req.request_id, then, marks)) as chunks:
            async for chunk in chunks:
                yield chunk

    def generate_into(self, req: SynthesisRequest,
                      sink: ChunkSink) -> Coroutine[None, None, None]:
        """As `generate`, but the chunks go to `sink` on the caller's loop: one call per engine step for every
        stream of that sink, [(request_id, chunk), ...] in the engine's order, instead of one queue and one task
        wake-up per chunk (at 256 streams a worker's event loop spent ~4.5 ms a step on those wake-ups). The
        returned coroutine ends once the request's last chunk went to `sink`; a refusal raises RequestRejected, as
        `generate` does, and no chunk goes to `sink` then. Cancelled before its end, the request is aborted. As
        with `generate`, an open text takes text from this call on, before the coroutine runs."""
        marks = {"called": time.perf_counter()}
        owner = req.text_open and req.request_id not in self._early_text
        if owner:
            self._early_text[req.request_id] = []
        admitting = self._claim(req.request_id)
        return self._generate_into(req, sink, owner, marks, admitting)

    async def _generate_into(self, req: SynthesisRequest, sink: ChunkSink, owner: bool, marks: dict[str, float],
                             admitting: _Admitting | None) -> None:
        prepared, then = await self._admit(req, owner, marks, admitting)
        if isinstance(prepared, StreamChunk):
            sink([(req.request_id, prepared)])
            return
        loop = asyncio.get_running_loop()
        await self._run_into("add", prepared, req.request_id, then,
                             EngineStream(loop, sink=sink, done=loop.create_future(), marks=marks))

    async def _admit(self, req: SynthesisRequest, owner: bool, marks: dict[str, float],
                     admitting: _Admitting | None) -> tuple[EngineRequest | StreamChunk, list[tuple]]:
        """The request ready for the engine (voice, tokens, prompt) and the text that came meanwhile; or, for a
        request aborted before it reached the engine (an open in-context clone waiting for text included), its last
        chunk. `marks` gets the perf_counter() stamps of the way: the voice found, the admission thread taking it
        and its prompt built. The caller hands a prepared request to the engine thread without awaiting first, so
        an abort after this returns finds it there."""
        then: list[tuple] = []
        try:
            if admitting is None or (req.text_open and not owner):
                raise RequestRejected(409, f"duplicate request id {req.request_id!r}")
            if self._stopping:
                raise RequestRejected.shutting_down()
            voice = await self._voice_of(req.input)
            marks["voice"] = time.perf_counter()
            prepared = await self._admitted_request(lambda: self._engine_request(req, voice), marks)
            if prepared.prompt is None:  # an in-context clone whose open text does not fill its prompt yet
                if req.handoff_only:  # its text goes to the decode side, so this side would wait forever
                    raise RequestRejected(400, "prefill-decode cannot take an in-context clone's streaming text "
                                               "(its prompt waits for text the decode side receives)")
                prepared = await self._with_enough_text(prepared)
                if prepared is None:
                    return StreamChunk(np.zeros(0, np.float32), 0, finished=True, finish_reason="abort",
                                       error=self._text_waits.pop(req.request_id, None) or "aborted"), []
        finally:
            self._text_waits.pop(req.request_id, None)
            if owner:
                then = self._early_text.pop(req.request_id, [])
            ended = self._admission_over(req.request_id, admitting)
        if ended is not None:
            return ended, []
        return prepared, then

    def _claim(self, request_id: str) -> _Admitting | None:
        """The id's admission guard, or None when another request under the same id (a client's X-Request-Id sent
        twice) is being admitted: that one holds the guard, and replacing it would let an abort meant for one end
        the other, or leave one to run on for nobody. The newcomer is refused as a duplicate."""
        if request_id in self._admitting:
            return None
        admitting = self._admitting[request_id] = _Admitting()
        return admitting

    def _admission_over(self, request_id: str, admitting: _Admitting | None) -> StreamChunk | None:
        """Forgets `admitting` (unless a later request under its id took the entry); the request's last chunk if
        it was aborted meanwhile. Aborted while it was being admitted (a worker process hears its front's Abort
        while the request's task is still here), the request, added now, would run to its frame cap for nobody,
        and an open text would wait for text that never comes, holding a slot and its blocks for ever."""
        if admitting is None:  # a duplicate, refused: the guard is its namesake's
            return None
        if self._admitting.get(request_id) is admitting:
            del self._admitting[request_id]
        if admitting.reason is None:
            return None
        return StreamChunk(np.zeros(0, np.float32), 0, finished=True, finish_reason="abort", error=admitting.reason)

    async def _with_enough_text(self, prepared: EngineRequest) -> EngineRequest | None:
        """Waits until the text that came (held in `_early_text`) fills an open in-context clone's prompt, or
        closes; then folds it into the request and builds the prompt. None: aborted while it waited. The
        wait has no deadline of its own, as a running request waiting for text has none: its caller's limits
        (a socket's idle time) end it, through `abort`."""
        rid = prepared.request_id
        arrived = asyncio.Event()
        self._text_waits[rid] = arrived
        spec = prepared.spec
        while True:
            held = self._early_text.get(rid, [])
            taken = 0
            while taken < len(held) and spec.text_open:  # up to the close: what follows it goes on to the engine
                _, _, ids, close = held[taken]
                spec = with_more_text(spec, ids, close)
                taken += 1
            del held[:taken]
            if not spec.text_open or open_text_missing(spec) == 0:
                break
            arrived.clear()
            await arrived.wait()
            if self._text_waits.get(rid) is not arrived:  # abort() replaced it with its reason
                return None
            if self._stopping:
                raise RequestRejected.shutting_down()
        del self._text_waits[rid]
        return await self._admitted_request(lambda: dataclasses.replace(prepared, spec=spec))

    takes_text_input = True

    async def append_text(self, request_id: str, text: str, close: bool = False) -> None:
        # Tokenised here, on the caller's loop, so pieces reach the engine thread in the order they came.
        ids = segment_ids(self.loaded.text_tokenizer, text, first=False) if text else []
        cmd = ("text", request_id, ids, close)
        early = self._early_text.get(request_id)
        if early is not None:
            early.append(cmd)
            if (waiting := self._text_waits.get(request_id)) is not None:
                waiting.set()
        else:
            self._submit(cmd)

    def generate_from_handoff(self, handoff: Handoff) -> AsyncIterator[StreamChunk]:
        """Decodes a request prefilled by another engine (prefill-decode disaggregation). A handoff whose text
        is open takes text from this call on, as `generate` does."""
        rid = handoff.request_id
        owner = handoff.text_open and rid not in self._early_text
        if owner:
            self._early_text[rid] = []
        admitting = self._claim(rid)
        return self._decode_handoff(handoff, owner, admitting)

    async def _decode_handoff(self, handoff: Handoff, owner: bool,
                              admitting: _Admitting | None) -> AsyncIterator[StreamChunk]:
        rid = handoff.request_id
        then = self._handoff_admitted(handoff, owner, admitting)
        if isinstance(then, StreamChunk):
            yield then
            return
        async with contextlib.aclosing(self._stream("handoff", handoff, rid, then)) as chunks:
            async for chunk in chunks:
                yield chunk

    def generate_from_handoff_into(self, handoff: Handoff,
                                   sink: ChunkSink) -> Coroutine[None, None, None]:
        """`generate_from_handoff` with its chunks going to `sink`, as `generate_into` does (a decode worker's
        path)."""
        rid = handoff.request_id
        owner = handoff.text_open and rid not in self._early_text
        if owner:
            self._early_text[rid] = []
        admitting = self._claim(rid)
        return self._decode_handoff_into(handoff, sink, owner, admitting)

    async def _decode_handoff_into(self, handoff: Handoff, sink: ChunkSink, owner: bool,
                                   admitting: _Admitting | None) -> None:
        rid = handoff.request_id
        then = self._handoff_admitted(handoff, owner, admitting)
        if isinstance(then, StreamChunk):
            sink([(rid, then)])
            return
        loop = asyncio.get_running_loop()
        await self._run_into("handoff", handoff, rid, then, EngineStream(loop, sink=sink, done=loop.create_future()))

    def _handoff_admitted(self, handoff: Handoff, owner: bool,
                          admitting: _Admitting | None) -> list[tuple] | StreamChunk:
        """The text that came for a handoff since it was asked for, to follow it to the engine thread; or its last
        chunk, if it was aborted before it got there. A decode worker hears its front's Abort as a message of its
        own, and may handle it after asking for the handoff's decode and before that decode's task first runs:
        the engine has nothing to abort then, and the handoff, added after, would decode to its frame cap for
        nobody (as `_admit` guards a new request)."""
        rid = handoff.request_id
        try:
            if admitting is None or (handoff.text_open and not owner):
                raise RequestRejected(409, f"duplicate request id {rid!r}")
        finally:
            then = self._early_text.pop(rid, []) if owner else []
            ended = self._admission_over(rid, admitting)
        return then if ended is None else ended

    async def _stream(self, kind: str, payload: object, request_id: str,
                      then: list[tuple] = (), marks: dict[str, float] | None = None) -> AsyncIterator[StreamChunk]:
        stream = EngineStream(asyncio.get_running_loop(), queue=asyncio.Queue(), marks=marks)
        async with self._admitted(kind, payload, request_id, then, stream) as ended:
            while True:
                chunk = await stream.queue.get()
                ended[0] = chunk.finished
                yield chunk
                if chunk.finished:
                    return

    async def _run_into(self, kind: str, payload: object, request_id: str, then: list[tuple],
                        stream: EngineStream) -> None:
        async with self._admitted(kind, payload, request_id, then, stream) as ended:
            await stream.done
            ended[0] = True

    @contextlib.asynccontextmanager
    async def _admitted(self, kind: str, payload: object, request_id: str, then: list[tuple], stream: EngineStream):
        """Hands the request to the engine thread and waits for its admission (raising RequestRejected); the body
        then takes its chunks and sets `ended[0]` at the last. Left before that, the request is aborted."""
        if self._stopping:
            raise RequestRejected.shutting_down()
        admitted = stream.loop.create_future()
        stream.submitted = time.perf_counter()
        if not self._submit((kind, payload, admitted, stream)):
            raise RequestRejected(503, "the engine is not running")
        for cmd in then:  # text that came during admission: right behind its request, before anything newer
            self._submit(cmd)
        ended = [False]
        try:
            await admitted  # raises RequestRejected
            yield ended
        finally:
            # A refused request is not in the engine; aborting its id could end another request using it.
            refused = admitted.done() and not admitted.cancelled() and admitted.exception() is not None
            if not ended[0] and not refused:
                self._submit(("abort", request_id, "client disconnected"))

    async def abort(self, request_id: str, reason: str = "aborted") -> None:
        # A text_open stream that was asked for and never read holds its early text here: nothing else frees it.
        self._early_text.pop(request_id, None)
        if (admitting := self._admitting.pop(request_id, None)) is not None:  # not in the engine yet: ends there
            admitting.reason = reason
        waiting = self._text_waits.get(request_id)
        if isinstance(waiting, asyncio.Event):  # not in the engine yet: waiting for its text
            self._text_waits[request_id] = reason
            waiting.set()
        self._submit(("abort", request_id, reason))

    async def extract_voice(self, samples: np.ndarray, sample_rate: int) -> VoiceFeatures:
        if self._stopping or self._closed:  # a worker whose engine is gone takes no work of any kind
            raise RequestRejected(503, "the engine is not running")
        return await self._on_thread(self._encoder, self.voices, self.loaded, samples, sample_rate)

    async def _voice_of(self, inp: SpeechInput) -> VoiceFeatures | None:
        """The voice of a request's reference clip, found in the cache or encoded on the encoder thread before
        the request goes to admission (None: no clip, or admission should see to it). A new clip's encode takes
        ~5-75 ms on the H200, most for a clip length the process has not seen; on the admission thread every
        request queued behind it waited that long, however known its own voice.

        Only a clip `build_spec` would encode is encoded here; admission checks every request as before, and
        an encode that fails here is left to admission too, which fails the request with the same message."""
        if not reaches_voice(inp):
            return None
        codes, key = not inp.x_vector_only, inp.ref_audio_key
        if self.voices.max_entries > 0:
            if key is None:  # the server keys the clips it decodes; other callers' clips are keyed here (< 1 ms)
                try:
                    key = voice_key(inp.ref_audio, inp.ref_sample_rate)
                except (TypeError, ValueError):
                    return None
            known = self.voices.lookup(key, codes)
            if known is not None:
                return known
        try:
            return await self._on_thread(self._encoder, self.voices, self.loaded, inp.ref_audio,
                                         inp.ref_sample_rate, key, codes)
        except RequestRejected:
            return None

    async def _admitted_request(self, make, marks: dict[str, float] | None = None) -> EngineRequest:
        """`make()` (the request without its prompt) on the admission thread, with its prompt built in the batch
        it joins there; what refuses it comes back as a RequestRejected. `marks` gets when the thread took it
        (`taken`) and when its prompt was built (`built`)."""
        try:
            done = self._admission.submit(make)
            req = await asyncio.wrap_future(done)
            if marks is not None:
                marks.update(done.marks)
            return req
        except AdmissionClosed as e:
            raise RequestRejected.shutting_down() from e
        except Exception as e:
            raise rejection(e) from e

    async def _on_thread(self, executor: ThreadPoolExecutor, fn, *args):
        """`fn(*args)` on `executor`'s thread; what it raises comes back as a RequestRejected."""
        try:
            return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)
        except Exception as e:
            if isinstance(e, RuntimeError) and self._stopping:  # the executor was shut down under us
                raise RequestRejected.shutting_down() from e
            raise rejection(e) from e

    def _engine_request(self, req: SynthesisRequest, voice: VoiceFeatures | None = None) -> EngineRequest:
        """Admission thread: tokenises and takes the voice (`voice`, else the cache, encoding a clip it lacks);
        the prompt's embeddings are built for the batch (`Admission`)."""
        spec = build_spec(self.loaded, req.input, self.voices if voice is None else (lambda *a, **k: voice))
        if req.text_open:
            spec = dataclasses.replace(spec, text_open=True)
        return EngineRequest(
            request_id=req.request_id, spec=spec, sampling=req.sampling, max_frames=req.max_frames,
            ignore_eos=req.ignore_eos, first_chunk_frames=req.first_chunk_frames, handoff_only=req.handoff_only,
        )

    def stats(self) -> EngineStats:
        return self._stats

    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def _submit(self, cmd: tuple) -> bool:
        """Queues a command for the engine thread; False once that thread has exited."""
        with self._inbox_lock:
            if self._closed:
                return False
            self._inbox.put(cmd)
            return True

    # --- engine thread --------------------------------------------------------------------------------

    def _run(self) -> None:
        name_native_thread()
        raise_engine_thread_priority()
        try:
            while True:
                # Requests that only wait for text leave nothing to step: wait for a command (50 ms at most).
                idle = (not self.engine.has_unfinished() or self.engine.waits_for_text_only()) and not self._deferred
                block = idle and self._deadline is None
                started = time.perf_counter()
                self._drain(block=block)
                if not block:
                    self._loop_other_s += time.perf_counter() - started
                deadline = self._deadline  # set by a "stop" command, from the grace that came with it
                if deadline is not None and (not self.engine.has_unfinished() or time.monotonic() > deadline):
                    for rid in list(self._streams):
                        self.engine.abort(rid, "server shutting down")
                    outputs = self.engine.step()
                    self._refresh_stats()
                    self._deliver(outputs)
                    return
                outputs = self.engine.step()
                started = time.perf_counter()
                # Stats first: whoever sees a request's last chunk must see the blocks it gave back.
                self._refresh_stats()
                self._deliver(outputs)
                self._retry_deferred()  # an id whose old request's end just went out is free now
                self._loop_other_s += time.perf_counter() - started
        except Exception:  # the loop itself failing is fatal for this worker: fail every stream loudly
            log.exception("engine loop crashed")
            handover = StepHandover()
            for rid, s in list(self._streams.items()):
                handover.add(s, rid, StreamChunk(np.zeros(0, np.float32), 0, finished=True, finish_reason="error",
                                                 error="engine loop crashed"))
                self._streams.pop(rid, None)
            handover.send()
        finally:
            with self._inbox_lock:
                self._closed = True
            self._refuse_queued()
            for cmd, _ in self._deferred:
                settle(cmd[2], error=RequestRejected(503, "the engine is not running"))
            self._deferred.clear()
            self._stopped.set()

    def _refuse_queued(self) -> None:
        """Settles the commands left in the inbox once the loop has exited (their callers are waiting)."""
        gone = RequestRejected(503, "the engine is not running")
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            if cmd[0] in ("add", "handoff"):
                settle(cmd[2], error=gone)

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle_safely(cmd)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle_safely(self, cmd: tuple, give_up_at: float | None = None) -> None:
        """`_handle(cmd)`, where a command that fails costs its own request (aborted with the reason), never the
        loop: one client's text must not stop every other stream (an append to a request the scheduler had just
        ended once raised here and ended the engine thread)."""
        try:
            self._handle(cmd, give_up_at)
        except Exception as e:
            log.exception("engine thread: a %r command failed", cmd[0])
            rid = cmd[1] if cmd[0] in ("abort", "text") else None
            if rid is not None:
                try:
                    self.engine.abort(rid, f"internal error handling its {cmd[0]}: {type(e).__name__}: {e}")
                except Exception:
                    log.exception("engine thread: aborting %s failed too", rid)

    def _handle(self, cmd: tuple, give_up_at: float | None = None) -> None:
        kind = cmd[0]
        if kind in ("add", "handoff"):
            _, payload, admitted, stream = cmd
            wait_until = self._add(payload, admitted, stream, give_up_at)
            if wait_until is not None:
                self._deferred.append((cmd, wait_until))
        elif kind == "abort":
            _, rid, reason = cmd
            waiting = [d for d in self._deferred if d[0][1].request_id == rid]  # EngineRequest or Handoff
            if waiting:  # not in the engine yet (its id was still ending): it never will be
                self._deferred = [d for d in self._deferred if d not in waiting]
                for (_, _, admitted, _), _ in waiting:
                    settle(admitted, error=RequestRejected(409, f"request {rid!r} was aborted: {reason}"))
            if self.engine.abort(rid, reason):
                self._aborted[reason] += 1
                self._refresh_stats()  # its blocks are free now, not after the next step
        elif kind == "text":
            _, rid, ids, close = cmd
            try:
                self.engine.append_text(rid, ids, close)
            except ValueError as e:  # more text after the close: the caller broke the contract; end the request
                log.warning("request %s: text refused: %s", rid, e)
                self.engine.abort(rid, f"text refused: {e}")
        elif kind == "stop":
            self._stopping = True
            if self._deadline is None:
                self._deadline = time.monotonic() + cmd[1]

    def _retry_deferred(self) -> None:
        if not self._deferred:
            return
        deferred, self._deferred = self._deferred, []
        for cmd, give_up_at in deferred:
            self._handle_safely(cmd, give_up_at)

    def _add(self, req: EngineRequest | Handoff, admitted: asyncio.Future, stream: EngineStream,
             give_up_at: float | None = None) -> float | None:
        """Admits the request, or settles `admitted` with why not; returns when to give up instead when the request
        must wait for its id's earlier request to finish ending (the caller holds it until then)."""
        if self._stopping:
            settle(admitted, error=RequestRejected.shutting_down())
            return None
        try:
            seed = self.engine.add_handoff(req) if isinstance(req, Handoff) else self.engine.add_request(req)
        except RequestIdEnding as e:
            # The id's earlier request (its client gone, say) still has its last output on the way: this one
            # waits for it, a step or so, rather than being handed what is left of the old one.
            now = time.monotonic()
            give_up_at = give_up_at if give_up_at is not None else now + ENDING_WAIT_S
            if now < give_up_at:
                return give_up_at
            settle(admitted, error=rejection(e))
            return None
        except Exception as e:
            wait = (self._drain_rate.retry_after(self.engine.scheduler.num_waiting + 1)
                    if isinstance(e, QueueFullError) else 1.0)
            settle(admitted, error=rejection(e, retry_after=wait))
            return None
        self._streams[req.request_id] = stream
        stream.added = time.perf_counter()
        self._refresh_stats()  # a caller told it is admitted sees it counted
        settle(admitted, result=seed)
        return None

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hands a step's chunks to their streams, one wake-up per event loop (and per sink) per step
        (`StepHandover`)."""
        handover = StepHandover()
        for o in outputs:
            stream = self._streams.get(o.request_id)
            if stream is None:
                continue
            chunk = StreamChunk(
                audio=o.audio if o.audio is not None else np.zeros(0, np.float32),
                num_frames=o.num_frames, num_prompt_tokens=o.num_prompt_tokens, finished=o.finished,
                finish_reason=o.finish_reason, error=o.error, error_code=o.error_code, seed=o.seed,
                codes=o.codes.numpy(),
                handoff=o.handoff,
            )
            if o.finished:
                del self._streams[o.request_id]
                self._drain_rate.finished()
            if chunk.audio.size or chunk.codes.size or o.finished:
                handover.add(stream, o.request_id, chunk)
        handover.send()

    def _refresh_stats(self) -> None:
        self._stats = self._snapshot()

    def _snapshot(self) -> EngineStats:
        """The engine's stats as they are now: called by the engine thread, or before it runs."""
        sched, bm, times = self.engine.scheduler, self.engine.block_manager, self.engine.times
        return EngineStats(
            waiting=sched.num_waiting, running=sched.num_running, kv_usage=bm.usage,
            num_kv_blocks=bm.num_blocks, free_kv_blocks=bm.num_free_blocks,
            aborted=dict(self._aborted), steps=times.steps, decode_rows=times.decode_rows,
            step_host_s=times.host_s, step_gpu_s=times.gpu_s, step_gap_s=times.gap_s, loop_other_s=self._loop_other_s,
            text_wait_s=self.engine.text_wait_s,
            waiting_for_text=self.engine.num_waiting_for_text,
        )
