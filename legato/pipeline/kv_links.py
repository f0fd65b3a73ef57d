"""The KV links of one worker of a process `MpNd` deployment: one `KVConnector` per worker of the other role.

Decode worker j listens on a Unix socket named from the deployment's instance id; every prefill worker
connects to every decode worker and opens with a one-line preamble naming its index. Connecting, accepting
and the preamble run on a background thread with a deadline, never on the event loop or the engine thread;
the resulting connections are handed to the event loop, which builds a connector per link (the backend
chosen by name: `shm` by default, `mooncake`) and then owns it: connectors are not thread-safe, so every
call into them, `poll` included, happens on the event loop (`pump`).

Handoffs are the connector's business (deadlines, cancel, late and duplicate messages); this module only
maps "send this handoff to decode worker d" and "expect a handoff for request r from prefill worker p"
onto futures the worker awaits, and reports each link's state so the server can refuse a deployment whose
links failed their handshake (e.g. a KV layout mismatch).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

from legato.kv_transfer import (
    CancelResult,
    EventKind,
    FailReason,
    Handoff,
    KVConnector,
    KVLayout,
    LinkState,
    TransferEvent,
    get_backend,
)
from legato.pipeline import ipc
from legato.pipeline.ipc import socket_address

log = logging.getLogger(__name__)


@dataclass
class KVLinkSpec:
    """How one worker joins the links of its deployment (travels as JSON in the WorkerSpec)."""

    role: str  # "prefill" | "decode"
    index: int  # this worker's index among the workers of its role
    peers: int  # how many workers the other role has
    instance_id: str  # the deployment's: names sockets and shared memory
    backend: str = "shm"
    transfer_timeout_s: float = 10.0  # sender side: from send to the peer's ack
    connect_timeout_s: float = 120.0  # prefill side: decode workers may still be loading
    send_delay_s: float = 0.0  # fault injection for tests: hold handoffs this long before sending them,
    delay_prefix: str = ""  # ... those whose request id starts with this
    # Across hosts (the Ray launcher fills these in): a decode worker listens on `listen` ("tcp://host:port")
    # instead of its Unix socket, a prefill worker dials `peer_addresses[d]` for decode worker d ("" = the
    # Unix socket), and `host` is where peers reach this worker's mooncake engine.
    listen: str = ""
    peer_addresses: list[str] = dataclasses.field(default_factory=list)
    host: str = "127.0.0.1"
    # Per peer, the backend of that link ("" = `backend`): `backend="auto"` under the Ray launcher makes
    # links within a node shm and links between nodes mooncake; both ends of a link are given the same.
    peer_backends: list[str] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"KV link role must be 'prefill' or 'decode', got {self.role!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def choose_backend(requested: str, device: str, peer_device: str, same_host: bool = True) -> str:
    """The backend of one KV link between a worker on `device` and its peer on `peer_device`. A named backend
    is itself; `auto` is cuda_ipc between two CUDA devices of one host (0.76 ms for a 16.5 MB handoff on the
    H200 against 21.4 ms through shm: the KV never leaves the GPU), shm for any other pair on one host, and
    mooncake between hosts. Our local launcher shows every worker every GPU, which CUDA IPC needs; the Ray
    launcher, whose actors each see only their own, keeps shm within a node (`ray_launcher.link`)."""
    if requested != "auto":
        return requested
    if not same_host:
        return "mooncake"
    on_gpu = str(device).startswith("cuda") and str(peer_device).startswith("cuda")
    return "cuda_ipc" if on_gpu else "shm"


def socket_path(instance_id: str, decode_index: int) -> str:
    """The address of decode worker `decode_index`'s KV-link listener (abstract on Linux: see ipc.py)."""
    return socket_address(instance_id, f"kv{decode_index}")


def tcp_host_port(address: str) -> tuple[str, int]:
    """("host", port) of a "tcp://host:port" address."""
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"not a tcp://host:port address: {address!r}")
    return host, int(port)


class KVLinks:
    """The links of one worker. Create and use on the worker's event loop; `start` spawns the socket thread."""

    def __init__(self, spec: KVLinkSpec, layout: KVLayout,
                 on_state: Callable[[int, LinkState, str | None, dict], None] | None = None,
                 device: str = "cpu") -> None:
        self.spec = spec
        self.layout = layout
        self.device = device  # this worker's engine device (cuda_ipc lands handoffs there)
        self.connectors: dict[int, KVConnector] = {}
        self._on_state = on_state
        self._reported: dict[int, LinkState] = {}
        self._connect_errors: dict[int, str] = {}
        self._arrivals: queue.SimpleQueue = queue.SimpleQueue()  # (peer, Connection | error str), from the thread
        self._waiting: dict[tuple[int, str], asyncio.Future] = {}
        self._closed = threading.Event()
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._pump: asyncio.Task | None = None

    @property
    def name(self) -> str:
        return f"{self.spec.instance_id}-{self.spec.role[0]}{self.spec.index}"

    # --- life cycle -----------------------------------------------------------------------------------

    def start(self) -> None:
        if self.spec.role == "decode" and self.spec.listen:
            self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind(tcp_host_port(self.spec.listen))
        elif self.spec.role == "decode":
            path = socket_path(self.spec.instance_id, self.spec.index)
            ipc.remove(path)
            self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._listener.bind(path)
        if self.spec.role == "decode":
            self._listener.listen(max(8, self.spec.peers))
            self._listener.settimeout(0.2)
            target = self._accept_loop
        else:
            target = self._connect_all
        self._thread = threading.Thread(target=target, name=f"kv-links-{self.name}", daemon=True)
        self._thread.start()
        self._pump = asyncio.get_running_loop().create_task(self._pump_loop())

    async def close(self) -> None:
        self._closed.set()
        if self._pump is not None:
            self._pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pump
        for peer, conn in list(self.connectors.items()):
            self._dispatch(peer, conn.close())
        if self._listener is not None:
            self._listener.close()
            if not self.spec.listen:
                ipc.remove(socket_path(self.spec.instance_id, self.spec.index))
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_result(TransferEvent("", EventKind.FAILED, FailReason.CLOSED, "worker closing"))
        self._waiting.clear()

    # --- transfers (event loop) -----------------------------------------------------------------------

    def send(self, peer: int, handoff: Handoff) -> asyncio.Future:
        """Starts moving `handoff` to decode worker `peer`; the future resolves to its SENT or FAILED event."""
        return self._start(peer, handoff.request_id,
                           lambda c: c.send(handoff, self.spec.transfer_timeout_s))

    def receive(self, peer: int, request_id: str, deadline_s: float) -> asyncio.Future:
        """Arms the link from prefill worker `peer`; the future resolves to a RECEIVED or FAILED event."""
        return self._start(peer, request_id, lambda c: c.receive(request_id, deadline_s))

    def cancel(self, peer: int, request_id: str, reason: str = "cancelled") -> CancelResult:
        """Abandons a transfer (tells the peer); its future resolves to FAILED with `reason`."""
        fut = self._waiting.pop((peer, request_id), None)
        conn = self.connectors.get(peer)
        result = conn.cancel(request_id, reason) if conn is not None else CancelResult.NOT_FOUND
        if fut is not None and not fut.done():
            fut.set_result(TransferEvent(request_id, EventKind.FAILED, FailReason.PEER_CANCELLED, reason))
        return result

    def forget_unsent(self, peer: int, request_id: str) -> None:
        """What the link to `peer` remembers of an outgoing `request_id` given up before its send (see
        `KVConnector.forget_unsent`): called when a prefill of that id starts and when it ends unsent."""
        conn = self.connectors.get(peer)
        if conn is not None:
            conn.forget_unsent(request_id)

    def backend_of(self, peer: int) -> str:
        named = self.spec.peer_backends[peer] if peer < len(self.spec.peer_backends) else ""
        return named or ("shm" if self.spec.backend == "auto" else self.spec.backend)

    def pending(self, request_id: str) -> int | None:
        """The peer of `request_id`'s transfer in flight, or None."""
        return next((p for (p, rid) in self._waiting if rid == request_id), None)

    def states(self) -> dict[int, tuple[LinkState, str | None]]:
        out = {}
        for peer in range(self.spec.peers):
            conn = self.connectors.get(peer)
            if conn is not None:
                out[peer] = (conn.link_state, conn.link_error)
            elif peer in self._connect_errors:
                out[peer] = (LinkState.FAILED, self._connect_errors[peer])
            else:
                out[peer] = (LinkState.NOT_READY, None)
        return out

    def counters(self, peer: int) -> dict[str, int]:
        conn = self.connectors.get(peer)
        if conn is None:
            return {}
        st = conn.stats()
        return {**{k: v for k, v in dataclasses.asdict(st).items() if isinstance(v, int)}, **st.extra}

    def report_all(self) -> None:
        """Reports every link's state again (the server may have missed one while it was starting)."""
        if self._on_state is not None:
            for peer, (state, error) in self.states().items():
                self._on_state(peer, state, error, self.counters(peer))

    def _start(self, peer: int, request_id: str, begin: Callable[[KVConnector], None]) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        conn = self.connectors.get(peer)
        if not 0 <= peer < self.spec.peers:
            fut.set_result(TransferEvent(request_id, EventKind.FAILED, FailReason.PEER_NOT_READY,
                                         f"no worker {peer} on the other side of this deployment"))
            return fut
        if conn is None:
            why = self._connect_errors.get(peer, "the KV link has not connected yet")
            fut.set_result(TransferEvent(request_id, EventKind.FAILED, FailReason.PEER_NOT_READY, why))
            return fut
        if (peer, request_id) in self._waiting:
            raise ValueError(f"request {request_id!r} already has a transfer in flight with worker {peer}")
        self._waiting[(peer, request_id)] = fut
        try:
            begin(conn)
        except ValueError as e:  # e.g. a handoff of another layout: fail this request, not the worker
            self._waiting.pop((peer, request_id), None)
            fut.set_result(TransferEvent(request_id, EventKind.FAILED, FailReason.LAYOUT_MISMATCH, str(e)))
        return fut

    # --- event loop: connectors ------------------------------------------------------------------------

    async def _pump_loop(self) -> None:
        while True:
            while True:
                try:
                    peer, conn = self._arrivals.get_nowait()
                except queue.Empty:
                    break
                self._adopt(peer, conn)
            for peer, c in list(self.connectors.items()):
                try:
                    events = c.poll()
                except Exception:  # a connector bug must not stop the other links or the worker
                    log.exception("KV link to worker %d failed while polling", peer)
                    events = c.close()
                self._dispatch(peer, events)
            self._report_changes()
            await asyncio.sleep(0.0005 if self._waiting else 0.005)

    def _adopt(self, peer: int, conn: Connection | str) -> None:
        if isinstance(conn, str):
            self._connect_errors[peer] = conn
            log.error("KV link %s <-> worker %d: %s", self.name, peer, conn)
            return
        if peer in self.connectors:
            log.error("KV link %s: a second connection from worker %d; dropping it", self.name, peer)
            conn.close()
            return
        backend = self.backend_of(peer)
        extra = {"mooncake": {"hostname": self.spec.host}, "cuda_ipc": {"device": self.device}}.get(backend, {})
        try:
            self.connectors[peer] = get_backend(backend)(self.layout, conn, f"{self.name}.{peer}", **extra)
        except Exception as e:  # e.g. a backend this process cannot run: this link fails, not the worker
            conn.close()
            self._adopt(peer, f"cannot open a {backend} link: {e}")

    def _dispatch(self, peer: int, events: list[TransferEvent]) -> None:
        for ev in events:
            fut = self._waiting.pop((peer, ev.request_id), None)
            if fut is None:
                if ev.kind is not EventKind.RELEASED:
                    log.info("KV link %s: %s for %s after it was given up", self.name, ev.kind.value, ev.request_id)
                continue
            if not fut.done():
                fut.set_result(ev)

    def _report_changes(self) -> None:
        for peer, (state, error) in self.states().items():
            if self._reported.get(peer) is not state:
                self._reported[peer] = state
                conn = self.connectors.get(peer)
                if state is LinkState.FAILED and conn is not None and conn.closed_by_peer:
                    log.info("KV link %s <-> worker %d closed by the peer (its shutdown)", self.name, peer)
                elif state is LinkState.FAILED:
                    log.error("KV link %s <-> worker %d failed: %s", self.name, peer, error)
                elif state is LinkState.READY:
                    log.info("KV link %s <-> worker %d ready (%s)", self.name, peer, self.backend_of(peer))
                if self._on_state is not None:
                    self._on_state(peer, state, error, self.counters(peer))

    # --- socket thread --------------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # the listener was closed
            sock.settimeout(None)
            conn = Connection(sock.detach())
            try:
                if not conn.poll(10.0):
                    raise ValueError("no preamble within 10 s")
                hello = json.loads(conn.recv_bytes(4096))
                peer = hello["prefill"]
                if not isinstance(peer, int) or not 0 <= peer < self.spec.peers:
                    raise ValueError(f"preamble names prefill worker {peer!r}")
            except (OSError, EOFError, ValueError, KeyError, TypeError) as e:
                log.error("KV link %s: refused a connection: %s", self.name, e)
                conn.close()
                continue
            self._arrivals.put((peer, conn))

    def _connect_all(self) -> None:
        deadline = time.monotonic() + self.spec.connect_timeout_s
        todo = set(range(self.spec.peers))
        while todo and not self._closed.is_set():
            for peer in sorted(todo):
                address = self.spec.peer_addresses[peer] if peer < len(self.spec.peer_addresses) else ""
                sock = socket.socket(socket.AF_INET if address else socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    sock.connect(tcp_host_port(address) if address else socket_path(self.spec.instance_id, peer))
                except OSError:
                    sock.close()
                    continue
                conn = Connection(sock.detach())
                conn.send_bytes(json.dumps({"prefill": self.spec.index}).encode())
                self._arrivals.put((peer, conn))
                todo.discard(peer)
            if todo and time.monotonic() > deadline:
                for peer in todo:
                    self._arrivals.put((peer, f"decode worker {peer} did not accept a KV link within "
                                              f"{self.spec.connect_timeout_s:.0f} s"))
                return
            if todo:
                self._closed.wait(0.05)
