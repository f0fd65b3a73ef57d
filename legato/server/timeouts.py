"""A deadline on one await, awaited in the caller's task where Python allows.

`asyncio.wait_for` before Python 3.12 wraps what it waits for in a task of its own (two event-loop passes for
every awaited chunk or body part, on a loop whose passes take tens of milliseconds at hundreds of streams), and
it can swallow a cancel of its caller that lands as the awaited thing completes (a WebSocket writer task then
never ended). `asyncio.timeout` (Python >= 3.11) has neither problem; on 3.10 the await runs in a task raced
against the deadline with `asyncio.wait`, which never swallows the caller's cancel.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

log = logging.getLogger(__name__)

_expiring: set[asyncio.Task] = set()  # `before_cancel` tasks: the loop holds tasks only weakly


async def within(pending: Awaitable[T], timeout_s: float,
                 before_cancel: Callable[[], Awaitable[None]] | None = None) -> T:
    """`pending`, or TimeoutError once `timeout_s` has passed (`pending` is cancelled then).

    `before_cancel` runs at the deadline before `pending` is cancelled: an engine stream aborts its request as a
    client gone ("client disconnected") when its pull is cancelled, and the engine counts an abort under the
    first reason it hears, so a timeout is told to the engine first. An error it raises is logged, and the
    cancel follows all the same."""
    if not hasattr(asyncio, "timeout"):
        return await _within_task(pending, timeout_s, before_cancel)
    if before_cancel is None:
        async with asyncio.timeout(timeout_s):
            return await pending
    loop = asyncio.get_running_loop()
    inside, expired = True, False
    async with asyncio.timeout(None) as timeout:
        def cancel_now(_: asyncio.Task) -> None:
            if inside:  # asyncio.timeout cancels `pending` and turns the cancel into TimeoutError
                timeout.reschedule(loop.time())

        def expire() -> None:
            nonlocal expired
            expired = True
            task = loop.create_task(_run_logged(before_cancel))
            _expiring.add(task)
            task.add_done_callback(_expiring.discard)
            task.add_done_callback(cancel_now)

        handle = loop.call_later(timeout_s, expire)
        try:
            result = await pending
        finally:
            inside = False
            handle.cancel()
    if expired:  # `pending` ended while `before_cancel` ran: the deadline had passed all the same
        raise TimeoutError
    return result


async def _within_task(pending: Awaitable[T], timeout_s: float,
                       before_cancel: Callable[[], Awaitable[None]] | None) -> T:
    # Python 3.10: the await in a task of its own, raced against the deadline.
    task = asyncio.ensure_future(pending)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
        if not done:
            if before_cancel is not None:
                await _run_logged(before_cancel)
            raise TimeoutError
        return task.result()
    finally:
        task.cancel()  # a no-op once it is done


async def _run_logged(fn: Callable[[], Awaitable[None]]) -> None:
    try:
        await fn()
    except Exception:
        log.exception("work before a timeout's cancel failed")
