"""Graceful shutdown: drain in-flight requests on the first SIGTERM/SIGINT, exit at once on the second.

uvicorn's own shutdown closes the listener, waits `timeout_graceful_shutdown` and then cancels whatever
still runs, and only then runs the lifespan that stops the engine. Cancelled streams end as a cut
connection (no SSE error event, counted as a client disconnect) with CancelledError tracebacks. So the
order is reversed here:

1. first signal: `Lifecycle.begin_drain` marks the app draining (new speech/voice requests and /health
   answer 503, the listener stays open so load balancers see it) and asks the engine to stop with the
   grace: it lets running requests finish, then ends the rest as aborted, which each response format
   reports in its own way (streaming.py);
2. once no request is in flight (or grace + margin has passed), uvicorn is told to exit; its graceful
   timeout is longer still, so it never has to cancel a request the engine is ending properly;
3. a second signal exits the process at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Callable
from types import FrameType

import uvicorn
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from legato.pipeline.client import EngineClient
from legato.server.errors import error_body

log = logging.getLogger(__name__)

SHUTDOWN_MARGIN_S = 5.0
"""Time past the grace for aborted requests to write their error endings before uvicorn may cancel them."""

SHUTTING_DOWN = "server is shutting down"
_REFUSED_PREFIX = "/v1/audio/"  # speech and voices: new work; /health, /metrics and /v1/models still answer


class Lifecycle:
    """The app's draining state, its count of in-flight requests, and the engine stop (run once)."""

    def __init__(self, client: EngineClient, grace_s: float) -> None:
        self.client = client
        self.grace_s = grace_s
        self.draining = False
        self.in_flight = 0
        self._idle: asyncio.Event | None = None
        self._engine_stop: asyncio.Task[None] | None = None

    def begin_drain(self) -> None:
        """Refuses new work from now on and starts stopping the engine (which ends requests at the grace)."""
        if self.draining:
            return
        self.draining = True
        log.info("shutting down: refusing new requests; in-flight requests get %.1f s", self.grace_s)
        self.stop_engine()

    def stop_engine(self) -> asyncio.Task[None]:
        """The engine stop, started on the first call; later calls (the lifespan's) wait on the same one."""
        if self._engine_stop is None:
            self._engine_stop = asyncio.ensure_future(self.client.stop(self.grace_s))
        return self._engine_stop

    async def wait_idle(self, timeout_s: float) -> bool:
        """Waits until no request is in flight; False if `timeout_s` passed first."""
        try:
            await asyncio.wait_for(self._idle_event().wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True

    def _idle_event(self) -> asyncio.Event:
        if self._idle is None:
            self._idle = asyncio.Event()
            if self.in_flight == 0:
                self._idle.set()
        return self._idle

    def enter(self) -> None:
        self.in_flight += 1
        self._idle_event().clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle_event().set()


class DrainMiddleware:
    """Counts in-flight HTTP requests and, while draining, refuses new speech/voice work with 503 (and
    `Connection: close`, so clients reconnect elsewhere)."""

    def __init__(self, app: ASGIApp, lifecycle: Lifecycle) -> None:
        self.app = app
        self.lifecycle = lifecycle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.lifecycle.draining and scope["path"].startswith(_REFUSED_PREFIX):
            response = JSONResponse(error_body(503, SHUTTING_DOWN, "shutting_down"), status_code=503,
                                    headers={"Connection": "close"})
            await response(scope, receive, send)
            return
        self.lifecycle.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.lifecycle.leave()


class GracefulServer(uvicorn.Server):
    """uvicorn's server with the signal handling above. Its config's `timeout_graceful_shutdown` should be
    at least grace + SHUTDOWN_MARGIN_S (see `graceful_timeout`)."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle
        self._loop: asyncio.AbstractEventLoop | None = None
        self._signalled = False
        self._drain_task: asyncio.Task[None] | None = None
        self.on_signal: Callable[[], None] | None = None  # told of a stop signal (front 0 of --fronts N)
        self.gave_up = False  # stopped by request_drain(failed=True): the process exits 1
        self.on_started: Callable[[], None] | None = None  # called once the listener takes connections

    async def startup(self, sockets: list | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)
        if self.started and self.on_started is not None:
            self.on_started()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded in uvicorn's captured signals: it would re-raise them after a clean shutdown, and the
        # process would end "killed by SIGTERM" instead of exiting 0.
        if self.on_signal is not None:
            self.on_signal()
        if self._signalled:
            # A signal handler may run while the logging lock is held; write the line directly.
            os.write(2, f"legato: second {signal.Signals(sig).name}: exiting now\n".encode())
            os._exit(128 + sig)
        self._signalled = True
        if self._loop is None or not self.started:  # still starting: nothing to drain
            self.should_exit = True
            return
        # The handler runs between two bytecodes of the loop's thread; schedule the work on the loop instead.
        self._loop.call_soon_threadsafe(self._start_drain)

    def request_drain(self, failed: bool = False) -> None:
        """Drains and exits as on a first signal, from any thread or a signal handler, but never counts as one
        (front 0 of --fronts N asks the others so: each may have had the signal itself already). `failed`: the
        process then exits 1."""
        self.gave_up = self.gave_up or failed
        if self._loop is not None and self.started:
            self._loop.call_soon_threadsafe(self._start_drain)
        else:
            self.should_exit = True

    def _start_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        try:
            self.lifecycle.begin_drain()
            if not await self.lifecycle.wait_idle(self.lifecycle.grace_s + SHUTDOWN_MARGIN_S):
                log.warning("%d request(s) still in flight after the grace; closing the server anyway",
                            self.lifecycle.in_flight)
        finally:
            self.should_exit = True


def graceful_timeout(grace_s: float) -> float:
    """uvicorn's `timeout_graceful_shutdown` for a grace: long enough that it never cancels a request the
    engine is about to end itself."""
    return grace_s + 2 * SHUTDOWN_MARGIN_S
