"""The transfer protocol every same-host backend shares, over a pluggable control channel and payload carrier.

A backend is a `Channel` (small control messages, in order, no loss while open) plus a `Carrier` (where
the handoff bytes live between the offer and the receiver's copy). `LinkConnector` runs the protocol:

    sender                                   receiver
    hello{version, instance, layout}  <->    hello{...}                 handshake: layouts must agree
    publish payload; offer{rid, gen, ttl_s, loc}  ->
                                             armed: fetch (copy out), validate, reap payload
                                      <-     ack{rid, gen}              -> SENT / RECEIVED
                                      <-     reject{rid, gen, reason}   payload unusable -> FAILED both
                                             not armed yet: hold the offer until armed or ttl_s
    withdraw{rid, reason}             ->     sender cancelled or timed out -> receiver FAILED(PEER_CANCELLED)
                                      <-     decline{rid, reason[, gen]} receiver cancelled or timed out
                                                                         -> sender FAILED(PEER_CANCELLED)
    bye                               <->    closing: the peer fails everything in flight (PEER_DIED)

Messages are plain dicts of JSON values (the inproc carrier's locator excepted, which never leaves the
process). A decline that arrives before `send` is remembered, so a request the decode side already gave
up on is never published. A withdraw that arrives before `receive` likewise fails the later `receive`.
Ended ids are remembered (bounded) so late and duplicate messages are counted, not acted on.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from legato.kv_transfer.base import (
    CancelResult,
    EventKind,
    FailReason,
    KVConnector,
    LinkState,
    TransferEvent,
    TransferStats,
)
from legato.kv_transfer.handoff import Handoff, HandoffFormatError, KVLayout, LayoutMismatch
from legato.kv_transfer.transport import Carrier, Channel, ChannelClosed, Message

PROTOCOL_VERSION = 1
_MAX_REMEMBERED = 65536

log = logging.getLogger(__name__)

@dataclass
class _Outgoing:
    gen: int
    deadline: float


@dataclass
class _Incoming:
    deadline: float
    num_tokens: int | None


@dataclass
class _Offer:
    gen: int
    locator: Message
    expiry: float


class _Remembered:
    """A bounded map of ended request ids to how they ended."""

    def __init__(self) -> None:
        self._d: OrderedDict[str, str] = OrderedDict()

    def put(self, rid: str, how: str) -> None:
        self._d[rid] = how
        self._d.move_to_end(rid)
        while len(self._d) > _MAX_REMEMBERED:
            self._d.popitem(last=False)

    def get(self, rid: str) -> str | None:
        return self._d.get(rid)

    def pop(self, rid: str) -> str | None:
        return self._d.pop(rid, None)


class LinkConnector(KVConnector):
    """The protocol above, over any Channel + Carrier. See base.KVConnector for the contract."""

    def __init__(self, layout: KVLayout, channel: Channel, carrier: Carrier, instance_id: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(layout)
        self.instance_id = instance_id
        self.peer_id: str | None = None
        self._channel = channel
        self._carrier = carrier
        self._clock = clock
        self._state = LinkState.NOT_READY
        self._error: str | None = None
        self._error_reason = FailReason.PEER_NOT_READY
        self._peer_bye = False
        self._mismatch: LayoutMismatch | None = None
        self._out: dict[str, _Outgoing] = {}
        self._in: dict[str, _Incoming] = {}
        self._offers: dict[str, _Offer] = {}
        self._ended_out = _Remembered()  # "done" | "failed" | "declined"/"cancelled" (given up before the send)
        self._ended_in = _Remembered()  # "done" | "failed" | "withdrawn" (peer gave up before we armed)
        self._events: list[TransferEvent] = []
        self._stats = TransferStats()
        self._gen = 0
        self._closed = False
        self._post({"op": "hello", "version": PROTOCOL_VERSION, "instance": instance_id, "layout": layout.to_dict()})

    # -- contract ------------------------------------------------------------------------------------------------

    @property
    def link_state(self) -> LinkState:
        return self._state

    @property
    def link_error(self) -> str | None:
        return self._error

    @property
    def closed_by_peer(self) -> bool:
        return self._peer_bye

    def handshake(self, peer_layout: KVLayout) -> None:
        try:
            self.layout.check_compatible(peer_layout)
        except LayoutMismatch as e:
            self._state, self._error, self._error_reason = LinkState.FAILED, str(e), FailReason.LAYOUT_MISMATCH
            self._mismatch = e
            raise
        if self._state is LinkState.NOT_READY:
            self._state = LinkState.READY

    def connect(self, timeout_s: float) -> None:
        """Wait (bounded) for the handshake. Raises LayoutMismatch, ConnectionError (peer gone) or
        TimeoutError; events that arrive meanwhile are kept for the next `poll`."""
        end = time.monotonic() + timeout_s  # wall time even under an injected clock: this call blocks
        while self._state is LinkState.NOT_READY:
            self._progress()
            left = end - time.monotonic()
            if self._state is not LinkState.NOT_READY:
                break
            if left <= 0:
                raise TimeoutError(f"kv link {self.instance_id}: no handshake from the peer within {timeout_s}s")
            self._channel.wait(min(left, 0.05))
        if self._state is LinkState.FAILED:
            if self._mismatch is not None:
                raise self._mismatch
            raise ConnectionError(f"kv link {self.instance_id}: {self._error}")

    def send(self, handoff: Handoff, deadline_s: float) -> None:
        rid = handoff.request_id
        if rid in self._out:
            raise ValueError(f"request {rid!r} is already being sent on this link")
        self.layout.check_compatible(handoff.layout)
        if self._state is not LinkState.READY:
            self._fail(rid, self._error_reason, self._error or "link not ready (no handshake yet)", out=True)
            return
        if self._ended_out.get(rid) in ("declined", "cancelled"):
            who = "the receiver" if self._ended_out.pop(rid) == "declined" else "this side"
            self._fail(rid, FailReason.PEER_CANCELLED, f"{who} cancelled the request before the send", out=True)
            return
        try:
            locator, nbytes = self._carrier.publish(handoff)
        except (OSError, ValueError) as e:
            self._fail(rid, FailReason.TRANSPORT_ERROR, f"publish failed: {e}", out=True)
            return
        self._gen += 1
        self._out[rid] = _Outgoing(self._gen, self._clock() + deadline_s)
        self._stats.bytes_sent += nbytes
        self._post({"op": "offer", "rid": rid, "gen": self._gen, "ttl_s": deadline_s, "loc": locator})

    def receive(self, request_id: str, deadline_s: float, num_tokens: int | None = None) -> None:
        rid = request_id
        if rid in self._in:
            raise ValueError(f"request {rid!r} is already armed on this link")
        if self._state is not LinkState.READY:
            self._fail(rid, self._error_reason, self._error or "link not ready (no handshake yet)", out=False)
            return
        if self._ended_in.get(rid) == "withdrawn":
            self._ended_in.pop(rid)
            self._fail(rid, FailReason.PEER_CANCELLED, "the sender withdrew before the receive", out=False)
            return
        self._ended_in.pop(rid)
        self._in[rid] = _Incoming(self._clock() + deadline_s, num_tokens)

    def forget_unsent(self, request_id: str) -> None:
        # A decline or cancel is kept so that a send racing in after it fails at once; once the request it was
        # for has ended without a send, it would fail every later request reusing the id (the marker only ages
        # out after _MAX_REMEMBERED other ids).
        if self._ended_out.get(request_id) in ("declined", "cancelled"):
            self._ended_out.pop(request_id)

    def poll(self) -> list[TransferEvent]:
        self._progress()
        events, self._events = self._events, []
        return events

    def cancel(self, request_id: str, reason: str = "cancelled") -> CancelResult:
        rid = request_id
        sending = rid in self._out
        receiving = rid in self._in or rid in self._offers
        if sending:
            del self._out[rid]
            self._carrier.discard(rid)
            self._ended_out.put(rid, "failed")
        if receiving or not sending:
            self._in.pop(rid, None)
            self._offers.pop(rid, None)
            self._reap(rid)
            self._ended_in.put(rid, "failed")
        if not (sending or receiving):
            self._ended_out.put(rid, "cancelled")  # a `send` racing in after this fails at once
        # An id we hold no transfer for is still announced both ways: the peer may be armed for it, or
        # about to send it, and should give up now rather than at its deadline.
        if sending or not receiving:
            self._post({"op": "withdraw", "rid": rid, "reason": reason})
        if receiving or not sending:
            self._post({"op": "decline", "rid": rid, "reason": reason})
        if not (sending or receiving):
            return CancelResult.NOT_FOUND
        self._stats.cancelled += 1
        # The receiver copies payloads out itself, so once this returns nothing can land in its memory.
        return CancelResult.SAFE

    def stats(self) -> TransferStats:
        return self._stats

    def close(self) -> list[TransferEvent]:
        if not self._closed:
            self._closed = True
            self._post({"op": "bye"})
            self._link_down(FailReason.CLOSED, "connector closed")
            self._channel.close()
            self._carrier.close()
        events, self._events = self._events, []
        return events

    # -- progress --------------------------------------------------------------------------------------------------

    def _progress(self) -> None:
        if self._closed:
            return
        try:
            messages = self._channel.receive()
        except ChannelClosed:
            messages = []
            self._link_down(FailReason.PEER_DIED, "control channel closed (peer gone)")
        for msg in messages:
            try:
                self._handle(msg)
            except (KeyError, TypeError, ValueError) as e:
                self._stats.extra["bad_message"] = self._stats.extra.get("bad_message", 0) + 1
                log.warning("kv link %s: ignoring malformed message %r: %s", self.instance_id, msg, e)
        for rid in [r for r in self._in if r in self._offers]:
            self._take(rid, self._offers.pop(rid))
        self._expire()

    def _handle(self, msg: Message) -> None:
        op = msg["op"]
        if op == "hello":
            self._on_hello(msg)
        elif op == "offer":
            self._on_offer(msg["rid"], _Offer(int(msg["gen"]), msg["loc"], self._clock() + float(msg["ttl_s"])))
        elif op in ("ack", "reject", "decline"):
            self._on_reply(op, msg)
        elif op == "withdraw":
            self._on_withdraw(msg["rid"], str(msg.get("reason", "")))
        elif op == "bye":
            self._peer_bye = self._state is not LinkState.FAILED
            self._link_down(FailReason.PEER_DIED, "peer closed the link")
        else:
            raise ValueError(f"unknown op {op!r}")

    def _on_hello(self, msg: Message) -> None:
        if msg["version"] != PROTOCOL_VERSION:
            self._state, self._error_reason = LinkState.FAILED, FailReason.LAYOUT_MISMATCH
            self._error = f"peer speaks kv link protocol {msg['version']}, we speak {PROTOCOL_VERSION}"
            return
        self.peer_id = str(msg["instance"])
        try:
            self.handshake(KVLayout.from_dict(msg["layout"]))
        except LayoutMismatch as e:
            log.error("kv link %s: %s", self.instance_id, e)

    def _on_offer(self, rid: str, offer: _Offer) -> None:
        how = self._ended_in.get(rid)  # `receive` clears it, so an armed id is never in here
        if how is not None:
            # We already finished with this id: count it, free the payload, and tell a sender that may wait.
            self._count_ignored(how, "offer", rid)
            self._reap(rid)
            if how != "done":
                self._post({"op": "decline", "rid": rid, "gen": offer.gen, "reason": "receiver already gave up"})
            return
        if rid in self._offers:
            self._stats.duplicate += 1
        # Taken after the whole batch is handled, so a withdraw right behind it still wins; an offer that
        # arrives before `receive` waits here until armed or until its ttl passes.
        self._offers[rid] = offer

    def _take(self, rid: str, offer: _Offer) -> None:
        want = self._in.pop(rid)
        try:
            handoff = self._carrier.fetch(self.peer_id or "", rid, offer.locator)
            if handoff.request_id != rid:
                raise HandoffFormatError(f"payload is for request {handoff.request_id!r}")
            self.layout.check_compatible(handoff.layout)
            if want.num_tokens is not None and handoff.num_tokens != want.num_tokens:
                raise HandoffFormatError(f"payload has {handoff.num_tokens} tokens, expected {want.num_tokens}")
        except LayoutMismatch as e:
            self._reject(rid, offer.gen, FailReason.LAYOUT_MISMATCH, str(e))
            return
        except (HandoffFormatError, ValueError, KeyError, TypeError) as e:
            # KeyError/TypeError: a locator of another shape (e.g. a peer running another backend).
            self._reject(rid, offer.gen, FailReason.BAD_PAYLOAD, f"{type(e).__name__}: {e}")
            return
        except OSError as e:  # the transport could not read it (peer gone, read timed out, no room)
            self._reject(rid, offer.gen, FailReason.TRANSPORT_ERROR, str(e))
            return
        finally:
            self._reap(rid)
        self._ended_in.put(rid, "done")
        self._stats.received += 1
        self._stats.bytes_received += int(offer.locator.get("nbytes", 0))
        self._events.append(TransferEvent(rid, EventKind.RECEIVED, handoff=handoff))
        self._post({"op": "ack", "rid": rid, "gen": offer.gen})

    def _reject(self, rid: str, gen: int, reason: FailReason, detail: str) -> None:
        self._fail(rid, reason, detail, out=False)
        self._post({"op": "reject", "rid": rid, "gen": gen, "reason": reason.value, "detail": detail})

    def _on_reply(self, op: str, msg: Message) -> None:
        rid = msg["rid"]
        out = self._out.get(rid)
        gen = msg.get("gen")
        if out is None or (gen is not None and int(gen) != out.gen):
            how = self._ended_out.get(rid)
            if how is None and op == "decline":
                self._ended_out.put(rid, "declined")  # the receiver gave up before we sent
            else:
                self._count_ignored(how, op, rid)
            return
        del self._out[rid]
        self._carrier.discard(rid)
        if op == "ack":
            self._ended_out.put(rid, "done")
            self._stats.sent += 1
            self._events.append(TransferEvent(rid, EventKind.SENT))
        elif op == "reject":
            try:
                reason = FailReason(msg["reason"])
            except ValueError:
                reason = FailReason.BAD_PAYLOAD
            self._fail(rid, reason, f"receiver rejected the payload: {msg.get('detail', '')}", out=True)
        else:
            self._stats.peer_cancelled += 1
            self._fail(rid, FailReason.PEER_CANCELLED, f"receiver declined: {msg.get('reason', '')}", out=True)

    def _on_withdraw(self, rid: str, reason: str) -> None:
        if rid in self._in:
            del self._in[rid]
            self._reap(rid)
            self._stats.peer_cancelled += 1
            self._fail(rid, FailReason.PEER_CANCELLED, f"sender withdrew: {reason}", out=False)
        elif rid in self._offers:
            del self._offers[rid]
            self._reap(rid)
            self._ended_in.put(rid, "withdrawn")
        elif self._ended_in.get(rid) is None:
            self._ended_in.put(rid, "withdrawn")
        else:
            self._count_ignored(self._ended_in.get(rid), "withdraw", rid)

    def _expire(self) -> None:
        now = self._clock()
        for rid in [r for r, o in self._out.items() if now >= o.deadline]:
            del self._out[rid]
            self._carrier.discard(rid)
            self._stats.timeouts += 1
            self._fail(rid, FailReason.XFER_TIMEOUT, "no ack from the receiver before the deadline", out=True)
            self._post({"op": "withdraw", "rid": rid, "reason": FailReason.XFER_TIMEOUT.value})
        for rid in [r for r, i in self._in.items() if now >= i.deadline]:
            del self._in[rid]
            self._reap(rid)
            self._stats.timeouts += 1
            self._fail(rid, FailReason.XFER_TIMEOUT, "no handoff from the sender before the deadline", out=False)
            self._post({"op": "decline", "rid": rid, "reason": FailReason.XFER_TIMEOUT.value})
        for rid in [r for r, o in self._offers.items() if now >= o.expiry]:
            del self._offers[rid]
            self._reap(rid)
            self._stats.unknown += 1
            log.info("kv link %s: offer for %r was never claimed", self.instance_id, rid)

    # -- helpers ---------------------------------------------------------------------------------------------------

    def _fail(self, rid: str, reason: FailReason, detail: str, *, out: bool) -> None:
        (self._ended_out if out else self._ended_in).put(rid, "failed")
        self._stats.failed += 1
        self._events.append(TransferEvent(rid, EventKind.FAILED, reason=reason, detail=detail))

    def _link_down(self, reason: FailReason, detail: str) -> None:
        if self._state is not LinkState.FAILED:
            self._state, self._error, self._error_reason = LinkState.FAILED, detail, reason
        for rid in list(self._out):
            del self._out[rid]
            self._carrier.discard(rid)
            self._fail(rid, reason, detail, out=True)
        for rid in list(self._in):
            del self._in[rid]
            self._reap(rid)
            self._fail(rid, reason, detail, out=False)
        for rid in list(self._offers):
            del self._offers[rid]
            self._reap(rid)

    def _reap(self, rid: str) -> None:
        if self.peer_id is not None:
            try:
                self._carrier.reap(self.peer_id, rid)
            except OSError as e:
                log.warning("kv link %s: could not free the payload of %r: %s", self.instance_id, rid, e)

    def _count_ignored(self, how: str | None, what: str, rid: str) -> None:
        if how == "done":
            self._stats.duplicate += 1
        elif how is None:
            self._stats.unknown += 1
        else:
            self._stats.late += 1
        log.debug("kv link %s: ignored %s for %r (%s)", self.instance_id, what, rid, how or "unknown")

    def _post(self, msg: Message) -> None:
        try:
            self._channel.send(msg)
        except ChannelClosed:
            pass  # the next poll sees the closed channel and fails what is in flight
