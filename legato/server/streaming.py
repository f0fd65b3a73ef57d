"""Delivering one synthesis: the whole file, a raw audio stream, or SSE events.

Every mode first waits for the request's first chunk, so a refusal (429 queue full, 400 bad prompt, 503
shutting down) or a failure before any audio is still an ordinary HTTP error with a JSON body; the
response headers (request id, seed) are sent only once the request is really running.

After that, each mode ends in exactly one recorded outcome (metrics + one log line):
- the engine finished (stop/length): usage in headers (file), the `speech.audio.done` event (SSE), or
  the log (raw stream, whose headers are long gone);
- the engine failed the request, or shutdown aborted it: 500/503 (file), a `speech.audio.error` event
  (SSE), or a cut raw stream: the connection closes without the final chunk, so the client sees a
  truncated body rather than a short but valid-looking file;
- the request outlived `request_timeout_s`: it is aborted, then reported as above with 504;
- the client went away: the engine request is aborted at once (its blocks freed), counted as 499.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from collections.abc import AsyncIterator, Callable

import anyio
import numpy as np
from fastapi import Request
from fastapi.responses import Response

from legato.engine.engine import TEXT_TOO_LONG
from legato.pipeline.client import (
    ENGINE_UNAVAILABLE,
    EngineClient,
    RequestRejected,
    StreamChunk,
    SynthesisRequest,
    unavailable_code,
)
from legato.server.encoding import AudioFormat, StreamEncoder, encode_file, media_type
from legato.server.errors import ApiError, error_type
from legato.server.frame_budget import CAPS, FrameBudget
from legato.server.metrics import ServerMetrics
from legato.server.resample import StreamResampler, resample_all
from legato.server.settings import ServerSettings
from legato.server.stream_response import AudioStreamResponse, ClientGone, StreamCut, until_disconnected
from legato.server.timeouts import within

log = logging.getLogger(__name__)

_FAILED = {"error": 500, "abort": 503}
# The headers a speech response may carry beyond HTTP's own: CORS exposes every one (app.py), so a page of an
# allowed origin reads what any other client reads (the usage headers of a whole file included).
RESPONSE_HEADERS = ("X-Request-Id", "X-Seed", "X-Sample-Rate", "X-Usage-Input-Tokens", "X-Usage-Output-Tokens",
                    "X-Usage-Total-Tokens", "X-Audio-Seconds", "X-Finish-Reason", "X-Length-Cap", "Retry-After")


class Generation:
    """One engine request as the HTTP layer sees it: pulls chunks under the request's deadline, keeps the
    usage, and records exactly one outcome."""

    def __init__(self, client: EngineClient, req: SynthesisRequest, mode: str, started: float,
                 timeout_s: float | None, metrics: ServerMetrics,
                 on_end: Callable[[str], None] | None = None, budget: FrameBudget | None = None) -> None:
        self.req = req
        self.budget = budget
        self._on_end = on_end
        self.mode = mode
        self.started = started
        self.deadline = None if timeout_s is None else started + timeout_s
        self.metrics = metrics
        self.sample_rate = client.info.sample_rate
        self._client = client
        self._chunks = client.generate(req)
        self.prompt_tokens = 0
        self.frames = 0
        self.samples = 0
        self.seed = req.sampling.seed
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.ttfp: float | None = None
        self.stages: dict[str, float] = {}  # where the TTFP went on the engine's side (StreamChunk.stages)
        # The front's own share of the TTFP: `front_in` (headers in -> the request handed to the engine client:
        # body, checks, clip) and `reply` (handed over -> first audio chunk pulled here: the hops to the engine
        # and back plus the engine's stages), so a slow TTFP names the process it is spent in.
        self.handed_over = time.perf_counter()
        self.front_stages: dict[str, float] = {}
        self.outcome: int | None = None

    async def next(self) -> StreamChunk:
        """The next chunk. Raises RequestRejected (first call), TimeoutError (after aborting the request)."""
        pending = anext(self._chunks)
        try:
            if self.deadline is None:
                chunk = await pending
            else:
                # On timeout the pull inside the engine iterator is cancelled, which aborts the request as a client
                # gone: the engine is told "timeout" first, so its abort counts (/health, metrics) say why.
                chunk = await within(pending, max(self.deadline - time.perf_counter(), 0.0),
                                     before_cancel=lambda: self._client.abort(self.req.request_id, "timeout"))
        except StopAsyncIteration:  # a client breaking the contract: say so rather than hang or crash
            chunk = StreamChunk(np.zeros(0, np.float32), self.frames, finished=True, finish_reason="error",
                                error="the engine stream ended without a final chunk", seed=self.seed or 0)
        self.prompt_tokens = chunk.num_prompt_tokens or self.prompt_tokens
        # An end the deployment made (a worker died, a handoff failed) carries no counts of its own (0 frames,
        # seed 0): the request's usage and seed stay what its engine reported.
        self.frames = max(self.frames, chunk.num_frames)
        self.samples += len(chunk.audio)
        if chunk.seed or self.seed is None:
            self.seed = chunk.seed
        if chunk.stages:
            self.stages = chunk.stages
        if chunk.audio.size and not self.front_stages:
            self.front_stages = {"front_in": self.handed_over - self.started,
                                 "reply": time.perf_counter() - self.handed_over}
        if chunk.finished:
            self.finish_reason, self.error = chunk.finish_reason, chunk.error
        return chunk

    @property
    def succeeded(self) -> bool:
        return self.finish_reason in ("stop", "length")

    @property
    def audio_seconds(self) -> float:
        return self.samples / self.sample_rate

    @property
    def length_cap(self) -> str | None:
        """The cap (frame_budget.CAPS) that ended a request `length`, or None (it ended otherwise, or the
        front could not tell)."""
        b = self.budget
        return b.cap if self.finish_reason == "length" and b is not None and self.frames >= b.frames else None

    def usage(self) -> dict:
        return {"input_tokens": self.prompt_tokens, "output_tokens": self.frames,
                "total_tokens": self.prompt_tokens + self.frames}

    def first_audio(self) -> None:
        if self.ttfp is None:
            self.ttfp = time.perf_counter() - self.started
            self.metrics.observe_ttfp(self.mode, self.ttfp)

    def finish(self, status: int, abort_reason: str | None = None, error: str | None = None) -> None:
        """Records the outcome once: metrics and one log line carrying the usage."""
        if self.outcome is not None:
            return
        self.outcome = status
        self._ended()
        e2e = time.perf_counter() - self.started
        if abort_reason:
            self.metrics.aborts.labels(abort_reason).inc()
        if status == 200:
            self.metrics.observe_e2e(self.mode, e2e)
            if self.samples:
                self.metrics.rtf.labels(self.mode).observe(e2e / self.audio_seconds)
            self.metrics.audio_seconds.inc(self.audio_seconds)
        level = logging.INFO if status < 500 or status == 503 else logging.WARNING
        log.log(level, "speech %s", "done" if status == 200 else f"ended with {status}", extra={
            "request_id": self.req.request_id, "status": status, "mode": self.mode,
            "finish_reason": self.finish_reason, "abort_reason": abort_reason, "error": error or self.error,
            "prompt_tokens": self.prompt_tokens, "frames": self.frames, "audio_s": round(self.audio_seconds, 3),
            "ttfp_s": None if self.ttfp is None else round(self.ttfp, 4), "e2e_s": round(e2e, 4), "seed": self.seed,
            "length_cap": self.length_cap,
            **{f"{k}_s": round(v, 4) for k, v in (*self.stages.items(), *self.front_stages.items())},
        })
        if self.length_cap is not None and not self.budget.exact:
            log.info("request %s ended 'length' at %d frames: cut by %s", self.req.request_id, self.frames,
                     CAPS[self.length_cap], extra={"request_id": self.req.request_id, "length_cap": self.length_cap})

    def finish_failed(self) -> int:
        """Records a request the engine failed (500) or aborted while shutting down (503)."""
        status = _FAILED.get(self.finish_reason or "error", 500)
        self.finish(status, abort_reason="shutdown" if status == 503 else None)
        return status

    async def close(self) -> None:
        """Ends the engine request if it is still running (closing the iterator aborts it)."""
        with anyio.CancelScope(shield=True):
            await self._chunks.aclose()
        self._ended()

    def _ended(self) -> None:
        if self._on_end is not None:
            self._on_end(self.req.request_id)
            self._on_end = None

    async def abandon(self) -> None:
        """Ends the request as the client leaving (499) unless an outcome was recorded, and closes it."""
        self.finish(499, abort_reason="client_disconnect")
        await self.close()


class SpeechResponder:
    def __init__(self, client: EngineClient, settings: ServerSettings, metrics: ServerMetrics) -> None:
        self.client = client
        self.settings = settings
        self.metrics = metrics
        self._live: set[str] = set()  # request ids between claim() and their Generation's end

    def claim(self, request_id: str) -> None:
        """Reserves a request id for one request at a time: a second request with the id of one still in
        flight is a conflict (409), not a new request (ids key aborts, logs and metrics)."""
        if request_id in self._live:
            raise ApiError(409, f"request id {request_id!r} is already in flight", "duplicate_request_id",
                           "X-Request-Id")
        self._live.add(request_id)

    def release(self, request_id: str) -> None:
        self._live.discard(request_id)

    async def respond(self, req: SynthesisRequest, fmt: str | AudioFormat, mode: str, request: Request,
                      budget: FrameBudget | None = None) -> Response:
        audio = fmt if isinstance(fmt, AudioFormat) else AudioFormat(fmt)
        started = getattr(request.state, "started", time.perf_counter())
        gen = Generation(self.client, req, mode, started, self.settings.request_timeout_s, self.metrics,
                         on_end=self.release, budget=budget)
        request.state.generation = gen  # its outcome is the request's final status (see app.SpeechStatusCounter)
        try:
            if mode == "file":
                return await until_disconnected(request, self._file(gen, audio))
            first = await until_disconnected(request, self._first(gen))
        except ClientGone:
            await gen.abandon()
            return Response(status_code=499)
        except BaseException:
            await gen.close()
            raise
        headers = {"X-Request-Id": req.request_id, "X-Seed": str(gen.seed),
                   "X-Sample-Rate": str(audio.sample_rate or gen.sample_rate), "Cache-Control": "no-cache"}
        if mode == "sse":
            return AudioStreamResponse(self._sse(gen, first, audio), "text/event-stream", headers, gen.abandon)
        return AudioStreamResponse(self._raw(gen, first, audio), media_type(audio.fmt), headers, gen.abandon)

    async def _first(self, gen: Generation) -> StreamChunk:
        """The first chunk with audio (or the last chunk), or the request's error as an ApiError when it
        failed before any audio. Chunks carrying only codec codes are skipped: they hold nothing to send."""
        try:
            chunk = await gen.next()
            while not chunk.finished and not chunk.audio.size:
                chunk = await gen.next()
        except RequestRejected as e:
            gen.finish(e.status, error=e.message)
            headers = {"Retry-After": str(max(1, round(e.retry_after)))} if e.retry_after is not None else None
            code = rejection_code(e)
            # the client's text was too long: the field to fix is `input`, as a validation error names it
            raise ApiError(e.status, e.message, code, "input" if code == TEXT_TOO_LONG else None,
                           headers=headers) from e
        except asyncio.TimeoutError as e:
            gen.finish(504, abort_reason="timeout")
            raise ApiError(504, f"request timed out after {self.settings.request_timeout_s:g} s", "timeout") from e
        if chunk.finished and not gen.succeeded and not chunk.audio.size:
            self._raise_failure(gen)
        return chunk

    def _raise_failure(self, gen: Generation) -> None:
        status = gen.finish_failed()
        message = gen.error or ("aborted: the server is shutting down" if status == 503 else "generation failed")
        raise ApiError(status, message, unavailable_code(message) if status == 503 else "generation_failed")

    async def _file(self, gen: Generation, fmt: AudioFormat) -> Response:
        chunk = await self._first(gen)
        parts = [chunk.audio]
        try:
            while not chunk.finished:
                chunk = await gen.next()
                parts.append(chunk.audio)
        except asyncio.TimeoutError as e:
            gen.finish(504, abort_reason="timeout")
            raise ApiError(504, f"request timed out after {self.settings.request_timeout_s:g} s", "timeout") from e
        if not gen.succeeded:
            self._raise_failure(gen)
        gen.first_audio()
        audio = np.concatenate(parts) if len(parts) > 1 else parts[0]
        rate = fmt.sample_rate or gen.sample_rate
        body = await asyncio.to_thread(_encode_whole, audio, gen.sample_rate, fmt)
        gen.finish(200)
        usage = gen.usage()
        return Response(body, media_type=media_type(fmt.fmt), headers={
            "X-Request-Id": gen.req.request_id, "X-Seed": str(gen.seed), "X-Sample-Rate": str(rate),
            "X-Usage-Input-Tokens": str(usage["input_tokens"]), "X-Usage-Output-Tokens": str(usage["output_tokens"]),
            "X-Usage-Total-Tokens": str(usage["total_tokens"]), "X-Audio-Seconds": f"{gen.audio_seconds:.6f}",
            "X-Finish-Reason": gen.finish_reason or "", **({"X-Length-Cap": gen.length_cap} if gen.length_cap else {}),
        })

    async def _raw(self, gen: Generation, first: StreamChunk, fmt: AudioFormat) -> AsyncIterator[bytes]:
        encoder = _Encoder(fmt, gen.sample_rate)
        try:
            chunk = first
            gen.first_audio()
            yield await encoder.start() + await encoder.encode(first.audio)
            while not chunk.finished:
                chunk = await gen.next()
                if chunk.audio.size:
                    yield await encoder.encode(chunk.audio)
            if gen.succeeded:
                tail = await encoder.finish()
                gen.finish(200)
                if tail:
                    yield tail
                return
            gen.finish_failed()
            raise StreamCut(gen.error or gen.finish_reason)
        except asyncio.TimeoutError as e:
            gen.finish(504, abort_reason="timeout")
            raise StreamCut("timeout") from e
        except StreamCut:
            raise
        except Exception as e:
            log.exception("audio stream failed")
            gen.finish(500, error=f"{type(e).__name__}: {e}")
            raise StreamCut(f"internal error: {type(e).__name__}") from e
        finally:
            encoder.close()
            await gen.abandon()  # no-op unless the client left

    async def _sse(self, gen: Generation, first: StreamChunk, audio: AudioFormat) -> AsyncIterator[bytes]:
        # Deltas carry the requested format, which must stream; a WAV header has no place in events: PCM.
        fmt = "pcm" if audio.fmt == "wav" else audio.fmt
        encoder = _Encoder(AudioFormat(fmt, audio.sample_rate, audio.mp3_kbps), gen.sample_rate)
        try:
            chunk = first
            gen.first_audio()
            pending = await encoder.start()
            if first.audio.size:
                yield _delta(pending + await encoder.encode(first.audio), fmt)
                pending = b""
            while not chunk.finished:
                chunk = await gen.next()
                if chunk.audio.size:
                    yield _delta(pending + await encoder.encode(chunk.audio), fmt)
                    pending = b""
            if gen.succeeded:
                tail = pending + await encoder.finish()
                if tail:
                    yield _delta(tail, fmt)
                gen.finish(200)
                yield _event({"type": "speech.audio.done", "usage": gen.usage(), "request_id": gen.req.request_id,
                              "seed": gen.seed, "audio_seconds": round(gen.audio_seconds, 6),
                              "sample_rate": audio.sample_rate or gen.sample_rate, "finish_reason": gen.finish_reason,
                              "length_cap": gen.length_cap})
                return
            status = gen.finish_failed()
            message = gen.error or "generation failed"
        except asyncio.TimeoutError:
            status = 504
            gen.finish(status, abort_reason="timeout")
            message = f"request timed out after {self.settings.request_timeout_s:g} s"
        except Exception as e:
            log.exception("event stream failed")
            status, message = 500, f"internal error: {type(e).__name__}"
            gen.finish(status, error=f"{type(e).__name__}: {e}")
        finally:
            encoder.close()
            await gen.abandon()  # no-op unless the client left
        yield _event({"type": "speech.audio.error", "request_id": gen.req.request_id, "usage": gen.usage(),
                      "error": {"message": message, "type": error_type(status),
                                "code": status, "partial_audio": gen.samples > 0}})


def rejection_code(e: RequestRejected) -> str:
    """The `code` of an engine's refusal: the one it carries, else its status's (a 503 that names none is a
    worker that is not serving)."""
    if e.code is not None:
        return e.code
    codes = {429: "queue_full", 413: "request_too_large", 409: "duplicate_request_id", 503: ENGINE_UNAVAILABLE}
    return codes.get(e.status, "internal_error" if e.status >= 500 else "invalid_request")


def _encode_whole(audio: np.ndarray, model_rate: int, fmt: AudioFormat) -> bytes:
    rate = fmt.sample_rate or model_rate
    return encode_file(resample_all(audio, model_rate, rate) if rate != model_rate else audio, rate, fmt.fmt,
                       fmt.mp3_kbps)


def _event(data: dict) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


def _delta(data: bytes, fmt: str) -> bytes:
    return _event({"type": "speech.audio.delta", "response_format": fmt,
                   "audio": base64.b64encode(data).decode("ascii")})


class _Encoder:
    """A `StreamEncoder` whose compressing formats run on a worker thread (LAME and Opus release the GIL),
    so encoding many streams never stalls the event loop; PCM and WAV are cheap enough to stay on it."""

    def __init__(self, fmt: AudioFormat, model_rate: int) -> None:
        rate = fmt.sample_rate or model_rate
        self._enc = StreamEncoder(fmt.fmt, rate, fmt.mp3_kbps)
        self._resampler = StreamResampler(model_rate, rate) if rate != model_rate else None
        self._threaded = fmt.fmt not in ("pcm", "wav") or self._resampler is not None

    async def _call(self, fn, *args) -> bytes:
        return await asyncio.to_thread(fn, *args) if self._threaded else fn(*args)

    async def start(self) -> bytes:
        return await self._call(self._enc.start)

    async def encode(self, audio: np.ndarray) -> bytes:
        return await self._call(self._encode, audio)

    async def finish(self) -> bytes:
        return await self._call(self._finish)

    def _encode(self, audio: np.ndarray) -> bytes:
        return self._enc.encode(audio if self._resampler is None else self._resampler.process(audio))

    def _finish(self) -> bytes:
        tail = b"" if self._resampler is None else self._enc.encode(self._resampler.flush())
        return tail + self._enc.finish()

    def close(self) -> None:
        self._enc.close()
