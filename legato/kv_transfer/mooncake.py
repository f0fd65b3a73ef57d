"""Cross-host KV transfer over the Mooncake Transfer Engine (TCP, or RDMA where the hosts have it).

Payload. Each connector registers one memory arena with a Mooncake `TransferEngine` started in
peer-to-peer handshake mode (no metadata server). The sender writes a handoff's wire form
(handoff.write_handoff) into a region of its arena and offers {session, addr, nbytes, tag}; the receiver
pulls the region with a one-sided read into a staging region of its own arena, parses it (read_handoff
copies into memory it owns) and frees the staging region. The sender frees its region on ack, reject,
decline, deadline, cancel and close. Control messages travel on any `Channel` (across hosts:
`ConnectionChannel.from_socket(tcp_socket)`).

One arena, registered once, rather than one registration per handoff: memory is bounded (`arena_bytes`;
a full arena fails that one request with TRANSPORT_ERROR), RDMA registration pins pages and costs far more
than the ~10 us it costs on TCP, and the peer never has to learn about new registrations. The arena is
an anonymous mapping, so untouched pages cost nothing on TCP.

Seal. A sender frees a region on its own (deadline, cancel) while the receiver may not have seen the
withdraw yet, and reuses it for the next handoff. Each region therefore starts with a 64-byte seal holding
a tag unique to one publish: written after the payload, zeroed before the region is freed. The receiver
reads seal + payload, then the seal again, and keeps the bytes only if both show the offer's tag, so a
payload torn by reuse is rejected (BAD_PAYLOAD), never delivered. Cost: one extra 8-byte read.

Locators. The receiver reads only inside what the peer advertised in its hello (session and arena range,
added by `_HelloChannel`); an offer naming another session or range is rejected without a read. The
Mooncake TCP server also refuses reads outside registered memory. Registered memory is readable and
writable by anyone who reaches the engine's port (Mooncake has no authentication): the arena only ever
holds handoffs in flight, never the KV cache; bind `hostname` to a private interface.

Bounds. `fetch` blocks the receiver's loop for the read (the sender's loop is free: the read is
one-sided). A hung peer would hold a Mooncake read for its own 30 s progress timeout, so fetch gives up
after `read_timeout_s`; the staging region of an abandoned read stays allocated until the engine reports
the read ended. `reap` does nothing: the payload lives in the sender's arena and dies with its process.

Engines. Stopping an engine that has talked to a peer takes about a second, so a process with several
links may share one `MooncakeEngine` (`engine=`); a connector then only unregisters its arena at close.
"""

from __future__ import annotations

try:
    from mooncake.engine import TransferEngine
except ImportError as e:  # also the CUDA build on a host without libcudart / libcuda
    raise ImportError(
        "the 'mooncake' KV transfer backend needs the Mooncake Transfer Engine: pip install legato[mooncake] "
        "(mooncake-transfer-engine on GPU hosts, mooncake-transfer-engine-non-cuda on CPU hosts; they "
        f"load libibverbs.so.1: apt-get install libibverbs1; import failed with: {e})"
    ) from e

import bisect
import ctypes
import logging
import mmap
import re
import secrets
import struct
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

from legato.kv_transfer.base import TransferEvent, TransferStats
from legato.kv_transfer.handoff import (
    Handoff,
    HandoffFormatError,
    KVLayout,
    handoff_nbytes,
    read_handoff,
    write_handoff,
)
from legato.kv_transfer.link import LinkConnector
from legato.kv_transfer.shm import ConnectionChannel
from legato.kv_transfer.transport import Carrier, Channel, Message

log = logging.getLogger(__name__)

DEFAULT_ARENA_BYTES = 1 << 30
_ALIGN = 64
_SEAL = 64  # region header; the tag is its first 8 bytes, the rest keeps the payload 64-byte aligned
_TAG = struct.Struct("<Q")
_SESSION = re.compile(r"\S+:\d{1,5}")  # host:port; an IPv6 host comes bracketed


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class MooncakeEngine:
    """A started TransferEngine and the arenas registered with it. Share one among a process's links;
    close it after them (closing stops the engine, which aborts reads still in flight, then unmaps)."""

    def __init__(self, hostname: str = "127.0.0.1", protocol: str = "tcp", device_name: str = "") -> None:
        engine = TransferEngine()
        # P2PHANDSHAKE: peers exchange segment descriptors directly, so no etcd / metadata server is needed.
        if engine.initialize(hostname, "P2PHANDSHAKE", protocol, device_name) != 0:
            raise OSError(f"Mooncake transfer engine failed to start on {hostname!r} (protocol {protocol!r})")
        self.raw: TransferEngine | None = engine
        self.session = f"{hostname}:{engine.get_rpc_port()}"
        self._maps: list[mmap.mmap] = []

    def new_arena(self, nbytes: int) -> tuple[mmap.mmap, int]:
        """An anonymous, page-aligned mapping of `nbytes`, registered with the engine; (mapping, address)."""
        if self.raw is None:
            raise OSError("Mooncake engine is closed")
        mm = mmap.mmap(-1, nbytes)
        view = ctypes.c_char.from_buffer(mm)
        addr = ctypes.addressof(view)
        del view  # the export would keep `mm` from closing
        if self.raw.register_memory(addr, nbytes) != 0:
            mm.close()
            raise OSError(f"Mooncake could not register a {nbytes}-byte arena")
        self._maps.append(mm)
        return mm, addr

    def retire_arena(self, mm: mmap.mmap, addr: int) -> None:
        """Unregister an arena. It stays mapped until `close`: a read the engine still serves from it, or
        an abandoned read still landing in it, must not touch unmapped memory. Its pages go back now."""
        if self.raw is not None:
            self.raw.unregister_memory(addr)
        if not mm.closed and hasattr(mmap, "MADV_DONTNEED"):
            mm.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        """Stop the engine (about a second once it has talked to a peer) and unmap every arena. Idempotent."""
        self.raw = None  # the only reference: the engine stops and joins its threads here
        for mm in self._maps:
            try:
                mm.close()
            except BufferError:
                log.warning("a Mooncake arena still has views; it is unmapped when they go")
        self._maps.clear()


class _Arena:
    """First-fit allocator of 64-byte-aligned regions over [0, capacity); free regions coalesce."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free: list[tuple[int, int]] = [(0, capacity)]  # (offset, size), sorted by offset
        self._used: dict[int, int] = {}

    def alloc(self, nbytes: int) -> int | None:
        n = _align(nbytes)
        for i, (off, size) in enumerate(self._free):
            if size >= n:
                if size == n:
                    del self._free[i]
                else:
                    self._free[i] = (off + n, size - n)
                self._used[off] = n
                return off
        return None

    def free(self, off: int) -> None:
        n = self._used.pop(off)
        i = bisect.bisect(self._free, (off, 0))
        if i < len(self._free) and self._free[i][0] == off + n:
            n += self._free.pop(i)[1]
        if i > 0 and sum(self._free[i - 1]) == off:
            self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + n)
        else:
            self._free.insert(i, (off, n))

    @property
    def in_use(self) -> int:
        return sum(self._used.values())


class MooncakeCarrier(Carrier):
    """Handoffs in a registered arena, pulled by the receiver with one-sided Mooncake reads."""

    def __init__(self, engine: MooncakeEngine, arena_bytes: int, read_timeout_s: float = 5.0) -> None:
        if not _is_int(arena_bytes) or arena_bytes < 4 * _ALIGN:
            raise ValueError(f"arena_bytes must be an int >= {4 * _ALIGN}, got {arena_bytes!r}")
        self.engine = engine
        self.read_timeout_s = read_timeout_s
        self.arena = _Arena(arena_bytes)
        self._mm, self._base = engine.new_arena(arena_bytes)
        self._own: dict[str, int] = {}  # request id -> region offset
        self._abandoned: list[tuple[int, int]] = []  # (batch id, staging offset) of reads we gave up on
        self._peer: tuple[str, int, int] | None = None  # session, arena address, arena size
        self._peer_error = "the peer's hello advertised no Mooncake arena (is it a mooncake connector?)"
        # Tags are unique per publish: a random epoch per carrier, then a counter.
        self._tag = secrets.randbits(31) << 32
        self._closed = False
        self.counters = {"mooncake_arena_full": 0, "mooncake_stage_full": 0, "mooncake_bad_locator": 0,
                         "mooncake_read_failed": 0, "mooncake_read_timeout": 0, "mooncake_stale_payload": 0}

    # -- handshake -------------------------------------------------------------------------------------------------

    def advertise(self) -> Message:
        return {"session": self.engine.session, "addr": self._base, "nbytes": self.arena.capacity}

    def learn_peer(self, info: object) -> None:
        """Remember the arena the peer advertised; offers must point inside it."""
        ok = (isinstance(info, dict) and isinstance(info.get("session"), str) and _SESSION.fullmatch(info["session"])
              and _is_int(info.get("addr")) and _is_int(info.get("nbytes")) and info["addr"] > 0 and info["nbytes"] > 0)
        if not ok:
            self._peer = None
            if info is not None:
                self._peer_error = f"the peer advertised a malformed Mooncake arena: {info!r}"
            return
        self._peer = (info["session"], info["addr"], info["nbytes"])

    # -- sender ----------------------------------------------------------------------------------------------------

    def publish(self, handoff: Handoff) -> tuple[Message, int]:
        if self._closed:
            raise OSError("Mooncake carrier is closed")
        self.reclaim()
        nbytes = handoff_nbytes(handoff)
        off = self.arena.alloc(_SEAL + nbytes)
        if off is None:
            self.counters["mooncake_arena_full"] += 1
            raise OSError(f"Mooncake arena full: {nbytes} bytes wanted, {self.arena.in_use} of "
                          f"{self.arena.capacity} in use (arena_bytes)")
        try:
            write_handoff(handoff, self._mm_view(off + _SEAL, nbytes))
        except BaseException:
            self.arena.free(off)
            raise
        self._tag += 1
        _TAG.pack_into(self._mm, off, self._tag)  # last: a reader that sees the tag sees the whole payload
        self._own[handoff.request_id] = off
        return {"session": self.engine.session, "addr": self._base + off, "nbytes": nbytes, "tag": self._tag}, nbytes

    def discard(self, request_id: str) -> None:
        off = self._own.pop(request_id, None)
        if off is not None:
            _TAG.pack_into(self._mm, off, 0)  # before the region can be reused: see "Seal" above
            self.arena.free(off)

    # -- receiver --------------------------------------------------------------------------------------------------

    def fetch(self, peer_id: str, request_id: str, locator: Message) -> Handoff:
        if self._closed:
            raise OSError("Mooncake carrier is closed")
        self.reclaim()
        session, addr, nbytes, tag = self._check_locator(locator)
        off: int | None = self.arena.alloc(_SEAL + nbytes)
        if off is None:
            self.counters["mooncake_stage_full"] += 1
            raise OSError(f"no room to stage a {nbytes}-byte payload: {self.arena.in_use} of "
                          f"{self.arena.capacity} arena bytes in use (arena_bytes)")
        try:
            self._read(session, off, addr, _SEAL + nbytes)
            first = _TAG.unpack_from(self._mm, off)[0]
            if first == tag:
                self._read(session, off, addr, _TAG.size)  # the seal again, now that the payload is here
            if first != tag or _TAG.unpack_from(self._mm, off)[0] != tag:
                self.counters["mooncake_stale_payload"] += 1
                raise HandoffFormatError("the payload was withdrawn or replaced while it was read")
            return read_handoff(self._mm_view(off + _SEAL, nbytes))
        except _Abandoned:
            off = None  # the abandoned read owns the region now; reclaim frees it
            raise
        finally:
            if off is not None:
                self.arena.free(off)

    def reap(self, peer_id: str, request_id: str) -> None:
        pass  # nothing of the peer's lives here: its payload is in its own arena and dies with it

    def _check_locator(self, loc: Message) -> tuple[str, int, int, int]:
        if self._peer is None:
            self.counters["mooncake_bad_locator"] += 1
            raise HandoffFormatError(self._peer_error)
        session, base, size = self._peer
        if not isinstance(loc, dict):
            loc = {"not a mapping": loc}
        addr, nbytes, tag = loc.get("addr"), loc.get("nbytes"), loc.get("tag")
        if loc.get("session") != session:
            problem = f"names session {loc.get('session')!r}, the peer advertised {session!r}"
        elif not (_is_int(addr) and _is_int(nbytes) and _is_int(tag)) or nbytes < 1 or tag < 1:
            problem = f"is malformed: {loc!r}"
        elif addr < base or addr + _SEAL + nbytes > base + size:
            problem = f"range [{addr:#x}, +{_SEAL + nbytes}) lies outside the peer's arena [{base:#x}, +{size})"
        else:
            return session, addr, nbytes, tag
        self.counters["mooncake_bad_locator"] += 1
        raise HandoffFormatError(f"offer {problem}")

    def _read(self, session: str, off: int, remote: int, nbytes: int) -> None:
        """Pull `nbytes` from the peer's `remote` into our arena at `off`, waiting at most read_timeout_s.
        Raises OSError; _Abandoned (an OSError) when it gave up on a read that may still land."""
        raw = self.engine.raw
        if raw is None:
            raise OSError("Mooncake engine is closed")
        batch = raw.batch_transfer_async_read(session, [self._base + off], [remote], [nbytes])
        if not 0 < batch < 1 << 63:  # 0, or -1 as an unsigned batch id: the read never started
            self.counters["mooncake_read_failed"] += 1
            raise OSError(f"Mooncake read from {session} could not start (peer unreachable?)")
        end, delay = time.monotonic() + self.read_timeout_s, 0.0
        # transfer_check_status frees the batch once it reports 1 (done) or -1 (failed): never ask again then.
        while (status := raw.transfer_check_status(batch)) == 0 and time.monotonic() < end:
            time.sleep(delay)
            delay = min(max(2 * delay, 2e-5), 1e-3)
        if status == 1:
            return
        if status == -1:
            self.counters["mooncake_read_failed"] += 1
            raise OSError(f"Mooncake read of {nbytes} bytes from {session} failed (peer gone?)")
        self.counters["mooncake_read_timeout"] += 1
        self._abandoned.append((batch, off))
        raise _Abandoned(f"Mooncake read of {nbytes} bytes from {session} took over {self.read_timeout_s}s")

    def reclaim(self) -> None:
        """Free the staging regions of abandoned reads that the engine has since finished or failed."""
        raw, still = self.engine.raw, []
        for batch, off in self._abandoned:
            status = raw.transfer_check_status(batch) if raw is not None else 1
            if status == 0:
                still.append((batch, off))
            elif status == -2:
                # The engine's own timeout leaves the batch alive and the region possibly still written:
                # it stays allocated until close.
                log.warning("a Mooncake read timed out in the engine; its staging region at %d is held", off)
            else:
                self.arena.free(off)
        self._abandoned = still

    def _mm_view(self, off: int, nbytes: int) -> memoryview:
        return memoryview(self._mm)[off:off + nbytes]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for rid in list(self._own):
            self.discard(rid)
        self.engine.retire_arena(self._mm, self._base)


class _Abandoned(OSError):
    """A read given up on while it may still land: its staging region must stay allocated."""


class _HelloChannel(Channel):
    """Adds this end's arena to the outgoing hello and hands the peer's to the carrier. The link protocol
    ignores unknown hello fields, so the offer can be checked against what the peer itself announced."""

    def __init__(self, inner: Channel, carrier: MooncakeCarrier) -> None:
        self._inner, self._carrier = inner, carrier

    def send(self, msg: Message) -> None:
        if msg.get("op") == "hello":
            msg = {**msg, "mooncake": self._carrier.advertise()}
        self._inner.send(msg)

    def receive(self) -> list[Message]:
        messages = self._inner.receive()
        for msg in messages:
            if isinstance(msg, dict) and msg.get("op") == "hello":
                self._carrier.learn_peer(msg.get("mooncake"))
        return messages

    def wait(self, timeout_s: float) -> None:
        self._inner.wait(timeout_s)

    def close(self) -> None:
        self._inner.close()


class MooncakeConnector(LinkConnector):
    """One end of a cross-host link. `channel` is a Channel, or a multiprocessing Connection to wrap.

    `hostname` is the address peers reach this host's engine at (the session is hostname:port, the port
    picked by the engine); `protocol` "tcp" or "rdma" with `device_name` the NIC(s), e.g. "mlx5_0".
    `arena_bytes` bounds the memory of handoffs in flight, both directions. `engine` shares a started
    MooncakeEngine (hostname, protocol and device_name are then the engine's); None starts one for this
    connector and stops it at close."""

    def __init__(self, layout: KVLayout, channel: Channel | Connection, instance_id: str,
                 clock: Callable[[], float] = time.monotonic, *, hostname: str = "127.0.0.1",
                 protocol: str = "tcp", device_name: str = "", arena_bytes: int = DEFAULT_ARENA_BYTES,
                 read_timeout_s: float = 5.0, engine: MooncakeEngine | None = None) -> None:
        if isinstance(channel, Connection):
            channel = ConnectionChannel(channel)
        self._owned_engine = MooncakeEngine(hostname, protocol, device_name) if engine is None else None
        try:
            self._mooncake = MooncakeCarrier(engine or self._owned_engine, arena_bytes, read_timeout_s)
        except BaseException:
            if self._owned_engine is not None:
                self._owned_engine.close()
            raise
        super().__init__(layout, _HelloChannel(channel, self._mooncake), self._mooncake, instance_id, clock)

    @property
    def session(self) -> str:
        """host:port of this end's engine, as peers address it."""
        return self._mooncake.engine.session

    def poll(self) -> list[TransferEvent]:
        self._mooncake.reclaim()
        return super().poll()

    def stats(self) -> TransferStats:
        stats = super().stats()
        stats.extra.update({k: v for k, v in self._mooncake.counters.items() if v})
        return stats

    def close(self) -> list[TransferEvent]:
        events = super().close()  # discards our payloads and retires the arena
        if self._owned_engine is not None:
            self._owned_engine.close()
        return events
