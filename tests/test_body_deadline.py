"""The arithmetic of a request body's deadlines (body_deadline.py) and of a client's share of slow
connections (connections.py); the behaviour on real sockets is tests/reliability/test_slow_clients.py."""

from __future__ import annotations

import pytest

from legato.server.body_deadline import BodyDeadline
from legato.server.connections import SlowConnections, check_limits, default_slow_share


def test_a_body_at_the_minimum_rate_never_meets_its_overall_deadline():
    d = BodyDeadline(pause_s=30.0, min_rate=100.0, started=0.0)
    for second in range(1, 1000):  # 100 bytes a second for 1,000 s: always 30 s ahead of its deadline
        d.chunk(100, float(second))
        assert d.wait_s(float(second)) == 30.0


def test_a_dribbled_body_is_held_to_the_rate_after_the_grace():
    d = BodyDeadline(pause_s=30.0, min_rate=16384.0, started=0.0)
    d.chunk(1, 20.0)  # one byte every 20 s: inside the pause limit, far below the rate
    assert d.wait_s(20.0) == pytest.approx(10.0 + 1 / 16384)
    assert not d.stalled(30.0 + 1 / 16384)  # it fell behind the rate; it did not pause for 30 s


def test_a_stall_is_reported_as_a_stall_and_no_rate_means_pauses_only():
    d = BodyDeadline(pause_s=1.0, min_rate=16384.0, started=0.0)
    d.chunk(14, 0.002)
    assert d.wait_s(0.002) == pytest.approx(1.0 + 14 / 16384 - 0.002)
    assert d.stalled(1.0 + 14 / 16384)
    plain = BodyDeadline(pause_s=5.0, min_rate=None, started=0.0)
    plain.chunk(1, 100.0)
    assert plain.overall() is None and plain.wait_s(100.0) == 5.0


def test_each_client_holds_at_most_its_share_of_slow_connections():
    slow = SlowConnections(per_client=2)
    a, b, c, d = object(), object(), object(), object()
    assert slow.admit("10.0.0.1", a) and slow.admit("10.0.0.1", b) and slow.admit("10.0.0.1", a)
    assert not slow.admit("10.0.0.1", c)  # a third for the same address
    assert slow.admit("10.0.0.2", d)  # another address has its own share
    slow.release("10.0.0.1", a)
    assert slow.admit("10.0.0.1", c) and slow.held("10.0.0.1") == 2
    for conn in (b, c):
        slow.release("10.0.0.1", conn)
    assert slow.held("10.0.0.1") == 0


def test_the_share_and_the_rate_are_checked_where_they_are_given():
    assert default_slow_share(1024) == 64 and default_slow_share(10) == 4
    with pytest.raises(ValueError, match="--min-body-rate"):
        check_limits(10, 30, 1024, min_body_rate=0)
    with pytest.raises(ValueError, match="--max-slow-connections-per-client"):
        check_limits(10, 30, 1024, slow_per_client=0)
