"""A worker of each role SIGKILLed under load: several requests in flight on it and on the others.

The per-role tests (replica: test_process_workers; prefill and decode: test_pd_process; codec: test_split)
kill a worker holding one request. Here each role's victim holds several at once, next to others in flight
elsewhere: every one of the victim's requests must end with an error chunk saying why, every other one
must finish, the client must stay up and serve new requests (or, where the role has no second worker,
refuse them with a reason), and no KV block may leak."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
from collections.abc import Awaitable, Callable

import pytest
from test_pd_process import _long, _pd, _settled
from test_process_workers import _process_client, _req
from test_split import BLOCKS, process_split

from legato.pipeline.client import RequestRejected

PER_WORKER = 3  # requests in flight on each worker when the victim is killed
FRAMES = 40
DEATH = ("worker died", "peer_died")  # a reason naming the death, as the server or the KV link saw it
WAIT_S = 30.0


@dataclasses.dataclass
class Outcome:
    victims: list[list]  # the chunks of each request the killed worker held
    others: list[list]  # the chunks of each request in flight elsewhere
    after: list[list] | RequestRejected  # new requests after the kill, or their refusal
    alive: bool  # the client still says it serves


async def _until(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def _open(client, reqs) -> list:
    """Starts every request and waits for its first chunk, so each is really in flight."""
    streams = [client.generate(r) for r in reqs]
    firsts = await asyncio.gather(*(anext(s) for s in streams))
    assert not any(c.finished for c in firsts)
    return [(first, stream) for first, stream in zip(firsts, streams, strict=True)]


async def _rest(opened) -> list[list]:
    async def one(first, stream):
        return [first, *[c async for c in stream]]
    return await asyncio.gather(*(one(f, s) for f, s in opened))


async def _gather(client, reqs) -> list[list]:
    async def one(r):
        return [c async for c in client.generate(r)]
    return await asyncio.gather(*(one(r) for r in reqs))


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


async def _replica(path) -> Outcome:
    router = _process_client(path, "replicas:2")
    await router.start()
    try:
        reqs = [_req(i, frames=FRAMES, ignore_eos=True) for i in range(2 * PER_WORKER)]
        opened = await _open(router, reqs)
        on_victim = {rid for rid, idx in router._placement.items() if idx == 0}
        assert len(on_victim) == PER_WORKER, router._placement
        _kill(router.replicas[0].pid)
        results = await _rest(opened)
        after = await _gather(router, [_req(10 + i) for i in range(PER_WORKER)])
        victims, others = _split(reqs, results, on_victim)
        return Outcome(victims, others, after, router.is_alive())
    finally:
        await router.stop()


def _split(reqs, results, on_victim: set[str]) -> tuple[list, list]:
    pairs = list(zip(reqs, results, strict=True))
    return ([c for r, c in pairs if r.request_id in on_victim], [c for r, c in pairs if r.request_id not in on_victim])


async def _decode(path) -> Outcome:
    router = _pd(path, "1p2d")
    await router.start()
    try:
        opened = await _open(router, [_long(f"k{i}", FRAMES) for i in range(2 * PER_WORKER)])
        assert router.decode_in_flight == [PER_WORKER, PER_WORKER]
        _kill(router.decode[0].pid)
        results = await _rest(opened)
        # The router keeps no request -> decode worker map: the victim's are the ones that failed, and
        # there must be exactly as many as it held.
        failed = [c for c in results if c[-1].finish_reason == "error"]
        after = await _gather(router, [_long(f"after{i}", 5) for i in range(PER_WORKER)])
        await _settled(router)
        assert len(failed) == PER_WORKER
        return Outcome(failed, [c for c in results if c[-1].finish_reason != "error"], after, router.is_alive())
    finally:
        await router.stop()


async def _prefill(path) -> Outcome:
    # Every handoff is held 3 s on its prefill worker, so the victim's are all still there when it dies.
    router = _pd(path, "2p1d", kv_options={"send_delay_s": 3.0, "delay_prefix": "slow"})
    await router.start()
    try:
        reqs = [_long(f"slow-{i}", 5) for i in range(2 * PER_WORKER)]
        running = asyncio.ensure_future(_gather(router, reqs))
        await _until(lambda: len(router.prefill._placement) == len(reqs), "every request placed")
        on_victim = {rid for rid, idx in router.prefill._placement.items() if idx == 0}
        assert len(on_victim) == PER_WORKER, router.prefill._placement
        victim = router.prefill.replicas[0]

        def held() -> bool:  # the worker logs each handoff its injected delay holds
            return all(any(f"holding the handoff of {rid} " in line for line in list(victim._log_tail))
                       for rid in on_victim)

        await _until(held, "the victim holds every handoff it prefilled")
        _kill(victim.pid)
        results = await running
        after = await _gather(router, [_long(f"after{i}", 5) for i in range(PER_WORKER)])
        await _settled(router)
        return Outcome(*_split(reqs, results, on_victim), after, router.is_alive())
    finally:
        await router.stop()


async def _codec(path) -> Outcome:
    """The split has one codec worker: all its streams fail, and new requests are refused with a reason."""
    client = process_split(path)
    await client.start()
    try:
        opened = await _open(client, [_long(f"c{i}", 300) for i in range(PER_WORKER)])
        _kill(client.codec.worker.pid)
        victims = await _rest(opened)

        def talker_settled() -> bool:
            s = client.talker.stats()
            return s.free_kv_blocks == BLOCKS and s.running == 0

        await _until(talker_settled, "the talker to free every KV block")
        try:
            after = await _gather(client, [_long("late", 5)])
        except RequestRejected as e:
            after = e
        assert client.talker.is_alive()  # the talker worker itself is untouched
        return Outcome(victims, [], after, client.is_alive())
    finally:
        await client.stop()


SCENARIOS: dict[str, Callable[..., Awaitable[Outcome]]] = {
    "replica": _replica, "prefill": _prefill, "decode": _decode, "codec": _codec,
}


@pytest.mark.parametrize("role", list(SCENARIOS))
def test_killed_worker_under_load(tiny_checkpoint, role):
    out = asyncio.run(SCENARIOS[role](tiny_checkpoint))
    assert len(out.victims) >= PER_WORKER
    for chunks in out.victims:
        last = chunks[-1]
        assert last.finished and last.finish_reason == "error", (role, last)
        assert last.error and any(why in last.error for why in DEATH), (role, last.error)
    for chunks in out.others:
        assert chunks[-1].finish_reason == "length", (role, chunks[-1])
    if role == "codec":
        assert isinstance(out.after, RequestRejected) and out.after.status == 503 and out.after.message
        assert not out.alive
    else:
        assert len(out.others) >= PER_WORKER
        assert all(c[-1].finish_reason == "length" for c in out.after), role
        assert out.alive
