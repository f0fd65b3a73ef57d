"""`MpNd`: M prefill engines hand requests to N decode engines (prefill-decode disaggregation).

The router places a request on the least-loaded prefill engine, which builds the prompt, runs the talker
prefill, samples the first codebook-0 token and returns a `Handoff` (KV + side state); the router then
places the handoff on a decode engine (least loaded, ties round robin), which streams the frames and audio.
Here every engine runs on a thread of this process and the handoff moves by reference (the `inproc`
path); process workers move it through a `voxserve.kv_transfer` connector instead.
"""

from __future__ import annotations

import asyncio
import itertools
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
