"""Process MpNd: prefill and decode engines in their own worker processes, each handoff moving straight
between them over a KV link (shm or mooncake). Codes must equal `single`'s for seeded and greedy requests,
and every fault (a worker killed, a transfer deadline passing, a layout mismatch, an abort while the
handoff is in flight) must fail only the requests it touches, with a reason, and leak no KV block."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import socket
import time

import numpy as np
import pytest
import torch
from client_helpers import EMB, gather_streams, mixed_requests

from legato.engine.config import EngineConfig
from legato.models.qwen3_tts.inputs import SpeechInput
from legato.models.qwen3_tts.sampling import SamplingParams
from legato.pipeline.client import SynthesisRequest
from legato.pipeline.kv_links import socket_path
from legato.pipeline.pd import LinkedPrefillDecodeRouter
from legato.pipeline.process_client import ProcessEngineClient, new_instance_id
from legato.pipeline.topology import TopologyError, build_client, parse_topology

BLOCKS = 128
OPTS = {"torch_threads": 1, "start_timeout_s": 90}


def _config(**kw) -> EngineConfig:
    return EngineConfig(device="cpu", dtype="float32", max_num_seqs=8, num_kv_blocks=BLOCKS, max_model_len=512,
                        max_num_batched_tokens=256, **kw)


def _requests(n: int, prefix: str = "q") -> list[SynthesisRequest]:
    return mixed_requests(n, prefix)


def _long(rid: str, frames: int = 40) -> SynthesisRequest:
    inp = SpeechInput("A long one.", language="english", speaker_embedding=EMB, x_vector_only=True)
    return SynthesisRequest(rid, inp, SamplingParams(seed=3, max_new_tokens=frames + 1), ignore_eos=True)


_gather = gather_streams


def _codes(chunks) -> np.ndarray:
    return np.concatenate([c.codes for c in chunks if c.codes is not None])


def _pd(path, topology: str, kv_backend: str = "shm", instance_id: str | None = None, kv_options=None,
        on_kv_failure: str = "fail", **config) -> LinkedPrefillDecodeRouter:
    router = build_client(parse_topology(topology), None, _config(**config), workers="process",
                          model_path=str(path), instance_id=instance_id, process_options=OPTS,
                          kv_backend=kv_backend, kv_options=kv_options, on_kv_failure=on_kv_failure)
    assert isinstance(router, LinkedPrefillDecodeRouter)
    return router


def _workers(router) -> list[ProcessEngineClient]:
    return [*router.prefill.replicas, *router.decode]


async def _until(cond, timeout_s: float = 15.0) -> None:
    """Polls `cond` until it holds or the deadline passes (the assertions after it then say what was seen).
    Link counters and states reach the server with the workers' heartbeats: a fixed wait for "two heartbeats"
    read stale counters whenever a busy machine delayed one."""
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


def _logged(worker: ProcessEngineClient, text: str) -> bool:
    return any(text in line for line in list(worker._log_tail))


async def _held(worker: ProcessEngineClient, rid: str) -> None:
    """Until the prefill worker holds `rid`'s handoff (the injected send delay): its log says so."""
    await _until(lambda: _logged(worker, f"holding the handoff of {rid} "), timeout_s=60.0)
    assert _logged(worker, f"holding the handoff of {rid} "), f"{rid}'s handoff was never held"


async def _released(worker: ProcessEngineClient, rid: str) -> None:
    """Until the injected delay of `rid`'s handoff is over (the worker then sends it, or drops it if aborted)."""
    await _until(lambda: _logged(worker, f"releasing the handoff of {rid}"), timeout_s=60.0)
    assert _logged(worker, f"releasing the handoff of {rid}"), f"{rid}'s handoff was never released"


def _count(client, peer: int, key: str) -> int:
    status = client.links.get(peer)
    return status.counters.get(key, 0) if status is not None else 0


async def _settled(router, timeout_s: float = 15.0) -> None:
    """Waits until every live worker reports all its KV blocks free and nothing running."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        live = [w for w in _workers(router) if w.is_alive()]
        if all(w.stats().free_kv_blocks == BLOCKS and w.stats().running == 0 for w in live):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("KV blocks leaked: " + ", ".join(f"{w.label}: {w.stats()}" for w in _workers(router)))


@pytest.fixture(scope="module")
def want(tiny_checkpoint):
    """Codes of `_requests(8)` from the in-process `single` engine."""
    from legato.models.qwen3_tts.loader import load_model

    torch.set_num_threads(1)
    single = build_client(parse_topology("single"), lambda d: load_model(tiny_checkpoint, device=d), _config())

    async def run():
        await single.start()
        try:
            return await _gather(single, _requests(8), 8)
        finally:
            await single.stop()
    return [_codes(chunks) for chunks in asyncio.run(run())]


@pytest.mark.parametrize(("topology", "backend", "mtp"), [
    ("1p1d", "shm", 1), ("1p2d", "shm", 1), ("2p1d", "shm", 1), ("1p1d", "shm", 2),
    ("1p1d", "mooncake", 1), ("1p2d", "mooncake", 1), ("2p1d", "mooncake", 1), ("1p1d", "mooncake", 2),
])
def test_process_pd_gives_the_codes_of_single(tiny_checkpoint, want, topology, backend, mtp):
    router = _pd(tiny_checkpoint, topology, backend, mtp_replicas=mtp)

    async def run():
        await router.start()
        try:
            got = {c: await _gather(router, _requests(8, prefix=f"c{c}-"), c) for c in (1, 8)}
            await _settled(router)
            await _until(lambda: sum(s.counters.get("sent", 0) for w in router.prefill.replicas
                                     for s in w.links.values()) >= 16)
            return got, [s for w in router.prefill.replicas for s in w.links.values()]
        finally:
            await router.stop()

    got, links = asyncio.run(run())
    for conc, results in got.items():
        for i, chunks in enumerate(results):
            assert chunks[-1].finish_reason == "length", (conc, i, chunks[-1])
            assert np.array_equal(_codes(chunks), want[i]), (conc, i)
            assert np.concatenate([c.audio for c in chunks]).size == want[i].shape[0] * 1920
    assert links and all(s.state == "ready" for s in links)
    assert sum(s.counters.get("sent", 0) for s in links) == 16  # every handoff crossed a link, none the server
    assert all(w.proc.returncode == 0 for w in _workers(router))


@pytest.mark.parametrize("concurrency", [1, 8])
def test_process_replicas_give_the_codes_of_single(tiny_checkpoint, want, concurrency):
    """The control MpNd is compared against, as processes, on the same seeded and greedy requests."""
    router = build_client(parse_topology("replicas:2"), None, _config(), workers="process",
                          model_path=str(tiny_checkpoint), process_options=OPTS)

    async def run():
        await router.start()
        try:
            return await _gather(router, _requests(8, prefix=f"r{concurrency}-"), concurrency)
        finally:
            await router.stop()

    for i, chunks in enumerate(asyncio.run(run())):
        assert chunks[-1].finish_reason == "length" and np.array_equal(_codes(chunks), want[i]), i
    assert all(r.proc.returncode == 0 for r in router.replicas) and router.in_flight == [0, 0]


def test_topology_refuses_inproc_between_processes(tiny_checkpoint):
    with pytest.raises(TopologyError, match="cross-process"):
        _pd(tiny_checkpoint, "1p1d", "inproc")


def test_topology_refuses_cuda_ipc_between_cpu_workers(tiny_checkpoint):
    with pytest.raises(TopologyError, match=r"cuda_ipc KV backend moves handoffs between CUDA devices.*use shm"):
        _pd(tiny_checkpoint, "1p1d", "cuda_ipc")


def test_layout_mismatch_is_refused_at_handshake(tiny_checkpoint):
    instance = new_instance_id()
    good = _pd(tiny_checkpoint, "1p1d", instance_id=instance)
    prefill = good.prefill.replicas[0]
    other = good.decode[0]
    other.config = dataclasses.replace(other.config, block_size=32)  # prefill pages by 16
    router = LinkedPrefillDecodeRouter([prefill], [other], link_timeout_s=60)
    with pytest.raises(RuntimeError, match="block_size"):
        asyncio.run(router.start())
    assert prefill.proc.poll() is not None and other.proc.poll() is not None  # stopped, not left running


def test_transfer_deadline_fails_that_request_only(tiny_checkpoint):
    # Handoffs of "slow" requests are held 1.5 s; the decode side gives up after 0.5 s.
    router = _pd(tiny_checkpoint, "1p1d", kv_options={"send_delay_s": 1.5, "delay_prefix": "slow"})
    router.receive_timeout_s = 0.5

    async def run():
        await router.start()
        try:
            slow, fast = await asyncio.gather(_gather(router, [_long("slow-1", 5)], 1),
                                              _gather(router, _requests(3, prefix="ok"), 3))
            await _released(router.prefill.replicas[0], "slow-1")  # then dropped: the router aborted it
            after = await _gather(router, _requests(2, prefix="after"), 2)
            await _settled(router)
            prefill, decode = router.prefill.replicas[0], router.decode[0]
            await _until(lambda: _count(decode, 0, "timeouts") == 1 and _count(prefill, 0, "sent") == 5)
            return slow[0], fast, after, prefill.links[0].counters, decode.links[0].counters
        finally:
            await router.stop()

    slow, fast, after, p_counts, d_counts = asyncio.run(run())
    assert slow[-1].finish_reason == "error" and "xfer_timeout" in slow[-1].error
    assert all(c[-1].finish_reason == "length" for c in fast + after)
    assert d_counts["timeouts"] == 1
    assert p_counts["sent"] == 5 and p_counts["failed"] == 0  # the router aborted the held handoff: never sent


def test_abort_while_the_handoff_is_held(tiny_checkpoint):
    router = _pd(tiny_checkpoint, "1p1d", kv_options={"send_delay_s": 3.0, "delay_prefix": "slow"})

    async def run():
        await router.start()
        try:
            gen = router.generate(_long("slow-a"))
            task = asyncio.create_task(anext(gen))
            await _held(router.prefill.replicas[0], "slow-a")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await gen.aclose()  # the client went away: both sides are aborted
            await _released(router.prefill.replicas[0], "slow-a")
            ok = await _gather(router, _requests(2, prefix="ok"), 2)
            await _settled(router)
            prefill, decode = router.prefill.replicas[0], router.decode[0]
            await _until(lambda: _count(prefill, 0, "sent") == 2 and _count(decode, 0, "received") == 2)
            return ok, prefill.links[0].counters, decode.links[0].counters
        finally:
            await router.stop()

    ok, p_counts, d_counts = asyncio.run(run())
    assert all(c[-1].finish_reason == "length" for c in ok)
    assert p_counts["sent"] == 2 and d_counts["received"] == 2  # the aborted handoff never crossed


def test_an_id_left_during_its_handoff_serves_again_at_once_and_later(tiny_checkpoint):
    """Process 1p1d (an outside probe): a client gone while its prefill held the handoff, retrying with the same
    X-Request-Id, got a 409 (the id still ending) where the other topologies wait a step; and every later request
    under that id failed its send (500), minutes later too: the decode side's decline of the old request stayed
    on the prefill link."""
    router = _pd(tiny_checkpoint, "1p1d", kv_options={"send_delay_s": 1.0, "delay_prefix": "slow"})

    async def run():
        await router.start()
        try:
            gen = router.generate(_long("slow-again", 5))
            task = asyncio.create_task(anext(gen))
            await _held(router.prefill.replicas[0], "slow-again")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await gen.aclose()  # the client went away while the prefill side held the handoff
            again = [c async for c in router.generate(_long("slow-again", 5))]  # at once, under the same id
            later = [c async for c in router.generate(_long("slow-again", 5))]
            await _settled(router)
            return again, later
        finally:
            await router.stop()

    again, later = asyncio.run(run())
    assert again[-1].finish_reason == "length", again[-1].error
    assert later[-1].finish_reason == "length", later[-1].error


def test_late_handoff_for_a_request_the_decode_side_aborted(tiny_checkpoint):
    """The decode side gives the request up while the prefill worker still holds its handoff; the handoff
    is sent anyway and must be refused and counted, with nothing leaked on either side."""
    router = _pd(tiny_checkpoint, "1p1d", kv_options={"send_delay_s": 3.0, "delay_prefix": "slow"})

    async def run():
        await router.start()
        try:
            prefill, decode = router.prefill.replicas[0], router.decode[0]
            req = _long("slow-late", 5)
            decoded = decode.await_handoff(req.request_id, 0, 30.0)
            sent = asyncio.ensure_future(_gather(prefill, [dataclasses.replace(req, handoff_only=True,
                                                                               handoff_to=0)], 1))
            await _held(prefill, req.request_id)
            await decode.abort(req.request_id, "client disconnected")  # only the decode side hears it
            dec = [c async for c in decoded]
            pre = (await sent)[0]
            ok = await _gather(router, _requests(2, prefix="ok"), 2)
            await _settled(router)
            await _until(lambda: _count(prefill, 0, "failed") == 1 and _count(decode, 0, "cancelled") == 1
                         and _count(prefill, 0, "sent") == 2 and _count(decode, 0, "received") == 2)
            return dec, pre, ok, prefill.links[0].counters, decode.links[0].counters
        finally:
            await router.stop()

    dec, pre, ok, p_counts, d_counts = asyncio.run(run())
    assert dec[-1].finish_reason == "abort"
    assert pre[-1].finish_reason == "error" and "peer_cancelled" in pre[-1].error  # the late send was refused
    # The decode side's decline reached the prefill side before the send: never published, failed, counted.
    assert p_counts["failed"] == 1 and d_counts["cancelled"] == 1
    assert all(c[-1].finish_reason == "length" for c in ok)
    assert p_counts["sent"] == 2 and d_counts["received"] == 2


def test_killed_prefill_worker_fails_its_requests_and_the_rest_serve(tiny_checkpoint):
    router = _pd(tiny_checkpoint, "2p1d", kv_options={"send_delay_s": 3.0, "delay_prefix": "slow"})

    async def run():
        await router.start()
        try:
            victim = router.prefill.replicas[0]
            doomed = asyncio.ensure_future(_gather(router, [_long("slow-k", 5)], 1))  # placed on prefill 0
            await _until(lambda: router.prefill.in_flight[0] == 1)
            survivors = asyncio.ensure_future(_gather(router, [_long("s-long", 30)], 1))  # on prefill 1
            await _held(victim, "slow-k")  # the decode side is armed for it
            os.kill(victim.pid, signal.SIGKILL)
            doomed, survivors = await doomed, await survivors
            after = await _gather(router, _requests(2, prefix="after"), 2)
            await _settled(router)
            links = router.decode[0].links
            await _until(lambda: 0 in links and links[0].state == "failed" and 1 in links and links[1].state == "ready")
            # A copy: the worker's shutdown reports its other links closing after this returns.
            return doomed[0], survivors, after, dict(router.decode[0].links)
        finally:
            await router.stop()

    doomed, survivors, after, d_links = asyncio.run(run())
    assert doomed[-1].finish_reason == "error"
    assert "worker died" in doomed[-1].error or "peer_died" in doomed[-1].error
    assert all(c[-1].finish_reason == "length" for c in survivors + after)
    assert d_links[0].state == "failed" and d_links[1].state == "ready"


def test_recompute_policy_reruns_a_request_whose_handoff_timed_out(tiny_checkpoint):
    """`on_kv_failure="recompute"`: the request whose handoff missed its deadline is run again whole on the
    decode worker and gives the codes it would have given; the recompute is counted, nothing leaks."""
    router = _pd(tiny_checkpoint, "1p1d", kv_options={"send_delay_s": 1.5, "delay_prefix": "slow"},
                 on_kv_failure="recompute")
    router.receive_timeout_s = 0.5

    async def run():
        await router.start()
        try:
            slow, ref = await asyncio.gather(_gather(router, [_long("slow-r", 6)], 1),
                                             _gather(router, [_long("ref-r", 6)], 1))
            await _released(router.prefill.replicas[0], "slow-r")  # then dropped: the router aborted it
            await _settled(router)
            await _until(lambda: _count(router.decode[0], 0, "timeouts") == 1)
            return slow[0], ref[0], router.stats(), router.decode[0].links[0].counters
        finally:
            await router.stop()

    slow, ref, stats, d_counts = asyncio.run(run())
    assert slow[-1].finish_reason == ref[-1].finish_reason == "length"
    assert np.array_equal(_codes(slow), _codes(ref))  # same input and seed: the id does not enter the codes
    assert stats.recomputed == 1 and d_counts["timeouts"] == 1


def test_recompute_policy_survives_a_killed_prefill_worker(tiny_checkpoint):
    router = _pd(tiny_checkpoint, "2p1d", kv_options={"send_delay_s": 3.0, "delay_prefix": "slow"},
                 on_kv_failure="recompute")

    async def run():
        await router.start()
        try:
            doomed = asyncio.ensure_future(_gather(router, [_long("slow-k", 5)], 1))  # placed on prefill 0
            await _held(router.prefill.replicas[0], "slow-k")
            os.kill(router.prefill.replicas[0].pid, signal.SIGKILL)
            doomed = (await doomed)[0]
            ref = (await _gather(router, [_long("ref-k", 5)], 1))[0]  # prefill 1 is the one left
            await _settled(router)
            return doomed, ref, router.stats()
        finally:
            await router.stop()

    doomed, ref, stats = asyncio.run(run())
    assert doomed[-1].finish_reason == ref[-1].finish_reason == "length"
    assert np.array_equal(_codes(doomed), _codes(ref))
    assert stats.recomputed == 1


def test_stop_drains_in_order_so_a_held_handoff_still_lands(tiny_checkpoint):
    """stop() with a grace: the prefill worker sends the handoff it holds, the decode worker decodes it,
    then both exit cleanly."""
    router = _pd(tiny_checkpoint, "1p1d", kv_options={"send_delay_s": 1.0, "delay_prefix": "slow"})

    async def run():
        await router.start()
        stream = asyncio.ensure_future(_gather(router, [_long("slow-s", 8)], 1))
        await _held(router.prefill.replicas[0], "slow-s")
        await router.stop(10.0)
        return (await stream)[0]

    chunks = asyncio.run(run())
    assert chunks[-1].finish_reason == "length" and chunks[-1].num_frames == 8
    assert all(w.proc.returncode == 0 for w in _workers(router))


def test_killed_decode_worker_fails_its_requests_and_the_server_stays_up(tiny_checkpoint):
    router = _pd(tiny_checkpoint, "1p2d")

    async def run():
        await router.start()
        try:
            streams = [router.generate(_long(f"k{i}", 60)) for i in range(2)]
            first = [await s.__anext__() for s in streams]  # k0 on decode 0, k1 on decode 1
            assert not any(c.finished for c in first)
            os.kill(router.decode[0].pid, signal.SIGKILL)
            rest = []
            for stream in streams:
                rest.append([c async for c in stream])
            assert router.is_alive() and not router.decode[0].is_alive()
            after = await _gather(router, _requests(3, prefix="after"), 3)  # all placed on decode 1
            await _settled(router)
            return rest, after
        finally:
            await router.stop()

    rest, after = asyncio.run(run())
    assert rest[0][-1].finish_reason == "error" and "worker died" in rest[0][-1].error
    assert _listener_gone(socket_path(router.decode[0].kv.instance_id, 0))  # its listener, cleaned up
    assert rest[1][-1].finish_reason == "length"
    assert all(c[-1].finish_reason == "length" for c in after)


def _listener_gone(address: str) -> bool:
    """Nobody listens at the address, and no socket file is left for it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(address)
    except OSError:
        return address.startswith("\0") or not os.path.exists(address)
    finally:
        sock.close()
    return False
