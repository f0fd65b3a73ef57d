"""`within`: a deadline on one await, in the caller's task (no task of its own, whatever the Python)."""

from __future__ import annotations

import asyncio
import sys

import pytest

from legato.server.body_deadline import BodyTimeoutMiddleware
from legato.server.timeouts import within

NO_TIMEOUT_CM = pytest.mark.skipif(sys.version_info < (3, 11), reason="Python 3.10 has no asyncio.timeout: within "
                                   "falls back to wait_for, which awaits in a task of its own")


@NO_TIMEOUT_CM
def test_a_ready_await_returns_its_value_without_yielding_to_the_loop():
    async def main() -> None:
        ready = asyncio.get_running_loop().create_future()
        ready.set_result(7)
        coro = within(ready, 5.0)
        with pytest.raises(StopIteration) as done:
            coro.send(None)
        assert done.value.value == 7

    asyncio.run(main())


def test_a_late_await_times_out_and_is_cancelled():
    async def main() -> None:
        cancelled = asyncio.Event()

        async def slow() -> None:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.set()
                raise

        with pytest.raises(TimeoutError):
            await within(slow(), 0.01)
        assert cancelled.is_set()

    asyncio.run(main())


def test_a_cancel_from_outside_stays_a_cancel():
    async def main() -> None:
        task = asyncio.create_task(within(asyncio.sleep(30), 30.0))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_before_cancel_runs_at_the_deadline_before_the_await_is_cancelled():
    """An engine stream aborts as a client gone when its pull is cancelled, and the engine counts the first
    reason it hears: the timeout's own abort (`before_cancel`) must come first."""
    async def main() -> None:
        order = []

        async def slow() -> None:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                order.append("cancelled")
                raise

        async def abort() -> None:
            await asyncio.sleep(0)  # a client's abort may yield before it is sent
            order.append("abort")

        with pytest.raises(TimeoutError):
            await within(slow(), 0.01, before_cancel=abort)
        assert order == ["abort", "cancelled"]
        assert await within(asyncio.sleep(0, "ok"), 5.0, before_cancel=abort) == "ok"
        assert order == ["abort", "cancelled"]  # no deadline passed: not run

    asyncio.run(main())


def test_a_cancel_from_outside_stays_a_cancel_with_before_cancel():
    async def main() -> None:
        ran = []

        async def abort() -> None:
            ran.append(True)

        task = asyncio.create_task(within(asyncio.sleep(30), 30.0, before_cancel=abort))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not ran

    asyncio.run(main())


@NO_TIMEOUT_CM
def test_a_body_already_there_passes_the_body_deadline_without_a_loop_pass():
    """The body's deadline wraps every `receive` of the request body: it must not cost the request event-loop
    passes (on a loop serving hundreds of streams each takes tens of milliseconds)."""
    seen = []

    async def app(scope, receive, send) -> None:
        seen.append(await receive())

    async def receive() -> dict:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message) -> None:
        pass

    guarded = BodyTimeoutMiddleware(app, timeout_s=5.0)

    async def main() -> None:
        coro = guarded({"type": "http"}, receive, send)
        with pytest.raises(StopIteration):
            coro.send(None)

    asyncio.run(main())
    assert seen == [{"type": "http.request", "body": b"{}", "more_body": False}]
