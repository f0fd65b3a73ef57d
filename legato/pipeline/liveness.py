"""When the server may call a silent worker dead: after it has *watched* for the timeout without hearing from it.

The server's I/O thread reads the worker's messages, then looks at the silence since the last one (every
50 ms). Wall time since the last message is the wrong measure under CPU contention: when the server process
(or the whole machine) stalls, the worker's heartbeats wait in the socket, unread, and the first look after
the stall would see a long silence and kill a healthy worker (issue 20: a worker's return code was not 0
under load). So silence accrues only while the thread watches: each look adds the time since the previous
look, but at most `max_step_s`; a stall of any length costs at most that much. Any message is a sign of life,
not only a heartbeat: a worker busy streaming chunks is not silent.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class Liveness:
    """Silence of one worker, as the thread that reads its messages saw it (not thread-safe: that thread
    calls `heard` and `look`; others may read `silent_s`)."""

    def __init__(self, timeout_s: float, max_step_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not timeout_s > 0 or not max_step_s > 0:
            raise ValueError("timeout_s and max_step_s must be > 0")
        self.timeout_s = timeout_s
        self.max_step_s = max_step_s
        self._clock = clock
        self._last_look = clock()
        self.silent_s = 0.0

    def heard(self) -> None:
        """The worker said something: it is alive now."""
        self.silent_s = 0.0

    def look(self) -> bool:
        """One look after reading everything that had arrived; True once the watched silence passes the timeout."""
        now = self._clock()
        self.silent_s += min(max(0.0, now - self._last_look), self.max_step_s)
        self._last_look = now
        return self.silent_s > self.timeout_s

    @property
    def expired(self) -> bool:
        return self.silent_s > self.timeout_s
