"""The HTTP side of a streamed response: a body that watches for its client leaving and may be cut on
purpose (`StreamCut`), work raced against a disconnect (`until_disconnected`), and the log filter that keeps
a deliberate cut to one line. streaming.py decides what to send; this module only sends it."""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import anyio
from fastapi import Request
from fastapi.responses import Response
from starlette.types import Receive, Scope, Send

log = logging.getLogger("legato.server.streaming")  # the name these lines always had: log filters key on it
T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before the response started."""


class StreamCut(Exception):
    """Raised by a raw stream's body to end the response without its final chunk."""


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Awaits `work` in the calling task while a watcher waits for the client to leave; a disconnect cancels
    the work and raises ClientGone.

    The work runs in this task, not a task of its own: at hundreds of streams each pass of the event loop takes
    tens of milliseconds, and a wrapped task cost three of them on a request's way to its first audio (the
    wrapper starting, the engine request only sent from inside it, and `asyncio.wait` waking this task after the
    wrapper ended). A cancellation from outside (the server stopping) stays a cancellation."""
    task = asyncio.current_task()
    assert task is not None, "until_disconnected runs inside a task"
    watch = _DisconnectWatch(task)
    watcher = asyncio.ensure_future(watch.run(request.receive))
    try:
        result = await work
    except asyncio.CancelledError:
        if not watch.take_cancel():
            raise  # not ours: the server is cancelling this request
        raise ClientGone from None
    finally:
        watch.working = False
        watcher.cancel()
    if watch.take_cancel():  # the work ignored our cancel and ended anyway: the client is gone all the same
        raise ClientGone
    return result


class _DisconnectWatch:
    """Cancels `task` when the client leaves while the work runs, and remembers having done so."""

    def __init__(self, task: asyncio.Task) -> None:
        self.task = task
        self.working = True
        self.cancelled = False

    async def run(self, receive: Receive) -> None:
        await _wait_disconnect(receive)
        # Only while the work runs: once it has ended, this task is on to the response (which watches itself).
        if self.working:
            self.cancelled = True
            self.task.cancel()

    def take_cancel(self) -> bool:
        """True when the watcher cancelled the task; the cancel request is then withdrawn (Python >= 3.11 counts
        them), so only a cancellation from outside, if there also was one, is still pending."""
        if not self.cancelled:
            return False
        self.cancelled = False
        uncancel = getattr(self.task, "uncancel", None)
        if uncancel is not None and uncancel() > 0:
            raise asyncio.CancelledError  # cancelled from outside too: that one wins
        return True


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


# Set in the task of a request whose raw stream was cut on purpose; the context is the task's, so it is
# still set when uvicorn, in that same task, notices the incomplete response.
_cut_here: contextvars.ContextVar[bool] = contextvars.ContextVar("legato_stream_cut", default=False)
_UVICORN_INCOMPLETE = "ASGI callable returned without completing response."


class CutStreamLogFilter(logging.Filter):
    """Drops uvicorn's error line for a response left incomplete when that was a deliberate `StreamCut`,
    already logged with its reason: one line per cut stream. Other incomplete responses still log."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == _UVICORN_INCOMPLETE and _cut_here.get())


# uvicorn's websockets-sansio protocol logs a client's text frame that is not UTF-8 with a traceback, though the
# client is told (close code 1007) and the server is fine: any client could fill the log with them.
_UVICORN_BAD_UTF8 = "Invalid UTF-8 sequence received from client."


class ClientFrameLogFilter(logging.Filter):
    """Turns uvicorn's traceback for a WebSocket text frame that is not UTF-8 into one warning line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == _UVICORN_BAD_UTF8:
            record.msg = "a WebSocket client sent a text frame that is not UTF-8: closed with 1007"
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def install_uvicorn_log_filters() -> None:
    """Adds `CutStreamLogFilter` and `ClientFrameLogFilter` to uvicorn's error logger, once each."""
    logger = logging.getLogger("uvicorn.error")
    for kind in (CutStreamLogFilter, ClientFrameLogFilter):
        if not any(isinstance(f, kind) for f in logger.filters):
            logger.addFilter(kind())


class AudioStreamResponse(Response):
    """A streamed body that (a) watches for the client leaving and cancels the body at once, whatever
    the ASGI spec version (Starlette's StreamingResponse only notices on the next write with spec 2.4),
    (b) lets the body end the response without its final chunk by raising `StreamCut`, and (c) always
    awaits `on_close` at the end: a body that never started (the client left first) skips its own
    `finally`, so the request it streams must be ended from here."""

    def __init__(self, body: AsyncIterator[bytes], media_type: str, headers: dict[str, str],
                 on_close: Callable[[], Awaitable[None]]) -> None:
        self.body_iterator = body
        self.on_close = on_close
        self.status_code = 200
        self.media_type = media_type
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                await _wait_disconnect(receive)
                tg.cancel_scope.cancel()

            tg.start_soon(watch)
            try:
                await self._stream(send)
            finally:
                tg.cancel_scope.cancel()

    async def _stream(self, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except StreamCut as e:
            log.warning("cutting the audio stream: %s", e)  # the server closes the connection mid-body
            _cut_here.set(True)  # uvicorn is about to log the same cut again, without its reason
        except OSError:
            pass  # the client is gone (a write failed); the body's finally aborts the request
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
                await self.on_close()
