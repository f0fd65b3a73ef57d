"""Prefill-decode disaggregation in one process: MpNd gives the codes of `single` for seeded and greedy
requests, frees every block on both sides, and refuses a handoff whose KV layout does not match."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from client_helpers import EMB, gather_streams, mixed_requests, run_client

from legato.engine.config import EngineConfig
from legato.kv_transfer.handoff import LayoutMismatch
from legato.models.qwen3_tts.inputs import SpeechInput
from legato.models.qwen3_tts.loader import load_model
from legato.models.qwen3_tts.sampling import SamplingParams
from legato.pipeline.client import RequestRejected, SynthesisRequest
from legato.pipeline.local import LocalEngineClient
from legato.pipeline.pd import PrefillDecodeRouter


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint):
    torch.set_num_threads(1)
    return load_model(tiny_checkpoint)


def engine(loaded, prefill_only: bool = False) -> LocalEngineClient:
    return LocalEngineClient(loaded, EngineConfig(device="cpu", dtype="float32", max_num_seqs=4, num_kv_blocks=96,
                                                  max_model_len=512, max_num_batched_tokens=64,
                                                  prefill_only=prefill_only))


def requests(n: int) -> list[SynthesisRequest]:
    return mixed_requests(n, "p")


run = run_client


def outcome(chunks):
    codes = np.concatenate([c.codes for c in chunks if c.codes is not None])
    return codes, np.concatenate([c.audio for c in chunks]), chunks[-1].finish_reason


@pytest.mark.parametrize("concurrency", [1, 8])
@pytest.mark.parametrize(("m", "n"), [(1, 1), (1, 2), (2, 1)])
def test_pd_gives_the_codes_of_single(loaded, m, n, concurrency):
    reqs = requests(8)
    want = asyncio.run(run(engine(loaded), reqs, concurrency))
    prefill = [engine(loaded, prefill_only=True) for _ in range(m)]  # as the topology builds them
    decode = [engine(loaded) for _ in range(n)]
    router = PrefillDecodeRouter(prefill, decode)
    got = asyncio.run(run(router, reqs, concurrency))
    for r, a, b in zip(reqs, want, got, strict=True):
        ca, wa, fa = outcome(a)
        cb, wb, fb = outcome(b)
        assert fa == fb == "length", r.request_id
        assert ca.shape == (r.sampling.max_new_tokens - 1, 16) and np.array_equal(ca, cb), r.request_id
        assert wa.shape == wb.shape and np.abs(wa - wb).max() < 1e-5
    for e in prefill + decode:
        stats = e.stats()
        assert stats.free_kv_blocks == stats.num_kv_blocks == 96
    assert router.decode_in_flight == [0] * n


def test_decode_refuses_a_handoff_of_another_layout(loaded, tmp_path):
    from legato.models.qwen3_tts.testing import write_checkpoint
    from legato.models.qwen3_tts.tiny import tiny_config

    cfg = tiny_config("base")
    cfg.talker_config.num_key_value_heads = 4  # a different KV layout
    other = load_model(write_checkpoint(tmp_path / "other", cfg))

    async def main():
        pre, dec = engine(loaded), engine(other)
        await pre.start()
        await dec.start()
        try:
            req = requests(1)[0]
            from dataclasses import replace
            chunks = [c async for c in pre.generate(replace(req, handoff_only=True))]
            handoff = chunks[-1].handoff
            with pytest.raises(Exception) as err:
                [c async for c in dec.generate_from_handoff(handoff)]
            return chunks[-1], err.value, dec.stats()
        finally:
            await pre.stop()
            await dec.stop()

    last, err, stats = asyncio.run(main())
    assert last.finish_reason == "handoff" and last.handoff is not None and last.handoff.num_tokens > 0
    assert getattr(err, "status", None) == 500 and "kv_heads" in str(err)
    assert stats.free_kv_blocks == stats.num_kv_blocks
    with pytest.raises(LayoutMismatch):
        last.handoff.layout.check_compatible(
            type(last.handoff.layout)(**{**last.handoff.layout.__dict__, "kv_heads": 4}))


def test_aborting_during_decode_frees_both_sides(loaded):
    async def main():
        prefill, decode = [engine(loaded)], [engine(loaded)]
        router = PrefillDecodeRouter(prefill, decode)
        await router.start()
        try:
            req = SynthesisRequest("long", SpeechInput("A long one.", language="english", speaker_embedding=EMB,
                                                       x_vector_only=True),
                                   SamplingParams(seed=1, max_new_tokens=200), ignore_eos=True, first_chunk_frames=1)
            stream = router.generate(req)
            first = await stream.__anext__()
            await stream.aclose()
            for _ in range(100):
                await asyncio.sleep(0.02)
                s = router.stats()
                if s.free_kv_blocks == s.num_kv_blocks and s.running == 0:
                    break
            return first, router.stats()
        finally:
            await router.stop()

    first, stats = asyncio.run(main())
    assert first.num_frames >= 0
    assert stats.free_kv_blocks == stats.num_kv_blocks == 192


@pytest.mark.parametrize("path", ["generate_from_handoff", "generate_from_handoff_into"])
def test_a_handoff_aborted_before_it_reached_the_decode_engine_ends_with_the_abort(loaded, path):
    """A decode worker asks for a handoff's decode, then awaits (handing on held text) before that decode's task
    runs; its front's Abort (a client that left) can be handled in that gap, when the decode engine has nothing
    to abort. The handoff, added after, decoded to its frame cap (200 frames here) for nobody."""
    from dataclasses import replace

    async def main():
        pre, dec = engine(loaded, prefill_only=True), engine(loaded)
        await pre.start()
        await dec.start()
        try:
            req = SynthesisRequest("gone", SpeechInput("A long one.", language="english", speaker_embedding=EMB,
                                                       x_vector_only=True),
                                   SamplingParams(seed=1, max_new_tokens=200), ignore_eos=True)
            handoff = [c async for c in pre.generate(replace(req, handoff_only=True))][-1].handoff
            sunk: list = []
            if path == "generate_from_handoff":
                stream = dec.generate_from_handoff(handoff)
                await dec.abort("gone", "client disconnected")
                sunk = [c async for c in stream]
            else:
                run = dec.generate_from_handoff_into(handoff, lambda out: sunk.extend(c for _, c in out))
                await dec.abort("gone", "client disconnected")
                await asyncio.wait_for(run, 60)
            return sunk, dec.stats(), dec
        finally:
            await pre.stop()
            await dec.stop()

    chunks, stats, dec = asyncio.run(main())
    assert len(chunks) == 1 and chunks[0].finish_reason == "abort" and chunks[0].num_frames == 0
    assert chunks[0].error == "client disconnected"
    assert stats.running == 0 and stats.free_kv_blocks == stats.num_kv_blocks
    assert dec._admitting == {}


def test_pairing_least_loaded_and_round_robin():
    """Least loaded picks the idlest live decode engine (ties in turn); round robin ignores the load."""

    class Decode:
        def __init__(self, alive=True):
            self.alive = alive

        def is_alive(self):
            return self.alive

    class Prefill(Decode):
        info = None

    def router(loads, pairing="least_loaded"):
        r = PrefillDecodeRouter([Prefill()], [Decode(), Decode(), Decode(alive=False)], pairing=pairing)
        r.decode_in_flight = list(loads)
        return r

    least = router([3, 1, 0])
    assert [least.pick_decode() for _ in range(3)] == [1, 1, 1]  # the dead, idle engine is never picked
    tied = router([1, 1, 0])
    assert [tied.pick_decode() for _ in range(3)] == [0, 1, 0]  # ties go in turn (turn 2, the dead one: next)
    rr = router([3, 1, 0], "round_robin")
    assert [rr.pick_decode() for _ in range(4)] == [0, 1, 0, 0]  # the load is ignored
    with pytest.raises(ValueError, match="pairing"):
        router([0, 0, 0], "random")


def test_stop_is_in_order_so_a_handoff_on_its_way_still_decodes(loaded):
    """Stopping takes the prefill engines down first and waits for their handoffs to reach the decode
    engines, which then drain: a request whose handoff is on its way when stop() is called finishes."""
    prefill = engine(loaded)
    router = PrefillDecodeRouter([prefill], [engine(loaded)])
    req = SynthesisRequest("late", SpeechInput("Said during shutdown.", language="english", speaker_embedding=EMB,
                                               x_vector_only=True), SamplingParams(seed=1, max_new_tokens=9))
    real = prefill.generate

    async def slow_hop(r):  # the handoff takes 0.3 s to reach the router
        async for chunk in real(r):
            if chunk.finish_reason == "handoff":
                held.set()
                await asyncio.sleep(0.3)
            yield chunk

    prefill.generate = slow_hop

    async def go():
        await router.start()
        stream = asyncio.ensure_future(gather_streams(router, [req], 1))
        await held.wait()
        await router.stop(10.0)
        with pytest.raises(RequestRejected, match="shutting down") as refused:
            await anext(router.generate(req))
        assert refused.value.code == "shutting_down"
        return (await stream)[0]

    held = asyncio.Event()
    chunks = asyncio.run(go())
    assert chunks[-1].finish_reason == "length" and chunks[-1].num_frames == 8


def test_a_prefill_only_engine_has_no_codec_takes_only_handoffs_and_warms_up_with_them(loaded):
    """What the MpNd topology builds its prefill engines as: no codec decoder (nor, on a GPU, decode graphs), a
    request that would decode there refused with the reason, and a warm-up of requests that end at their handoff
    (it ran full requests, decoding frames a prefill engine never decodes)."""
    from legato.engine.engine import Engine, EngineRequest
    from legato.models.qwen3_tts.inputs import build_spec

    cfg = EngineConfig(device="cpu", dtype="float32", max_num_seqs=4, num_kv_blocks=96, max_model_len=512,
                       max_num_batched_tokens=64, prefill_only=True)
    eng = Engine(loaded, cfg)
    assert eng.codec is None
    spec = build_spec(loaded, SpeechInput("Hello there.", language="english", speaker_embedding=EMB,
                                          x_vector_only=True))
    with pytest.raises(ValueError, match="only prefills"):
        eng.add_request(EngineRequest("full", spec, SamplingParams(seed=1)))
    assert eng.warm_up() >= 0 and not eng.has_unfinished()
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    assert eng.times.decode_rows == 0  # nothing was decoded
    with pytest.raises(ValueError, match="prefill_only must be a bool"):
        EngineConfig(device="cpu", prefill_only="yes")


def test_the_mpnd_topology_builds_its_prefill_engines_prefill_only(loaded):
    from legato.pipeline.topology import build_client, parse_topology

    router = build_client(parse_topology("1p1d"), lambda device: loaded,
                          EngineConfig(device="cpu", dtype="float32", max_num_seqs=4, num_kv_blocks=96,
                                       max_model_len=512, max_num_batched_tokens=64))
    (prefill,), (decode,) = router.prefill.replicas, router.decode
    assert prefill.engine.config.prefill_only and prefill.engine.codec is None
    assert not decode.engine.config.prefill_only and decode.engine.codec is not None
