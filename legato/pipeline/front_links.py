"""A worker's links to its server's front processes (`legato serve --fronts N`).

One HTTP front process tops out near a millisecond of CPU per streamed request, so past a few hundred streams a
server runs several fronts on one port. Each front binds its own pair of sockets to each worker (commands in,
everything else out, as `ipc.py` names them); the worker connects to all of them. A request's answers (chunks,
its rejection, a voice result) go back over the link its opening message came in on; what every front needs
(Stats, Heartbeat, Ready, LinkStatus) goes to all. With one front this is the single pair it always was.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from legato.pipeline import messages as m

log = logging.getLogger("legato.worker")

_OPENINGS = (m.Submit, m.AwaitHandoff, m.ExtractVoice)  # messages that start something answered later
_ANSWERS = (m.Chunk, m.Rejected, m.VoiceResult)  # messages answering one request


def front_endpoints(base: tuple[str, str], front: int) -> tuple[str, str]:
    """The (command, output) endpoints of front `front`, from front 0's: the same names, suffixed."""
    return base if front == 0 else (f"{base[0]}{front}", f"{base[1]}{front}")


def request_id_of(msg: m.Message) -> str | None:
    """The request (or voice call) a message is about; None for one about the whole worker."""
    return msg.request.request_id if isinstance(msg, m.Submit) else getattr(msg, "request_id", None)



def emit(out: zmq.asyncio.Socket, msg: m.Message) -> None:
    """Sends without waiting (the socket keeps sends in order); a failure still reaches the log."""

    def check(f: asyncio.Future) -> None:
        if not f.cancelled() and f.exception() is not None:
            log.error("sending a %s failed: %s", type(msg).__name__, f.exception())

    out.send_multipart(m.encode(msg)).add_done_callback(check)

class FrontLinks:
    """The worker's (cmd, out) socket pairs, one per front, and which front each live request came from."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoints: list[tuple[str, str]], receive_limit: int) -> None:
        self.cmds: list[zmq.asyncio.Socket] = []
        self.outs: list[zmq.asyncio.Socket] = []
        for cmd_endpoint, out_endpoint in endpoints:
            out, cmd = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
            out.setsockopt(zmq.LINGER, 2000)  # let the last chunks reach the server after Shutdown
            cmd.setsockopt(zmq.LINGER, 0)
            cmd.setsockopt(zmq.MAXMSGSIZE, receive_limit)
            out.connect(out_endpoint)
            cmd.connect(cmd_endpoint)
            self.outs.append(out)
            self.cmds.append(cmd)
        self.origin: dict[str, int] = {}  # request (or voice call) id -> the front it came from; several fronts only

    @property
    def count(self) -> int:
        return len(self.outs)

    def admit(self, msg: m.Message, front: int) -> str | None:
        """Whether a message from `front` may be handled: None if so, else why not. An opening claims its id for
        that front (an id another front's request holds is refused); a message about a request another front
        opened is not this front's to send."""
        if self.count == 1:
            return None
        rid = request_id_of(msg)
        if rid is None:
            return None
        owner = self.origin.get(rid)
        if isinstance(msg, _OPENINGS):
            if owner is not None:
                return f"request id {rid!r} is already in flight"
            self.origin[rid] = front
            return None
        return None if owner in (None, front) else "not this front's request"

    def route(self, msg: m.Message) -> list[tuple[int, m.Message]]:
        """Where `msg` goes: its request's front for an answer (the last one ends the claim), every front for the
        rest. A step's Chunks split by front, each front's in their order."""
        if self.count == 1:
            return [(0, msg)]
        if isinstance(msg, m.Chunks):
            by_front: dict[int, list] = {}
            for rid, chunk in msg.chunks:
                by_front.setdefault(self._front_of(rid, chunk.finished), []).append((rid, chunk))
            return [(f, m.Chunk(*items[0]) if len(items) == 1 else m.Chunks(items)) for f, items in by_front.items()]
        if isinstance(msg, _ANSWERS):
            ends = not isinstance(msg, m.Chunk) or msg.chunk.finished
            return [(self._front_of(msg.request_id, ends), msg)]
        return [(f, msg) for f in range(self.count)]

    def _front_of(self, rid: str, ends: bool) -> int:
        return (self.origin.pop if ends else self.origin.get)(rid, 0)

    async def send(self, msg: m.Message) -> None:
        for front, part in self.route(msg):
            await self.outs[front].send_multipart(m.encode(part))

    async def send_to(self, front: int, msg: m.Message) -> None:
        await self.outs[front].send_multipart(m.encode(msg))

    def emit(self, msg: m.Message) -> None:
        """Sends without waiting (each socket keeps its sends in order); a failure still reaches the log."""
        for front, part in self.route(msg):
            emit(self.outs[front], part)

    def owned_by(self, front: int) -> list[str]:
        return [rid for rid, f in self.origin.items() if f == front]

    async def watch_fronts(self, gone: Callable[[int], Awaitable[None]]) -> None:
        """Calls `gone(k)` each time front k > 0 drops its link (its process died or stopped): nobody reads its
        requests' audio any more. Front 0 gone is the worker's own end (heartbeats() sees its parent go)."""
        if self.count == 1:
            return
        monitors = [self.outs[k].get_monitor_socket(zmq.EVENT_DISCONNECTED) for k in range(1, self.count)]

        async def watch(front: int, mon: zmq.asyncio.Socket) -> None:
            try:
                while True:
                    event = parse_monitor_message(await mon.recv_multipart())
                    if event["event"] == zmq.EVENT_DISCONNECTED:
                        await gone(front)
            finally:
                mon.close()

        await asyncio.gather(*(watch(k, mon) for k, mon in enumerate(monitors, start=1)))

    def close(self) -> None:
        for sock in (*self.cmds, *self.outs):
            sock.close()
