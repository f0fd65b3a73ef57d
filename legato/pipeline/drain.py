"""How long a refused client should wait: the waiting queue's depth over its measured drain rate.

A fixed `Retry-After: 1` sends every refused client back at once while the queue still needs many seconds
to empty, so the retries are refused again and only add load. The engine thread records each finished
request here; a 429 then carries the time the queue ahead of the client needs at the recent pace.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable


class DrainRate:
    """Requests finished per second over the last `window_s` seconds. Owned by one thread."""

    def __init__(self, window_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._done: deque[float] = deque()

    def finished(self, count: int = 1) -> None:
        now = self._clock()
        self._done.extend([now] * count)
        self._trim(now)

    def rate(self) -> float | None:
        """Finishes per second, or None before any request finished within the window."""
        now = self._clock()
        self._trim(now)
        if not self._done:
            return None
        # From the oldest finish in the window: a burst that just ended must not read as a fast steady pace.
        span = max(now - self._done[0], 1.0)
        return len(self._done) / span

    def retry_after(self, queued: int, floor_s: float = 1.0, ceiling_s: float = 120.0) -> float:
        """Seconds until `queued` requests ahead have drained at the recent pace, within [floor_s, ceiling_s].
        With no finish in the window the pace is unknown but slower than one per window: wait one window."""
        rate = self.rate()
        wait = self.window_s if rate is None else queued / rate
        return min(max(wait, floor_s), ceiling_s)

    def _trim(self, now: float) -> None:
        while self._done and self._done[0] < now - self.window_s:
            self._done.popleft()
