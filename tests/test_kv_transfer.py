"""legato.kv_transfer: handoff packing and wire form, the connector protocol (inproc and shm), the registry."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import multiprocessing
import os
import socket
import struct
import subprocess
import sys
import time
import uuid
from multiprocessing import Pipe, resource_tracker
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path

import pytest
import torch
from kv_transfer_helpers import HostIpc, child_report, make_handoff, sender_main, small_layout, wait_events

import legato
from legato.kv_transfer import (
    CancelResult,
    EventKind,
    FailReason,
    Handoff,
    HandoffFormatError,
    KVLayout,
    LayoutMismatch,
    LinkState,
    backend_names,
    encode_handoff,
    gather_blocks,
    get_backend,
    read_handoff,
    scatter_blocks,
)
from legato.kv_transfer.cuda_ipc import CudaIpcConnector
from legato.kv_transfer.inproc import InprocChannel, InprocConnector
from legato.kv_transfer.shm import ConnectionChannel, ShmConnector, list_segments, reap_segments, segment_name
from legato.kv_transfer.transport import Channel

# ---------------------------------------------------------------------------------------------------------------
# gather / scatter


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_layer", [False, True])
def test_gather_scatter_round_trip_into_other_blocks(dtype, per_layer):
    layers, bs, heads, dim = 3, 4, 2, 8
    src_k = torch.randn(layers, 12, bs, heads, dim).to(dtype)
    src_v = torch.randn(layers, 12, bs, heads, dim).to(dtype)
    src_blocks, dst_blocks, n = [5, 2, 9], [0, 7, 3], 2 * bs + 3
    dst_k = torch.zeros(layers, 8, bs, heads, dim, dtype=dtype)
    dst_v = torch.zeros(layers, 8, bs, heads, dim, dtype=dtype)
    if per_layer:  # lists of per-layer views, as a model holding one tensor per layer would pass them
        kv = gather_blocks(list(src_k), list(src_v), src_blocks + [11], n)  # extra ids past the need are ignored
        scatter_blocks(list(dst_k), list(dst_v), dst_blocks, kv)
    else:
        kv = gather_blocks(src_k, src_v, src_blocks, n)
        scatter_blocks(dst_k, dst_v, dst_blocks, kv)

    assert kv.shape == (layers, 2, 3, bs, heads, dim) and kv.dtype == dtype and kv.is_contiguous()
    for s, d in zip(src_blocks[:2], dst_blocks[:2], strict=True):
        assert torch.equal(dst_k[:, d], src_k[:, s]) and torch.equal(dst_v[:, d], src_v[:, s])
    # Last block: the 3 valid positions copied exactly, the tail zero (never the previous owner's data).
    assert torch.equal(dst_k[:, 3, :3], src_k[:, 9, :3]) and torch.equal(dst_v[:, 3, :3], src_v[:, 9, :3])
    assert not dst_k[:, 3, 3:].any() and not kv[:, :, 2, 3:].any()
    untouched = [b for b in range(8) if b not in dst_blocks]
    assert not dst_k[:, untouched].any() and not dst_v[:, untouched].any()
    # Both cache forms pack identically.
    assert torch.equal(kv, gather_blocks(src_k, src_v, src_blocks, n))


def test_gather_scatter_refuse_bad_input():
    k = torch.zeros(2, 6, 4, 1, 8)
    with pytest.raises(ValueError, match="need 3 blocks"):
        gather_blocks(k, k, [0, 1], 9)
    with pytest.raises(ValueError, match="repeat"):
        gather_blocks(k, k, [0, 1, 1], 9)
    kv = gather_blocks(k, k, [0, 1, 2], 9)
    with pytest.raises(ValueError, match="repeat"):
        scatter_blocks(k, k, [4, 4, 5], kv)
    with pytest.raises(ValueError, match="destination block ids"):
        scatter_blocks(k, k, [4, 5], kv)
    with pytest.raises(ValueError, match="dtype"):
        scatter_blocks(k.bfloat16(), k.bfloat16(), [3, 4, 5], kv)
    with pytest.raises(ValueError, match="does not fit"):
        scatter_blocks(torch.zeros(2, 6, 8, 1, 8), torch.zeros(2, 6, 8, 1, 8), [3, 4, 5], kv)


# ---------------------------------------------------------------------------------------------------------------
# wire form


def assert_same_handoff(a: Handoff, b: Handoff) -> None:
    for f in dataclasses.fields(Handoff):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y), f.name
        else:
            assert x == y, f.name


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float16"])
def test_handoff_wire_round_trip_every_field(dtype):
    h = make_handoff(small_layout(dtype), "req-ü/1", seed=3)
    blob = encode_handoff(h)
    back = read_handoff(blob)
    assert_same_handoff(h, back)
    assert back.sampling.temperature == 0.7 and back.sampling.seed == 3 and back.first_chunk_frames == 2
    assert back.text_open and back.text_tokens == 3
    assert back.kv.data_ptr() != h.kv.data_ptr()
    # Minimal side state: no reference codes, no trailing text, defaults.
    h2 = dataclasses.replace(make_handoff(small_layout(dtype), "r2", seed=4, num_tokens=1, ref=False),
                             trailing_text=torch.zeros(0, 16), ignore_eos=False, first_chunk_frames=None)
    assert_same_handoff(h2, read_handoff(memoryview(encode_handoff(h2))))
    assert b"pickle" not in blob and blob[:4] == b"VXHF"


def test_handoff_wire_rejects_bad_bytes():
    blob = bytearray(encode_handoff(make_handoff(small_layout(), "r", seed=1)))
    with pytest.raises(HandoffFormatError, match="magic"):
        read_handoff(b"XXXX" + bytes(blob[4:]))
    with pytest.raises(HandoffFormatError, match="version 9"):
        read_handoff(bytes(blob[:4]) + struct.pack("<I", 9) + bytes(blob[8:]))
    with pytest.raises(HandoffFormatError):
        read_handoff(bytes(blob[: len(blob) // 2]))
    with pytest.raises(HandoffFormatError):
        read_handoff(bytes(blob[:10]))


def test_handoff_validate_catches_inconsistent_fields():
    h = make_handoff(small_layout(), "r", seed=1)
    with pytest.raises(ValueError, match="kv shape"):
        dataclasses.replace(h, num_tokens=13).validate()
    with pytest.raises(ValueError, match="trailing_text"):
        dataclasses.replace(h, trailing_text=torch.zeros(2, 15)).validate()
    with pytest.raises(ValueError, match="ref_code"):
        dataclasses.replace(h, ref_code=torch.zeros(2, 16, dtype=torch.int32)).validate()
    assert "tokens=10" in repr(h) and len(repr(h)) < 300


def test_layout_mismatch_names_every_differing_field():
    a = small_layout()
    b = small_layout("float16", block_size=16, head_dim=64, model_hash="other")
    with pytest.raises(LayoutMismatch) as err:
        a.check_compatible(b)
    assert set(err.value.fields) == {"dtype", "block_size", "head_dim", "model_hash"}
    for text in ("dtype", "block_size", "head_dim", "model_hash", "'other'", "16"):
        assert text in str(err.value)
    a.check_compatible(small_layout())
    assert KVLayout.of_cache(torch.zeros(3, 5, 4, 2, 8, dtype=torch.bfloat16), "tiny-abc123") == a
    with pytest.raises(ValueError):
        small_layout("notatype")


# ---------------------------------------------------------------------------------------------------------------
# The connector protocol, on both same-host backends


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Tap(Channel):
    """Wraps a channel, recording what this end sends so a test can replay or forge messages."""

    def __init__(self, inner: Channel) -> None:
        self.inner, self.sent = inner, []

    def send(self, msg):
        self.sent.append(msg)
        self.inner.send(msg)

    def receive(self):
        return self.inner.receive()

    def wait(self, timeout_s):
        self.inner.wait(timeout_s)

    def close(self):
        self.inner.close()

    def last(self, op):
        return next(m for m in reversed(self.sent) if m["op"] == op)


@dataclasses.dataclass
class Link:
    a: object  # the sending end
    b: object  # the receiving end
    tap_a: Tap
    tap_b: Tap
    clock: Clock
    ids: tuple[str, str]
    backend: str = ""

    def segments(self) -> list[str]:
        """What the ends still hold for their peer: shared memory, or cuda_ipc's device arenas."""
        arenas = [f"arena {rid}" for end in (self.a, self.b) for rid in getattr(end._carrier, "published", [])]
        return list_segments(self.ids[0]) + list_segments(self.ids[1]) + arenas


def make_link(backend: str, layout_b: KVLayout | None = None) -> Link:
    clock, lay = Clock(), small_layout()
    ids = (f"ta{uuid.uuid4().hex[:10]}", f"tb{uuid.uuid4().hex[:10]}")
    if backend == "inproc":
        ca, cb = InprocChannel.pair()
        tap_a, tap_b = Tap(ca), Tap(cb)
        a, b = InprocConnector(lay, tap_a, ids[0], clock), InprocConnector(layout_b or lay, tap_b, ids[1], clock)
    else:
        pa, pb = Pipe()
        tap_a, tap_b = Tap(ConnectionChannel(pa)), Tap(ConnectionChannel(pb))
        if backend == "shm":
            a, b = ShmConnector(lay, tap_a, ids[0], clock), ShmConnector(layout_b or lay, tap_b, ids[1], clock)
        else:  # cuda_ipc's packing, offers and arena lifetime, with the handles stood in for on the CPU
            registry: dict = {}
            a, b = (CudaIpcConnector(layout, tap, rid, device="cpu", clock=clock, ipc=HostIpc(registry))
                    for layout, tap, rid in ((lay, tap_a, ids[0]), (layout_b or lay, tap_b, ids[1])))
    return Link(a, b, tap_a, tap_b, clock, ids, backend)


@pytest.fixture(params=["inproc", "shm", "cuda_ipc"])
def link(request):
    lk = make_link(request.param)
    lk.a.connect(2.0)
    lk.b.connect(2.0)
    yield lk
    lk.a.close()
    lk.b.close()
    assert lk.segments() == [], "shared memory leaked"


def kinds(events):
    return [(e.request_id, e.kind, e.reason) for e in events]


def test_transfer_delivers_complete_handoff(link):
    h = make_handoff(small_layout(), "r1", seed=1)
    link.b.receive("r1", 5.0, num_tokens=10)
    link.a.send(h, 5.0)
    assert link.a.poll() == []
    (ev,) = link.b.poll()
    assert ev.kind is EventKind.RECEIVED and ev.request_id == "r1"
    assert_same_handoff(h, ev.handoff)
    # shm: the receiver frees the payload as soon as it has copied it out; cuda_ipc: the arena is the
    # sender's, freed when the ack arrives.
    assert link.segments() == (["arena r1"] if link.backend == "cuda_ipc" else [])
    assert kinds(link.a.poll()) == [("r1", EventKind.SENT, None)]
    assert link.segments() == []
    sa, sb = link.a.stats(), link.b.stats()
    assert (sa.sent, sb.received) == (1, 1) and sa.bytes_sent > h.kv.numel() * 2
    assert sb.bytes_received == sa.bytes_sent


def test_offer_before_receive_is_held_until_armed(link):
    link.a.send(make_handoff(small_layout(), "early", seed=2), 5.0)
    assert link.b.poll() == []  # not armed yet: held, not failed, not dropped
    link.b.receive("early", 5.0)
    assert kinds(link.b.poll()) == [("early", EventKind.RECEIVED, None)]
    assert kinds(link.a.poll()) == [("early", EventKind.SENT, None)]


def test_receiver_deadline_fails_and_tells_the_sender(link):
    link.b.receive("slow", 1.0)
    link.clock.now += 0.5
    assert link.b.poll() == []
    link.clock.now += 0.6
    (ev,) = link.b.poll()
    assert (ev.kind, ev.reason) == (EventKind.FAILED, FailReason.XFER_TIMEOUT) and "deadline" in ev.detail
    assert link.b.stats().timeouts == 1
    # The prefill side finishes late: the decline is already there, so nothing is even published.
    link.a.poll()
    link.a.send(make_handoff(small_layout(), "slow", seed=3), 5.0)
    assert kinds(link.a.poll()) == [("slow", EventKind.FAILED, FailReason.PEER_CANCELLED)]
    assert link.segments() == []


def test_sender_deadline_fails_and_tells_the_receiver(link):
    link.a.send(make_handoff(small_layout(), "r", seed=4), 1.0)
    link.clock.now += 1.5  # the receiver never polled in time (injected stall)
    (ev,) = link.a.poll()
    assert (ev.kind, ev.reason) == (EventKind.FAILED, FailReason.XFER_TIMEOUT)
    assert link.segments() == []
    assert link.b.poll() == []  # offer then withdraw: dropped together
    link.b.receive("r", 5.0)
    assert kinds(link.b.poll()) == [("r", EventKind.FAILED, FailReason.PEER_CANCELLED)]


def test_receiver_cancel_reaches_sender_and_late_delivery_is_ignored(link):
    link.b.receive("c", 5.0)
    link.a.send(make_handoff(small_layout(), "c", seed=5), 5.0)
    assert link.b.cancel("c", "client gone") is CancelResult.SAFE  # the offer is already on its way
    (ev,) = link.a.poll()
    assert (ev.kind, ev.reason) == (EventKind.FAILED, FailReason.PEER_CANCELLED) and "client gone" in ev.detail
    assert link.b.poll() == []  # the late offer is counted, not delivered
    assert link.b.stats().late == 1 and link.b.stats().cancelled == 1
    assert link.a.poll() == [] and link.a.stats().late == 1  # our decline of the late offer: also a no-op
    assert link.segments() == []
    assert link.b.cancel("c") is CancelResult.NOT_FOUND


def test_a_decline_left_by_a_request_that_ended_unsent_is_forgotten_for_the_next_under_its_id(link):
    """Process 1p1d (an outside probe): a client gone during its prefill left the decode side's decline on the
    prefill link, and every later request reusing that X-Request-Id failed its send (500), minutes later too.
    The worker forgets it when that prefill ends unsent and when the next one under the id starts."""
    link.b.receive("x", 5.0)
    link.b.cancel("x", "client gone")  # the decline reaches the sender before any send
    assert link.a.poll() == []
    link.a.forget_unsent("x")
    link.b.receive("x", 5.0)  # the same id, a new request
    link.a.send(make_handoff(small_layout(), "x", seed=9), 5.0)
    assert kinds(link.b.poll()) == [("x", EventKind.RECEIVED, None)]
    assert kinds(link.a.poll()) == [("x", EventKind.SENT, None)]
    # unforgotten, the decline still fails a send racing in after it (what it is kept for)
    link.b.receive("y", 5.0)
    link.b.cancel("y", "client gone")
    link.a.poll()
    link.a.send(make_handoff(small_layout(), "y", seed=10), 5.0)
    assert kinds(link.a.poll()) == [("y", EventKind.FAILED, FailReason.PEER_CANCELLED)]
    link.a.forget_unsent("y")  # a sent or done id is not touched
    link.a.forget_unsent("x")
    assert link.segments() == []


def test_sender_cancel_reaches_receiver(link):
    link.b.receive("s1", 5.0)
    link.b.receive("s2", 5.0)
    link.a.send(make_handoff(small_layout(), "s1", seed=6), 5.0)
    assert link.a.cancel("s1") is CancelResult.SAFE  # sent, not yet taken
    assert link.a.cancel("s2", "prefill failed") is CancelResult.NOT_FOUND  # never sent: still announced
    events = {e.request_id: e for e in link.b.poll()}
    assert {r: (e.kind, e.reason) for r, e in events.items()} == {
        "s1": (EventKind.FAILED, FailReason.PEER_CANCELLED), "s2": (EventKind.FAILED, FailReason.PEER_CANCELLED)}
    assert "prefill failed" in events["s2"].detail
    assert link.a.poll() == [] and link.segments() == []
    link.a.send(make_handoff(small_layout(), "s2", seed=6), 5.0)  # the prefill finishes after its own abort
    assert kinds(link.a.poll()) == [("s2", EventKind.FAILED, FailReason.PEER_CANCELLED)]
    assert link.segments() == []


def test_duplicate_and_unknown_completions_are_counted_noops(link):
    link.b.receive("d", 5.0)
    link.a.send(make_handoff(small_layout(), "d", seed=7), 5.0)
    assert len(link.b.poll()) == 1 and len(link.a.poll()) == 1
    link.tap_b.send(link.tap_b.last("ack"))  # a second ack
    link.tap_b.send({"op": "ack", "rid": "never-sent", "gen": 1})
    link.tap_a.send(link.tap_a.last("offer"))  # a second offer of a delivered handoff
    link.tap_a.send({"op": "offer", "rid": "d", "gen": 99, "ttl_s": 1.0, "loc": {"nbytes": 0}})
    link.tap_a.send({"op": "bogus"})
    assert link.a.poll() == [] and link.b.poll() == []
    assert (link.a.stats().duplicate, link.a.stats().unknown) == (1, 1)
    assert link.b.stats().duplicate == 2 and link.b.stats().extra == {"bad_message": 1}
    assert link.a.link_state is LinkState.READY and link.b.link_state is LinkState.READY


def test_wrong_length_payload_fails_both_sides(link):
    link.b.receive("n", 5.0, num_tokens=11)
    link.a.send(make_handoff(small_layout(), "n", seed=8), 5.0)
    assert kinds(link.b.poll()) == [("n", EventKind.FAILED, FailReason.BAD_PAYLOAD)]
    (ev,) = link.a.poll()
    assert (ev.kind, ev.reason) == (EventKind.FAILED, FailReason.BAD_PAYLOAD) and "expected 11" in ev.detail


def test_peer_death_fails_in_flight_transfers(link):
    link.b.receive("x", 60.0)
    link.b.receive("y", 60.0)
    link.a.send(make_handoff(small_layout(), "x", seed=9), 60.0)
    link.tap_a.close()  # abrupt: no bye (the process died)
    events = link.b.poll() + link.b.poll()
    # What made it out before the end died is delivered; what was still owed fails at once, not at its deadline.
    assert kinds(events) == [("x", EventKind.RECEIVED, None), ("y", EventKind.FAILED, FailReason.PEER_DIED)]
    assert link.b.link_state is LinkState.FAILED and "closed" in link.b.link_error
    link.b.receive("z", 60.0)  # fails fast, with the link's reason
    assert kinds(link.b.poll()) == [("z", EventKind.FAILED, FailReason.PEER_DIED)]


def test_close_fails_in_flight_and_the_peer_sees_it(link):
    link.a.send(make_handoff(small_layout(), "k1", seed=10), 60.0)
    link.b.receive("k2", 60.0)
    assert kinds(link.a.close()) == [("k1", EventKind.FAILED, FailReason.CLOSED)]
    assert link.segments() == []
    assert kinds(link.b.poll()) == [("k2", EventKind.FAILED, FailReason.PEER_DIED)]
    assert link.a.close() == []


@pytest.mark.parametrize("backend", ["inproc", "shm", "cuda_ipc"])
def test_layout_mismatch_refused_at_handshake(backend):
    lk = make_link(backend, layout_b=small_layout("float32", num_layers=4, model_hash="elsewhere"))
    for end in (lk.a, lk.b):
        with pytest.raises(LayoutMismatch) as err:
            end.connect(2.0)
        assert set(err.value.fields) == {"dtype", "num_layers", "model_hash"}
        assert end.link_state is LinkState.FAILED and "num_layers" in end.link_error
    lk.a.send(make_handoff(small_layout(), "m", seed=1), 5.0)  # never falls back: fails fast
    assert kinds(lk.a.poll()) == [("m", EventKind.FAILED, FailReason.LAYOUT_MISMATCH)]
    lk.a.close(), lk.b.close()
    assert lk.segments() == []


@pytest.mark.parametrize("backend", ["inproc", "shm", "cuda_ipc"])
def test_send_before_handshake_fails_fast(backend):
    lk = make_link(backend)
    lk.a.send(make_handoff(small_layout(), "early", seed=1), 5.0)
    assert kinds(lk.a.poll()) == [("early", EventKind.FAILED, FailReason.PEER_NOT_READY)]
    with pytest.raises(TimeoutError):
        InprocConnector(small_layout(), InprocChannel.pair()[0]).connect(0.05)
    lk.a.close(), lk.b.close()


# ---------------------------------------------------------------------------------------------------------------
# cuda_ipc specifics (its packing and lifetime run above with a stand-in for the handles; tests/test_gpu_kv.py
# runs the handles between processes on a GPU)


def test_cuda_ipc_refuses_in_one_line_without_cuda(monkeypatch):
    from legato.kv_transfer.cuda_ipc import CudaIpcConnector, CudaIpcUnavailable, require_cuda_device

    ca, _ = InprocChannel.pair()
    with pytest.raises(CudaIpcUnavailable, match=r"runs on cpu \(use --kv-transfer shm\)"):
        CudaIpcConnector(small_layout(), ca, "nocuda", device="cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(CudaIpcUnavailable, match="sees no CUDA device") as err:
        require_cuda_device("cuda:0")
    assert "\n" not in str(err.value)


def test_cuda_ipc_offer_pointing_outside_its_buffer_fails_that_request():
    """A tensor region past the peer's buffer, or an offer naming another request, is a bad payload: nothing
    outside the buffer is read, and the link goes on."""
    lk = make_link("cuda_ipc")
    lk.a.connect(2.0), lk.b.connect(2.0)
    lk.b.receive("o1", 5.0)
    lk.a.send(make_handoff(small_layout(), "o1", seed=3), 5.0)
    offer = lk.tap_a.last("offer")
    assert kinds(lk.b.poll()) == [("o1", EventKind.RECEIVED, None)]
    forged = json.loads(json.dumps(offer))
    forged["rid"] = forged["loc"]["header"]["request_id"] = "o2"
    forged["loc"]["tensors"]["kv"]["offset"] = forged["loc"]["nbytes"]
    lk.b.receive("o2", 5.0)
    lk.tap_a.send(forged)
    (ev,) = lk.b.poll()
    assert (ev.kind, ev.reason) == (EventKind.FAILED, FailReason.BAD_PAYLOAD) and "outside" in ev.detail
    other = json.loads(json.dumps(offer))
    other["rid"] = "o3"  # the header still says o1
    lk.b.receive("o3", 5.0)
    lk.tap_a.send(other)
    (ev,) = lk.b.poll()
    assert (ev.kind, ev.reason) == (EventKind.FAILED, FailReason.BAD_PAYLOAD) and "'o1'" in ev.detail
    assert lk.b.link_state is LinkState.READY
    lk.a.close(), lk.b.close()
    assert lk.segments() == []


def test_cuda_ipc_arena_freed_before_the_receiver_reads_fails_as_a_transport_error():
    """The sender frees its arena at its deadline: an offer the receiver takes after that cannot be read
    (as a freed CUDA allocation's handle cannot be opened) and fails that request, not the link."""
    lk = make_link("cuda_ipc")
    lk.a.connect(2.0), lk.b.connect(2.0)
    lk.a.send(make_handoff(small_layout(), "gone", seed=4), 1.0)
    lk.a._carrier.discard("gone")  # as if the sender had already let go of it
    lk.b.receive("gone", 5.0)
    (ev,) = lk.b.poll()
    assert (ev.kind, ev.reason) == (EventKind.FAILED, FailReason.TRANSPORT_ERROR) and "gone" in ev.detail
    assert lk.b.link_state is LinkState.READY
    lk.a.close(), lk.b.close()


# ---------------------------------------------------------------------------------------------------------------
# shm specifics


def test_segment_names_derive_from_instance_and_request():
    assert segment_name("dep1-p0", "r1") != segment_name("dep2-p0", "r1") != segment_name("dep1-p0", "r2")
    assert segment_name("dep1-p0", "r1") == segment_name("dep1-p0", "r1")
    assert segment_name("dep1-p0", "r1").startswith("vxdep1-p0_") and len(segment_name("a" * 40, "r" * 999)) < 64
    for bad in ("", "has_underscore", "sl/ash", "x" * 41):
        with pytest.raises(ValueError):
            segment_name(bad, "r")


def test_shm_refuses_a_segment_it_did_not_create_and_reap_cleans_up():
    lk = make_link("shm")
    lk.a.connect(2.0), lk.b.connect(2.0)
    stale = SharedMemory(name=segment_name(lk.ids[0], "r"), create=True, size=64)  # a crashed run's leftover
    try:
        lk.a.send(make_handoff(small_layout(), "r", seed=1), 5.0)
        (ev,) = lk.a.poll()
        assert (ev.kind, ev.reason) == (EventKind.FAILED, FailReason.TRANSPORT_ERROR) and "reused" in ev.detail
        assert reap_segments(lk.ids[0]) == [stale.name.lstrip("/")]
        assert list_segments(lk.ids[0]) == []
    finally:
        stale.close()
        resource_tracker.unregister(stale._name, "shared_memory")
    lk.a.close(), lk.b.close()


def test_shm_ignores_an_offer_naming_a_foreign_segment():
    lk = make_link("shm")
    lk.a.connect(2.0), lk.b.connect(2.0)
    lk.b.receive("f", 5.0)
    lk.tap_a.send({"op": "offer", "rid": "f", "gen": 1, "ttl_s": 5.0, "loc": {"segment": "psm_other", "nbytes": 8}})
    (ev,) = lk.b.poll()
    assert (ev.kind, ev.reason) == (EventKind.FAILED, FailReason.BAD_PAYLOAD) and "psm_other" in ev.detail
    lk.a.close(), lk.b.close()


def test_shm_over_a_socketpair():
    sa, sb = socket.socketpair()
    lay = small_layout()
    ids = (f"sa{uuid.uuid4().hex[:10]}", f"sb{uuid.uuid4().hex[:10]}")
    a = ShmConnector(lay, ConnectionChannel.from_socket(sa), ids[0])
    b = ShmConnector(lay, ConnectionChannel.from_socket(sb), ids[1])
    a.connect(2.0), b.connect(2.0)
    h = make_handoff(lay, "sock", seed=5)
    b.receive("sock", 5.0)
    a.send(h, 5.0)
    (ev,) = wait_events(b, 1)
    assert_same_handoff(h, ev.handoff)
    assert kinds(wait_events(a, 1)) == [("sock", EventKind.SENT, None)]
    a.close(), b.close()
    assert list_segments(ids[0]) == []


def test_shm_across_a_spawned_process():
    """A real prefill process: delivery, a cancel that reaches it, and finally its death mid-write."""
    ctx = multiprocessing.get_context("spawn")
    lay = small_layout()
    child_id, parent_id = f"ch{uuid.uuid4().hex[:10]}", f"pa{uuid.uuid4().hex[:10]}"
    kv_parent, kv_child = ctx.Pipe()
    cmd_parent, cmd_child = ctx.Pipe()
    proc = ctx.Process(target=sender_main, args=(kv_child, cmd_child, lay.to_dict(), child_id), daemon=True)
    proc.start()
    cmd_child.close()
    # kv_child stays open here on purpose: like a relay that hides EOF, so only deadlines can save us.
    recv = ShmConnector(lay, kv_parent, parent_id)
    try:
        recv.connect(60.0)
        assert child_report(cmd_parent, 60.0) == ("ready",)

        # 1. Delivery across processes, bytes identical to what the child built.
        recv.receive("p1", 10.0, num_tokens=10)
        cmd_parent.send(("send", "p1", 11, 10.0))
        (ev,) = wait_events(recv, 1)
        assert ev.kind is EventKind.RECEIVED
        assert_same_handoff(make_handoff(lay, "p1", 11), ev.handoff)
        assert child_report(cmd_parent) == ("event", "p1", "sent", None)

        # 2. Cancel reaches the child; its offer arrives late and is ignored.
        recv.receive("p2", 10.0)
        cmd_parent.send(("send", "p2", 12, 10.0))
        name = segment_name(child_id, "p2")
        end = time.monotonic() + 10
        while name not in list_segments(child_id) and time.monotonic() < end:
            time.sleep(0.002)
        assert recv.cancel("p2") is CancelResult.SAFE
        assert child_report(cmd_parent) == ("event", "p2", "failed", "peer_cancelled")
        late_events, end = [], time.monotonic() + 10
        while recv.stats().late == 0 and time.monotonic() < end:
            late_events += wait_events(recv, 1, timeout_s=0.01)
        assert late_events == [] and recv.stats().late == 1

        # 3. The child dies after creating the segment, before offering it: we fail at our deadline.
        recv.receive("p3", 1.0)
        started = time.monotonic()
        cmd_parent.send(("stall_send", "p3", 13, 10.0))
        name = segment_name(child_id, "p3")
        while name not in list_segments(child_id) and time.monotonic() - started < 10:
            time.sleep(0.002)
        assert name in list_segments(child_id)
        proc.kill()
        proc.join(10)
        (ev,) = wait_events(recv, 1)
        assert (ev.request_id, ev.kind, ev.reason) == ("p3", EventKind.FAILED, FailReason.XFER_TIMEOUT)
        assert 0.9 < time.monotonic() - started < 8
        assert list_segments(child_id) == []  # the receiver freed the dead sender's segment by its derived name
        resource_tracker.unregister("/" + name, "shared_memory")  # the killed child's registration

        # Once the channel does show EOF, the link itself goes down with PEER_DIED.
        kv_child.close()
        recv.receive("p4", 10.0)
        assert kinds(wait_events(recv, 1)) == [("p4", EventKind.FAILED, FailReason.PEER_DIED)]
    finally:
        if proc.is_alive():
            proc.kill()
        recv.close()
        reap_segments(child_id)
    assert list_segments(child_id) == [] and list_segments(parent_id) == []


# ---------------------------------------------------------------------------------------------------------------
# registry


def test_registry_is_lazy():
    code = (
        "import sys, legato.kv_transfer as kt\n"
        "mods = lambda: sorted(m for m in sys.modules if m.startswith('legato.kv_transfer.'))\n"
        "print(mods())\n"
        "backends = ('.shm', '.inproc', '.link', '.mooncake', '.nixl', '.cuda_ipc')\n"
        "assert not any(m.endswith(backends) for m in mods()), mods()\n"
        "assert kt.get_backend('inproc').__name__ == 'InprocConnector'\n"
        "assert 'legato.kv_transfer.inproc' in sys.modules and 'legato.kv_transfer.shm' not in sys.modules\n"
        "assert kt.get_backend('shm').__name__ == 'ShmConnector'\n"
    )
    root = str(Path(legato.__file__).resolve().parents[1])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": root})
    assert out.returncode == 0, out.stderr


def test_registry_errors_are_clear():
    assert backend_names() == ["cuda_ipc", "inproc", "mooncake", "nixl", "shm"]
    with pytest.raises(ValueError, match="unknown KV transfer backend 'rdma'.*cuda_ipc, inproc, mooncake, nixl, shm"):
        get_backend("rdma")
    for name in ("mooncake", "nixl"):
        if importlib.util.find_spec(name) is not None:
            continue  # the library is installed here: nothing to refuse
        with pytest.raises(ImportError, match=rf"pip install legato\[{name}\]"):
            get_backend(name)
    assert get_backend("inproc") is InprocConnector and get_backend("shm") is ShmConnector


def test_an_offer_of_another_shape_fails_that_request_without_raising():
    """A locator the shm carrier cannot read (e.g. from a peer running another backend) is a bad payload for
    that request; `poll` never raises, and the link keeps working."""
    lk = make_link("shm")
    lk.a.connect(2.0), lk.b.connect(2.0)
    lk.b.receive("m", 5.0)
    lk.tap_a.send({"op": "offer", "rid": "m", "gen": 1, "ttl_s": 5.0, "loc": {"session": "h:1", "addr": 4}})
    (ev,) = lk.b.poll()
    assert (ev.kind, ev.reason) == (EventKind.FAILED, FailReason.BAD_PAYLOAD) and "KeyError" in ev.detail
    assert lk.b.link_state is LinkState.READY
    lk.a.close(), lk.b.close()


def test_a_link_whose_backend_cannot_open_fails_that_link_not_the_worker():
    """A worker that cannot run its link's backend (cuda_ipc on a CPU engine) reports that link failed, with
    the reason, instead of raising out of its event loop."""
    from legato.pipeline.kv_links import KVLinks, KVLinkSpec

    links = KVLinks(KVLinkSpec(role="decode", index=0, peers=2, instance_id="t1", backend="cuda_ipc"),
                    small_layout(), device="cpu")
    ours, theirs = Pipe()
    links._adopt(0, ours)
    state, error = links.states()[0]
    assert state is LinkState.FAILED and "cannot open a cuda_ipc link" in error and "use --kv-transfer shm" in error
    assert ours.closed and links.states()[1] == (LinkState.NOT_READY, None)
    theirs.close()


@pytest.mark.parametrize(("field", "value"), [("text_open", "yes"), ("text_tokens", -1), ("text_tokens", 2.5)])
def test_a_handoff_with_a_malformed_text_state_is_refused(field, value):
    from legato.kv_transfer.handoff import handoff_from_parts, handoff_header, handoff_tensors

    h = make_handoff(small_layout("float32"), "r", seed=5)
    header = {**handoff_header(h), field: value}
    with pytest.raises(HandoffFormatError, match="text_open"):
        handoff_from_parts(header, handoff_tensors(h))
    assert handoff_from_parts(handoff_header(h), handoff_tensors(h)).text_open  # the well-formed one reads back
