"""The KV-connector contract: one small interface every backend implements.

One connector instance is one end of a link between two workers. Either end can send and receive;
in prefill-decode disaggregation the prefill worker only calls `send` and the decode worker only calls
`receive`. Everything is non-blocking and driven by `poll()`, which the owner calls from its loop.

Rules every backend keeps (they are what the engine relies on):

* **Bounded.** Every `send` and every `receive` has a deadline on its own side. Expiry yields a FAILED
  event (`FailReason.XFER_TIMEOUT`) and tells the peer.
* **Atomic.** A RECEIVED event carries a complete, validated `Handoff`; nothing is delivered in parts.
* **Total and idempotent.** Each request id ends with exactly one terminal event per side. Messages for
  ids that already ended (late), ended successfully (duplicate) or were never known (unknown) are counted
  in `stats()` and otherwise ignored; they never raise.
* **Local failure.** Transport errors fail the request they concern with a reason, never the worker.
  Only programming errors (e.g. sending the same id twice while in flight) raise.
* **Cancel reaches the peer.** `cancel` tells the other end, which fails its half with
  `FailReason.PEER_CANCELLED`. Its return value says whether destination memory may be reused now
  (`CancelResult.SAFE`) or stays quarantined until a RELEASED event (`CancelResult.QUARANTINED`, for
  transports where the peer writes into our memory and a write may still be in flight).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from legato.kv_transfer.handoff import Handoff, KVLayout


class LinkState(enum.Enum):
    NOT_READY = "not_ready"  # handshake not finished: send/receive fail fast with PEER_NOT_READY
    READY = "ready"
    FAILED = "failed"  # layout mismatch, peer died or link closed; see KVConnector.link_error


class FailReason(str, enum.Enum):
    XFER_TIMEOUT = "xfer_timeout"  # this side's deadline passed
    PEER_CANCELLED = "peer_cancelled"  # the peer cancelled or gave up (its own deadline)
    PEER_NOT_READY = "peer_not_ready"  # the link has not completed its handshake
    PEER_DIED = "peer_died"  # the control channel closed under us
    LAYOUT_MISMATCH = "layout_mismatch"
    BAD_PAYLOAD = "bad_payload"  # the payload could not be read or did not match the request
    TRANSPORT_ERROR = "transport_error"  # the local transport refused (e.g. shared memory full)
    CLOSED = "closed"  # this connector was closed with the transfer in flight


class EventKind(enum.Enum):
    SENT = "sent"  # the peer has the handoff; the sender may free everything it kept for it
    RECEIVED = "received"  # `handoff` is complete and validated
    FAILED = "failed"  # `reason` says why; terminal for this side of the request
    RELEASED = "released"  # a quarantined destination can no longer be written (after CancelResult.QUARANTINED)


class CancelResult(enum.Enum):
    SAFE = "safe"  # nothing can land in the destination any more
    QUARANTINED = "quarantined"  # wait for the RELEASED event before reusing the destination
    NOT_FOUND = "not_found"  # no transfer in flight under this id (already ended, or never started)


@dataclass
class TransferEvent:
    request_id: str
    kind: EventKind
    reason: FailReason | None = None
    detail: str = ""
    handoff: Handoff | None = None


@dataclass
class TransferStats:
    """Monotonic counters. `late`, `duplicate` and `unknown` count messages that were ignored."""

    sent: int = 0
    received: int = 0
    failed: int = 0
    timeouts: int = 0
    cancelled: int = 0  # by this side
    peer_cancelled: int = 0
    late: int = 0  # for an id that already failed or was cancelled
    duplicate: int = 0  # for an id that already completed
    unknown: int = 0  # for an id never seen, or an unclaimed offer that expired
    bytes_sent: int = 0
    bytes_received: int = 0
    extra: dict[str, int] = field(default_factory=dict)


class KVConnector(ABC):
    """One end of a KV-transfer link. Not thread-safe: call it from one thread (the worker loop)."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout

    @property
    @abstractmethod
    def link_state(self) -> LinkState: ...

    @property
    @abstractmethod
    def link_error(self) -> str | None:
        """Why the link FAILED, or None."""

    @property
    def closed_by_peer(self) -> bool:
        """The link went down because the peer closed it in order (its shutdown), not by a failure."""
        return False

    @abstractmethod
    def handshake(self, peer_layout: KVLayout) -> None:
        """Accept the peer's layout (READY) or raise LayoutMismatch naming every differing field (FAILED).
        Backends call it when the peer's hello arrives; a mismatch is never adapted around."""

    @abstractmethod
    def send(self, handoff: Handoff, deadline_s: float) -> None:
        """Start moving `handoff` to the peer. Returns without waiting for the peer; the outcome is a
        SENT or FAILED event from `poll`. The connector owns `handoff` from here on (do not mutate it).
        Raises (ValueError) only for caller bugs: a handoff of another layout (LayoutMismatch), or an id
        already being sent on this link. Request ids are unique per attempt: a retry uses a new id."""

    @abstractmethod
    def receive(self, request_id: str, deadline_s: float, num_tokens: int | None = None) -> None:
        """Arm this end for one request. The outcome is a RECEIVED or FAILED event from `poll`. If
        `num_tokens` is given, a handoff of any other length fails with BAD_PAYLOAD."""

    @abstractmethod
    def poll(self) -> list[TransferEvent]:
        """Make progress (messages, payload copies, deadlines) and return the events since the last call.
        Never raises for transport or peer errors."""

    @abstractmethod
    def cancel(self, request_id: str, reason: str = "cancelled") -> CancelResult:
        """Abandon this side of `request_id` and tell the peer. No event follows on this side."""

    def forget_unsent(self, request_id: str) -> None:
        """Drops what this side remembers of an outgoing `request_id` that was given up before its send (the
        peer declined it, or it was cancelled): a later request under the same id starts clean. A connector that
        remembers nothing of the kind has nothing to do."""
        return None

    @abstractmethod
    def stats(self) -> TransferStats: ...

    @abstractmethod
    def close(self) -> list[TransferEvent]:
        """Tell the peer, free transport resources and return a FAILED (FailReason.CLOSED) event for
        everything still in flight, plus any events not yet polled. Idempotent."""
