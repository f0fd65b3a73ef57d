"""A deadline on one await, awaited in the caller's task.

`asyncio.wait_for` before Python 3.12 wraps what it waits for in a task of its own: two event-loop passes for
every awaited chunk or body part, on a loop whose passes take tens of milliseconds at hundreds of streams.
`asyncio.timeout` (Python >= 3.11) cancels the caller's own await instead; 3.10 keeps `wait_for`.
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
    return await asyncio.wait_for(pending, timeout_s)
