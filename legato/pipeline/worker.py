"""One engine worker process: `python -m legato.pipeline.worker '<WorkerSpec JSON>'`.

The worker loads its model on its device, runs a `LocalEngineClient` (the engine on a thread of this
process) and serves it over two ZMQ sockets the server bound: commands arrive on a PULL socket, and
chunks, rejections, voice results, stats and heartbeats leave on a PUSH socket (see `messages.py`); a server
with several front processes binds a pair per front (`front_links.py`). It sends Ready once the engine runs,
and exits on Shutdown or when the process that started it is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import numpy as np
import zmq
import zmq.asyncio

from legato.kv_transfer import EventKind
from legato.pipeline import heap
from legato.pipeline import messages as m
from legato.pipeline.client import SHUTTING_DOWN, HeldText, RequestRejected, StreamChunk
from legato.pipeline.front_links import FrontLinks, front_endpoints, request_id_of
from legato.pipeline.kv_links import KVLinks, KVLinkSpec

log = logging.getLogger("legato.worker")


@dataclass
class WorkerSpec:
    """Everything a worker needs, passed as JSON on its command line."""

    model_path: str
    engine_config: dict  # EngineConfig fields
    name: str
    label: str  # e.g. "abc123-0": instance id and worker index, for logs
    cmd_endpoint: str  # server -> worker (worker connects a PULL socket)
    out_endpoint: str  # worker -> server (worker connects a PUSH socket)
    parent_pid: int
    fronts: int = 1  # the server's front processes; front k > 0 binds the endpoints above suffixed with k
    heartbeat_s: float = 0.5
    torch_threads: int | None = None
    kv: dict | None = None  # process MpNd: this worker's KVLinkSpec fields
    role: str = "engine"  # or "codec": the codec worker of `split` (codec_process.py)
    max_message_bytes: int = m.MAX_MESSAGE_BYTES  # a larger command is dropped (see messages.py)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        return cls(**json.loads(text))


class PassOutbox:
    """Items queued during one event-loop pass, handed over as one list when the pass ends (`send_batch`). A
    worker's thread hands a step's outputs to their streams in one event-loop callback, so every stream's task runs
    before the flush the first of them scheduled: a step costs one message, not one per stream. Items keep their
    order."""

    def __init__(self, send_batch: Callable[[list], None]) -> None:
        self._send_batch = send_batch
        self._items: list = []

    def put(self, item) -> None:
        self.put_all([item])

    def put_all(self, items: list) -> None:
        if not items:
            return
        first = not self._items
        self._items.extend(items)
        if first:
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        """Hands over what is queued now (a message that must follow the queued items calls this first)."""
        if self._items:
            items, self._items = self._items, []
            self._send_batch(items)


class ChunkOutbox(PassOutbox):
    """Streams' chunks of one pass as one message (`Chunks`, or `Chunk` for one); `before_end` makes a message sent
    ahead of a batch in which some request ends (None: nothing); `stamp` sees each batch just before it leaves."""

    def __init__(self, send: Callable[[m.Message], None], before_end: Callable[[], m.Message] | None = None,
                 stamp: Callable[[list[tuple[str, StreamChunk]]], None] | None = None) -> None:
        def send_chunks(chunks: list[tuple[str, StreamChunk]]) -> None:
            if stamp is not None:
                stamp(chunks)
            if before_end is not None and any(c.finished for _, c in chunks):
                send(before_end())
            send(m.Chunk(*chunks[0]) if len(chunks) == 1 else m.Chunks(chunks))

        super().__init__(send_chunks)


class _Worker:
    def __init__(self, spec: WorkerSpec, client, links: FrontLinks | None) -> None:
        self.spec, self.client, self.fronts = spec, client, links
        self.ready: m.Ready | None = None  # what a front that says Hello is answered with
        self.links: KVLinks | None = None
        self.cancelled: set[str] = set()  # aborted while their handoff was held or in transfer
        self.tasks: dict[str, asyncio.Task] = {}
        # Decode worker: the streaming text of armed requests whose handoff has not landed yet, in order.
        self.awaiting_text = HeldText()
        self.stop = asyncio.Event()
        self.grace_s = 0.0
        self.draining = False  # after Shutdown: nothing new is taken, aborts still are
        self.engine_died = False  # the engine thread ended on its own: the worker exits with 1
        # Chunks ending a request leave after fresh Stats: whoever reads a request end must see the blocks it gave
        # back, as `finish` promises.
        self.arrived: dict[str, float] = {}  # perf_counter() when each request's message came, until its first audio
        self.outbox = ChunkOutbox(lambda msg: self.emit(msg), lambda: m.Stats(self.client.stats()),
                                  self.stamp_first_audio)

    async def send(self, msg: m.Message) -> None:
        self.outbox.flush()  # chunks queued before this message leave before it
        await self.fronts.send(msg)

    def send_chunks(self, chunks: list[tuple[str, StreamChunk]]) -> None:
        """A step's chunks of every request `run_request` runs, as the engine thread hands them over; they leave
        in one message with the rest of the event-loop pass."""
        self.outbox.put_all(chunks)

    def stamp_first_audio(self, chunks: list[tuple[str, StreamChunk]]) -> None:
        """Adds `worker` (its message in -> now, as it leaves) to the stages of a request's first audio chunk."""
        now = time.perf_counter()
        for rid, chunk in chunks:
            if chunk.stages is not None and rid in self.arrived:
                chunk.stages["worker"] = now - self.arrived.pop(rid)

    def flush_chunks(self) -> None:
        self.outbox.flush()

    def emit(self, msg: m.Message) -> None:
        """Sends without waiting (a step's chunks, and the stats before a request's end)."""
        self.fronts.emit(msg)

    async def serve(self) -> None:
        beats = asyncio.create_task(self.heartbeat())
        receiving = asyncio.create_task(self.receive_all())
        watching = asyncio.create_task(self.fronts.watch_fronts(self.front_gone))
        await self.stop.wait()
        watching.cancel()
        await drain(self.tasks, self.grace_s, receiving, self.client.stop)  # running requests, handoffs
        if self.links is not None:
            await self.links.close()  # fails transfers still in flight: their tasks send error chunks
        if self.tasks:
            await asyncio.wait(list(self.tasks.values()), timeout=5.0)
        await self.send(m.Stats(self.client.stats()))
        beats.cancel()

    async def front_gone(self, front: int) -> None:
        """Front `front` dropped its link: its requests end here (their audio has no reader), freeing their slots."""
        rids = self.fronts.owned_by(front)
        if rids:
            log.warning("front %d dropped its link: aborting its %d request(s)", front, len(rids))
        for rid in rids:
            await handle_safely(self.handle, m.Abort(rid, "front process gone"), front)

    async def receive_all(self) -> None:
        await asyncio.gather(*(self.receive(cmd, front) for front, cmd in enumerate(self.fronts.cmds)))

    async def receive(self, cmd: zmq.asyncio.Socket, front: int = 0) -> None:
        async for msg in incoming(cmd, self.spec.max_message_bytes):
            await handle_safely(self.handle, msg, front)

    async def handle(self, msg: m.Message, front: int = 0) -> None:
        arrived = time.perf_counter()
        refused = self.fronts.admit(msg, front) if self.fronts is not None else None
        if refused is not None:
            if isinstance(msg, (m.Submit, m.AwaitHandoff, m.ExtractVoice)):
                await self.fronts.send_to(front, m.Rejected(request_id_of(msg), 409, refused))
            else:
                log.warning("dropping a %s from front %d: %s", type(msg).__name__, front, refused)
        elif isinstance(msg, m.Hello):
            await self.fronts.send_to(front, m.Stats(self.client.stats()))  # before Ready, as at start
            if self.ready is not None:
                await self.fronts.send_to(front, self.ready)
        elif self.draining and isinstance(msg, (m.Submit, m.AwaitHandoff, m.ExtractVoice)):
            await self.send(m.Rejected(request_id_of(msg), 503, "the worker is shutting down", code=SHUTTING_DOWN))
        elif isinstance(msg, (m.Submit, m.AwaitHandoff)) and request_id_of(msg) in self.tasks:
            # Its id's earlier request is still ending here: a second task under one id would lose the first.
            await self.send(m.Rejected(request_id_of(msg), 409, f"request id {request_id_of(msg)!r} is still "
                                                                 "ending on its worker; retry it shortly"))
        elif isinstance(msg, m.Submit):
            req = msg.request
            if req.handoff_to is not None:
                job = self.prefill_and_send(req) if self.links is not None else self.no_links(req.request_id)
            else:  # asked for now: an open text's next message may be its first AppendText
                self.arrived[req.request_id] = arrived
                job = self.run_request(req.request_id, self.client.generate_into(req, self.send_chunks))
            self.tasks[req.request_id] = asyncio.create_task(job)
        elif isinstance(msg, m.AwaitHandoff):
            if self.links is not None:
                self.awaiting_text.hold(msg.request_id)  # its text, until the handoff lands
                job = self.receive_and_decode(msg)
            else:
                job = self.no_links(msg.request_id)
            self.tasks[msg.request_id] = asyncio.create_task(job)
        elif isinstance(msg, m.Abort):
            rid = msg.request_id
            if self.links is not None and rid in self.tasks:
                self.cancelled.add(rid)
                peer = self.links.pending(rid)
                if peer is not None:
                    self.links.cancel(peer, rid, msg.reason)
            await self.client.abort(rid, msg.reason)
        elif isinstance(msg, m.AppendText):
            if not await self.awaiting_text.append(msg.request_id, msg.text, msg.close):
                await self.client.append_text(msg.request_id, msg.text, msg.close)
        elif isinstance(msg, m.ExtractVoice):
            asyncio.create_task(self.voice(msg))
        elif isinstance(msg, m.Shutdown):
            log.info("shutdown requested (grace %.1f s)", msg.grace_s)
            self.grace_s, self.draining = msg.grace_s, True
            self.stop.set()
        else:
            log.error("dropping a %s: not a server -> worker message", type(msg).__name__)

    async def finish(self, rid: str, chunk: StreamChunk) -> None:
        """A request's last chunk, after the Stats that no longer count it: the server reads them in order, so
        whoever sees a request end sees the blocks it gave back (not those of the last heartbeat)."""
        await self.send(m.Stats(self.client.stats()))
        await self.send(m.Chunk(rid, chunk))

    async def run_request(self, rid: str, run) -> None:
        """A request decoded here (`run`: `generate_into` or `generate_from_handoff_into`): its chunks go straight
        from the engine thread's hand-over into the outbox, with no task wake-up per chunk."""
        try:
            await run
        except RequestRejected as e:
            await self.send(m.Rejected(rid, e.status, e.message, e.retry_after, e.code))
            await self.send(m.Stats(self.client.stats()))  # blocks may have come back all the same
        except Exception as e:  # a failure here fails this request, with a reason, not the worker
            log.exception("running %s failed", rid)
            await self.finish(rid, _end("error", f"worker error: {e}"))
        finally:
            if self.tasks.get(rid) is asyncio.current_task():  # not a later request's under the same id
                del self.tasks[rid]
                self.cancelled.discard(rid)
                self.arrived.pop(rid, None)

    async def prefill_and_send(self, req) -> None:
        """Prefill worker: run the prefill, then move the handoff over the KV link to decode worker
        `req.handoff_to`; the server hears "handoff" once the peer has it, or why it failed."""
        rid, peer = req.request_id, req.handoff_to
        final: StreamChunk | None = None
        # An earlier request under this id that the decode side gave up before its send left that on the link:
        # it is not this request's (whose own decline, if one comes, arrives from here on).
        self.links.forget_unsent(peer, rid)
        sent = False
        try:
            async with contextlib.aclosing(self.client.generate(dataclasses.replace(req, handoff_only=True))) as cs:
                async for chunk in cs:
                    final = chunk if chunk.finished else final
            if final is None or final.finish_reason != "handoff" or final.handoff is None:
                await self.finish(rid, final or _end("error", "prefill ended without a handoff"))
                return
            if self.links.spec.send_delay_s > 0 and rid.startswith(self.links.spec.delay_prefix):
                # Fault injection: the lines let a test act while the handoff is held, and after, without
                # guessing how long a busy machine takes to get there.
                log.info("holding the handoff of %s for %.1f s (injected send delay)", rid,
                         self.links.spec.send_delay_s)
                await asyncio.sleep(self.links.spec.send_delay_s)
                log.info("releasing the handoff of %s", rid)
            if rid in self.cancelled:
                await self.finish(rid, _end("abort", "aborted before its handoff was sent"))
                return
            sent = True
            ev = await self.links.send(peer, final.handoff)
            if ev.kind is EventKind.SENT:
                await self.finish(rid, dataclasses.replace(final, handoff=None))
            else:
                await self.finish(rid, self._transfer_failed(rid, f"to decode worker {peer}", ev))
        except RequestRejected as e:
            await self.send(m.Rejected(rid, e.status, e.message, e.retry_after, e.code))
            await self.send(m.Stats(self.client.stats()))
        except Exception as e:
            log.exception("prefill of %s failed", rid)
            await self.finish(rid, _end("error", f"worker error: {e}"))
        finally:
            if not sent:  # ended before its send (aborted, failed): a decline for it has nothing left to stop
                self.links.forget_unsent(peer, rid)
            self.tasks.pop(rid, None)
            self.cancelled.discard(rid)

    async def receive_and_decode(self, msg: m.AwaitHandoff) -> None:
        """Decode worker: wait (bounded) for the handoff from prefill worker `msg.peer`, then decode it."""
        rid = msg.request_id
        try:
            ev = await self.links.receive(msg.peer, rid, msg.deadline_s)
        except ValueError as e:  # the same id armed twice: refuse this one
            ev, refused = None, m.Rejected(rid, 400, str(e))
        if ev is not None and ev.kind is EventKind.RECEIVED and rid not in self.cancelled:
            # An open text's appends are taken from this call on.
            run = self.client.generate_from_handoff_into(ev.handoff, self.send_chunks)
            await self.awaiting_text.hand_on(rid, self.client)
            self.awaiting_text.forget(rid)  # from here on text goes to the client, as for any request
            await self.run_request(rid, run)  # cleans up after itself
            return
        self.awaiting_text.forget(rid)
        if ev is None:
            out = refused
        elif ev.kind is EventKind.RECEIVED:  # aborted while the handoff was landing
            out = m.Chunk(rid, _end("abort", "aborted"))
        else:
            out = m.Chunk(rid, self._transfer_failed(rid, f"from prefill worker {msg.peer}", ev))
        self.tasks.pop(rid, None)
        self.cancelled.discard(rid)
        await self.send(out)

    async def no_links(self, rid: str) -> None:
        self.tasks.pop(rid, None)
        await self.send(m.Rejected(rid, 500, "this worker has no KV links: it is not part of an MpNd deployment"))

    def _transfer_failed(self, rid: str, where: str, ev) -> StreamChunk:
        """The last chunk of a request whose handoff did not cross: "abort" if we were told to drop it."""
        how = "abort" if rid in self.cancelled else "error"
        end = _end(how, f"KV transfer {where} failed: {ev.reason.value if ev.reason else ''} {ev.detail}".strip())
        return dataclasses.replace(end, retryable=how == "error")

    def link_changed(self, peer: int, state, error: str | None, counters: dict) -> None:
        asyncio.get_running_loop().create_task(self.send(m.LinkStatus(peer, state.value, error, counters)))

    async def voice(self, msg: m.ExtractVoice) -> None:
        try:
            v = await self.client.extract_voice(msg.samples, msg.sample_rate)
        except RequestRejected as e:
            await self.send(m.Rejected(msg.request_id, e.status, e.message, e.retry_after, e.code))
        except Exception as e:  # unanswered, the server's call would wait forever
            log.exception("voice extraction %s failed", msg.request_id)
            await self.send(m.Rejected(msg.request_id, 500, f"worker error: {e}"))
        else:
            await self.send(m.VoiceResult(msg.request_id, v.speaker_embedding.numpy(), v.ref_code.numpy()))

    async def heartbeat(self) -> None:
        await heartbeats(self.spec, self.send, self.client.stats, self.stop,
                         self.links.report_all if self.links is not None else None, self.engine_running)

    def engine_running(self) -> bool:
        """False once the engine thread has ended on its own (crashed): the worker then exits, so the server sees
        it down (its /health 503, its requests refused) instead of a live process whose engine is gone."""
        if self.draining or self.client.is_alive():
            return True
        self.engine_died = True
        return False


async def run(spec: WorkerSpec) -> int:
    import torch

    from legato.engine.config import EngineConfig
    from legato.models.qwen3_tts.loader import load_model
    from legato.pipeline.local import LocalEngineClient

    if spec.torch_threads:
        torch.set_num_threads(spec.torch_threads)
    ctx = zmq.asyncio.Context()
    base = (spec.cmd_endpoint, spec.out_endpoint)
    fronts = FrontLinks(ctx, [front_endpoints(base, k) for k in range(spec.fronts)],
                        receive_limit(spec.max_message_bytes))
    try:
        config = EngineConfig(**spec.engine_config)
        if spec.role == "codec":
            from legato.pipeline.codec_process import serve_codec

            await serve_codec(spec, config, fronts.outs[0], fronts.cmds[0])
            return 0
        loaded = load_model(spec.model_path, device=config.device, dtype=getattr(torch, config.dtype))
        client = LocalEngineClient(loaded, config, name=spec.name)
        await client.start()
        if config.device.startswith("cuda"):
            # Warmed up: what the load and the warm-up left is never walked by a full collection again. Only in a
            # worker process, whose one engine lives as long as it does; a process that makes engine after engine
            # (a test run, a benchmark of variants) would keep a dropped engine's cycles, and its GPU memory.
            heap.freeze_heap()
        worker = _Worker(spec, client, fronts)
        if spec.kv is not None:
            worker.links = KVLinks(KVLinkSpec(**spec.kv), client.engine.kv_layout, worker.link_changed,
                                   device=config.device)
            worker.links.start()
        # Stats before Ready: the server serves once it reads Ready, and must not serve the stats it assumed.
        await worker.send(m.Stats(client.stats()))
        worker.ready = m.Ready(client.info, os.getpid(), dict(loaded.generation_defaults))
        await worker.send(worker.ready)
        log.info("ready: %s on %s", spec.model_path, config.device)
        await worker.serve()
        return 1 if worker.engine_died else 0
    finally:
        fronts.close()
        ctx.term()


async def incoming(cmd: zmq.asyncio.Socket, max_bytes: int = m.MAX_MESSAGE_BYTES) -> AsyncIterator[m.Message]:
    """The messages arriving on `cmd`; a malformed one is logged and dropped."""
    while True:
        frames = await cmd.recv_multipart()
        try:
            msg = m.decode(frames, max_bytes)
        except m.MessageError as e:
            log.error("dropping a malformed message: %s", e)
            continue
        except Exception:  # a decoder bug must cost one message, never the command loop
            log.exception("dropping a message that could not be decoded")
            continue
        yield msg


async def handle_safely(handle, msg: m.Message, *args) -> None:
    """`await handle(msg, *args)`, where a failure is logged and costs that one message, not the command loop
    (whose end would leave the worker heart-beating but deaf)."""
    try:
        await handle(msg, *args)
    except Exception:
        log.exception("dropping a %s: handling it failed", type(msg).__name__)


def receive_limit(max_message_bytes: int) -> int:
    """ZMQ's MAXMSGSIZE for a receiving socket: far above the decoder's limit, so a frame just over it is still
    received and dropped with a log line, while a far larger one never is (libzmq drops its connection)."""
    return 2 * max_message_bytes + 2**20


async def drain(tasks: dict[str, asyncio.Task], grace_s: float, receiving: asyncio.Task, stop_engine) -> None:
    """A worker's shutdown, in order: what it holds (`tasks`) ends on its own within the grace while aborts are
    still heard; then `receiving` stops and `stop_engine(what is left of the grace)` aborts the rest, whose
    last chunks still go out."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    if tasks and grace_s > 0:
        await asyncio.wait(list(tasks.values()), timeout=grace_s)
    receiving.cancel()
    await stop_engine(max(0.0, deadline - loop.time()))


async def heartbeats(spec: WorkerSpec, send, stats, stop: asyncio.Event, each_beat=None, alive=None) -> None:
    """Every `spec.heartbeat_s`: a Heartbeat and the worker's Stats (`stats()`), until the process that
    started this worker is gone, or `alive()` says the worker's engine is, either of which sets `stop`."""
    seq = 0
    while True:
        if os.getppid() != spec.parent_pid:  # orphaned: nobody reads our output any more
            log.error("parent process %d is gone; exiting", spec.parent_pid)
            stop.set()
            return
        if alive is not None and not alive():
            log.error("the engine thread has ended (see above); exiting so that the server sees this worker down")
            stop.set()
            return
        seq += 1
        await send(m.Heartbeat(seq))
        await send(m.Stats(stats()))
        if each_beat is not None:
            each_beat()
        await asyncio.sleep(spec.heartbeat_s)


def _end(reason: str, error: str) -> StreamChunk:
    return StreamChunk(np.zeros(0, np.float32), 0, finished=True, finish_reason=reason, error=error)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m legato.pipeline.worker '<WorkerSpec JSON>'", file=sys.stderr)
        return 2
    spec = WorkerSpec.from_json(argv[0])
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s worker[{spec.label}] %(levelname)s %(name)s: %(message)s")
    try:
        return asyncio.run(run(spec))
    except Exception:
        log.exception("worker failed")
        return 1


if __name__ == "__main__":
    sys.exit(main())
