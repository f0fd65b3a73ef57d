"""Engine workers as processes: the wire contract, codes equal to the in-process engine, aborts across the
process boundary, a killed worker failing only its own requests, and a clean stop."""

from __future__ import annotations

import asyncio
import glob
import os
import signal
import time

import numpy as np
import pytest
import torch

from legato.engine.config import EngineConfig
from legato.models.qwen3_tts.inputs import SpeechInput, extract_voice
from legato.models.qwen3_tts.sampling import SamplingParams
from legato.pipeline import ipc
from legato.pipeline import messages as m
from legato.pipeline.client import EngineStats, ModelInfo, RequestRejected, StreamChunk, SynthesisRequest
from legato.pipeline.process_client import ProcessEngineClient, new_instance_id
from legato.pipeline.router import ReplicaRouter
from legato.pipeline.topology import build_client, parse_topology

EMB = torch.randn(64, generator=torch.Generator().manual_seed(0))
N = 4  # seeded requests compared across topologies


def _config() -> EngineConfig:
    return EngineConfig(device="cpu", dtype="float32", max_num_seqs=4, num_kv_blocks=128, max_model_len=512,
                        max_num_batched_tokens=256)


def _req(i: int, frames: int = 5, **kw) -> SynthesisRequest:
    inp = SpeechInput(f"Sentence number {i} is here.", language="english", speaker_embedding=EMB, x_vector_only=True)
    return SynthesisRequest(f"r{i}", inp, SamplingParams(seed=100 + i, max_new_tokens=frames + 1), **kw)


def _codes(chunks: list[StreamChunk]) -> np.ndarray:
    return np.concatenate([c.codes for c in chunks])


async def _collect(client, req) -> list[StreamChunk]:
    return [c async for c in client.generate(req)]


def _process_client(path, topology: str, instance_id: str | None = None):
    return build_client(parse_topology(topology), None, _config(), workers="process", model_path=str(path),
                        instance_id=instance_id, process_options={"torch_threads": 1, "start_timeout_s": 60})


# --- the wire contract --------------------------------------------------------------------------------


def test_messages_round_trip():
    ref = np.linspace(-1, 1, 100, dtype=np.float32)
    code = np.arange(32, dtype=np.int64).reshape(2, 16)
    inp = SpeechInput("hi", language="english", ref_audio=ref, ref_sample_rate=16000, ref_text="ref",
                      speaker_embedding=EMB, ref_code=torch.from_numpy(code), non_streaming_mode=False,
                      ref_audio_key="0123abcd")
    sub = m.Submit(SynthesisRequest("a", inp, SamplingParams(seed=7, temperature=0.5, top_k=3), max_frames=9,
                                    ignore_eos=True, first_chunk_frames=2))
    got = m.decode(m.encode(sub))
    r, gi = got.request, got.request.input
    assert (r.request_id, r.max_frames, r.ignore_eos, r.first_chunk_frames) == ("a", 9, True, 2)
    assert r.sampling == sub.request.sampling
    assert (gi.text, gi.language, gi.ref_sample_rate, gi.ref_text, gi.non_streaming_mode, gi.speaker,
            gi.ref_audio_key) == ("hi", "english", 16000, "ref", False, None, "0123abcd")
    assert np.array_equal(gi.ref_audio, ref) and torch.equal(gi.speaker_embedding, EMB)
    assert gi.ref_code.dtype == torch.int64 and torch.equal(gi.ref_code, torch.from_numpy(code))

    chunk = StreamChunk(np.ones(8, np.float32), 3, num_prompt_tokens=11, finished=True, finish_reason="error",
                        error="boom", error_code="text_too_long", seed=5, codes=code)
    back = m.decode(m.encode(m.Chunk("a", chunk))).chunk
    assert np.array_equal(back.audio, chunk.audio) and np.array_equal(back.codes, code)
    assert (back.num_frames, back.num_prompt_tokens, back.finished, back.finish_reason, back.error, back.error_code,
            back.seed) == (3, 11, True, "error", "boom", "text_too_long", 5)
    assert not back.retryable
    plain = m.decode(m.encode(m.Chunk("a", StreamChunk(np.zeros(0, np.float32), 0)))).chunk
    assert plain.codes is None and not plain.retryable and plain.error_code is None
    failed = StreamChunk(np.zeros(0, np.float32), 0, finished=True, finish_reason="error", error="x", retryable=True)
    assert m.decode(m.encode(m.Chunk("a", failed))).chunk.retryable

    info = ModelInfo("n", "base", "0b6", 24000, ["auto"], ["x"], 64)
    simple = [m.Abort("a", "gone"), m.Rejected("a", 429, "busy", 1.0), m.Rejected("b", 400, "bad"),
              m.Rejected("c", 503, "going", code="shutting_down"),
              m.Stats(EngineStats(1, 2, 0.5, 10, 5, {"client disconnected": 3}, steps=4, decode_rows=9)),
              m.Ready(info, 42, {"top_k": 50}),
              m.Shutdown(2.5), m.Heartbeat(9)]
    for msg in simple:
        assert m.decode(m.encode(msg)) == msg
    voice = m.decode(m.encode(m.VoiceResult("v", EMB.numpy(), code)))
    assert np.array_equal(voice.speaker_embedding, EMB.numpy()) and np.array_equal(voice.ref_code, code)
    ev = m.decode(m.encode(m.ExtractVoice("v", ref, 16000)))
    assert np.array_equal(ev.samples, ref) and ev.sample_rate == 16000
    opened = m.decode(m.encode(m.CodecOpen("c", code, 2)))
    assert np.array_equal(opened.ref_code, code) and opened.first_chunk_frames == 2
    assert m.decode(m.encode(m.CodecOpen("c"))).ref_code is None
    frames = m.decode(m.encode(m.CodecFrames("c", code, last=True)))
    assert np.array_equal(frames.codes, code) and frames.last
    with pytest.raises(m.MessageError, match="codes"):
        m.decode(m.encode(m.CodecFrames("c", np.zeros((2, 8), np.int64))))


def test_malformed_messages_raise_clear_errors():
    good = m.encode(m.Chunk("a", StreamChunk(np.ones(4, np.float32), 1, codes=np.zeros((1, 16), np.int64))))
    header = good[0].decode()
    cases = [
        ([], "empty"),
        ([b"\xff"], "not JSON"),
        ([b"[1]"], "not a JSON object"),
        ([header.replace('"v": 1', '"v": 9').encode(), *good[1:]], "version"),
        ([header.replace('"chunk"', '"pickle"', 1).encode(), *good[1:]], "unknown message type"),
        ([header.replace('"num_frames": 1', '"num_frames": true').encode(), *good[1:]], "'num_frames' must be int"),
        ([header.replace(', "seed": 0', '').encode(), *good[1:]], "missing field 'seed'"),
        ([header.replace('"finish_reason": null', '"finish_reason": "x"').encode(), *good[1:]], "finish_reason"),
        (good[:2], "frames follow"),
        ([good[0], good[1][:-1], good[2]], "needs 16 bytes"),
        ([header.replace('"float32"', '"float64"').encode(), *good[1:]], "bad array entry"),
        ([m.encode(m.Heartbeat(1))[0].replace(b'"seq": 1', b'"seq": "1"')], "'seq' must be int"),
    ]
    for frames, match in cases:
        with pytest.raises(m.MessageError, match=match):
            m.decode(frames)
    # Arrays of the wrong shape, and sampling values the receiver would refuse, are malformed too.
    sub = m.Submit(_req(0))
    bad_code = m.encode(m.VoiceResult("v", EMB.numpy(), np.zeros((2, 8), np.int64)))
    with pytest.raises(m.MessageError, match="ref_code"):
        m.decode(bad_code)
    frames = m.encode(sub)
    with pytest.raises(m.MessageError, match="top_k"):
        m.decode([frames[0].replace(b'"top_k": 50', b'"top_k": -3'), *frames[1:]])
    with pytest.raises(m.MessageError, match="unknown fields"):
        m.decode([frames[0].replace(b'"do_sample"', b'"evil": 1, "do_sample"'), *frames[1:]])


# --- workers ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def want(tiny_checkpoint):
    """Codes of the seeded requests from the in-process (thread) single engine."""
    from legato.models.qwen3_tts.loader import load_model

    torch.set_num_threads(1)
    single = build_client(parse_topology("single"), lambda dev: load_model(tiny_checkpoint, device=dev), _config())

    async def run():
        await single.start()
        try:
            return await asyncio.gather(*(_collect(single, _req(i)) for i in range(N)))
        finally:
            await single.stop()

    return [_codes(chunks) for chunks in asyncio.run(run())]


@pytest.fixture(scope="module")
def proc_single(tiny_checkpoint):
    client = _process_client(tiny_checkpoint, "single")
    assert isinstance(client, ProcessEngineClient)
    asyncio.run(client.start())
    yield client
    asyncio.run(client.stop())


@pytest.mark.parametrize("concurrency", [1, 4])
def test_process_single_gives_the_codes_of_thread_single(proc_single, want, concurrency):
    async def run():
        sem = asyncio.Semaphore(concurrency)

        async def one(i):
            async with sem:
                return await _collect(proc_single, _req(i))
        return await asyncio.gather(*(one(i) for i in range(N)))

    for i, chunks in enumerate(asyncio.run(run())):
        assert chunks[-1].finished and chunks[-1].finish_reason == "length"
        assert _codes(chunks).shape == (5, 16) and np.array_equal(_codes(chunks), want[i])
        assert np.concatenate([c.audio for c in chunks]).shape == (5 * 1920,)
        timed = [c for c in chunks if c.stages is not None]
        assert len(timed) == 1 and timed[0].audio.size  # the first chunk with audio, and only it
        st = timed[0].stages
        # The worker's span holds the engine client's stages (its message in -> first audio out).
        assert st["worker"] >= st["prepare"] + st["inbox"] + st["engine"] > 0


def test_process_rejection_and_voice(proc_single, tiny_checkpoint):
    bad = SynthesisRequest("bad", SpeechInput("   ", language="english", speaker_embedding=EMB, x_vector_only=True),
                           SamplingParams(seed=1))
    with pytest.raises(RequestRejected) as err:
        asyncio.run(_collect(proc_single, bad))
    assert err.value.status == 400 and "empty" in err.value.message

    from legato.models.qwen3_tts.loader import load_model

    clip = np.random.default_rng(0).uniform(-0.5, 0.5, 24000).astype(np.float32)
    got = asyncio.run(proc_single.extract_voice(clip, 24000))
    ref = extract_voice(load_model(tiny_checkpoint), clip, 24000)
    assert torch.allclose(got.speaker_embedding, ref.speaker_embedding, atol=1e-5)
    assert torch.equal(got.ref_code, ref.ref_code)


def test_closing_a_stream_aborts_in_the_worker(proc_single):
    async def run():
        gen = proc_single.generate(_req(9, frames=200, ignore_eos=True))
        seen = [await gen.__anext__() for _ in range(2)]
        await gen.aclose()
        return seen

    seen = asyncio.run(run())
    assert not seen[-1].finished
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        s = proc_single.stats()
        if s.free_kv_blocks == s.num_kv_blocks == 128 and s.aborted.get("client disconnected") == 1:
            break
        time.sleep(0.05)
    s = proc_single.stats()
    assert s.free_kv_blocks == s.num_kv_blocks == 128 and s.running == 0
    assert s.aborted == {"client disconnected": 1}
    assert proc_single.is_alive()


def test_process_replicas_give_the_codes_of_single(tiny_checkpoint, want):
    router = _process_client(tiny_checkpoint, "replicas:2")
    assert isinstance(router, ReplicaRouter) and len(router.replicas) == 2

    async def run():
        await router.start()
        try:
            return await asyncio.gather(*(_collect(router, _req(i)) for i in range(N)))
        finally:
            await router.stop()

    for i, chunks in enumerate(asyncio.run(run())):
        assert chunks[-1].finish_reason == "length" and np.array_equal(_codes(chunks), want[i])
    assert len({r.pid for r in router.replicas}) == 2 and router.in_flight == [0, 0]
    assert all(r.proc.returncode == 0 for r in router.replicas)  # an orderly Shutdown, not a kill


def test_killed_worker_fails_its_requests_and_the_other_replica_serves(tiny_checkpoint):
    instance = new_instance_id()
    router = _process_client(tiny_checkpoint, "replicas:2", instance_id=instance)
    victim, survivor = router.replicas

    async def run():
        await router.start()
        # On Linux the sockets live in the abstract namespace: nothing on disk even while they are open.
        assert all(e.startswith("ipc://@legato-") for r in router.replicas for e in r.endpoints) == ipc.ABSTRACT
        if ipc.ABSTRACT:
            assert glob.glob(f"/tmp/legato-{instance}-*") == []
        try:
            streams = [router.generate(_req(i, frames=60, ignore_eos=True)) for i in (0, 1)]
            first = [await s.__anext__() for s in streams]  # r0 placed on replica 0, r1 on replica 1
            assert router._placement == {"r0": 0, "r1": 1} and not any(c.finished for c in first)
            os.kill(victim.pid, signal.SIGKILL)
            rest = []
            for s in streams:
                rest.append([c async for c in s])
            assert not victim.is_alive() and survivor.is_alive() and router.is_alive()
            after = await _collect(router, _req(2))  # placed on the live replica
            return rest, after
        finally:
            await router.stop()

    rest, after = asyncio.run(run())
    assert rest[0][-1].finish_reason == "error" and "worker died" in rest[0][-1].error
    assert rest[1][-1].finish_reason == "length" and rest[1][-1].num_frames == 60
    assert after[-1].finish_reason == "length"
    # stop() leaves no process and no socket file behind (the SIGKILLed worker's included).
    assert victim.proc.returncode == -signal.SIGKILL and survivor.proc.returncode == 0
    assert glob.glob(f"/tmp/legato-{instance}-*") == []
    with pytest.raises(RequestRejected, match="shutting down") as refused:
        asyncio.run(_collect(survivor, _req(3)))
    assert refused.value.code == "shutting_down"


def test_summed_stats_add_every_engine_s_counters():
    """replicas and MpNd report one EngineStats for all their engines: steps, decoded rows and timers add up."""
    from legato.pipeline.router import sum_stats
    a = EngineStats(running=2, num_kv_blocks=10, free_kv_blocks=5, steps=3, decode_rows=7, step_host_s=0.5)
    b = EngineStats(running=1, num_kv_blocks=10, free_kv_blocks=10, steps=4, decode_rows=2, step_host_s=0.25)
    s = sum_stats([a, b])
    assert (s.running, s.steps, s.decode_rows, s.step_host_s) == (3, 7, 9, 0.75)
    assert s.kv_usage == 0.25


def test_a_dead_engine_s_blocks_are_not_counted_as_capacity():
    """A replica found dead holds nothing, and its blocks read as free: summed in, /health and the vLLM gauges
    showed twice the capacity left (an outside probe). Its counters still add up (they never go back)."""
    from legato.pipeline.router import ReplicaRouter, sum_stats

    a = EngineStats(running=2, waiting=1, num_kv_blocks=10, free_kv_blocks=5, steps=3, aborted={"x": 1})
    dead = EngineStats(num_kv_blocks=10, free_kv_blocks=10, steps=4, aborted={"x": 2})
    s = sum_stats([a, dead], [True, False])
    assert (s.num_kv_blocks, s.free_kv_blocks, s.kv_usage, s.running, s.waiting) == (10, 5, 0.5, 2, 1)
    assert (s.steps, s.aborted, s.engines_down) == (7, {"x": 3}, 1)

    class Replica:
        def __init__(self, stats, alive):
            self.s, self.alive, self.info = stats, alive, None

        def stats(self):
            return self.s

        def is_alive(self):
            return self.alive

    router = ReplicaRouter([Replica(a, True), Replica(dead, False)])  # type: ignore[list-item]
    assert router.stats() == s


def _every_field_set(scale: int) -> EngineStats:
    """An EngineStats whose every number differs from its default (so a field a path forgets shows)."""
    import dataclasses

    values = {}
    for i, f in enumerate(dataclasses.fields(EngineStats)):
        if f.name == "aborted":
            values[f.name] = {"gone": scale}
        elif f.name == "kv_usage":
            values[f.name] = 0.5
        else:
            values[f.name] = (i + 1) * scale * (0.5 if f.type == "float" else 1)
    return EngineStats(**values)


def test_every_stats_field_crosses_the_worker_link_and_adds_up_over_engines():
    """The streaming-text gauges once read 0 with worker processes or replicas (neither path carried them)."""
    import dataclasses

    from legato.pipeline.router import sum_stats

    sent = _every_field_set(1)
    got = m.decode(m.encode(m.Stats(sent))).stats
    # `recomputed` and `engines_down` are the routers' own counts: no worker has one to send
    assert got == dataclasses.replace(sent, recomputed=0, engines_down=0)
    a, b = _every_field_set(1), _every_field_set(3)
    total = sum_stats([a, b])
    for f in dataclasses.fields(EngineStats):
        if f.name not in ("kv_usage", "aborted"):
            assert getattr(total, f.name) == getattr(a, f.name) + getattr(b, f.name), f.name
    assert total.aborted == {"gone": 4}


def test_a_worker_whose_engine_loop_crashed_exits_and_the_server_sees_it_down(tiny_checkpoint, tmp_path,
                                                                               monkeypatch):
    """The engine thread of a worker process ending on its own (a crash the per-request guards did not catch,
    injected here into the worker's first step with a request) must not leave a live process whose heartbeats say
    all is well while every request is refused: the worker exits, the client reports it not alive (the server's
    /health then answers 503), and the request in flight ends with the reason."""
    site = tmp_path / "inject"
    site.mkdir()
    # The fault comes with the first step that has the request in: the engine thread also steps when idle (after
    # each 50 ms wait for work), and a fault there, before a slow machine delivered the request, crashed the
    # worker with nothing in flight (this test failed so once).
    (site / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('LEGATO_TEST_CRASH_STEP'):\n"
        "    import legato.engine.engine as e\n"
        "    idle_step = e.Engine.step\n"
        "    def step(self):\n"
        "        if self.has_unfinished():\n"
        "            raise RuntimeError('injected engine loop fault')\n"
        "        return idle_step(self)\n"
        "    e.Engine.step = step\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p))
    monkeypatch.setenv("LEGATO_TEST_CRASH_STEP", "1")
    client = _process_client(tiny_checkpoint, "single")

    async def run():
        await client.start()
        try:
            chunks = await asyncio.wait_for(_collect(client, _req(0)), 60)
            deadline = time.monotonic() + 60
            while client.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            return chunks, client.is_alive(), client.proc.wait(60)
        finally:
            await client.stop()

    chunks, alive, rc = asyncio.run(run())
    assert chunks[-1].finish_reason == "error" and "engine loop crashed" in chunks[-1].error
    assert not alive and rc == 1
    with pytest.raises(RequestRejected):
        asyncio.run(_collect(client, _req(1)))


@pytest.mark.parametrize("workers", ["thread", "process"])
def test_an_id_reused_right_after_its_request_was_dropped_gets_a_request_of_its_own(tiny_checkpoint, workers):
    """A client drops a request and at once sends another under the same id (an HTTP retry with its
    X-Request-Id): the old request's end must not reach the new one, which runs to its own end (an outside
    probe saw the new request fail with the old one's 'client disconnected' and then run with nobody reading)."""
    from legato.models.qwen3_tts.loader import load_model

    if workers == "process":
        client = _process_client(tiny_checkpoint, "single")
    else:
        client = build_client(parse_topology("single"), lambda device: load_model(tiny_checkpoint), _config())

    async def run():
        await client.start()
        try:
            results = []
            for _ in range(3):
                gen = client.generate(_req(0, frames=60, ignore_eos=True))
                await gen.__anext__()
                await gen.aclose()  # the client left: its request is aborted
                results.append(await asyncio.wait_for(_collect(client, _req(0, frames=5, ignore_eos=True)), 60))
            deadline = time.monotonic() + 60
            while client.stats().running and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            return results, client.stats()
        finally:
            await client.stop()

    results, stats = asyncio.run(run())
    for chunks in results:
        assert chunks[-1].finished and chunks[-1].finish_reason == "length", chunks[-1]
        assert _codes(chunks).shape == (5, 16) and chunks[-1].num_frames == 5
    assert stats.running == 0 and stats.free_kv_blocks == stats.num_kv_blocks
