"""`split`: a talker-only engine (emit_audio=False) streams codes to a codec worker. Codes and audio equal
`single`'s for seeded and greedy requests (in-context clones included), the talker runs no codec, a codec
failure fails only its request, aborts free both sides, and talker and codec worker may each run as a process."""

from __future__ import annotations

import asyncio
import contextlib
import time

import numpy as np
import pytest
import torch
from client_helpers import run_client

from legato.engine.codec_schedule import StreamSchedule, next_chunk_frames
from legato.engine.config import EngineConfig
from legato.engine.engine import Engine, EngineRequest
from legato.models.qwen3_tts.inputs import SpeechInput, build_spec
from legato.models.qwen3_tts.loader import load_model
from legato.models.qwen3_tts.sampling import SamplingParams
from legato.pipeline.client import EngineStats, RequestRejected, StreamChunk, SynthesisRequest
from legato.pipeline.codec_engine import CodecEngine, load_codec_decoder
from legato.pipeline.local import LocalEngineClient
from legato.pipeline.split import SplitClient, build_split_client

EMB = torch.randn(64, generator=torch.Generator().manual_seed(0))
REF = torch.randint(0, 2048, (9, 16), generator=torch.Generator().manual_seed(1))
CLIP = np.random.default_rng(0).uniform(-0.5, 0.5, 24000).astype(np.float32)
BLOCKS = 128


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint):
    torch.set_num_threads(1)
    return load_model(tiny_checkpoint)


def config(**kw) -> EngineConfig:
    base = dict(device="cpu", dtype="float32", max_num_seqs=8, num_kv_blocks=BLOCKS, max_model_len=512,
                max_num_batched_tokens=256, first_chunk_frames=1, chunk_frames=3)
    return EngineConfig(**{**base, **kw})


def requests(n: int) -> list[SynthesisRequest]:
    out = []
    for i in range(n):
        if i % 4 == 1:  # in-context clone of a saved voice
            inp = SpeechInput(f"In context clone number {i}.", speaker_embedding=EMB, ref_code=REF,
                              ref_text="The reference transcript.")
        elif i % 4 == 3:  # in-context clone from reference audio (its codes are extracted first)
            inp = SpeechInput(f"Cloned from audio {i}.", ref_audio=CLIP, ref_sample_rate=24000,
                              ref_text="The reference transcript.")
        else:
            inp = SpeechInput(f"Plain sentence {i}, said twice.", language="english", speaker_embedding=EMB,
                              x_vector_only=True)
        greedy = i % 3 == 2
        params = SamplingParams(seed=40 + i, max_new_tokens=7 + i % 5, do_sample=not greedy,
                                subtalker_do_sample=not greedy)
        out.append(SynthesisRequest(f"s{i}", inp, params, first_chunk_frames=2 if i == 4 else None))
    return out


run = run_client


def outcome(chunks):
    codes = np.concatenate([c.codes for c in chunks if c.codes is not None])
    return codes, np.concatenate([c.audio for c in chunks]), chunks[-1]


def split_client(tiny_checkpoint, devices, **kw) -> SplitClient:
    return build_split_client(lambda dev: load_model(tiny_checkpoint, device=dev), config(**kw), devices)


def assert_same(want, got, reqs, exact: bool = False):
    """Codes equal; audio equal bit for bit when `exact` (a request alone: the codec decodes it in the calls
    `single` makes, whatever bursts its frames came in), else up to the float rounding of other batch make-ups."""
    for r, a, b in zip(reqs, want, got, strict=True):
        ca, wa, la = outcome(a)
        cb, wb, lb = outcome(b)
        assert la.finish_reason == lb.finish_reason == "length", (r.request_id, lb.error)
        assert (la.seed, la.num_frames, la.num_prompt_tokens) == (lb.seed, lb.num_frames, lb.num_prompt_tokens)
        assert ca.shape == (r.sampling.max_new_tokens - 1, 16) and np.array_equal(ca, cb), r.request_id
        assert wa.shape == wb.shape and np.abs(wa - wb).max() < 1e-5, r.request_id
        assert not exact or np.array_equal(wa, wb), (r.request_id, int((wa != wb).sum()))


def assert_first_audio_stages(results, processes: bool) -> None:
    """The first audio chunk, and only it, says where the request's time went: the talker's stages to its first
    codes, then `codec` (those codes in -> this audio out); with worker processes also each worker's own span."""
    for chunks in results:
        timed = [c for c in chunks if c.stages is not None]
        assert len(timed) == 1 and timed[0] is next(c for c in chunks if c.audio.size)
        st = timed[0].stages
        talker = st["prepare"] + st["inbox"] + st["engine"]
        assert talker > 0 and st["codec"] > 0
        if processes:  # each worker's span lies inside the front's view of it
            assert st["worker"] >= talker and 0 < st["codec_worker"] <= st["codec"]
        else:
            assert "worker" not in st and "codec_worker" not in st


@pytest.mark.parametrize(("devices", "concurrency", "ramp"), [
    (["cpu"], 1, False), (["cpu"], 8, False), (["cpu", "cpu"], 1, False), (["cpu", "cpu"], 8, False),
    (["cpu", "cpu"], 8, True),
])
def test_split_gives_the_codes_and_audio_of_single(loaded, tiny_checkpoint, devices, concurrency, ramp):
    reqs = requests(8)
    want = asyncio.run(run(LocalEngineClient(loaded, config(chunk_ramp=ramp)), reqs, concurrency))
    client = split_client(tiny_checkpoint, devices, chunk_ramp=ramp)
    got = asyncio.run(run(client, reqs, concurrency))
    assert_same(want, got, reqs, exact=concurrency == 1)
    assert_first_audio_stages(got, processes=False)
    # The audio comes on the same schedule as single: first_chunk_frames, then the ramp up to chunk_frames.
    for r, chunks in zip(reqs, got, strict=True):
        sizes = [c.audio.size // 1920 for c in chunks if c.audio.size]
        first, emitted = r.first_chunk_frames or 1, 0
        for s in sizes[:-1]:
            assert s == next_chunk_frames(emitted, first, 3, ramp)
            emitted += s
        assert 1 <= sizes[-1] <= next_chunk_frames(emitted, first, 3, ramp)
    stats = client.stats()
    assert stats.free_kv_blocks == stats.num_kv_blocks == BLOCKS and stats.running == 0
    assert client.codec.stats().streams == 0 and client.codec.stats().frames_decoded == sum(
        r.sampling.max_new_tokens - 1 for r in reqs)


def test_talker_only_engine_runs_no_codec(tiny_checkpoint, monkeypatch):
    talker_model = load_model(tiny_checkpoint)
    reference = Engine(load_model(tiny_checkpoint), config())
    engine = Engine(talker_model, config(emit_audio=False))
    assert engine.codec is None

    def boom(*a, **kw):
        raise AssertionError("the talker-only engine ran the codec decoder")

    monkeypatch.setattr(talker_model.speech_tokenizer.decoder, "stream_step", boom)
    got = {}
    for e in (reference, engine):
        reqs = requests(3)
        for r in reqs:
            spec = build_spec(e.loaded, r.input)
            e.add_request(EngineRequest(r.request_id, spec, r.sampling))
        codes, audio = {}, {}
        while e.has_unfinished():
            for o in e.step():
                codes.setdefault(o.request_id, []).append(o.codes)
                if o.audio is not None:
                    audio.setdefault(o.request_id, []).append(o.audio)
                # A talker-only engine streams every step's codes at once.
                assert e is reference or o.finished or o.codes.shape[0] == 1
        got[e is engine] = ({k: torch.cat(v) for k, v in codes.items()}, audio)
    (want_codes, want_audio), (codes, audio) = got[False], got[True]
    assert want_audio and not audio
    assert want_codes.keys() == codes.keys() and all(torch.equal(want_codes[k], codes[k]) for k in codes)

    # In the topology too: the codec worker has its own decoder; the talker's is never touched.
    client = build_split_client(lambda dev: talker_model, config(), ["cpu", "cpu"])
    [chunks] = asyncio.run(run(client, requests(1), 1))
    assert chunks[-1].finish_reason == "length" and sum(c.audio.size for c in chunks) == 6 * 1920
    assert client.talker.engine.codec is None


def test_codec_engine_cuts_bursts_on_the_single_schedule(loaded):
    codes = torch.randint(0, 2048, (10, 16), generator=torch.Generator().manual_seed(3))
    runs = []
    for burst in (1, 10, 4):
        eng = CodecEngine(loaded.speech_tokenizer.decoder,
                          StreamSchedule(first_chunk_frames=1, chunk_frames=4, chunk_ramp=False))
        eng.open("a", ref_code=REF)
        outs = []
        for i in range(0, 10, burst):
            eng.push("a", codes[i : i + burst])
            outs += eng.step()
        eng.end("a")
        outs += eng.step()
        assert [o.frames for o in outs if o.frames] == [1, 4, 4, 1] and outs[-1].finished
        assert eng.num_streams == 0 and eng.frames_decoded == 10
        runs.append(np.concatenate([o.audio for o in outs]))
    assert all(np.array_equal(w, runs[0]) for w in runs[1:])  # a burst decodes as frames one by one do
    eng = CodecEngine(loaded.speech_tokenizer.decoder)
    eng.open("b")
    with pytest.raises(ValueError, match=r"\[n, 16\]"):
        eng.push("b", codes[:, :8])
    with pytest.raises(ValueError, match="duplicate"):
        eng.open("b")
    assert eng.abort("b") and not eng.push("b", codes) and not eng.abort("b")


def test_a_codec_client_takes_the_engine_s_gil_switch_interval(loaded, monkeypatch):
    """A codec worker process has no engine client, so its codec client sets the interval the engine's does."""
    import sys

    from legato.pipeline.codec_worker import LocalCodecClient

    before = sys.getswitchinterval()
    monkeypatch.setenv("LEGATO_GIL_SWITCH_MS", "2")
    codec = LocalCodecClient(loaded.speech_tokenizer.decoder)

    async def main():
        await codec.start()
        try:
            return sys.getswitchinterval()
        finally:
            await codec.stop()

    try:
        assert asyncio.run(main()) == 0.002
    finally:
        sys.setswitchinterval(before)


def test_codec_decoder_alone_matches_the_full_load(loaded, tiny_checkpoint):
    decoder = load_codec_decoder(tiny_checkpoint, "cpu")
    full = loaded.speech_tokenizer.decoder.state_dict()
    assert decoder.state_dict().keys() == full.keys()
    assert all(torch.equal(v, full[k]) for k, v in decoder.state_dict().items())


@pytest.mark.parametrize("every_step", [True, False], ids=["decode-every-step", "decode-when-due"])
def test_a_codec_failure_fails_only_its_request(tiny_checkpoint, every_step):
    """A decode that raises for one stream fails that request alone, also when its frames were batched with
    other streams' into one call (every step decodes all streams at once: the call is retried stream by
    stream)."""
    client = split_client(tiny_checkpoint, ["cpu", "cpu"], chunk_ramp=False, codec_decode_every_step=every_step)
    streamer = client.codec.engine.streamer
    real = streamer._decode_rows

    def flaky(rows, codes, final=False):
        bad = streamer.streams.get("f2")
        if bad is not None and bad.slot in rows:
            raise RuntimeError("injected codec fault")
        return real(rows, codes, final)

    streamer._decode_rows = flaky
    reqs = [SynthesisRequest(f"f{i}", SpeechInput(f"Sentence {i}.", language="english", speaker_embedding=EMB,
                                                  x_vector_only=True),
                             SamplingParams(seed=i, max_new_tokens=60 if i == 2 else 8), ignore_eos=True,
                             first_chunk_frames=2 if i == 2 else None) for i in range(5)]
    got = asyncio.run(run(client, reqs, 5))
    for i, chunks in enumerate(got):
        last = chunks[-1]
        if i == 2:
            assert last.finish_reason == "error" and "injected codec fault" in last.error
        else:
            assert last.finish_reason == "length" and sum(c.audio.size for c in chunks) == 7 * 1920
    stats = client.stats()
    assert stats.free_kv_blocks == stats.num_kv_blocks == BLOCKS
    # The talker's half is aborted (unless it had already finished its frames) and the failure is counted.
    assert stats.aborted.get("codec error") == 1 and set(stats.aborted) <= {"codec error", "codec failed"}
    assert client.codec.stats().streams == 0


def test_a_retryable_talker_failure_stays_retryable(tiny_checkpoint):
    """The last chunk split rebuilds from its talker's end dropped `retryable`: a talker worker's death (the
    deployment's fault, worth running elsewhere) reached the front as the request's own failure."""
    client = split_client(tiny_checkpoint, ["cpu"])
    real = client.talker.generate

    async def dying(req):  # the talker's worker dies after its first codes
        async with contextlib.aclosing(real(req)) as chunks:
            async for chunk in chunks:
                yield chunk
                if chunk.codes is not None and chunk.codes.size:
                    break
        yield StreamChunk(np.zeros(0, np.float32), 0, finished=True, finish_reason="error",
                          error="engine worker t-0 died (exit code -9)", retryable=True)

    client.talker.generate = dying
    req = SynthesisRequest("r", SpeechInput("Long enough.", language="english", speaker_embedding=EMB,
                                            x_vector_only=True), SamplingParams(seed=1, max_new_tokens=60),
                           ignore_eos=True)
    [chunks] = asyncio.run(run(client, [req], 1))
    last = chunks[-1]
    assert last.finished and last.finish_reason == "error" and "died" in last.error
    assert last.retryable


def test_abort_mid_stream_frees_both_sides(tiny_checkpoint):
    client = split_client(tiny_checkpoint, ["cpu"])
    long = SpeechInput("A long one.", language="english", speaker_embedding=EMB, x_vector_only=True)

    async def main():
        await client.start()
        try:
            gen = client.generate(SynthesisRequest("gone", long, SamplingParams(seed=1, max_new_tokens=300),
                                                   ignore_eos=True))
            seen = [await gen.__anext__() for _ in range(3)]
            await gen.aclose()  # the client went away
            other = client.generate(SynthesisRequest("cut", long, SamplingParams(seed=2, max_new_tokens=300),
                                                     ignore_eos=True))
            first = await other.__anext__()
            await client.abort("cut", "operator")
            rest = [c async for c in other]
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                s = client.stats()
                if s.free_kv_blocks == BLOCKS and s.running == 0 and client.codec.stats().streams == 0:
                    break
                await asyncio.sleep(0.02)
            return seen, [first, *rest], client.stats(), client.codec.stats()
        finally:
            await client.stop()

    seen, cut, stats, codec = asyncio.run(main())
    assert not seen[-1].finished and seen[0].audio.size == 1920
    assert cut[-1].finished and cut[-1].finish_reason == "abort" and cut[-1].error == "operator"
    assert stats.free_kv_blocks == stats.num_kv_blocks == BLOCKS and stats.running == stats.waiting == 0
    assert codec.streams == 0 and codec.failures == {}
    assert client.talker.engine.live == {}


def test_rejections_pass_through_and_open_nothing(tiny_checkpoint):
    client = split_client(tiny_checkpoint, ["cpu"])
    bad = SynthesisRequest("bad", SpeechInput("   ", language="english", speaker_embedding=EMB, x_vector_only=True),
                           SamplingParams(seed=1))

    async def main():
        await client.start()
        try:
            with pytest.raises(RequestRejected) as err:
                [c async for c in client.generate(bad)]
            await asyncio.sleep(0.2)
            return err.value, client.codec.stats()
        finally:
            await client.stop()
            assert not client.is_alive()
            with pytest.raises(RequestRejected):
                [c async for c in client.generate(requests(1)[0])]

    err, codec = asyncio.run(main())
    assert err.status == 400 and "empty" in err.message and codec.streams == 0


def process_split(tiny_checkpoint, **kw) -> SplitClient:
    return build_split_client(None, config(**kw), ["cpu", "cpu"], workers="process", model_path=str(tiny_checkpoint),
                              process_options={"torch_threads": 1, "start_timeout_s": 60})


async def settled(client: SplitClient) -> EngineStats:
    """The talker's stats once it holds no request and no KV and the codec worker no stream (15 s at most)."""
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        s = client.talker.stats()
        if s.free_kv_blocks == BLOCKS and s.running == 0 and client.codec.stats().streams == 0:
            return s
        await asyncio.sleep(0.05)
    raise AssertionError(f"not settled: {client.talker.stats()} {client.codec.stats()}")


@pytest.mark.parametrize("concurrency", [1, 8])
def test_process_split_gives_the_codes_and_audio_of_single(loaded, tiny_checkpoint, concurrency):
    """Talker and codec worker each in their own process, the codes crossing between them through this one."""
    reqs = requests(8)
    want = asyncio.run(run(LocalEngineClient(loaded, config()), reqs, concurrency))
    client = process_split(tiny_checkpoint)
    from legato.pipeline.codec_process import ProcessCodecClient
    from legato.pipeline.process_client import ProcessEngineClient

    assert isinstance(client.talker, ProcessEngineClient) and client.talker.config.emit_audio is False
    assert isinstance(client.codec, ProcessCodecClient)
    talker_audio = []
    push_generate = client.talker.push_generate

    class Spy:  # between the talker worker and the codec feed its chunks are pushed into, no task between
        def __init__(self, sink):
            self.sink = sink

        def put_nowait(self, item):
            talker_audio.append(item.audio.size)  # the flag travels to the worker: codes and no audio
            self.sink.put_nowait(item)

    client.talker.push_generate = lambda req, sink: push_generate(req, Spy(sink))
    got = asyncio.run(run(client, reqs, concurrency))
    assert_same(want, got, reqs, exact=concurrency == 1)  # an outside probe saw ±1 LSB run to run here
    assert_first_audio_stages(got, processes=True)
    assert len(talker_audio) > len(reqs) and not any(talker_audio)
    assert client.codec.stats().frames_decoded == sum(r.sampling.max_new_tokens - 1 for r in reqs)
    assert client.talker.proc.returncode == 0 and client.codec.worker.proc.returncode == 0


def test_process_split_abort_and_a_killed_codec_worker(tiny_checkpoint):
    """An abort mid-stream frees both workers; a killed codec worker fails its streams with a reason, the
    talker is left with no KV held (its half was aborted, or had already finished), and the split refuses
    new requests (503)."""
    import os
    import signal

    client = process_split(tiny_checkpoint)
    long = SpeechInput("A long one.", language="english", speaker_embedding=EMB, x_vector_only=True)

    def req(rid):
        return SynthesisRequest(rid, long, SamplingParams(seed=1, max_new_tokens=300), ignore_eos=True)

    async def main():
        await client.start()
        try:
            cut = client.generate(req("cut"))
            first = await cut.__anext__()
            await client.abort("cut", "operator")
            cut_rest = [c async for c in cut]
            await settled(client)
            doomed = client.generate(req("doomed"))
            await doomed.__anext__()
            os.kill(client.codec.worker.pid, signal.SIGKILL)
            doomed_rest = [c async for c in doomed]
            after = await settled(client)
            with pytest.raises(RequestRejected) as refused:
                await client.generate(req("late")).__anext__()
            return first, cut_rest, doomed_rest, after, refused.value
        finally:
            await client.stop()

    first, cut, doomed, after, refused = asyncio.run(main())
    assert first.audio.size == 1920 and cut[-1].finish_reason == "abort" and cut[-1].error == "operator"
    assert doomed[-1].finish_reason == "error" and "worker died" in doomed[-1].error
    assert after.free_kv_blocks == BLOCKS and set(after.aborted) <= {"operator", "codec failed"}
    assert refused.status == 503 and client.talker.proc.returncode == 0


def test_process_split_a_client_leaving_an_id_reused_at_once_and_a_refusal(tiny_checkpoint):
    """With both workers processes the talker's chunks are pushed into the codec stream (no task reads them): a
    client leaving mid-stream still frees both workers, a request sent at once under the dropped id runs to its
    own end (not the old one's), and the talker's refusal reaches the caller and leaves no codec stream open."""
    client = process_split(tiny_checkpoint)
    long = SpeechInput("A long one.", language="english", speaker_embedding=EMB, x_vector_only=True)

    async def main():
        await client.start()
        try:
            left = client.generate(SynthesisRequest("r", long, SamplingParams(seed=1, max_new_tokens=300),
                                                    ignore_eos=True))
            await left.__anext__()
            await left.aclose()  # the client went away
            again = [c async for c in client.generate(SynthesisRequest(
                "r", long, SamplingParams(seed=2, max_new_tokens=6), ignore_eos=True))]
            busy = client.talker.generate(SynthesisRequest("dup", long, SamplingParams(seed=3, max_new_tokens=300),
                                                           ignore_eos=True))
            await busy.__anext__()  # "dup" is in flight in the talker alone: the split's talker half is refused
            with pytest.raises(RequestRejected) as refused:
                [c async for c in client.generate(SynthesisRequest("dup", long, SamplingParams(seed=1)))]
            await busy.aclose()
            return again, refused.value, await settled(client)
        finally:
            await client.stop()

    again, refused, after = asyncio.run(main())
    # Its own request to its end: max_new_tokens - 1 frames, as every split and single request here makes
    assert again[-1].finish_reason == "length" and again[-1].num_frames == 5
    assert sum(c.audio.size for c in again) == 5 * 1920
    assert refused.status == 409 and "in flight" in refused.message
    assert after.free_kv_blocks == BLOCKS and set(after.aborted) <= {"client disconnected"}
