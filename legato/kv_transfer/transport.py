"""The two pluggable halves of a same-host link (see link.py): a control `Channel` and a payload `Carrier`."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from legato.kv_transfer.handoff import Handoff

Message = dict[str, Any]


class ChannelClosed(ConnectionError):
    """The peer end of the control channel is gone."""


class Channel(ABC):
    """Control messages between the two ends of one link."""

    @abstractmethod
    def send(self, msg: Message) -> None:
        """Queue `msg` for the peer; raises ChannelClosed if the peer is gone."""

    @abstractmethod
    def receive(self) -> list[Message]:
        """Every message pending now, without blocking. Raises ChannelClosed once the peer is gone and
        nothing is pending."""

    @abstractmethod
    def wait(self, timeout_s: float) -> None:
        """Block until a message may be pending or `timeout_s` passes."""

    @abstractmethod
    def close(self) -> None: ...


class Carrier(ABC):
    """Where a handoff's bytes live between `publish` (sender) and `fetch` (receiver)."""

    @abstractmethod
    def publish(self, handoff: Handoff) -> tuple[Message, int]:
        """Make `handoff` readable by the peer; returns (locator for the offer message, payload bytes).
        Raises OSError or ValueError if the transport cannot take it."""

    @abstractmethod
    def fetch(self, peer_id: str, request_id: str, locator: Message) -> Handoff:
        """Copy the peer's payload out into memory this process owns. Raises HandoffFormatError or OSError."""

    @abstractmethod
    def discard(self, request_id: str) -> None:
        """Sender side: free what `publish` made for `request_id` (idempotent)."""

    @abstractmethod
    def reap(self, peer_id: str, request_id: str) -> None:
        """Receiver side: free the peer's payload for `request_id` if it still exists; covers a peer
        that died before it could free it (idempotent)."""

    @abstractmethod
    def close(self) -> None:
        """Free everything this end published."""
