"""`replicas:N`: N independent engines behind one least-loaded router.

Each replica is a complete `EngineClient`; the router places a request on the replica with the fewest
requests in flight (ties to the lowest index), keeps it there for its whole life, and forwards aborts to it.
It is the control every other topology is compared against.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import numpy as np

from legato.models.qwen3_tts.inputs import VoiceFeatures
from legato.pipeline.client import (
    EngineClient,
    EngineStats,
    RequestRejected,
    StreamChunk,
    SynthesisRequest,
    refused_stream,
)


class ReplicaRouter(EngineClient):
    def __init__(self, replicas: Sequence[EngineClient], what: str = "engine replica") -> None:
        if not replicas:
            raise ValueError("a router needs at least one replica")
        self.what = what  # in the 503 when none is serving: "engine replica", or a PD deployment's "prefill engine"
        self.replicas = list(replicas)
        self.info = self.replicas[0].info
        self.in_flight = [0] * len(self.replicas)
        self.stopped = False  # after stop(): its engines ended on purpose, not "down"
        self._placement: dict[str, int] = {}
        self._voice_turn = 0

    async def start(self) -> None:
        await asyncio.gather(*(r.start() for r in self.replicas))

    async def stop(self, grace_s: float = 10.0) -> None:
        self.stopped = True
        await asyncio.gather(*(r.stop(grace_s) for r in self.replicas))

    def pick(self) -> int:
        """The live replica with the fewest requests in flight; a dead replica gets none."""
        alive = [i for i, r in enumerate(self.replicas) if r.is_alive()]
        if not alive:
            raise RequestRejected(503, f"no {self.what} is serving")
        return min(alive, key=lambda i: (self.in_flight[i], i))

    def claim(self, idx: int, request_id: str) -> None:
        """Counts `request_id` as in flight on replica `idx` (and routes its aborts there) until `release`."""
        self.in_flight[idx] += 1
        self._placement[request_id] = idx

    def release(self, idx: int, request_id: str) -> None:
        self.in_flight[idx] -= 1
        self._placement.pop(request_id, None)

    def generate(self, req: SynthesisRequest) -> AsyncIterator[StreamChunk]:
        if not req.text_open:
            return self._generate(req)
        # Placed now, not at the first iteration: text appended right after this call goes to its replica.
        try:
            idx = self.pick()
        except RequestRejected as e:
            return refused_stream(e)
        self._placement[req.request_id] = idx  # counted in flight once its stream is read (`_follow`)
        return self._follow(idx, req.request_id, self.replicas[idx].generate(req))

    async def _generate(self, req: SynthesisRequest) -> AsyncIterator[StreamChunk]:
        idx = self.pick()
        self.claim(idx, req.request_id)
        try:
            async for chunk in self.replicas[idx].generate(req):
                yield chunk
        finally:
            self.release(idx, req.request_id)

    async def _follow(self, idx: int, request_id: str,
                      chunks: AsyncIterator[StreamChunk]) -> AsyncIterator[StreamChunk]:
        # Claimed here, at the first read, so a stream closed before it is ever read holds no count.
        self.claim(idx, request_id)
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            self.release(idx, request_id)

    @property
    def takes_text_input(self) -> bool:
        return all(r.takes_text_input for r in self.replicas)

    async def append_text(self, request_id: str, text: str, close: bool = False) -> None:
        idx = self._placement.get(request_id)
        if idx is not None:  # none: it has ended (its last chunk is out)
            await self.replicas[idx].append_text(request_id, text, close)

    async def abort(self, request_id: str, reason: str = "aborted") -> None:
        # Popped, not read: a text_open stream asked for and never read has no `_follow` to release it.
        idx = self._placement.pop(request_id, None)
        if idx is not None:
            await self.replicas[idx].abort(request_id, reason)

    async def extract_voice(self, samples: np.ndarray, sample_rate: int) -> VoiceFeatures:
        # Every replica holds the same model: any live one can encode a voice; rotate to spread the work.
        alive = [r for r in self.replicas if r.is_alive()]
        if not alive:
            raise RequestRejected(503, f"no {self.what} is serving")
        self._voice_turn += 1
        return await alive[self._voice_turn % len(alive)].extract_voice(samples, sample_rate)

    def is_alive(self) -> bool:
        # Replicas are independent: the router serves while any of them can.
        return any(r.is_alive() for r in self.replicas)

    def stats(self) -> EngineStats:
        return sum_stats([r.stats() for r in self.replicas], [self.stopped or r.is_alive() for r in self.replicas])


def sum_stats(parts: Sequence[EngineStats], alive: Sequence[bool] | None = None) -> EngineStats:
    """One view of several engines: counters (steps, aborts, ...) add up over all of them; the gauges (requests
    waiting and running, KV blocks and usage) over the live ones (`alive`; default all), so a dead replica's
    blocks are not counted as free capacity. `engines_down` counts the dead."""
    alive = [True] * len(parts) if alive is None else list(alive)
    live = [p for p, ok in zip(parts, alive, strict=True) if ok]
    aborted: dict[str, int] = {}
    for p in parts:
        for k, v in p.aborted.items():
            aborted[k] = aborted.get(k, 0) + v
    blocks = sum(p.num_kv_blocks for p in live)
    free = sum(p.free_kv_blocks for p in live)
    return EngineStats(
        waiting=sum(p.waiting for p in live),
        running=sum(p.running for p in live),
        kv_usage=(1.0 - free / blocks) if blocks else 0.0,
        num_kv_blocks=blocks,
        free_kv_blocks=free,
        aborted=aborted,
        recomputed=sum(p.recomputed for p in parts),
        steps=sum(p.steps for p in parts),
        decode_rows=sum(p.decode_rows for p in parts),
        step_host_s=sum(p.step_host_s for p in parts),
        step_gpu_s=sum(p.step_gpu_s for p in parts),
        step_gap_s=sum(p.step_gap_s for p in parts),
        loop_other_s=sum(p.loop_other_s for p in parts),
        waiting_for_text=sum(p.waiting_for_text for p in live),
        text_wait_s=sum(p.text_wait_s for p in parts),
        engines_down=sum(p.engines_down for p in parts) + alive.count(False),
    )
