"""The in-process engine client: streams, rejections as values, aborts that free blocks, graceful stop."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
import torch

from legato.engine.config import EngineConfig
from legato.models.qwen3_tts.inputs import SpeechInput
from legato.models.qwen3_tts.loader import load_model
from legato.models.qwen3_tts.sampling import SamplingParams
from legato.pipeline.client import RequestRejected, SynthesisRequest
from legato.pipeline.local import LocalEngineClient

EMB = torch.randn(64, generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint):
    torch.set_num_threads(1)
    return load_model(tiny_checkpoint)


def make_client(loaded, **kw) -> LocalEngineClient:
    cfg = dict(device="cpu", dtype="float32", max_num_seqs=4, num_kv_blocks=128, max_model_len=512,
               max_num_batched_tokens=256, max_waiting=8)
    cfg.update(kw)
    return LocalEngineClient(loaded, EngineConfig(**cfg))


def request(rid: str, frames: int = 6, text: str = "Hello there.", **kw) -> SynthesisRequest:
    inp = SpeechInput(text, language="english", speaker_embedding=EMB, x_vector_only=True)
    return SynthesisRequest(rid, inp, SamplingParams(seed=1, max_new_tokens=frames + 1), **kw)


async def collect(client, req):
    chunks = [c async for c in client.generate(req)]
    return chunks, np.concatenate([c.audio for c in chunks])


def test_stream_delivers_all_audio_and_usage(loaded):
    async def main():
        client = make_client(loaded)
        await client.start()
        try:
            chunks, audio = await collect(client, request("a", frames=6, first_chunk_frames=2))
        finally:
            await client.stop()
        return chunks, audio

    chunks, audio = asyncio.run(main())
    assert chunks[-1].finished and chunks[-1].finish_reason == "length"
    assert chunks[-1].num_frames == 6 and audio.shape == (6 * 1920,)
    first_audio = next(c for c in chunks if c.audio.size)
    assert first_audio.audio.shape == (2 * 1920,)  # the requested first chunk size
    assert np.concatenate([c.codes for c in chunks]).shape == (6, 16)
    assert chunks[-1].num_prompt_tokens > 0


def test_bad_request_is_rejected_with_400(loaded):
    async def main():
        client = make_client(loaded)
        await client.start()
        try:
            bad = SynthesisRequest("b", SpeechInput("Hi", language="klingon", speaker_embedding=EMB,
                                                    x_vector_only=True), SamplingParams(seed=1, max_new_tokens=4))
            with pytest.raises(RequestRejected) as err:
                await collect(client, bad)
            ok, _ = await collect(client, request("ok"))  # the engine keeps serving
        finally:
            await client.stop()
        return err.value, ok

    err, ok = asyncio.run(main())
    assert err.status == 400 and "klingon" in err.message
    assert ok[-1].finish_reason == "length"


def test_full_queue_is_429_with_retry_after(loaded):
    async def main():
        client = make_client(loaded, max_num_seqs=1, max_waiting=1)
        await client.start()
        try:
            streams = [client.generate(request(f"q{i}", frames=30)) for i in range(4)]
            results = await asyncio.gather(*(collect_safe(s) for s in streams))
        finally:
            await client.stop()
        return results

    async def collect_safe(stream):
        try:
            return [c async for c in stream]
        except RequestRejected as e:
            return e

    results = asyncio.run(main())
    rejected = [r for r in results if isinstance(r, RequestRejected)]
    assert rejected and all(r.status == 429 and r.retry_after for r in rejected)
    assert any(not isinstance(r, RequestRejected) and r[-1].finish_reason == "length" for r in results)


def test_closing_the_stream_aborts_and_frees_blocks(loaded):
    async def main():
        client = make_client(loaded)
        await client.start()
        try:
            stream = client.generate(request("d", frames=200, ignore_eos=True, first_chunk_frames=1))
            first = await stream.__anext__()
            while not first.audio.size:
                first = await stream.__anext__()
            await stream.aclose()  # the HTTP client went away
            for _ in range(100):
                await asyncio.sleep(0.02)
                stats = client.stats()
                if stats.free_kv_blocks == stats.num_kv_blocks and stats.running == 0:
                    break
        finally:
            await client.stop()
        return first, client.stats()

    first, stats = asyncio.run(main())
    assert first.audio.size == 1920
    assert stats.free_kv_blocks == stats.num_kv_blocks
    assert stats.aborted.get("client disconnected") == 1


def test_stop_finishes_running_requests_then_refuses(loaded):
    async def main():
        client = make_client(loaded)
        await client.start()
        task = asyncio.create_task(collect(client, request("s", frames=5)))
        # Admitted before the stop, which refuses what is not in yet (a fixed 50 ms is a guess a busy box can miss).
        deadline = time.monotonic() + 30.0
        while client.stats().waiting + client.stats().running == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await client.stop(grace_s=30)
        chunks, _ = await task
        with pytest.raises(RequestRejected) as err:
            await collect(client, request("late"))
        return chunks, err.value

    chunks, err = asyncio.run(main())
    assert chunks[-1].finish_reason == "length"
    assert err.status == 503 and err.code == "shutting_down"  # carried, not read out of the message


def test_extract_voice_runs_on_the_engine_thread(loaded):
    from pathlib import Path

    import soundfile as sf

    wav, sr = sf.read(Path(__file__).parent / "data" / "voice01.wav", dtype="float32")

    async def main():
        client = make_client(loaded)
        await client.start()
        try:
            feats = await client.extract_voice(wav, sr)
            with pytest.raises(RequestRejected) as err:
                await client.extract_voice(np.zeros(10, np.float32), sr)
        finally:
            await client.stop()
        return feats, err.value

    feats, err = asyncio.run(main())
    assert feats.speaker_embedding.shape == (64,)
    assert feats.ref_code.shape == (-(-len(wav) // 1920), 16)
    assert err.status == 400


def test_a_refused_duplicate_id_does_not_abort_the_live_request(loaded):
    """A second request reusing a live request's id is refused; its cleanup must not abort the first one."""
    async def main():
        client = make_client(loaded)
        await client.start()
        try:
            first = asyncio.create_task(collect(client, request("dup", frames=8, ignore_eos=True)))
            while client.stats().running == 0:
                await asyncio.sleep(0.01)
            with pytest.raises(RequestRejected) as err:
                await collect(client, request("dup"))
            chunks, _ = await first
        finally:
            await client.stop()
        return err.value, chunks

    err, chunks = asyncio.run(main())
    assert err.status == 409 and "duplicate" in err.message  # a conflict, as the server and worker links say
    assert chunks[-1].finish_reason == "length" and chunks[-1].num_frames == 8


def test_a_duplicate_id_during_its_namesakes_admission_is_refused_and_leaves_it_whole(loaded):
    """Two requests under one id (a client's X-Request-Id sent twice) while the first is still being admitted: the
    second is refused at once as a duplicate. Before, it took over the first's admission guard, so an abort of
    either reached the wrong one, and the second was refused only by the engine, after building its prompt."""
    release, entered = threading.Event(), threading.Event()

    async def main():
        client = make_client(loaded)
        build = client._engine_request

        def held_build(*args, **kwargs):  # admission thread: held until the duplicate has been refused
            entered.set()
            assert release.wait(60), "the test never released admission"
            return build(*args, **kwargs)

        client._engine_request = held_build
        await client.start()
        try:
            first = asyncio.create_task(collect(client, request("dup", frames=4, ignore_eos=True)))
            assert await asyncio.to_thread(entered.wait, 60), "the first request never reached admission"
            with pytest.raises(RequestRejected) as err:
                await asyncio.wait_for(collect(client, request("dup")), 30)  # refused without admission's help
            release.set()
            chunks, _ = await asyncio.wait_for(first, 60)
            # the id is free again once its request has ended: a third request under it runs
            client._engine_request = build
            again, _ = await asyncio.wait_for(collect(client, request("dup", frames=2, ignore_eos=True)), 60)
            stats = client.stats()
        finally:
            release.set()
            await client.stop()
        return err.value, chunks, again, stats

    err, chunks, again, stats = asyncio.run(main())
    assert err.status == 409 and "duplicate" in err.message
    assert chunks[-1].finish_reason == "length" and chunks[-1].num_frames == 4  # untouched by its namesake
    assert again[-1].finish_reason == "length" and again[-1].num_frames == 2
    assert stats.aborted == {} and stats.free_kv_blocks == stats.num_kv_blocks


def test_a_dead_engine_refuses_at_once_instead_of_hanging(loaded):
    async def main():
        client = make_client(loaded)

        def crash():
            raise RuntimeError("scheduler invariant broken")

        client.engine.step = crash  # the loop itself fails (not one request's step)
        await client.start()
        await asyncio.wait_for(asyncio.to_thread(client._stopped.wait, 10), 15)
        assert not client.is_alive()
        with pytest.raises(RequestRejected) as gen_err:
            await asyncio.wait_for(collect(client, request("after-crash")), 5)
        with pytest.raises(RequestRejected) as voice_err:
            await asyncio.wait_for(client.extract_voice(np.zeros(24000, np.float32), 24000), 5)
        await asyncio.wait_for(client.stop(grace_s=0), 5)
        return gen_err.value, voice_err.value

    gen_err, voice_err = asyncio.run(main())
    assert gen_err.status == voice_err.status == 503


def test_stop_uses_the_given_grace_and_returns_at_once_before_start(loaded):
    async def main():
        idle = make_client(loaded)
        t0 = asyncio.get_running_loop().time()
        await idle.stop(grace_s=5)  # never started: nothing to wait for
        never_started_s = asyncio.get_running_loop().time() - t0
        client = make_client(loaded)
        await client.start()
        task = asyncio.create_task(collect(client, request("long", frames=400, ignore_eos=True)))
        while client.stats().running == 0:
            await asyncio.sleep(0.01)
        t0 = asyncio.get_running_loop().time()
        await client.stop(grace_s=0.2)
        chunks, _ = await task
        return never_started_s, asyncio.get_running_loop().time() - t0, chunks

    never_started_s, stop_s, chunks = asyncio.run(main())
    assert never_started_s < 1
    assert chunks[-1].finish_reason == "abort" and stop_s < 5


@pytest.mark.parametrize("cache_size", [0, 2])
def test_a_reference_clip_sent_again_is_not_encoded_again(loaded, monkeypatch, cache_size):
    """Voice clones with the same clip reuse its features (same codes as encoding it each time); the cache
    keeps `voice_cache_size` clips, least recently used out first, and 0 turns it off."""
    from legato.models.qwen3_tts import inputs

    calls = []
    real = inputs.extract_voice
    monkeypatch.setattr(inputs, "extract_voice", lambda *a, **kw: (calls.append(a[2]), real(*a, **kw))[1])
    rng = np.random.default_rng(0)
    clips = [rng.uniform(-0.5, 0.5, 24000).astype(np.float32) for _ in range(3)]

    def clone(rid, clip, rate=24000):
        inp = SpeechInput("Cloned speech.", language="english", ref_audio=clip, ref_sample_rate=rate,
                          ref_text="A reference transcript.")
        return SynthesisRequest(rid, inp, SamplingParams(seed=5, max_new_tokens=5))

    async def main():
        client = make_client(loaded, voice_cache_size=cache_size)
        await client.start()
        try:
            order = [(0, 24000), (0, 24000), (1, 24000), (0, 16000), (0, 24000), (2, 24000), (1, 24000)]
            out = [(await collect(client, clone(f"c{i}", clips[c], r)))[0] for i, (c, r) in enumerate(order)]
        finally:
            await client.stop()
        return out, client.voices

    out, cache = asyncio.run(main())
    codes = [np.concatenate([c.codes for c in chunks]) for chunks in out]
    assert np.array_equal(codes[0], codes[1]) and np.array_equal(codes[0], codes[4])
    if cache_size == 0:
        assert len(calls) == 7
    else:
        # 0 miss, 0 hit, 1 miss, 0@16k miss (a rate is part of the key; evicts 0), 0 miss (evicts 1),
        # 2 miss (evicts 0@16k), 1 miss.
        assert len(calls) == 6 and (cache.hits, cache.misses) == (1, 6)


def test_an_x_vector_only_clip_skips_the_codec_encoder_until_a_clone_needs_its_codes(loaded, monkeypatch):
    """x-vector-only requests use the speaker encoder alone; a clone of the same clip later adds the codes to
    the cached entry (once), and both get exactly what a fresh extraction gives."""
    from legato.models.qwen3_tts import inputs

    encodes = []
    encoder = loaded.speech_tokenizer.encoder
    real_encode = encoder.encode
    monkeypatch.setattr(encoder, "encode", lambda wav: (encodes.append(len(wav)), real_encode(wav))[1])
    clip = np.random.default_rng(1).uniform(-0.5, 0.5, 24000).astype(np.float32)
    fresh = inputs.extract_voice(loaded, clip, 24000)
    assert len(encodes) == 1
    cache = inputs.VoiceCache(4)
    xvec = cache(loaded, clip, 24000, codes=False)
    again = cache(loaded, clip, 24000, codes=False)
    assert xvec.ref_code is None and again.ref_code is None and len(encodes) == 1  # no codec encoder run
    assert torch.equal(xvec.speaker_embedding, fresh.speaker_embedding)
    full = cache(loaded, clip, 24000)
    cache(loaded, clip, 24000)
    assert len(encodes) == 2 and torch.equal(full.ref_code, fresh.ref_code)  # codes added once, then hits
    assert (cache.hits, cache.misses) == (2, 2)
    spec = inputs.build_spec(loaded, SpeechInput("Hi there.", ref_audio=clip, ref_sample_rate=24000,
                                                 x_vector_only=True), inputs.VoiceCache(4))
    assert spec.x_vector_only and spec.ref_code is None and len(encodes) == 2


def test_the_voice_cache_encodes_a_clip_once_and_a_lookup_never_waits(loaded, monkeypatch):
    """Two threads bringing one new clip: one encodes, the other waits for that encode and gets the same
    features. Meanwhile a lookup of a cached clip answers at once, and one of the clip being encoded says
    it is not there yet."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from legato.models.qwen3_tts import inputs

    real = inputs.extract_voice
    release, entered, calls = threading.Event(), threading.Event(), []
    rng = np.random.default_rng(4)
    known, new = rng.uniform(-0.5, 0.5, 30000).astype(np.float32), rng.uniform(-0.5, 0.5, 24000).astype(np.float32)

    def extract(loaded_model, samples, rate, key=None, codes=True):
        calls.append(len(samples))
        if len(samples) == len(new):
            entered.set()
            assert release.wait(60), "the test never released the encoder"
        return real(loaded_model, samples, rate, codes=codes)

    monkeypatch.setattr(inputs, "extract_voice", extract)
    cache = inputs.VoiceCache(4)
    cache(loaded, known, 24000)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(cache, loaded, new, 24000)
        assert entered.wait(30)
        second = pool.submit(cache, loaded, new, 24000)
        try:
            assert cache.lookup(inputs.voice_key(known, 24000)) is not None
            assert cache.lookup(inputs.voice_key(new, 24000)) is None
        finally:
            release.set()
        a, b = first.result(60), second.result(60)
    assert calls == [len(known), len(new)]
    assert torch.equal(a.speaker_embedding, b.speaker_embedding) and torch.equal(a.ref_code, b.ref_code)
    assert (cache.hits, cache.misses) == (2, 2)


def test_a_slow_voice_encode_never_stalls_running_streams(loaded, monkeypatch):
    """Admission work (here a reference clip whose encoding blocks) runs off the engine thread: a stream
    already running finishes while the new request's voice is still being encoded, and that request then
    runs normally."""
    import threading

    from legato.models.qwen3_tts import inputs

    release = threading.Event()
    entered = threading.Event()

    def slow_extract(loaded_model, samples, rate, key=None, codes=True):
        entered.set()
        assert release.wait(60), "the test never released the encoder"
        return inputs.VoiceFeatures(EMB.clone(), torch.zeros(0, 16, dtype=torch.long))

    async def main():
        client = make_client(loaded)
        await client.start()
        monkeypatch.setattr(inputs, "extract_voice", slow_extract)  # after the start-up's own encode
        clip = SpeechInput("Hello there.", language="english", ref_audio=np.zeros(24000, np.float32),
                           x_vector_only=True)
        blocked = None
        try:
            running = []
            async for chunk in client.generate(request("running", frames=12, first_chunk_frames=1)):
                running.append(chunk)
                if blocked is None:  # the first chunk is out: now a request arrives whose voice blocks
                    blocked = asyncio.create_task(collect(client, SynthesisRequest(
                        "clip", clip, SamplingParams(seed=1, max_new_tokens=5))))
                    assert await asyncio.to_thread(entered.wait, 30)
            assert not blocked.done()  # its voice is still being encoded
            release.set()
            late, _ = await asyncio.wait_for(blocked, 60)
        finally:
            release.set()
            await client.stop()
        return running, late

    running, late = asyncio.run(main())
    assert running[-1].finish_reason == "length" and running[-1].num_frames == 12
    assert late[-1].finish_reason == "length" and late[-1].num_frames == 4


def test_a_new_clip_encoding_never_holds_up_requests_whose_voice_is_known(loaded, monkeypatch):
    """A new reference clip is encoded on its own thread: while its encode blocks, requests with a cached clip
    or a speaker embedding are admitted and finish, and each gets what it would have got alone."""
    import threading

    from legato.models.qwen3_tts import inputs

    rng = np.random.default_rng(3)
    known_clip, new_clip = (rng.uniform(-0.5, 0.5, 24000).astype(np.float32) for _ in range(2))
    real = inputs.extract_voice
    release, entered = threading.Event(), threading.Event()

    def extract(loaded_model, samples, rate, key=None, codes=True):
        if np.array_equal(samples, new_clip):
            entered.set()
            assert release.wait(60), "the test never released the encoder"
        return real(loaded_model, samples, rate, codes=codes)

    def clone(rid, clip):
        inp = SpeechInput("Cloned speech.", language="english", ref_audio=clip, ref_text="A reference transcript.")
        return SynthesisRequest(rid, inp, SamplingParams(seed=5, max_new_tokens=5))

    async def main():
        client = make_client(loaded)
        await client.start()
        try:
            alone = await collect(client, clone("known-alone", known_clip))  # encodes it: cached from now on
            monkeypatch.setattr(inputs, "extract_voice", extract)
            blocked = asyncio.create_task(collect(client, clone("new", new_clip)))
            assert await asyncio.to_thread(entered.wait, 30)
            known = await asyncio.wait_for(collect(client, clone("known", known_clip)), 60)
            plain = await asyncio.wait_for(collect(client, request("embedding", frames=4)), 60)
            assert not blocked.done()  # all the while, the new clip was still encoding
            release.set()
            late = await asyncio.wait_for(blocked, 60)
        finally:
            release.set()
            await client.stop()
        return alone, known, plain, late, client.voices

    alone, known, plain, late, voices = asyncio.run(main())
    codes = [np.concatenate([c.codes for c in chunks]) for chunks, _ in (alone, known)]
    assert np.array_equal(codes[0], codes[1])
    assert known[0][-1].finish_reason == "length" and plain[0][-1].finish_reason == "length"
    assert late[0][-1].finish_reason == "length"
    assert (voices.hits, voices.misses) == (1, 2)


def test_stats_count_steps_and_the_loop_time_around_them(loaded):
    async def main():
        client = make_client(loaded)
        await client.start()
        try:
            await collect(client, request("timed", frames=6))
            ok = await asyncio.to_thread(_wait_for, lambda: client.stats().steps >= 6 and
                                         client.stats().loop_other_s > 0 and client.stats().decode_rows > 0, 30)
        finally:
            await client.stop()
        return ok, client.stats()

    ok, stats = asyncio.run(main())
    assert ok, stats
    assert stats.step_host_s > 0 and stats.loop_other_s > 0 and stats.running == 0
    assert 0 < stats.decode_rows <= stats.steps  # one stream: at most one decoded row a step


def _wait_for(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def test_a_bad_gil_switch_interval_is_refused_in_one_line(monkeypatch):
    import sys

    from legato.pipeline.local import set_gil_switch_interval

    before = sys.getswitchinterval()
    for bad in ("fast", "-1", "nan", "inf"):
        monkeypatch.setenv("LEGATO_GIL_SWITCH_MS", bad)
        with pytest.raises(ValueError, match="LEGATO_GIL_SWITCH_MS"):
            set_gil_switch_interval()
        assert sys.getswitchinterval() == before
    monkeypatch.setenv("LEGATO_GIL_SWITCH_MS", "0")
    set_gil_switch_interval()
    assert sys.getswitchinterval() == before  # 0 leaves the interpreter's own


def test_generate_into_hands_each_step_over_in_one_call_with_the_streams_chunks(loaded):
    """`generate_into` (the worker's path): the chunks `generate` gives, per request in order, but a step's chunks
    of every stream sharing a sink arrive in one call; each call returns after its request's last chunk."""
    async def main():
        client = make_client(loaded)
        await client.start()
        try:
            alone = {rid: (await collect(client, request(rid, frames=5 + i, first_chunk_frames=1)))[0]
                     for i, rid in enumerate("abc")}
            calls: list[list] = []
            await asyncio.gather(*(client.generate_into(request(rid, frames=5 + i, first_chunk_frames=1),
                                                        calls.append) for i, rid in enumerate("abc")))
            refused = []
            with pytest.raises(RequestRejected) as err:
                await client.generate_into(SynthesisRequest("bad", SpeechInput(
                    "Hi", language="klingon", speaker_embedding=EMB, x_vector_only=True),
                    SamplingParams(seed=1, max_new_tokens=4)), refused.append)
        finally:
            await client.stop()
        return alone, calls, refused, err.value

    alone, calls, refused, err = asyncio.run(main())
    got = {rid: [c for call in calls for r, c in call if r == rid] for rid in "abc"}
    for rid in "abc":
        assert [c.num_frames for c in got[rid]] == [c.num_frames for c in alone[rid]], rid
        assert np.array_equal(np.concatenate([c.codes for c in got[rid]]),
                              np.concatenate([c.codes for c in alone[rid]])), rid
        # The codec decoded them in one batch here, alone there: the same audio to float rounding.
        np.testing.assert_allclose(np.concatenate([c.audio for c in got[rid]]),
                                   np.concatenate([c.audio for c in alone[rid]]), atol=1e-5, err_msg=rid)
        assert got[rid][-1].finished and sum(c.finished for c in got[rid]) == 1
        # The first chunk with audio says where the time before it went; no other chunk does.
        timed = [c for c in got[rid] if c.stages is not None]
        assert len(timed) == 1 and timed[0] is next(c for c in got[rid] if c.audio.size), rid
        st = timed[0].stages
        assert set(st) == {"prepare", "inbox", "engine", "voice", "queue", "build", "resume"}, rid
        assert min(st.values()) >= 0, st
        # `prepare` split into its steps (voice found, admission queue, the batch's build, the loop resuming).
        assert abs(st["voice"] + st["queue"] + st["build"] + st["resume"] - st["prepare"]) < 1e-9, st
    # The three ran together: some call carried chunks of more than one request.
    assert max(len({r for r, _ in call}) for call in calls) > 1
    assert err.status == 400 and refused == []


def test_cancelling_generate_into_aborts_the_request_and_frees_its_blocks(loaded):
    async def main():
        client = make_client(loaded)
        await client.start()
        try:
            seen = asyncio.Event()

            def sink(items):
                if any(c.audio.size for _, c in items):
                    seen.set()

            task = asyncio.ensure_future(client.generate_into(
                request("d", frames=200, ignore_eos=True, first_chunk_frames=1), sink))
            await asyncio.wait_for(seen.wait(), 60)
            task.cancel()  # the worker dropped the request
            for _ in range(500):
                stats = client.stats()
                if stats.free_kv_blocks == stats.num_kv_blocks and stats.running == 0:
                    break
                await asyncio.sleep(0.02)
        finally:
            await client.stop()
        return task, client.stats()

    task, stats = asyncio.run(main())
    assert task.cancelled()
    assert stats.free_kv_blocks == stats.num_kv_blocks and stats.running == 0
    assert stats.aborted.get("client disconnected") == 1


@pytest.mark.parametrize("during", ["before_it_runs", "during_admission"])
def test_a_request_aborted_before_it_reached_the_engine_ends_with_the_abort(loaded, during):
    """A worker process starts a request's task for its front's Submit and handles the front's Abort (a client
    that left at once) as a message of its own, before or while that task admits the request. The engine had
    nothing to abort yet, and the request was added after the abort: it ran to its frame cap for nobody (200
    frames here, minutes of a CPU worker for a client that connected and left)."""

    async def main():
        client = make_client(loaded)
        await client.start()
        sunk: list = []
        try:
            run = asyncio.ensure_future(client.generate_into(request("gone", frames=200, ignore_eos=True),
                                                             sunk.extend))
            if during == "during_admission":  # the task has started and waits on the admission thread
                await asyncio.sleep(0)  # one pass of the loop: the task runs to its first wait (no timing)
                assert not run.done()
            await client.abort("gone", "client disconnected")
            await asyncio.wait_for(run, 60)
            stats = client.stats()
        finally:
            await client.stop()
        return [c for _, c in sunk], stats, client

    chunks, stats, client = asyncio.run(main())
    assert len(chunks) == 1 and chunks[0].finish_reason == "abort" and chunks[0].num_frames == 0
    assert stats.running == 0 and stats.free_kv_blocks == stats.num_kv_blocks
    assert client._admitting == {}


def test_a_burst_admitted_as_one_batch_reaches_the_engine_with_each_prompt_built_alone(loaded):
    """Requests that queue for the admission thread while it works are prepared as one batch (their prompts built
    together), reach the engine in the order they came, and carry the prompt each gets alone; a bad request among
    them is refused alone."""
    from legato.models.qwen3_tts.inputs import build_spec
    from legato.models.qwen3_tts.prompt_build import build_prompt

    texts = ["Hello there.", "A longer sentence, with a few more words in it.", "Hi.", "Numbers: 1, 2, 3.",
             "Streams join and leave.", "The last one."]
    burst = [request(f"r{i}", frames=2, text=t) for i, t in enumerate(texts)]
    bad = SynthesisRequest("bad", SpeechInput("Hi", language="klingon", speaker_embedding=EMB, x_vector_only=True),
                           SamplingParams(seed=1, max_new_tokens=3))
    burst.insert(3, bad)

    async def main():
        client = make_client(loaded, max_num_seqs=8, max_waiting=16)
        reached = []
        add = client.engine.add_request
        client.engine.add_request = lambda er: (reached.append(er), add(er))[1]
        admission = client._admission

        entered = threading.Event()

        def hold_until_the_burst_is_queued():  # the admission thread's first job: the burst queues behind it
            entered.set()
            deadline = time.monotonic() + 30
            while admission._queue.qsize() < len(burst):
                assert time.monotonic() < deadline, f"the burst never queued ({admission._queue.qsize()})"
                time.sleep(0.001)
            raise RuntimeError("held")

        await client.start()
        try:
            holder = asyncio.wrap_future(admission.submit(hold_until_the_burst_is_queued))
            deadline = time.monotonic() + 30
            while not entered.is_set():  # its batch is formed (the holder alone) before the burst comes
                assert time.monotonic() < deadline, "the admission thread never started"
                await asyncio.sleep(0.001)
            results = await asyncio.gather(*(collect(client, r) for r in burst), return_exceptions=True)
            with pytest.raises(RuntimeError, match="held"):
                await holder
        finally:
            await client.stop()
        return results, reached, (admission.batches, admission.requests)

    results, reached, (batches, requests) = asyncio.run(main())
    assert isinstance(results[3], RequestRejected) and results[3].status == 400 and "klingon" in str(results[3])
    assert all(not isinstance(r, BaseException) and r[0][-1].finish_reason == "length"
               for i, r in enumerate(results) if i != 3)
    assert (batches, requests) == (2, 1 + len(burst))  # the holder, then the burst queued behind it as one batch
    assert [er.request_id for er in reached] == [r.request_id for r in burst if r is not bad]
    for er, req in zip(reached, (r for r in burst if r is not bad), strict=True):
        alone = build_prompt(build_spec(loaded, req.input), loaded.talker, loaded.config)
        assert torch.equal(er.prompt.embeds, alone.embeds)
        assert torch.equal(er.prompt.trailing_text, alone.trailing_text)


def test_the_admission_warm_up_builds_one_prompt_on_the_admission_thread_and_nothing_reaches_the_engine(loaded):
    """On a GPU `start` builds a full batch of throwaway prompts on the admission thread (its first costs a cuBLAS
    handle, a full batch's pinned buffers); the same call on the CPU: max_batch requests prepared, none reaching
    the engine."""
    async def main():
        client = make_client(loaded)
        seconds = await client._warm_up_admission()
        batches = (client._admission.batches, client._admission.requests, client._admission.max_batch)
        await client.stop()
        return seconds, batches, client.engine.has_unfinished()

    seconds, batches, unfinished = asyncio.run(main())
    done, requests, full = batches
    assert seconds >= 0 and requests == full and 1 <= done <= full and not unfinished
