"""A 429's Retry-After is the time the queue ahead needs at its measured pace, not a constant 1 s."""

from __future__ import annotations

from legato.engine.scheduler import QueueFullError
from legato.pipeline.drain import DrainRate
from legato.pipeline.local import rejection


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_retry_after_follows_the_measured_drain_rate():
    clock = Clock()
    drain = DrainRate(window_s=30.0, clock=clock)
    assert drain.rate() is None and drain.retry_after(28) == 30.0  # no pace yet: one window
    for _ in range(10):  # 10 finishes over 5 s: 2 per second
        clock.now += 0.5
        drain.finished()
    assert abs(drain.rate() - 10 / 4.5) < 1e-9
    assert abs(drain.retry_after(28) - 28 / (10 / 4.5)) < 1e-9  # the probe's case: ~14 s, not 1 s
    assert drain.retry_after(1) == 1.0  # never under a second
    assert drain.retry_after(10_000) == 120.0  # nor past the ceiling
    clock.now += 31  # the pace goes stale with its window
    assert drain.rate() is None
    print(f"\nRetry-After for 28 queued at 2.2 req/s: {28 / (10 / 4.5):.1f} s (was 1 s)")


def test_a_burst_does_not_read_as_a_fast_pace():
    clock = Clock()
    drain = DrainRate(clock=clock)
    drain.finished(8)  # eight requests of one batch ending in the same step
    assert drain.rate() == 8.0  # over at least one second, not over zero
    assert drain.retry_after(40) == 5.0


def test_the_engine_rejection_carries_the_wait():
    refused = rejection(QueueFullError("waiting queue is full"), retry_after=14.2)
    assert refused.status == 429 and refused.retry_after == 14.2
