"""Same host, different processes: the payload in POSIX shared memory, control messages on a pluggable channel.

Payload. The sender writes each handoff's wire form (handoff.write_handoff) into its own segment named
`segment_name(instance_id, request_id)`: derived, never hard-coded, so several deployments share a host
as long as live connectors use distinct instance ids. `send` returns once the bytes are in the segment;
the source KV blocks were already free (the Handoff holds its own gathered copy).

Ownership and cleanup. The receiver maps the segment read-only, copies the handoff out into its own
memory, then unlinks the segment; the sender also unlinks it on ack, reject, decline, deadline, cancel
and close (unlinking twice is harmless). Because names derive from (sender instance id, request id),
the receiver can free the segment of a sender that died mid-transfer without ever having been told its
name. `reap_segments(instance_id)` frees whatever a crashed connector left behind (for the launcher).

Quarantine. The receiver copies out itself and only after it armed the request, so after `cancel` (or
a failure) returns, nothing can land in its memory: cancel is always CancelResult.SAFE here. Destination
KV blocks are written by the caller (handoff.scatter_blocks) only after a RECEIVED event.

Control channel. Any `link.Channel`; `ConnectionChannel` carries JSON messages (never pickle) over a
`multiprocessing` Pipe end or a Unix socket (see `ConnectionChannel.from_socket`). A ZeroMQ PAIR socket
would be another ~20-line Channel.
"""

from __future__ import annotations

import _posixshmem
import hashlib
import json
import logging
import mmap
import os
import re
import socket
import time
from collections.abc import Callable
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory

from legato.kv_transfer.handoff import (
    Handoff,
    HandoffFormatError,
    KVLayout,
    handoff_nbytes,
    read_handoff,
    write_handoff,
)
from legato.kv_transfer.link import LinkConnector
from legato.kv_transfer.transport import Carrier, Channel, ChannelClosed, Message

log = logging.getLogger(__name__)

_INSTANCE_ID = re.compile(r"[A-Za-z0-9.-]{1,40}")  # no "_": it separates the id from the request digest
_SHM_DIR = "/dev/shm"


def _check_instance_id(instance_id: str) -> str:
    if not isinstance(instance_id, str) or not _INSTANCE_ID.fullmatch(instance_id):
        raise ValueError(f"instance id must match {_INSTANCE_ID.pattern}, got {instance_id!r}")
    return instance_id


def segment_prefix(instance_id: str) -> str:
    return f"vx{_check_instance_id(instance_id)}_"


def segment_name(instance_id: str, request_id: str) -> str:
    """The shared-memory name of `request_id`'s payload from sender `instance_id` (request ids are hashed:
    they are arbitrary strings and names have a length limit)."""
    digest = hashlib.blake2b(request_id.encode(), digest_size=10).hexdigest()
    return segment_prefix(instance_id) + digest


def _unlink_name(name: str) -> bool:
    """Unlink a segment by name without touching the resource tracker; False if it was already gone."""
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        return False
    return True


def list_segments(instance_id: str) -> list[str]:
    """Names of the live segments sent by `instance_id` (Linux: /dev/shm; elsewhere always empty)."""
    prefix = segment_prefix(instance_id)
    if not os.path.isdir(_SHM_DIR):
        return []
    return sorted(n for n in os.listdir(_SHM_DIR) if n.startswith(prefix))


def reap_segments(instance_id: str) -> list[str]:
    """Unlink every segment a (crashed) connector with `instance_id` left behind; returns their names."""
    return [n for n in list_segments(instance_id) if _unlink_name(n)]


class ShmCarrier(Carrier):
    def __init__(self, instance_id: str) -> None:
        self.instance_id = _check_instance_id(instance_id)
        self._own: dict[str, SharedMemory] = {}

    def publish(self, handoff: Handoff) -> tuple[Message, int]:
        rid = handoff.request_id
        name = segment_name(self.instance_id, rid)
        nbytes = handoff_nbytes(handoff)
        try:
            seg = SharedMemory(name=name, create=True, size=nbytes)
        except FileExistsError as e:
            # Never adopt or overwrite a segment we did not create: two live connectors would share an id.
            raise OSError(f"shared memory {name!r} already exists: instance id {self.instance_id!r} reused, "
                          f"or a crashed run's leftover (reap_segments)") from e
        try:
            write_handoff(handoff, seg.buf)
        except BaseException:
            _release(seg)
            raise
        self._own[rid] = seg
        return {"segment": name, "nbytes": nbytes}, nbytes

    def fetch(self, peer_id: str, request_id: str, locator: Message) -> Handoff:
        name, nbytes = locator["segment"], int(locator["nbytes"])
        if name != segment_name(peer_id, request_id):
            # Only ever open the name the protocol derives: a confused peer cannot point us elsewhere.
            raise HandoffFormatError(f"offer names segment {name!r}, expected {segment_name(peer_id, request_id)!r}")
        # Opened directly rather than through SharedMemory, which in Python < 3.13 would register the
        # segment with this process's resource tracker as if we owned it.
        fd = _posixshmem.shm_open("/" + name, os.O_RDONLY, mode=0o600)
        try:
            size = os.fstat(fd).st_size
            if size < nbytes:
                raise HandoffFormatError(f"segment {name!r} holds {size} bytes, offer says {nbytes}")
            mapped = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        try:
            return read_handoff(memoryview(mapped)[:nbytes])
        finally:
            try:
                mapped.close()
            except BufferError:
                pass  # a view outlived the read (an exception's traceback); the mapping goes with it

    def discard(self, request_id: str) -> None:
        seg = self._own.pop(request_id, None)
        if seg is not None:
            _release(seg)

    def reap(self, peer_id: str, request_id: str) -> None:
        _unlink_name(segment_name(peer_id, request_id))

    def close(self) -> None:
        for rid in list(self._own):
            self.discard(rid)


def _release(seg: SharedMemory) -> None:
    """Close and unlink a segment we created, whether or not the receiver unlinked it already."""
    try:
        seg.close()
    except BufferError:
        log.warning("shared memory %s still has views; unlinking it anyway", seg.name)
    try:
        seg.unlink()  # also unregisters it from the resource tracker
    except FileNotFoundError:
        resource_tracker.unregister(seg._name, "shared_memory")  # the receiver unlinked it first


class ConnectionChannel(Channel):
    """JSON messages over a multiprocessing Connection (a Pipe end, or a socket via `from_socket`)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._eof = False

    @classmethod
    def from_socket(cls, sock: socket.socket) -> ConnectionChannel:
        """Take over a connected stream socket (e.g. one end of socket.socketpair())."""
        return cls(Connection(sock.detach()))

    def send(self, msg: Message) -> None:
        if self._eof:
            raise ChannelClosed("channel closed")
        try:
            self._conn.send_bytes(json.dumps(msg).encode())
        except (OSError, ValueError) as e:
            raise ChannelClosed(str(e)) from e

    def receive(self) -> list[Message]:
        out: list[Message] = []
        if self._eof:
            raise ChannelClosed("channel closed")
        try:
            while self._conn.poll(0):
                out.append(json.loads(self._conn.recv_bytes()))
        except (EOFError, OSError, ValueError):
            self._eof = True
            if not out:
                raise ChannelClosed("peer closed the channel") from None
        return out

    def wait(self, timeout_s: float) -> None:
        if not self._eof:
            try:
                self._conn.poll(timeout_s)
            except (EOFError, OSError, ValueError):
                self._eof = True

    def close(self) -> None:
        self._eof = True
        self._conn.close()


class ShmConnector(LinkConnector):
    """One end of a same-host link. `channel` is a Channel, or a multiprocessing Connection to wrap."""

    def __init__(self, layout: KVLayout, channel: Channel | Connection, instance_id: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if isinstance(channel, Connection):
            channel = ConnectionChannel(channel)
        super().__init__(layout, channel, ShmCarrier(instance_id), instance_id, clock)
