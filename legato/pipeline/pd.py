"""`MpNd`: M prefill engines hand requests to N decode engines (prefill-decode disaggregation).

The router places a request on the least-loaded prefill engine, which builds the prompt, runs the talker
prefill, samples the first codebook-0 token and returns a `Handoff` (KV + side state); the router then
places the handoff on a decode engine (`pairing`: least loaded with ties round robin, or plain round robin),
which streams the frames and audio.
`PrefillDecodeRouter` runs every engine on a thread of this process and moves the handoff by reference;
`LinkedPrefillDecodeRouter` runs them as worker processes and the handoff moves straight from the prefill
worker to the decode worker over their KV link (`kv_links.py`: shm or mooncake), never through this
process: the router picks the pair, arms the decode side, sends the prompt to the prefill side, and
streams what the decode worker produces.

A handoff that does not cross (the prefill worker died, the transfer's deadline passed) fails its request
with the reason (`on_kv_failure="fail"`, the default), or, with `on_kv_failure="recompute"`, runs the whole
request again on a live decode engine: nothing was streamed yet, and a seeded request gives the same codes
there. Recomputes are logged and counted (`EngineStats.recomputed`), never silent.

Streaming text (a `text_open` request): the prefill side prefills what text there is and its handoff says the
text is open; the router holds the text appended meanwhile, in order, and hands it to the decode side as soon
as that side can take it (in process: its stream of the handoff is open; over links: the decode worker is
armed, and holds the text until the handoff lands), then passes later text straight on. A text_open request
whose handoff does not cross is failed, not recomputed: its text went to the decode side.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace

import numpy as np

from legato.models.qwen3_tts.inputs import VoiceFeatures
from legato.pipeline.client import (
    EngineClient,
    EngineStats,
    HeldText,
    RequestRejected,
    StreamChunk,
    SynthesisRequest,
    refused_stream,
)
from legato.pipeline.local import LocalEngineClient
from legato.pipeline.router import ReplicaRouter, sum_stats

PAIRINGS = ("least_loaded", "round_robin")
KV_FAILURE_POLICIES = ("fail", "recompute")

log = logging.getLogger(__name__)


def check_pd_options(pairing: str = "least_loaded", on_kv_failure: str = "fail") -> None:
    """Raises ValueError for a pairing or KV-failure policy this module does not know."""
    if pairing not in PAIRINGS:
        raise ValueError(f"pairing must be one of {', '.join(PAIRINGS)}, got {pairing!r}")
    if on_kv_failure not in KV_FAILURE_POLICIES:
        raise ValueError(f"on_kv_failure must be one of {', '.join(KV_FAILURE_POLICIES)}, got {on_kv_failure!r}")


class PrefillDecodeRouter(EngineClient):
    def __init__(self, prefill: Sequence[LocalEngineClient], decode: Sequence[LocalEngineClient],
                 pairing: str = "least_loaded") -> None:
        if not prefill or not decode:
            raise ValueError("prefill-decode disaggregation needs at least one prefill and one decode engine")
        check_pd_options(pairing)
        self.pairing = pairing
        self.prefill = ReplicaRouter(prefill, what="prefill engine")
        self.decode = list(decode)
        self.info = self.prefill.info
        self.decode_in_flight = [0] * len(self.decode)
        self._turn = itertools.count()
        self._before_decode = 0  # requests no decode engine has taken yet (at prefill, or handing over)
        self._stopping = False
        # Streaming text: held until the request's decode side can take it, then sent to that side.
        self._text = HeldText()

    async def start(self) -> None:
        await asyncio.gather(self.prefill.start(), *(d.start() for d in self.decode))

    async def stop(self, grace_s: float = 10.0) -> None:
        """In order, within one grace: the prefill engines finish what they hold (handoffs included), the
        decode engines take every handoff made, then they finish (or abort after the grace) their streams."""
        self._stopping = True
        deadline = time.monotonic() + grace_s
        await self.prefill.stop(grace_s)
        while self._before_decode and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        remaining = max(0.0, deadline - time.monotonic())
        await asyncio.gather(*(d.stop(remaining) for d in self.decode))

    def pick_decode(self) -> int:
        alive = [i for i, d in enumerate(self.decode) if d.is_alive()]
        if not alive:
            raise RequestRejected(503, "no decode engine is serving")
        turn = next(self._turn)
        if self.pairing == "round_robin":
            return min(alive, key=lambda i: (i - turn) % len(self.decode))
        return min(alive, key=lambda i: (self.decode_in_flight[i], (i - turn) % len(self.decode)))

    takes_text_input = True

    async def append_text(self, request_id: str, text: str, close: bool = False) -> None:
        await self._text.append(request_id, text, close)  # a request that has ended: its text is dropped

    def generate(self, req: SynthesisRequest) -> AsyncIterator[StreamChunk]:
        # A text_open request takes text from this call on.
        if req.text_open and not self._text.hold(req.request_id):
            return refused_stream(RequestRejected(409, f"duplicate request id {req.request_id!r}"))
        return self._tracked(req)

    async def _tracked(self, req: SynthesisRequest) -> AsyncIterator[StreamChunk]:
        try:
            async with contextlib.aclosing(self._generate(req)) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            self._text.forget(req.request_id)

    async def _generate(self, req: SynthesisRequest) -> AsyncIterator[StreamChunk]:
        if self._stopping:
            raise RequestRejected.shutting_down()
        self._before_decode += 1
        taken, idx = False, None
        try:
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
            decoded = self.decode[idx].generate_from_handoff(handoff)  # takes text from here on
            await self._text.hand_on(req.request_id, self.decode[idx])
            async for chunk in decoded:
                if not taken:  # the decode engine has it: a stop may now take the decode engines down
                    taken = True
                    self._before_decode -= 1
                yield chunk
        finally:
            if not taken:
                self._before_decode -= 1
            if idx is not None:
                self.decode_in_flight[idx] -= 1

    async def abort(self, request_id: str, reason: str = "aborted") -> None:
        self._text.forget(request_id)
        await self.prefill.abort(request_id, reason)
        await asyncio.gather(*(d.abort(request_id, reason) for d in self.decode))

    async def extract_voice(self, samples: np.ndarray, sample_rate: int) -> VoiceFeatures:
        return await self.prefill.extract_voice(samples, sample_rate)

    def is_alive(self) -> bool:
        return self.prefill.is_alive() and any(d.is_alive() for d in self.decode)

    def stats(self) -> EngineStats:
        # The prefill pool's view already leaves its dead engines out (and counts them); decode engines one by one.
        return sum_stats([self.prefill.stats(), *(d.stats() for d in self.decode)],
                         [True, *(self._stopping or d.is_alive() for d in self.decode)])


class LinkedPrefillDecodeRouter(PrefillDecodeRouter):
    """MpNd over worker processes joined by KV links (see the module docstring)."""

    def __init__(self, prefill: Sequence, decode: Sequence, receive_timeout_s: float = 300.0,
                 link_timeout_s: float = 120.0, pairing: str = "least_loaded", on_kv_failure: str = "fail") -> None:
        check_pd_options(pairing, on_kv_failure)
        super().__init__(prefill, decode, pairing)
        self.receive_timeout_s = receive_timeout_s  # decode side: from the submit until the handoff lands
        self.link_timeout_s = link_timeout_s
        self.on_kv_failure = on_kv_failure
        self.recomputed = 0
        self._recomputing: dict[str, str] = {}  # client request id -> the id its recompute runs under

    async def start(self) -> None:
        await super().start()
        await self.wait_links()

    async def wait_links(self) -> None:
        """Waits (bounded) until both ends of every link report it ready (a decode worker whose end has not
        had the prefill worker's hello yet cannot be armed); a link that failed its handshake (e.g. a KV
        layout mismatch between workers) makes the deployment fail to start."""
        deadline = time.monotonic() + self.link_timeout_s
        while True:
            states = {(p, d): c.links.get(d) for p, c in enumerate(self.prefill.replicas)
                      for d in range(len(self.decode))}
            decode_ends = {(p, d): c.links.get(p) for d, c in enumerate(self.decode)
                           for p in range(len(self.prefill.replicas))}
            states = {key: s if s is None or s.state != "ready" else decode_ends[key] for key, s in states.items()}
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

    async def _generate(self, req: SynthesisRequest) -> AsyncIterator[StreamChunk]:
        streamed, failed = False, None
        recompute = self.on_kv_failure == "recompute" and not req.text_open
        async with contextlib.aclosing(self._prefill_then_decode(req)) as chunks:
            async for chunk in chunks:
                if chunk.finished and chunk.retryable and not streamed and recompute:
                    failed = chunk
                    break
                streamed = True
                yield chunk
        if failed is not None:  # outside the first stream, whose cleanup (disarming the decode side) has run
            async for chunk in self._recompute(req, failed):
                yield chunk

    async def _recompute(self, req: SynthesisRequest, failed: StreamChunk) -> AsyncIterator[StreamChunk]:
        """Runs `req` whole (prompt, prefill, decode) on a live decode engine, under an id of its own so no
        message of the failed attempt can reach it."""
        rid = req.request_id
        try:
            d = self.pick_decode()
        except RequestRejected as e:
            yield replace(failed, error=f"{failed.error}; not recomputed: {e.message}")
            return
        alias = f"{rid}/recompute"
        log.warning("request %s: %s; recomputing it on decode engine %d", rid, failed.error, d)
        self.recomputed += 1
        self._recomputing[rid] = alias
        self.decode_in_flight[d] += 1
        try:
            async for chunk in self.decode[d].generate(replace(req, request_id=alias, handoff_only=False,
                                                               handoff_to=None)):
                yield chunk
        except RequestRejected as e:
            yield replace(failed, error=f"{failed.error}; recompute refused: {e.message}")
        finally:
            self._recomputing.pop(rid, None)
            self.decode_in_flight[d] -= 1

    async def _prefill_then_decode(self, req: SynthesisRequest) -> AsyncIterator[StreamChunk]:
        if self._stopping:
            raise RequestRejected.shutting_down()
        p, d = self.prefill.pick(), self.pick_decode()
        prefill, decode = self.prefill.replicas[p], self.decode[d]
        rid = req.request_id
        # A client retrying the id of a request it just left gets its own request after the old one's last chunk
        # (a step or so), as on the other topologies, not a 409 (the prefill side's generate waits the same way).
        await decode.until_ended(rid)
        decoded = decode.await_handoff(rid, p, self.receive_timeout_s)  # armed before the prefill starts
        self.prefill.claim(p, rid)  # counted only once nothing above can raise
        self.decode_in_flight[d] += 1
        # Both sides are watched at once: the decode side may start streaming before the prefill's "sent"
        # arrives, and may fail first (its receive deadline), which must end the request at once.
        prefilled = asyncio.ensure_future(_last_chunk(prefill.generate(replace(req, handoff_only=True,
                                                                                 handoff_to=d))))
        first = asyncio.ensure_future(anext(decoded))
        try:
            await self._text.hand_on(rid, decode)  # the armed decode worker holds it until the handoff lands
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
        self._text.forget(request_id)
        ids = [request_id, *([self._recomputing[request_id]] if request_id in self._recomputing else [])]
        await asyncio.gather(*(c.abort(i, reason) for c in [*self.prefill.replicas, *self.decode] for i in ids))

    def stats(self) -> EngineStats:
        return replace(super().stats(), recomputed=self.recomputed)


async def _last_chunk(chunks: AsyncIterator[StreamChunk]) -> StreamChunk:
    last = None
    async for chunk in chunks:
        last = chunk
    if last is None:
        raise RequestRejected(500, "the prefill worker ended the request without a chunk")
    return last
