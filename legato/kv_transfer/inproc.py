"""Both ends in one process: the handoff object itself is passed by reference through in-memory queues.

For tests and for topologies that run prefill and decode in one process. It runs the same protocol
(deadlines, cancel, late/duplicate accounting) as the cross-process backends, so code tested against it
behaves the same elsewhere; only the payload copy is skipped.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from legato.kv_transfer.handoff import Handoff, KVLayout
from legato.kv_transfer.link import LinkConnector
from legato.kv_transfer.transport import Carrier, Channel, ChannelClosed, Message


class _Pipe:
    """One direction of an in-process channel."""

    def __init__(self) -> None:
        self.queue: deque[Message] = deque()
        self.writer_closed = False
        self.ready = threading.Event()


class InprocChannel(Channel):
    def __init__(self, inbox: _Pipe, outbox: _Pipe) -> None:
        self._inbox, self._outbox = inbox, outbox

    @classmethod
    def pair(cls) -> tuple[InprocChannel, InprocChannel]:
        a_to_b, b_to_a = _Pipe(), _Pipe()
        return cls(b_to_a, a_to_b), cls(a_to_b, b_to_a)

    def send(self, msg: Message) -> None:
        if self._outbox.writer_closed:
            raise ChannelClosed("channel closed")
        self._outbox.queue.append(msg)
        self._outbox.ready.set()

    def receive(self) -> list[Message]:
        self._inbox.ready.clear()
        out = []
        while self._inbox.queue:
            out.append(self._inbox.queue.popleft())
        if not out and self._inbox.writer_closed:
            raise ChannelClosed("peer closed the channel")
        return out

    def wait(self, timeout_s: float) -> None:
        self._inbox.ready.wait(timeout_s)

    def close(self) -> None:
        self._outbox.writer_closed = True
        self._outbox.ready.set()


class _ObjectCarrier(Carrier):
    """The locator is the handoff itself; nothing to free."""

    def publish(self, handoff: Handoff) -> tuple[Message, int]:
        handoff.validate()
        nbytes = sum(t.numel() * t.element_size()
                     for t in (handoff.kv, handoff.last_hidden, handoff.trailing_text, handoff.ref_code)
                     if t is not None)
        return {"handoff": handoff, "nbytes": nbytes}, nbytes

    def fetch(self, peer_id: str, request_id: str, locator: Message) -> Handoff:
        handoff = locator["handoff"]
        if not isinstance(handoff, Handoff):
            raise ValueError(f"inproc payload is a {type(handoff).__name__}, not a Handoff")
        return handoff

    def discard(self, request_id: str) -> None:
        pass

    def reap(self, peer_id: str, request_id: str) -> None:
        pass

    def close(self) -> None:
        pass


class InprocConnector(LinkConnector):
    """One end of an in-process link; build both ends with `InprocConnector.pair`."""

    def __init__(self, layout: KVLayout, channel: Channel, instance_id: str = "inproc",
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(layout, channel, _ObjectCarrier(), instance_id, clock)

    @classmethod
    def pair(cls, layout: KVLayout, peer_layout: KVLayout | None = None,
             clock: Callable[[], float] = time.monotonic) -> tuple[InprocConnector, InprocConnector]:
        """Two connected ends (handshake messages queued; the first `poll` of each completes it)."""
        ca, cb = InprocChannel.pair()
        return (cls(layout, ca, "inproc-a", clock), cls(peer_layout or layout, cb, "inproc-b", clock))
