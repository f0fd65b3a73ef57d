"""`MpNd`: M prefill engines hand requests to N decode engines (prefill-decode disaggregation).

The router places a request on the least-loaded prefill engine, which builds the prompt, runs the talker
prefill, samples the first codebook-0 token and returns a `Handoff` (KV + side state); the router then
places the handoff on a decode engine (least loaded, ties round robin), which streams the frames and audio.
`PrefillDecodeRouter` runs every engine on a thread of this process and moves the handoff by reference;
`LinkedPrefillDecodeRouter` runs them as worker processes and the handoff moves straight from the prefill
worker to the decode worker over their KV link (`kv_links.py`: shm or mooncake), never through this
process: the router picks the pair, arms the decode side, sends the prompt to the prefill side, and
streams what the decode worker produces.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace

import numpy as np

from voxserve.models.qwen3_tts.inputs import VoiceFeatures
from voxserve.pipeline.client import EngineClient, EngineStats, RequestRejected, StreamChunk, SynthesisRequest
from voxserve.pipeline.local import LocalEngineClient
from voxserve.pipeline.router import ReplicaRouter, sum_stats


class PrefillDecodeRouter(EngineClient):
    def __init__(self, prefill: Sequence[LocalEngineClient], decode: Sequence[LocalEngineClient]) -> None:
        if not prefill or not decode:
            raise ValueError("prefill-decode disaggregation needs at least one prefill and one decode engine")
        self.prefill = ReplicaRouter(prefill)
        self.decode = list(decode)
        self.info = self.prefill.info
        self.decode_in_flight = [0] * len(self.decode)
        self._turn = itertools.count()

    async def start(self) -> None:
        await asyncio.gather(self.prefill.start(), *(d.start() for d in self.decode))

    async def stop(self, grace_s: float = 10.0) -> None:
        await asyncio.gather(self.prefill.stop(grace_s), *(d.stop(grace_s) for d in self.decode))

    def pick_decode(self) -> int:
        alive = [i for i, d in enumerate(self.decode) if d.is_alive()]
        if not alive:
            raise RequestRejected(503, "no decode engine is serving")
        turn = next(self._turn)
        return min(alive, key=lambda i: (self.decode_in_flight[i], (i - turn) % len(self.decode)))

    async def generate(self, req: SynthesisRequest) -> AsyncIterator[StreamChunk]:
        handoff = None
        async for chunk in self.prefill.generate(replace(req, handoff_only=True)):
            if not chunk.finished:
                continue
            if chunk.finish_reason != "handoff":  # EOS at prefill, or a failure: the request ends here
                yield chunk
                return
            handoff = chunk.handoff
        if handoff is None:
            raise RequestRejected(500, "the prefill engine ended without a handoff")
        idx = self.pick_decode()
        self.decode_in_flight[idx] += 1
        try:
            async for chunk in self.decode[idx].generate_from_handoff(handoff):
                yield chunk
        finally:
            self.decode_in_flight[idx] -= 1

    async def abort(self, request_id: str, reason: str = "aborted") -> None:
        await self.prefill.abort(request_id, reason)
        await asyncio.gather(*(d.abort(request_id, reason) for d in self.decode))

    async def extract_voice(self, samples: np.ndarray, sample_rate: int) -> VoiceFeatures:
        return await self.prefill.extract_voice(samples, sample_rate)

    def is_alive(self) -> bool:
        return self.prefill.is_alive() and any(d.is_alive() for d in self.decode)

    def stats(self) -> EngineStats:
        return sum_stats([self.prefill.stats(), *(d.stats() for d in self.decode)])


class LinkedPrefillDecodeRouter(PrefillDecodeRouter):
    """MpNd over worker processes joined by KV links (see the module docstring)."""

    def __init__(self, prefill: Sequence, decode: Sequence, receive_timeout_s: float = 300.0,
                 link_timeout_s: float = 120.0) -> None:
        super().__init__(prefill, decode)
        self.receive_timeout_s = receive_timeout_s  # decode side: from the submit until the handoff lands
        self.link_timeout_s = link_timeout_s

    async def start(self) -> None:
        await super().start()
        await self.wait_links()

    async def wait_links(self) -> None:
        """Waits (bounded) until every prefill worker reports every link ready; a link that failed its
        handshake (e.g. a KV layout mismatch between workers) makes the deployment fail to start."""
        deadline = time.monotonic() + self.link_timeout_s
        while True:
            states = {(p, d): c.links.get(d) for p, c in enumerate(self.prefill.replicas)
                      for d in range(len(self.decode))}
            failed = [f"prefill {p} -> decode {d}: {s.error}" for (p, d), s in states.items()
                      if s is not None and s.state == "failed"]
            if failed:
                await self.stop(0.0)
                raise RuntimeError("KV links failed: " + "; ".join(failed))
            if all(s is not None and s.state == "ready" for s in states.values()):
                return
            if time.monotonic() > deadline:
                await self.stop(0.0)
                waiting = [f"prefill {p} -> decode {d}" for (p, d), s in states.items() if s is None or
                           s.state != "ready"]
                raise RuntimeError(f"KV links not ready within {self.link_timeout_s:.0f} s: " + ", ".join(waiting))
            await asyncio.sleep(0.05)

    async def generate(self, req: SynthesisRequest) -> AsyncIterator[StreamChunk]:
        p, d = self.prefill.pick(), self.pick_decode()
        prefill, decode = self.prefill.replicas[p], self.decode[d]
        rid = req.request_id
        decoded = decode.await_handoff(rid, p, self.receive_timeout_s)  # armed before the prefill starts
        self.prefill.claim(p, rid)  # counted only once nothing above can raise
        self.decode_in_flight[d] += 1
        # Both sides are watched at once: the decode side may start streaming before the prefill's "sent"
        # arrives, and may fail first (its receive deadline), which must end the request at once.
        prefilled = asyncio.ensure_future(_last_chunk(prefill.generate(replace(req, handoff_only=True,
                                                                                 handoff_to=d))))
        first = asyncio.ensure_future(anext(decoded))
        try:
            await asyncio.wait({prefilled, first}, return_when=asyncio.FIRST_COMPLETED)
            if not first.done():
                end = prefilled.result()  # raises RequestRejected: the prefill worker refused it
                if end.finish_reason != "handoff":  # EOS at prefill, abort, failure: the decode side never runs
                    yield end
                    return
            chunk = await first
            yield chunk
            if not chunk.finished:
                async for chunk in decoded:
                    yield chunk
        finally:
            for task in (first, prefilled):
                if not task.done():
                    task.cancel()
            await asyncio.gather(first, prefilled, return_exceptions=True)
            if not (first.done() and not first.cancelled() and first.exception() is None):
                await decode.abort(rid, "prefill ended")  # the decode side is still armed: disarm it
            await decoded.aclose()
            self.prefill.release(p, rid)
            self.decode_in_flight[d] -= 1

    async def abort(self, request_id: str, reason: str = "aborted") -> None:
        await asyncio.gather(*(c.abort(request_id, reason) for c in [*self.prefill.replicas, *self.decode]))


async def _last_chunk(chunks: AsyncIterator[StreamChunk]) -> StreamChunk:
    last = None
    async for chunk in chunks:
        last = chunk
    if last is None:
        raise RequestRejected(500, "the prefill worker ended the request without a chunk")
    return last
