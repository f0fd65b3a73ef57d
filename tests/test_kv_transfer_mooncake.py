"""legato.kv_transfer.mooncake: the link protocol over Mooncake one-sided reads (CPU build, loopback TCP).

In-process links share one engine (stopping an engine that has talked to a peer takes about a second);
the cross-process test starts its own on each side, with the control channel on a TCP socket as across
hosts.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal
import socket
import time
import uuid
from multiprocessing import Pipe

import pytest
from kv_transfer_helpers import make_handoff, small_layout
from test_kv_transfer import Clock, Tap, assert_same_handoff, kinds

from legato.kv_transfer import CancelResult, EventKind, FailReason, KVLayout, LayoutMismatch, LinkState, get_backend
from legato.kv_transfer.mooncake import MooncakeConnector, MooncakeEngine, _Arena
from legato.kv_transfer.shm import ConnectionChannel, ShmConnector

ARENA = 1 << 20


@pytest.fixture(scope="module")
def engine():
    eng = MooncakeEngine()
    yield eng
    eng.close()


@dataclasses.dataclass
class Link:
    a: MooncakeConnector  # the sending end
    b: MooncakeConnector  # the receiving end
    tap_a: Tap
    tap_b: Tap
    clock: Clock

    def in_use(self) -> tuple[int, int]:
        return self.a._mooncake.arena.in_use, self.b._mooncake.arena.in_use


def make_link(engine: MooncakeEngine, layout_b: KVLayout | None = None, arena_bytes: int = ARENA) -> Link:
    clock, lay = Clock(), small_layout()
    pa, pb = Pipe()
    tap_a, tap_b = Tap(ConnectionChannel(pa)), Tap(ConnectionChannel(pb))
    a = MooncakeConnector(lay, tap_a, "ma", clock, engine=engine, arena_bytes=arena_bytes)
    b = MooncakeConnector(layout_b or lay, tap_b, "mb", clock, engine=engine, arena_bytes=arena_bytes)
    return Link(a, b, tap_a, tap_b, clock)


@pytest.fixture
def link(engine):
    lk = make_link(engine)
    lk.a.connect(2.0)
    lk.b.connect(2.0)
    yield lk
    lk.a.close()
    lk.b.close()


def wait_events(conn, want: int, timeout_s: float = 10.0):
    events, end = [], time.monotonic() + timeout_s
    while len(events) < want and time.monotonic() < end:
        events += conn.poll()
        time.sleep(0.002)
    return events


def test_transfer_is_bit_identical_and_frees_both_arenas(link):
    small, big = make_handoff(small_layout(), "r1", seed=1), make_handoff(small_layout(), "r2", seed=2, num_tokens=900)
    link.b.receive("r1", 5.0, num_tokens=10)
    link.b.receive("r2", 5.0)
    link.a.send(small, 5.0)
    link.a.send(big, 5.0)
    assert link.a.poll() == [] and link.in_use()[0] > 0  # published, waiting for the acks
    events = {e.request_id: e for e in link.b.poll()}
    assert {r: e.kind for r, e in events.items()} == {"r1": EventKind.RECEIVED, "r2": EventKind.RECEIVED}
    assert_same_handoff(small, events["r1"].handoff)
    assert_same_handoff(big, events["r2"].handoff)
    assert sorted(kinds(link.a.poll())) == [("r1", EventKind.SENT, None), ("r2", EventKind.SENT, None)]
    assert link.in_use() == (0, 0)
    sa, sb = link.a.stats(), link.b.stats()
    assert (sa.sent, sb.received, sa.failed, sb.failed) == (2, 2, 0, 0)
    assert sb.bytes_received == sa.bytes_sent > big.kv.numel() * 2
    assert sa.extra == {} and sb.extra == {}


def test_arena_allocator_aligns_and_coalesces():
    arena = _Arena(1024)
    a, b, c = arena.alloc(100), arena.alloc(64), arena.alloc(1)
    assert (a, b, c) == (0, 128, 192) and arena.in_use == 256
    assert arena.alloc(769) is None  # 768 left
    arena.free(b)
    assert arena.alloc(60) == 128  # first fit reuses the hole
    arena.free(128), arena.free(a), arena.free(c)
    assert arena.in_use == 0 and arena.alloc(1024) == 0  # every hole merged back into one


def test_layout_mismatch_refused_at_handshake(engine):
    lk = make_link(engine, layout_b=small_layout("float32", num_layers=4, model_hash="elsewhere"))
    for end in (lk.a, lk.b):
        with pytest.raises(LayoutMismatch) as err:
            end.connect(2.0)
        assert set(err.value.fields) == {"dtype", "num_layers", "model_hash"}
        assert end.link_state is LinkState.FAILED and "num_layers" in end.link_error
    lk.a.send(make_handoff(small_layout(), "m", seed=1), 5.0)  # fails fast, nothing published
    assert kinds(lk.a.poll()) == [("m", EventKind.FAILED, FailReason.LAYOUT_MISMATCH)]
    assert lk.in_use() == (0, 0)
    lk.a.close(), lk.b.close()


def test_sender_deadline_expires_and_tells_the_receiver(link):
    link.a.send(make_handoff(small_layout(), "r", seed=4), 1.0)
    link.clock.now += 1.5
    (ev,) = link.a.poll()
    assert (ev.kind, ev.reason) == (EventKind.FAILED, FailReason.XFER_TIMEOUT)
    assert link.in_use() == (0, 0) and link.a.stats().timeouts == 1
    assert link.b.poll() == []  # offer then withdraw: dropped together
    link.b.receive("r", 5.0)
    assert kinds(link.b.poll()) == [("r", EventKind.FAILED, FailReason.PEER_CANCELLED)]


def test_receiver_deadline_expires_and_tells_the_sender(link):
    link.b.receive("slow", 1.0)
    link.clock.now += 1.1
    (ev,) = link.b.poll()
    assert (ev.kind, ev.reason) == (EventKind.FAILED, FailReason.XFER_TIMEOUT)
    link.a.poll()
    link.a.send(make_handoff(small_layout(), "slow", seed=3), 5.0)  # the decline is already here
    assert kinds(link.a.poll()) == [("slow", EventKind.FAILED, FailReason.PEER_CANCELLED)]
    assert link.in_use() == (0, 0) and link.b.stats().timeouts == 1


def test_cancel_reaches_the_peer_both_ways(link):
    link.b.receive("c1", 5.0)
    link.a.send(make_handoff(small_layout(), "c1", seed=5), 5.0)
    assert link.b.cancel("c1", "client gone") is CancelResult.SAFE
    (ev,) = link.a.poll()
    assert (ev.kind, ev.reason) == (EventKind.FAILED, FailReason.PEER_CANCELLED) and "client gone" in ev.detail
    link.b.receive("c2", 5.0)
    link.a.send(make_handoff(small_layout(), "c2", seed=6), 5.0)
    assert link.a.cancel("c2", "prefill failed") is CancelResult.SAFE
    assert link.in_use() == (0, 0)  # the sender frees its region at once
    (ev,) = link.b.poll()
    assert (ev.request_id, ev.kind, ev.reason) == ("c2", EventKind.FAILED, FailReason.PEER_CANCELLED)
    assert link.a.stats().cancelled == 1 and link.b.stats().cancelled == 1 and link.b.stats().late == 1


def test_full_arena_fails_only_that_request(engine):
    lk = make_link(engine, arena_bytes=12 * 1024)  # room for two ~4 KB handoffs
    lk.a.connect(2.0), lk.b.connect(2.0)
    for i in range(3):
        lk.a.send(make_handoff(small_layout(), f"f{i}", seed=i), 5.0)
    lk.a.send(make_handoff(small_layout(), "huge", seed=9, num_tokens=400), 5.0)  # larger than the arena
    events = lk.a.poll()
    assert kinds(events) == [("f2", EventKind.FAILED, FailReason.TRANSPORT_ERROR),
                             ("huge", EventKind.FAILED, FailReason.TRANSPORT_ERROR)]
    assert "arena full" in events[0].detail and "arena_bytes" in events[0].detail
    lk.b.receive("f0", 5.0), lk.b.receive("f1", 5.0)
    assert [e.kind for e in lk.b.poll()] == [EventKind.RECEIVED] * 2
    assert [e.kind for e in lk.a.poll()] == [EventKind.SENT] * 2
    lk.a.send(make_handoff(small_layout(), "f3", seed=3), 5.0)  # room again once the acks freed it
    lk.b.receive("f3", 5.0)
    (ev,) = lk.b.poll()
    assert_same_handoff(make_handoff(small_layout(), "f3", seed=3), ev.handoff)
    assert kinds(lk.a.poll()) == [("f3", EventKind.SENT, None)]
    assert lk.a.stats().extra == {"mooncake_arena_full": 2} and lk.a.stats().failed == 2
    lk.a.close(), lk.b.close()


def test_offers_outside_what_the_peer_advertised_are_never_read(link):
    good = dict(link.tap_a.last("hello")["mooncake"])
    base, size = good["addr"], good["nbytes"]
    forged = {
        "session": {"session": "127.0.0.2:1", "addr": base, "nbytes": 64, "tag": 1},
        "below": {"session": good["session"], "addr": base - 64, "nbytes": 64, "tag": 1},
        "past": {"session": good["session"], "addr": base, "nbytes": size, "tag": 1},
        "bool": {"session": good["session"], "addr": base, "nbytes": True, "tag": 1},
        "neg": {"session": good["session"], "addr": base, "nbytes": -5, "tag": 1},
        "notag": {"session": good["session"], "addr": base, "nbytes": 64},
    }
    for rid, loc in forged.items():
        link.b.receive(rid, 5.0)
        link.tap_a.send({"op": "offer", "rid": rid, "gen": 1, "ttl_s": 5.0, "loc": loc})
    events = {e.request_id: e for e in link.b.poll()}
    assert {r: (e.kind, e.reason) for r, e in events.items()} == {
        r: (EventKind.FAILED, FailReason.BAD_PAYLOAD) for r in forged}
    assert "127.0.0.2:1" in events["session"].detail and "outside the peer's arena" in events["past"].detail
    assert link.b.stats().extra == {"mooncake_bad_locator": len(forged)}  # and no read was attempted
    assert link.in_use() == (0, 0)


def test_a_reused_region_is_never_delivered(link):
    link.a.send(make_handoff(small_layout(), "old", seed=1), 5.0)
    old = link.tap_a.last("offer")["loc"]
    link.a.cancel("old")  # the sender frees the region on its own...
    link.a.send(make_handoff(small_layout(), "new", seed=2), 5.0)  # ...and reuses it at once
    new = link.tap_a.last("offer")["loc"]
    assert new["addr"] == old["addr"] and new["tag"] != old["tag"]
    assert link.b.poll() == []
    # A receiver that acts on the old offer (its withdraw not yet seen) finds the seal changed.
    link.b.receive("late", 5.0)
    link.tap_a.send({"op": "offer", "rid": "late", "gen": 7, "ttl_s": 5.0, "loc": old})
    (ev,) = link.b.poll()
    assert (ev.kind, ev.reason) == (EventKind.FAILED, FailReason.BAD_PAYLOAD) and "withdrawn or replaced" in ev.detail
    link.b.receive("new", 5.0)
    (ev,) = link.b.poll()
    assert_same_handoff(make_handoff(small_layout(), "new", seed=2), ev.handoff)
    assert link.b.stats().extra == {"mooncake_stale_payload": 1}


def test_a_peer_that_is_not_mooncake_is_refused_per_request(engine):
    pa, pb = Pipe()
    lay = small_layout()
    shm = ShmConnector(lay, pa, f"sh{uuid.uuid4().hex[:10]}")
    mc = MooncakeConnector(lay, pb, "mc", engine=engine, arena_bytes=ARENA)
    shm.connect(2.0), mc.connect(2.0)  # same layout: the handshake itself passes
    mc.receive("x", 5.0)
    shm.send(make_handoff(lay, "x", seed=1), 5.0)
    (ev,) = wait_events(mc, 1)
    assert (ev.kind, ev.reason) == (EventKind.FAILED, FailReason.BAD_PAYLOAD) and "no Mooncake arena" in ev.detail
    assert kinds(wait_events(shm, 1)) == [("x", EventKind.FAILED, FailReason.BAD_PAYLOAD)]
    shm.close(), mc.close()


def test_close_is_idempotent_and_fails_what_is_in_flight(link):
    link.a.send(make_handoff(small_layout(), "k1", seed=10), 60.0)
    link.b.receive("k2", 60.0)
    assert kinds(link.a.close()) == [("k1", EventKind.FAILED, FailReason.CLOSED)]
    assert link.a._mooncake.arena.in_use == 0
    assert kinds(link.b.poll()) == [("k2", EventKind.FAILED, FailReason.PEER_DIED)]
    assert link.a.close() == []


# ---------------------------------------------------------------------------------------------------------------
# Separate processes


def mooncake_sender_main(port: int, cmd_conn, layout: dict, instance_id: str) -> None:
    """Child process: the prefill end, its control channel a TCP socket to the parent. Commands:
    ("send", rid, seed, num_tokens, deadline_s), ("exit",). Reports ("ready", session) and
    ("event", rid, kind, reason) for every event."""
    lay = KVLayout.from_dict(layout)
    sock = socket.create_connection(("127.0.0.1", port))
    conn = MooncakeConnector(lay, ConnectionChannel.from_socket(sock), instance_id, arena_bytes=1 << 22)
    conn.connect(30.0)
    cmd_conn.send(("ready", conn.session))
    while True:
        for ev in conn.poll():
            cmd_conn.send(("event", ev.request_id, ev.kind.value, ev.reason.value if ev.reason else None))
        if not cmd_conn.poll(0.002):
            continue
        cmd = cmd_conn.recv()
        if cmd[0] == "send":
            conn.send(make_handoff(lay, cmd[1], cmd[2], num_tokens=cmd[3]), cmd[4])
            cmd_conn.send(("offered", cmd[1]))
        elif cmd[0] == "exit":
            conn.close()
            return


def _report(cmd, timeout_s: float = 30.0):
    assert cmd.poll(timeout_s), "child did not answer"
    return cmd.recv()


def _wait_stopped(pid: int, timeout_s: float) -> None:
    """Until the kernel reports the process stopped (state T in /proc/PID/stat), or fail."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                return
        time.sleep(0.005)
    raise AssertionError(f"process {pid} did not stop within {timeout_s}s")


def test_across_processes_over_tcp():
    """A real prefill process: delivery, cancel, a hung peer (bounded read), then its death mid-transfer."""
    ctx = multiprocessing.get_context("spawn")
    lay = small_layout()
    listener = socket.create_server(("127.0.0.1", 0))
    cmd_parent, cmd_child = ctx.Pipe()
    proc = ctx.Process(target=mooncake_sender_main, daemon=True,
                       args=(listener.getsockname()[1], cmd_child, lay.to_dict(), "child"))
    proc.start()
    cmd_child.close()
    listener.settimeout(60.0)
    sock, _ = listener.accept()
    listener.close()
    # Built by name, as a deployment would; its own engine, default arena.
    recv = get_backend("mooncake")(lay, ConnectionChannel.from_socket(sock), "parent", read_timeout_s=0.5)
    try:
        recv.connect(60.0)
        ready = _report(cmd_parent, 60.0)
        assert ready[0] == "ready" and ready[1] != recv.session

        # 1. Delivery across processes, bytes identical to what the child built.
        recv.receive("p1", 10.0, num_tokens=700)
        cmd_parent.send(("send", "p1", 11, 700, 10.0))
        (ev,) = wait_events(recv, 1)
        assert ev.kind is EventKind.RECEIVED
        assert_same_handoff(make_handoff(lay, "p1", 11, num_tokens=700), ev.handoff)
        assert _report(cmd_parent) == ("offered", "p1")
        assert _report(cmd_parent) == ("event", "p1", "sent", None)

        # 2. Cancel reaches the child.
        recv.receive("p2", 10.0)
        assert recv.cancel("p2", "client gone") is CancelResult.SAFE
        cmd_parent.send(("send", "p2", 12, 10, 10.0))
        assert _report(cmd_parent) == ("offered", "p2")
        assert _report(cmd_parent) == ("event", "p2", "failed", "peer_cancelled")

        # 3. A hung peer: the read gives up after read_timeout_s, not Mooncake's 30 s; the staging region
        # stays held until the read really ends, then is reclaimed.
        cmd_parent.send(("send", "p3", 13, 10, 10.0))
        assert _report(cmd_parent) == ("offered", "p3")
        assert recv.poll() == []  # the offer is held, not yet armed
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            # kill() only queues the signal: on a loaded box the child can still serve a read for a while.
            _wait_stopped(proc.pid, 30.0)
            recv.receive("p3", 10.0)
            started = time.monotonic()
            (ev,) = recv.poll()
            # Not before read_timeout_s, and far short of Mooncake's own 30 s.
            assert 0.4 < time.monotonic() - started < 15
            assert (ev.kind, ev.reason) == (EventKind.FAILED, FailReason.TRANSPORT_ERROR)
            assert "took over 0.5s" in ev.detail
            assert recv._mooncake.arena.in_use > 0 and recv.stats().extra == {"mooncake_read_timeout": 1}
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        assert _report(cmd_parent) == ("event", "p3", "failed", "transport_error")  # our reject reached it
        end = time.monotonic() + 10
        while recv._mooncake.arena.in_use and time.monotonic() < end:
            assert recv.poll() == []  # polling reclaims it
            time.sleep(0.01)
        assert recv._mooncake.arena.in_use == 0

        # 4. SIGKILL with an offer outstanding and another request armed: both fail at once, no hang.
        recv.receive("p5", 60.0)
        cmd_parent.send(("send", "p4", 14, 10, 60.0))
        assert _report(cmd_parent) == ("offered", "p4")
        assert recv.poll() == []
        proc.kill()
        proc.join(10)
        recv.receive("p4", 60.0)
        started = time.monotonic()
        events = wait_events(recv, 2)
        assert sorted(kinds(events)) == [("p4", EventKind.FAILED, FailReason.PEER_DIED),
                                         ("p5", EventKind.FAILED, FailReason.PEER_DIED)]
        assert time.monotonic() - started < 20 and recv.link_state is LinkState.FAILED
        recv.receive("p6", 60.0)  # fails fast with the link's reason
        assert kinds(recv.poll()) == [("p6", EventKind.FAILED, FailReason.PEER_DIED)]
    finally:
        if proc.is_alive():
            proc.kill()
        recv.close()
    assert recv.close() == [] and recv._mooncake.engine.raw is None  # its own engine is stopped
