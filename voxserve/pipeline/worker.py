"""One engine worker process: `python -m voxserve.pipeline.worker '<WorkerSpec JSON>'`.

The worker loads its model on its device, runs a `LocalEngineClient` (the engine on a thread of this
process) and serves it over two ZMQ sockets the server bound: commands arrive on a PULL socket, and
chunks, rejections, voice results, stats and heartbeats leave on a PUSH socket (see `messages.py`). It
sends Ready once the engine runs, and exits on Shutdown or when the process that started it is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import sys
from dataclasses import dataclass

import numpy as np
import zmq
import zmq.asyncio

from voxserve.pipeline import messages as m
from voxserve.pipeline.client import RequestRejected, StreamChunk

log = logging.getLogger("voxserve.worker")


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
    heartbeat_s: float = 0.5
    torch_threads: int | None = None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        return cls(**json.loads(text))


class _Worker:
    def __init__(self, spec: WorkerSpec, client, out: zmq.asyncio.Socket) -> None:
        self.spec, self.client, self.out = spec, client, out
        self.tasks: dict[str, asyncio.Task] = {}
        self.stop = asyncio.Event()
        self.grace_s = 0.0

    async def send(self, msg: m.Message) -> None:
        await self.out.send_multipart(m.encode(msg))

    async def serve(self, cmd: zmq.asyncio.Socket) -> None:
        beats = asyncio.create_task(self.heartbeat())
        receiving = asyncio.create_task(self.receive(cmd))
        await self.stop.wait()
        receiving.cancel()
        await self.client.stop(self.grace_s)  # aborts what is left after the grace: their last chunks go out
        if self.tasks:
            await asyncio.wait(list(self.tasks.values()), timeout=5.0)
        await self.send(m.Stats(self.client.stats()))
        beats.cancel()

    async def receive(self, cmd: zmq.asyncio.Socket) -> None:
        while True:
            frames = await cmd.recv_multipart()
            try:
                msg = m.decode(frames)
            except m.MessageError as e:
                log.error("dropping a malformed message: %s", e)
                continue
            if isinstance(msg, m.Submit):
                rid = msg.request.request_id
                self.tasks[rid] = asyncio.create_task(self.stream(msg.request))
            elif isinstance(msg, m.Abort):
                await self.client.abort(msg.request_id, msg.reason)
            elif isinstance(msg, m.ExtractVoice):
                asyncio.create_task(self.voice(msg))
            elif isinstance(msg, m.Shutdown):
                log.info("shutdown requested (grace %.1f s)", msg.grace_s)
                self.grace_s = msg.grace_s
                self.stop.set()
                return
            else:
                log.error("dropping a %s: not a server -> worker message", type(msg).__name__)

    async def stream(self, req) -> None:
        rid = req.request_id
        try:
            async with contextlib.aclosing(self.client.generate(req)) as chunks:
                async for chunk in chunks:
                    await self.send(m.Chunk(rid, chunk))
        except RequestRejected as e:
            await self.send(m.Rejected(rid, e.status, e.message, e.retry_after))
        except Exception as e:  # a failure here fails this request, with a reason, not the worker
            log.exception("streaming %s failed", rid)
            await self.send(m.Chunk(rid, StreamChunk(np.zeros(0, np.float32), 0, finished=True,
                                                     finish_reason="error", error=f"worker error: {e}")))
        finally:
            self.tasks.pop(rid, None)
        await self.send(m.Stats(self.client.stats()))  # blocks came back: say so without waiting for a beat

    async def voice(self, msg: m.ExtractVoice) -> None:
        try:
            v = await self.client.extract_voice(msg.samples, msg.sample_rate)
        except RequestRejected as e:
            await self.send(m.Rejected(msg.request_id, e.status, e.message, e.retry_after))
        else:
            await self.send(m.VoiceResult(msg.request_id, v.speaker_embedding.numpy(), v.ref_code.numpy()))

    async def heartbeat(self) -> None:
        seq = 0
        while True:
            if os.getppid() != self.spec.parent_pid:  # orphaned: nobody reads our output any more
                log.error("parent process %d is gone; exiting", self.spec.parent_pid)
                self.stop.set()
                return
            seq += 1
            await self.send(m.Heartbeat(seq))
            await self.send(m.Stats(self.client.stats()))
            await asyncio.sleep(self.spec.heartbeat_s)


async def run(spec: WorkerSpec) -> int:
    import torch

    from voxserve.engine.config import EngineConfig
    from voxserve.models.qwen3_tts.loader import load_model
    from voxserve.pipeline.local import LocalEngineClient

    if spec.torch_threads:
        torch.set_num_threads(spec.torch_threads)
    ctx = zmq.asyncio.Context()
    out = ctx.socket(zmq.PUSH)
    cmd = ctx.socket(zmq.PULL)
    out.setsockopt(zmq.LINGER, 2000)  # let the last chunks reach the server after Shutdown
    cmd.setsockopt(zmq.LINGER, 0)
    out.connect(spec.out_endpoint)
    cmd.connect(spec.cmd_endpoint)
    try:
        config = EngineConfig(**spec.engine_config)
        loaded = load_model(spec.model_path, device=config.device, dtype=getattr(torch, config.dtype),
                            codec_dtype=getattr(torch, config.codec_dtype))
        client = LocalEngineClient(loaded, config, name=spec.name)
        await client.start()
        worker = _Worker(spec, client, out)
        await worker.send(m.Ready(client.info, os.getpid(), dict(loaded.generation_defaults)))
        log.info("ready: %s on %s", spec.model_path, config.device)
        await worker.serve(cmd)
        return 0
    finally:
        cmd.close()
        out.close()
        ctx.term()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m voxserve.pipeline.worker '<WorkerSpec JSON>'", file=sys.stderr)
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
