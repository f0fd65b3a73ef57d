"""A deadline on one await, awaited in the caller's task where Python allows.

`asyncio.wait_for` before Python 3.12 wraps what it waits for in a task of its own (two event-loop passes for
every awaited chunk or body part, on a loop whose passes take tens of milliseconds at hundreds of streams), and
it can swallow a cancel of its caller that lands as the awaited thing completes (a WebSocket writer task then
never ended). `asyncio.timeout` (Python >= 3.11) has neither problem; on 3.10 the await runs in a task raced
against the deadline with `asyncio.wait`, which never swallows the caller's cancel.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def within(pending: Awaitable[T], timeout_s: float) -> T:
    """`pending`, or TimeoutError once `timeout_s` has passed (`pending` is cancelled then)."""
    if hasattr(asyncio, "timeout"):
        async with asyncio.timeout(timeout_s):
            return await pending
    task = asyncio.ensure_future(pending)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    except BaseException:
        task.cancel()
        raise
    if not done:
        task.cancel()
        raise TimeoutError
    return task.result()
