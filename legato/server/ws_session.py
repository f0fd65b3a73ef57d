"""One streaming-text WebSocket: its contexts (each one engine request whose text is still arriving), the
bounded outbox every message to the client goes through, and the loop that reads the client's events.

Why an outbox: the engine makes audio whether or not the client reads it. Every message waits in one queue of
`WsLimits.send_queue` entries, written by one task; a client that stops reading fills it, its producers wait
(backpressure) and, past `send_timeout_s`, the socket is closed and its requests aborted: no buffer grows
without bound. A cancelled context's audio still in the queue is dropped, so a barge-in stops the audio within
the engine step that takes the abort, and the reply counts only the audio that really went out.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from legato.engine.engine import TEXT_TOO_LONG
from legato.models.qwen3_tts.text_stream import TextStream
from legato.pipeline.client import EngineClient, RequestRejected, StreamChunk, unavailable_code
from legato.server.encoding import STREAMABLE, AudioFormat, audio_options_problem
from legato.server.errors import ApiError
from legato.server.metrics import ServerMetrics
from legato.server.speech import SpeechService
from legato.server.streaming import _Encoder, rejection_code
from legato.server.text import is_blank
from legato.server.timeouts import within
from legato.server.ws_protocol import (
    ClientEvent,
    ProtocolError,
    SessionConfig,
    WsLimits,
    binary_frame,
    default_session,
    error_event,
    parse_event,
    session_config,
    session_echo,
)

log = logging.getLogger(__name__)


async def _next_chunk(gen: AsyncIterator[StreamChunk], deadline: float | None,
                      abort: Callable[[], Awaitable[None]] | None = None) -> StreamChunk:
    """The stream's next chunk; TimeoutError once `deadline` (monotonic; None: none) has passed, after `abort`
    (the engine told "timeout" before the cancelled pull aborts the request as a client gone)."""
    if deadline is None:
        return await anext(gen)
    return await within(anext(gen), max(deadline - time.monotonic(), 0.0), before_cancel=abort)


class SlowClient(Exception):
    """The client did not take its messages within `send_timeout_s`."""


class InFlight(Protocol):
    """What counts requests in flight for the server's drain (`lifecycle.Lifecycle`)."""

    def enter(self) -> None: ...

    def leave(self) -> None: ...


@dataclass
class Context:
    """One `context_id`: its text as it arrives and, once a first piece is out, its engine request."""

    id: str
    text: TextStream = field(default_factory=TextStream)
    chars: int = 0  # characters appended so far
    lead: str = ""  # pieces so far blank: held until a piece with something to say starts the request
    request_id: str | None = None
    task: asyncio.Task | None = None
    ended: bool = False  # input_text.end received
    cancelled: bool = False
    samples_sent: int = 0  # model-rate samples of audio handed to the socket
    transport: str = "binary"  # how its audio goes out: the session's at the context's start, kept to its end


@dataclass
class _Out:
    """An outgoing message: a text event (a dict, or a function making it when it is sent) or audio bytes."""

    event: dict | Callable[[], dict] | None = None
    audio: bytes | None = None
    context: Context | None = None
    samples: int = 0


class StreamSession:
    def __init__(self, client: EngineClient, service: SpeechService, metrics: ServerMetrics, limits: WsLimits,
                 receive: Callable[[], Awaitable[dict]], send_text: Callable[[str], Awaitable[None]],
                 send_bytes: Callable[[bytes], Awaitable[None]], close: Callable[[int, str], Awaitable[None]],
                 in_flight: InFlight | None = None) -> None:
        self.client, self.service, self.metrics, self.limits = client, service, metrics, limits
        # Each running context counts as a request in flight (the server's drain waits for them as for HTTP's).
        self.in_flight = in_flight
        self._receive, self._send_text, self._send_bytes, self._close = receive, send_text, send_bytes, close
        self.config: SessionConfig = default_session()
        self.contexts: dict[str, Context] = {}
        self._outbox: asyncio.Queue[_Out] = asyncio.Queue(maxsize=limits.send_queue)
        self._gone = asyncio.Event()  # the client left or is being closed: stop reading and writing
        self._close_reason: tuple[int, str] | None = None
        self._close_sent = False
        self._last_activity = time.monotonic()
        self.rate = client.info.sample_rate

    # --- the socket's life ----------------------------------------------------------------------------

    async def run(self) -> None:
        """Reads the client's events until it leaves; a watchdog closes an idle socket or one whose client stopped
        reading. On the way out every context still running is aborted."""
        writer = asyncio.create_task(self._write())
        watchdog = asyncio.create_task(self._watch())
        try:
            await self._read()
        except SlowClient:  # a reply to the client's own messages found it not reading: close it, as for audio
            await self._send_close()
        finally:
            self._gone.set()
            for ctx in list(self.contexts.values()):
                await self._drop(ctx, "client disconnected")
            for task in (writer, watchdog):
                task.cancel()
            await asyncio.wait({writer, watchdog}, timeout=5.0)  # bounded, whatever they do with the cancel

    async def _read(self) -> None:
        while True:
            msg = await self._receive()
            if msg["type"] == "websocket.disconnect":
                return
            if self._gone.is_set():
                continue  # closing: what the client still sends is not acted on
            self._last_activity = time.monotonic()
            await self._on_message(msg)

    async def _watch(self) -> None:
        while not self._gone.is_set():
            try:
                await within(self._gone.wait(), max(0.01, self._idle_left()))
            except TimeoutError:
                if self._idle_left() <= 0:
                    self._close_reason = (1000, "idle timeout")
                    self._gone.set()
        await self._send_close()

    async def _send_close(self) -> None:
        """The close frame `_close_reason` asks for, once (the watchdog and the reader may both get here)."""
        if self._close_reason is None or self._close_sent:
            return
        self._close_sent = True
        try:
            await within(self._close(*self._close_reason), 2.0)
        except Exception:  # the client is gone already: nothing to tell it
            pass

    def _idle_left(self) -> float:
        """Seconds until the socket counts as idle: no message from the client and none sent to it, and no context
        whose text is all in (its audio is the engine's to make: a request queued behind others sends nothing for
        a while, and closing its socket would fail it)."""
        if any(ctx.ended for ctx in self.contexts.values()):
            return self.limits.idle_timeout_s  # its last message (done, cancelled, error) counts as activity
        return self.limits.idle_timeout_s - (time.monotonic() - self._last_activity)

    async def _on_message(self, msg: dict) -> None:
        ev = None
        try:
            if msg.get("text") is None:
                raise ProtocolError("binary messages are not accepted: send JSON text events", "binary_not_accepted")
            ev = parse_event(msg["text"], self.limits)
            await self._on_event(ev)
        except ProtocolError as e:
            if ev is not None:
                e.event_id = e.event_id or ev.event_id
                e.context_id = e.context_id or ev.context_id
            self.metrics.ws_refused.labels(e.code).inc()
            await self._put(_Out(error_event(e.status, e.message, e.code, e.param, e.context_id, e.event_id)))

    # --- events ---------------------------------------------------------------------------------------

    async def _on_event(self, ev: ClientEvent) -> None:
        if ev.type == "session.update":
            config = session_config(ev.session, self.config)
            fmt = config.speech.response_format
            if fmt not in STREAMABLE:
                raise ProtocolError(f"response_format {fmt} cannot be streamed; streamable: {', '.join(STREAMABLE)}",
                                    "unsupported_format", "response_format", event_id=ev.event_id)
            # Checked now, as HTTP checks a request, not when a context starts on a session that said it was fine.
            problem = audio_options_problem(fmt, config.speech.sample_rate, config.speech.mp3_bitrate, self.rate)
            if problem is not None:
                raise ProtocolError(*problem, event_id=ev.event_id)
            self.config = config
            await self._put(_Out({"type": "session.updated", "session": session_echo(config, self.rate)}))
            return
        ctx = self.contexts.get(ev.context_id)
        if ev.type == "response.cancel":
            if ctx is None:
                raise ProtocolError(f"no context {ev.context_id!r} is running", "unknown_context", "context_id")
            await self._cancel(ctx)
        elif ev.type == "input_text.append":
            if ctx is None:
                if len(ev.text) > self.limits.max_text_chars:
                    raise ProtocolError(f"a context takes at most {self.limits.max_text_chars} characters of text",
                                        "text_too_long", "text")
                if len(self.contexts) >= self.limits.max_contexts:
                    raise ProtocolError(f"a socket runs at most {self.limits.max_contexts} contexts at once",
                                        "too_many_contexts", "context_id")
                ctx = self.contexts[ev.context_id] = Context(ev.context_id)
                self.metrics.ws_contexts.inc()
            await self._append(ctx, ev.text)
        elif ctx is None:
            raise ProtocolError(f"no context {ev.context_id!r} is running", "unknown_context", "context_id")
        elif ev.type == "input_text.flush":
            self._check_open(ctx)
            await self._offer(ctx, ctx.text.flush(), close=False)
        else:  # input_text.end
            self._check_open(ctx)
            ctx.ended = True
            await self._offer(ctx, ctx.text.close(), close=True)

    def _check_open(self, ctx: Context) -> None:
        if ctx.ended:
            raise ProtocolError(f"context {ctx.id!r} has ended its text", "context_ended", "context_id")

    async def _append(self, ctx: Context, text: str) -> None:
        self._check_open(ctx)
        if ctx.chars + len(text) > self.limits.max_text_chars:
            raise ProtocolError(f"a context takes at most {self.limits.max_text_chars} characters of text",
                                "text_too_long", "text")
        ctx.chars += len(text)
        await self._offer(ctx, ctx.text.append(text), close=False)

    async def _offer(self, ctx: Context, piece: str, close: bool) -> None:
        """A piece the text stream let out: it starts the context's request or goes to the running one."""
        if ctx.request_id is not None:
            if piece or close:
                await self.client.append_text(ctx.request_id, piece, close=close)
            return
        ctx.lead += piece
        if is_blank(ctx.lead):  # what HTTP refuses as blank input (invisible and control characters too)
            if close:
                await self._drop(ctx, None)
                raise ProtocolError("the context ended without any text to speak (only spaces, control or "
                                    "invisible characters)", "empty_text", "text")
            return
        await self._start(ctx, ctx.lead, close)

    async def _start(self, ctx: Context, first: str, close: bool) -> None:
        if not self.client.takes_text_input:
            await self._drop(ctx, None)
            raise ProtocolError("this deployment's engine client cannot take streaming text",
                                "unsupported_topology", status=501)
        ctx.request_id = uuid.uuid4().hex
        ctx.transport = self.config.transport  # a later session.update applies to later contexts only
        body = self.config.speech.model_copy(update={"input": first})
        try:
            prepared = await self.service.prepare(body, ctx.request_id, text_open=True)
        except ApiError as e:
            await self._drop(ctx, None)
            raise ProtocolError(e.message, e.code or "invalid_request", e.param, status=e.status) from None
        gen = self.client.generate(prepared.synthesis)  # takes text from here on, before it is admitted
        if close:
            await self.client.append_text(ctx.request_id, "", close=True)
        ctx.task = asyncio.create_task(self._pump(ctx, gen, prepared.audio))

    async def _cancel(self, ctx: Context) -> None:
        """Barge-in: the engine aborts the request at its next step, and nothing more of its audio goes out."""
        ctx.cancelled = True
        self.metrics.ws_cancels.inc()
        await self._drop(ctx, "cancelled")

        def reply() -> dict:  # made when it is sent: by then every audio frame sent before it is counted
            return {"type": "response.cancelled", "context_id": ctx.id,
                    "audio_ms_sent": round(ctx.samples_sent * 1000 / self.rate)}

        await self._put(_Out(reply))

    async def _drop(self, ctx: Context, reason: str | None) -> None:
        """Ends a context: aborts its request (if any) and forgets it; its id may start a new context."""
        if self.contexts.get(ctx.id) is ctx:
            del self.contexts[ctx.id]
            self.metrics.ws_contexts.dec()
        ctx.cancelled = ctx.cancelled or reason is not None
        if ctx.request_id is not None and reason is not None:
            await self.client.abort(ctx.request_id, reason)
        if ctx.task is not None and ctx.task is not asyncio.current_task():
            ctx.task.cancel()

    # --- audio out ------------------------------------------------------------------------------------

    async def _pump(self, ctx: Context, gen: AsyncIterator[StreamChunk], fmt: AudioFormat) -> None:
        encoder = _Encoder(fmt, self.rate)
        last: StreamChunk | None = None
        # --request-timeout bounds a context as it bounds an HTTP request: a context whose text stays open (a client
        # appending a word a minute) would otherwise hold its decode slot and KV blocks for as long as it likes.
        timeout_s = self.service.settings.request_timeout_s
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        request_id = ctx.request_id

        async def abort() -> None:
            if request_id is not None:
                await self.client.abort(request_id, "timeout")

        if self.in_flight is not None:  # entered here, where the finally below is sure to run
            self.in_flight.enter()
        try:
            await self._audio(ctx, await encoder.start(), 0)
            while True:
                try:
                    chunk = await _next_chunk(gen, deadline, abort)
                except StopAsyncIteration:
                    break
                last = chunk
                if chunk.audio.size:
                    await self._audio(ctx, await encoder.encode(chunk.audio), chunk.audio.size)
                if chunk.finished:
                    if chunk.finish_reason != "error":
                        await self._audio(ctx, await encoder.finish(), 0)
                    break
            if last is not None and last.finish_reason == "error":
                if last.error_code == TEXT_TOO_LONG:  # the client's text, not the server, was too much
                    await self._put(_Out(error_event(400, last.error or "the context's text is too long",
                                                     TEXT_TOO_LONG, "text", context_id=ctx.id)))
                else:
                    await self._put(_Out(error_event(500, last.error or "synthesis failed", "synthesis_failed",
                                                     context_id=ctx.id)))
            elif last is not None and last.finish_reason == "abort":
                # Ended by the server (its drain's grace ran out), not by this client, whose own cancel is answered
                # with response.cancelled: an error, as HTTP's 503, not a `done` a client would take for the whole
                # turn. Tied to the context, so a cancel that crosses it still silences it.
                message = last.error or "aborted: the server is shutting down"
                await self._put(_Out(error_event(503, message, unavailable_code(message), context_id=ctx.id),
                                     context=ctx))
            elif last is not None:
                await self._put(_Out(lambda: self._done(ctx, last), context=ctx))
        except RequestRejected as e:
            code = rejection_code(e)
            await self._put(_Out(error_event(e.status, e.message, code, context_id=ctx.id)))
        except TimeoutError:  # the pull was cancelled inside the engine stream, which aborts the request
            log.info("streaming-text context %s timed out after %g s", ctx.id, timeout_s,
                     extra={"request_id": ctx.request_id})
            self.metrics.aborts.labels("timeout").inc()
            await self._put(_Out(error_event(504, f"request timed out after {timeout_s:g} s", "timeout",
                                             context_id=ctx.id)))
        except SlowClient:
            pass
        finally:
            encoder.close()
            try:
                await gen.aclose()  # a request still running (cancelled, socket gone) is aborted by its client
            finally:
                if self.contexts.get(ctx.id) is ctx:
                    del self.contexts[ctx.id]
                    self.metrics.ws_contexts.dec()
                if self.in_flight is not None:
                    self.in_flight.leave()

    def _done(self, ctx: Context, last: StreamChunk) -> dict:
        seconds = ctx.samples_sent / self.rate
        return {"type": "response.audio.done", "context_id": ctx.id, "finish_reason": last.finish_reason,
                "usage": {"input_characters": ctx.chars, "audio_seconds": round(seconds, 3), "frames": last.num_frames,
                          "prompt_tokens": last.num_prompt_tokens, "seed": last.seed}}

    async def _audio(self, ctx: Context, data: bytes, samples: int) -> None:
        if not data and not samples:
            return
        if ctx.transport == "binary":
            await self._put(_Out(audio=binary_frame(ctx.id, data), context=ctx, samples=samples))
        else:
            event = {"type": "response.audio.delta", "context_id": ctx.id,
                     "audio": base64.b64encode(data).decode("ascii")}
            await self._put(_Out(event, context=ctx, samples=samples))

    async def _put(self, out: _Out) -> None:
        if self._gone.is_set():
            raise SlowClient()
        try:
            await within(self._outbox.put(out), self.limits.send_timeout_s)
        except TimeoutError:
            self._slow()
            raise SlowClient() from None

    def _slow(self) -> None:
        if not self._gone.is_set():
            log.warning("streaming-text socket closed: the client took no message for %.1f s",
                        self.limits.send_timeout_s)
            self.metrics.ws_slow_closes.inc()
            self._close_reason = (1008, "client is not reading its messages")
            self._gone.set()

    async def _write(self) -> None:
        while True:
            out = await self._outbox.get()
            ctx = out.context
            if ctx is not None and ctx.cancelled:
                continue  # barge-in: what was queued for it stays unsent
            try:
                send = self._send_bytes(out.audio) if out.audio is not None else self._send_text(
                    json.dumps(out.event() if callable(out.event) else out.event))
                await within(send, self.limits.send_timeout_s)
            except TimeoutError:
                self._slow()
                return
            except Exception:  # the socket is closed under us: the reader sees the disconnect
                self._gone.set()
                return
            self._last_activity = time.monotonic()
            if ctx is not None:
                ctx.samples_sent += out.samples
