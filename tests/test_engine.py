"""The engine against the reference loop, and its placement invariance, streaming and bookkeeping."""

from __future__ import annotations

import logging
import math
import random

import numpy as np
import pytest
import torch
from engine_helpers import engine_config, run_all, tiny_model

from legato.engine.engine import Engine, EngineRequest, warm_up_input
from legato.models.qwen3_tts.inputs import SpeechInput, build_spec
from legato.models.qwen3_tts.prompt import target_text_tokens
from legato.models.qwen3_tts.prompt_build import build_prompt
from legato.models.qwen3_tts.reference_loop import generate_codes
from legato.models.qwen3_tts.sampling import SamplingParams

TEXTS = [
    "Hello world, this is a test.",
    "Please call Stella and ask her to bring these things.",
    "今天天气很好，我们一起去公园散步吧。",
    "Short.",
    "The quick brown fox jumps over the lazy dog, twice, and then takes a long nap in the sun.",
]


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    yield


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("engine-models")


def greedy(max_new_tokens: int = 21) -> SamplingParams:
    return SamplingParams(do_sample=False, subtalker_do_sample=False, max_new_tokens=max_new_tokens)


def sampled(seed: int, max_new_tokens: int = 16, **kw) -> SamplingParams:
    return SamplingParams(seed=seed, max_new_tokens=max_new_tokens, **kw)


def base_inputs(seed: int = 0) -> list[SpeechInput]:
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(64, generator=g)
    ref = torch.randint(0, 2048, (7, 16), generator=g)
    return [
        SpeechInput(TEXTS[0], language="english", speaker_embedding=emb, x_vector_only=True),
        SpeechInput(TEXTS[1], language="english", speaker_embedding=emb, x_vector_only=True, non_streaming_mode=True),
        SpeechInput(TEXTS[4], speaker_embedding=emb, ref_code=ref, ref_text="A reference transcript here."),
        SpeechInput(TEXTS[2], language="chinese", speaker_embedding=emb, ref_code=ref, ref_text="Ref.",
                    non_streaming_mode=True),
    ]


MODE_INPUTS = {
    "base": base_inputs,
    "custom_voice": lambda: [
        SpeechInput(TEXTS[0], language="english", speaker="ryan"),
        SpeechInput(TEXTS[2], speaker="eric", non_streaming_mode=False),
    ],
    "voice_design": lambda: [
        SpeechInput(TEXTS[1], instructions="A calm, deep narrator voice."),
        SpeechInput(TEXTS[3], language="english", instructions="Bright and fast.", non_streaming_mode=False),
    ],
}


@pytest.mark.parametrize("model_type", list(MODE_INPUTS))
def test_greedy_engine_equals_reference_loop(root, model_type):
    lm = tiny_model(root, model_type)
    inputs = MODE_INPUTS[model_type]()
    specs = [build_spec(lm, i) for i in inputs]
    expected = [generate_codes(lm.talker, build_prompt(s, lm.talker, lm.config), greedy()) for s in specs]
    engine = Engine(lm, engine_config())
    got = run_all(engine, [EngineRequest(f"r{i}", s, greedy()) for i, s in enumerate(specs)])
    for i, exp in enumerate(expected):
        assert torch.equal(got.frames(f"r{i}"), exp), f"request {i}"
        assert got.finish_count[f"r{i}"] == 1


def _mixed_requests(lm, seed_base: int = 100) -> list[EngineRequest]:
    specs = [build_spec(lm, i) for i in base_inputs(1)]
    reqs = []
    for i in range(8):
        params = sampled(seed_base + i, max_new_tokens=8 + 3 * (i % 4),
                         temperature=0.7 + 0.1 * (i % 3), top_k=[0, 50, 10][i % 3], top_p=[1.0, 0.9, 0.8][i % 3])
        if i == 5:
            params = greedy(14)
        reqs.append(EngineRequest(f"m{i}", specs[i % len(specs)], params))
    return reqs


def test_seeded_request_is_placement_invariant(root):
    """One seeded request gives the same codes alone, in a batch of 8 mixed requests, with chunked prefill
    on or off, and with requests joining and leaving mid-run."""
    lm = tiny_model(root, "base")
    target = _mixed_requests(lm)[2]
    alone = run_all(Engine(lm, engine_config()), [target]).frames("m2")
    assert alone.shape[0] == target.sampling.max_new_tokens - 1

    batch = run_all(Engine(lm, engine_config()), _mixed_requests(lm))
    assert torch.equal(batch.frames("m2"), alone)

    # A 16-token budget forces the ICL prompts through several prefill chunks, mixed with decodes.
    chunked = run_all(Engine(lm, engine_config(max_num_batched_tokens=16)), _mixed_requests(lm))
    assert torch.equal(chunked.frames("m2"), alone)
    whole = run_all(Engine(lm, engine_config(enable_chunked_prefill=False)), _mixed_requests(lm))
    assert torch.equal(whole.frames("m2"), alone)

    reqs = _mixed_requests(lm)
    joining = run_all(Engine(lm, engine_config(max_num_seqs=4)), reqs[:3], join_at={4: reqs[3:6], 9: reqs[6:]})
    assert torch.equal(joining.frames("m2"), alone)
    for r in reqs:
        assert joining.finish_count[r.request_id] == 1
    # Every other request is placement invariant too.
    for r in reqs:
        assert torch.equal(joining.frames(r.request_id), batch.frames(r.request_id)), r.request_id

    # Prompts that arrive one by one and join every third step together (`prefill_interval`): the same codes.
    reqs = _mixed_requests(lm)
    held = run_all(Engine(lm, engine_config(max_num_seqs=4, prefill_interval=3)), reqs[:1],
                   join_at={t: [reqs[t]] for t in range(1, 8)})
    for r in reqs:
        assert held.finish_count[r.request_id] == 1
        assert torch.equal(held.frames(r.request_id), batch.frames(r.request_id)), r.request_id


def test_unseeded_requests_draw_a_seed_that_reproduces(root):
    lm = tiny_model(root, "base")
    spec = build_spec(lm, base_inputs()[0])
    engine = Engine(lm, engine_config())
    seed = engine.add_request(EngineRequest("u", spec, sampled(None, 10)))
    assert isinstance(seed, int) and 0 <= seed < 2**63
    first = run_all(engine, []).frames("u")
    again = run_all(Engine(lm, engine_config()), [EngineRequest("u", spec, sampled(seed, 10))]).frames("u")
    assert torch.equal(first, again)


def test_streamed_audio_equals_one_shot_decode(root):
    """Chunks of 1, then 4 frames (and the tail) concatenate to the whole-utterance decode; an in-context
    clone's stream equals decoding the reference codes in front and cutting them off."""
    lm = tiny_model(root, "base")
    specs = [build_spec(lm, i) for i in base_inputs(2)]
    engine = Engine(lm, engine_config(first_chunk_frames=1, chunk_frames=4))
    got = run_all(engine, [EngineRequest(f"s{i}", s, sampled(7 + i, 19)) for i, s in enumerate(specs)])
    decoder = lm.speech_tokenizer.decoder
    for i, spec in enumerate(specs):
        codes = got.frames(f"s{i}")
        full = codes if spec.ref_code is None else torch.cat([spec.ref_code, codes])
        wav = decoder.decode(full.unsqueeze(0))[0].numpy()
        wav = wav[(0 if spec.ref_code is None else spec.ref_code.shape[0]) * 1920:]
        pcm = got.pcm(f"s{i}")
        assert pcm.shape == wav.shape
        assert np.abs(pcm - wav).max() < 1e-5
        assert len(got.audio[f"s{i}"][0]) == 1920  # first chunk: one frame


def test_a_long_stream_equals_the_windowed_decode(root):
    """350 frames (past the reference's 300-frame decode window), and an in-context clone whose reference
    frames move the window boundary: the streamed audio equals `TTS.decode`, the reference implementation's
    windowed decode, within 1e-4."""
    from legato.api import TTS

    lm = tiny_model(root, "base")
    g = torch.Generator().manual_seed(5)
    emb, ref = torch.randn(64, generator=g), torch.randint(0, 2048, (40, 16), generator=g)
    inputs = [SpeechInput(TEXTS[0], speaker_embedding=emb, x_vector_only=True),
              SpeechInput(TEXTS[1], speaker_embedding=emb, ref_code=ref, ref_text="A reference transcript.")]
    specs = [build_spec(lm, i) for i in inputs]
    engine = Engine(lm, engine_config(max_model_len=2048, chunk_ramp=True))
    got = run_all(engine, [EngineRequest(f"l{i}", s, sampled(3 + i, 400), max_frames=350, ignore_eos=True)
                           for i, s in enumerate(specs)])
    tts = TTS(lm)
    for i, spec in enumerate(specs):
        codes = got.frames(f"l{i}")
        assert codes.shape == (350, 16)
        want = tts.decode(codes, spec.ref_code)
        pcm = got.pcm(f"l{i}")
        assert pcm.shape == want.shape == (350 * 1920,)
        assert np.abs(pcm - want).max() < 1e-4


def test_the_frame_cap_ends_a_request_that_would_run_on(root, caplog):
    """Random weights never sample EOS: a request without an exact length stops at the text-derived cap
    (frames_per_text_token x its text tokens + the margin) with reason `length`, and the log says why; an
    exact length (ignore_eos + max_frames) is the caller's and is not capped; no cap, no stop."""
    lm = tiny_model(root, "custom_voice")
    spec = build_spec(lm, SpeechInput(TEXTS[3], speaker="ryan"))
    cap = math.ceil(2.0 * target_text_tokens(spec)) + 3
    engine = Engine(lm, engine_config(frames_per_text_token=2.0, frame_cap_margin=3))
    assert engine.frame_cap(spec) == cap
    with caplog.at_level(logging.WARNING, logger="legato.engine.engine"):
        got = run_all(engine, [
            EngineRequest("runs-on", spec, sampled(1, 500)),
            EngineRequest("ignores-eos", spec, sampled(2, 500), ignore_eos=True),
            EngineRequest("exact", spec, sampled(3, 500), max_frames=cap + 7, ignore_eos=True),
            EngineRequest("short", spec, sampled(4, cap - 2)),
        ])
    assert got.finished == {"runs-on": "length", "ignores-eos": "length", "exact": "length", "short": "length"}
    frames = {rid: got.frames(rid).shape[0] for rid in got.finished}
    assert frames == {"runs-on": cap, "ignores-eos": cap, "exact": cap + 7, "short": cap - 3}
    hits = [r.getMessage() for r in caplog.records if "frame cap" in r.getMessage()]
    assert len(hits) == 2 and all(f"{cap} frames" in h for h in hits)  # the capped two, not the others
    uncapped = Engine(lm, engine_config(frames_per_text_token=None))
    assert uncapped.frame_cap(spec) is None
    assert run_all(uncapped, [EngineRequest("free", spec, sampled(1, 40))]).frames("free").shape[0] == 39


def test_64_requests_none_lost_or_duplicated(root):
    lm = tiny_model(root, "base")
    spec_pool = [build_spec(lm, i) for i in base_inputs(3)]
    rng = random.Random(0)
    engine = Engine(lm, engine_config(max_num_seqs=8, num_kv_blocks=96))
    reqs = [
        EngineRequest(f"q{i}", spec_pool[rng.randrange(len(spec_pool))], sampled(i, 50),
                      max_frames=rng.randint(1, 10), ignore_eos=True, stream_audio=i % 2 == 0)
        for i in range(64)
    ]
    out = run_all(engine, reqs[:40], join_at={3: reqs[40:]})
    for r in reqs:
        assert out.finish_count.get(r.request_id) == 1, r.request_id
        assert out.finished[r.request_id] == "length"
        assert out.frames(r.request_id).shape[0] == r.max_frames
    # every frame is one stream's row of one decode step (a prefill gives only its first codebook 0)
    assert engine.times.decode_rows == sum(r.max_frames for r in reqs)
    assert engine.block_manager.num_free_blocks == 96
    assert not engine.live and not engine.codec.streams


def test_eos_stops_and_frees(root):
    lm = tiny_model(root, "base", eos_logit_scale=30.0)
    spec = build_spec(lm, base_inputs()[0])
    expected = generate_codes(lm.talker, build_prompt(spec, lm.talker, lm.config), greedy(200))
    assert 0 < expected.shape[0] < 199, "the scaled EOS row should stop the model early"
    engine = Engine(lm, engine_config())
    got = run_all(engine, [EngineRequest("e", spec, greedy(200))])
    assert got.finished["e"] == "stop"
    assert torch.equal(got.frames("e"), expected)
    assert engine.block_manager.num_free_blocks == engine.config.num_kv_blocks


def test_abort_frees_blocks_in_every_state(root):
    lm = tiny_model(root, "base")
    specs = [build_spec(lm, i) for i in base_inputs(4)]
    engine = Engine(lm, engine_config(max_num_seqs=2, num_kv_blocks=64))
    for i in range(4):
        engine.add_request(EngineRequest(f"a{i}", specs[i], sampled(i, 40), ignore_eos=True))
    outs = []
    for _ in range(3):
        outs += engine.step()
    assert engine.scheduler.num_running == 2
    assert engine.abort("a0")  # running
    assert engine.abort("a3")  # still waiting
    assert not engine.abort("a3")  # duplicate: a counted no-op
    assert not engine.abort("nope")
    got = run_all(engine, [])
    got.take(outs)
    assert got.finished["a0"] == "abort" and got.finished["a3"] == "abort"
    assert got.finished["a1"] == "length" and got.finished["a2"] == "length"
    assert engine.block_manager.num_free_blocks == 64
    assert not engine.codec.streams


@pytest.mark.parametrize("every_step", [True, False])
def test_an_id_is_free_again_only_once_its_earlier_request_has_all_come_out(root, every_step):
    """Abort a running request and add another under its id at once (a client that drops a request and retries
    with the same X-Request-Id): the old one's final output, its launched row and its audio are still on their
    way, and a new request live under the id would be handed them. The engine refuses the id (RequestIdEnding)
    until one step has let them out; then the new request runs as if the id were new."""
    from legato.engine.engine import RequestIdEnding
    from legato.engine.scheduler import DuplicateRequestError

    lm = tiny_model(root, "base")
    spec = build_spec(lm, base_inputs(1)[0])
    engine = Engine(lm, engine_config(max_num_seqs=2, codec_decode_every_step=every_step))
    engine.add_request(EngineRequest("x", spec, sampled(1, 40), ignore_eos=True))
    with pytest.raises(DuplicateRequestError):
        engine.add_request(EngineRequest("x", spec, sampled(1, 40), ignore_eos=True))  # live: a conflict
    outs = []
    for _ in range(6):
        outs += engine.step()
    assert engine.abort("x", "client disconnected")
    with pytest.raises(RequestIdEnding, match="still ending"):
        engine.add_request(EngineRequest("x", spec, sampled(2, 6), ignore_eos=True))
    old = [o for o in engine.step() if o.request_id == "x"]
    assert old and old[-1].finished and old[-1].finish_reason == "abort"
    while True:  # a step or two lets the rest out
        try:
            engine.add_request(EngineRequest("x", spec, sampled(2, 6), ignore_eos=True))
            break
        except RequestIdEnding:
            old += engine.step()
    new = run_all(engine, [])
    assert new.finished["x"] == "length" and new.finish_count["x"] == 1
    fresh = run_all(Engine(lm, engine_config(max_num_seqs=2, codec_decode_every_step=every_step)),
                    [EngineRequest("y", spec, sampled(2, 6), ignore_eos=True)])
    assert torch.equal(torch.cat(new.codes["x"]), torch.cat(fresh.codes["y"]))  # nothing of the old one in it
    assert np.concatenate(new.audio["x"]).shape == np.concatenate(fresh.audio["y"]).shape


def test_bad_requests_are_refused_before_allocation(root):
    lm = tiny_model(root, "base")
    spec = build_spec(lm, base_inputs()[0])
    engine = Engine(lm, engine_config(max_model_len=64, max_text_tokens=4))
    with pytest.raises(ValueError, match="max_text_tokens"):
        engine.add_request(EngineRequest("t", spec, greedy(10)))
    engine = Engine(lm, engine_config(max_model_len=64))
    with pytest.raises(ValueError):
        engine.add_request(EngineRequest("big", spec, greedy(500)))
    engine.add_request(EngineRequest("ok", spec, greedy(5)))
    with pytest.raises(ValueError, match="duplicate"):
        engine.add_request(EngineRequest("ok", spec, greedy(5)))
    assert engine.block_manager.num_free_blocks == engine.config.num_kv_blocks


def test_a_failing_step_fails_its_requests_not_the_engine(root, monkeypatch):
    lm = tiny_model(root, "base")
    spec = build_spec(lm, base_inputs()[0])
    engine = Engine(lm, engine_config())
    engine.add_request(EngineRequest("x", spec, greedy(6)))
    original = engine.runner.decode

    def boom(work):
        raise RuntimeError("injected device fault")

    engine.runner.decode = boom
    got = run_all(engine, [])
    assert got.finished["x"] == "error" and "injected device fault" in got.errors["x"]
    engine.runner.decode = original
    after = run_all(engine, [EngineRequest("y", spec, greedy(6))])
    assert after.finished["y"] == "length"
    assert engine.block_manager.num_free_blocks == engine.config.num_kv_blocks


def test_a_step_fault_fails_the_requests_it_was_starting_too(root):
    """A decode fault in a step that also admits a request fails that request as well: it is never left
    scheduled without its slot state, and its blocks come back."""
    lm = tiny_model(root, "base")
    spec = build_spec(lm, base_inputs()[0])
    engine = Engine(lm, engine_config())
    original = engine.runner.decode
    faults = []

    def boom(work):
        if "late" in engine.live and not faults:
            faults.append(len(work))
            raise RuntimeError("injected device fault")
        return original(work)

    engine.runner.decode = boom
    got = run_all(engine, [EngineRequest("early", spec, greedy(8))],
                  join_at={2: [EngineRequest("late", spec, greedy(8))]})
    assert faults == [1]
    assert got.finished == {"early": "error", "late": "error"}
    assert "injected device fault" in got.errors["late"]
    after = run_all(engine, [EngineRequest("next", spec, greedy(6))])
    assert after.finished["next"] == "length"
    assert engine.block_manager.num_free_blocks == engine.config.num_kv_blocks


def test_a_failing_codec_open_fails_only_that_request(root, monkeypatch):
    """Admission work (slot reset, codec priming) fails the one request; the step and the engine go on."""
    lm = tiny_model(root, "base")
    specs = [build_spec(lm, i) for i in base_inputs()]
    engine = Engine(lm, engine_config())
    original = engine.codec.open

    def open_or_fail(request_id, *args, **kw):
        if request_id == "bad":
            raise RuntimeError("injected codec fault")
        return original(request_id, *args, **kw)

    monkeypatch.setattr(engine.codec, "open", open_or_fail)
    got = run_all(engine, [EngineRequest("good", specs[0], greedy(6)), EngineRequest("bad", specs[2], greedy(6))])
    assert got.finished["bad"] == "error" and "injected codec fault" in got.errors["bad"]
    assert got.finished["good"] == "length" and got.frames("good").shape[0] == 5
    assert got.finish_count == {"good": 1, "bad": 1}
    assert engine.block_manager.num_free_blocks == engine.config.num_kv_blocks
    assert not engine.live and not engine.codec.streams
    after = run_all(engine, [EngineRequest("next", specs[0], greedy(6))])
    assert torch.equal(after.frames("next"), got.frames("good"))


def test_a_failing_codec_decode_fails_its_streams_not_the_engine(root, monkeypatch):
    """A codec failure while streaming fails the streams in it (running or just finished) with an error;
    a request without audio streaming is untouched, nothing leaks, and the engine keeps serving."""
    lm = tiny_model(root, "base")
    spec = build_spec(lm, base_inputs()[0])
    engine = Engine(lm, engine_config(first_chunk_frames=1, chunk_frames=2))

    def boom(*args, **kw):
        raise RuntimeError("injected decoder fault")

    monkeypatch.setattr(engine.codec.codec, "step", boom)
    got = run_all(engine, [EngineRequest("audio", spec, greedy(6)),
                           EngineRequest("codes", spec, greedy(6), stream_audio=False)])
    assert got.finished["audio"] == "error" and "injected decoder fault" in got.errors["audio"]
    assert got.finished["codes"] == "length" and got.frames("codes").shape[0] == 5
    assert got.finish_count == {"audio": 1, "codes": 1}
    assert engine.block_manager.num_free_blocks == engine.config.num_kv_blocks
    assert not engine.live and not engine.codec.streams
    monkeypatch.undo()
    after = run_all(engine, [EngineRequest("again", spec, greedy(6))])
    assert after.finished["again"] == "length" and after.pcm("again").shape[0] == 5 * 1920


def test_a_codec_fault_in_a_batched_decode_fails_only_the_stream_that_raises(root):
    """Every step decodes all streams in one call; when that call raises, each stream is retried alone, so
    only the faulty stream fails: the others' codes are those of a run without the fault and their audio is
    within float32 tolerance of it (it was decoded in smaller batches)."""
    lm = tiny_model(root, "base")
    spec = build_spec(lm, base_inputs()[0])

    def reqs():
        return [EngineRequest(rid, spec, SamplingParams(seed=i, max_new_tokens=12), ignore_eos=True)
                for i, rid in enumerate(["a", "bad", "c"])]

    clean = run_all(Engine(lm, engine_config(chunk_frames=3)), reqs())
    engine = Engine(lm, engine_config(chunk_frames=3))
    streamer, real, batched_faults = engine.codec, engine.codec._decode_rows, []

    def flaky(rows, codes, final=False):
        bad = streamer.streams.get("bad")
        if bad is not None and bad.slot in rows:
            batched_faults.append(len(rows))
            raise RuntimeError("injected codec fault")
        return real(rows, codes, final)

    streamer._decode_rows = flaky
    got = run_all(engine, reqs())
    assert max(batched_faults) == 3  # the fault hit a call holding all three streams
    assert got.finished["bad"] == "error" and "injected codec fault" in got.errors["bad"]
    for rid in ("a", "c"):
        assert got.finished[rid] == "length"
        assert torch.equal(got.frames(rid), clean.frames(rid))
        assert np.abs(got.pcm(rid) - clean.pcm(rid)).max() < 1e-5
    assert engine.block_manager.num_free_blocks == engine.config.num_kv_blocks and not engine.codec.streams


@pytest.mark.parametrize("model_type", ["base", "custom_voice", "voice_design"])
def test_warm_up_runs_a_throwaway_request_and_leaves_nothing_behind(root, model_type):
    """The start-up run that compiles and captures on a GPU: one request through prefill, every chunk size
    of the codec schedule and (Base) in-context priming; afterwards the engine is empty and serves as new."""
    lm = tiny_model(root, model_type)
    engine = Engine(lm, engine_config(chunk_ramp=True, chunk_frames=6))
    assert engine.warm_up() > 0
    assert not engine.live and not engine.codec.streams and not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.config.num_kv_blocks
    assert engine.times.steps > 6
    before = (engine.times.steps, engine.times.host_s)
    for _ in range(3):  # the engine thread's call after each idle wait: nothing launched, collected or emitted
        assert engine.step() == []
    assert (engine.times.steps, engine.times.host_s) == before  # an idle engine does not count steps (a metric)


@pytest.mark.parametrize(("max_num_seqs", "budget", "want"), [
    (16, 4096, {1, 2, 3, 4, 8, 16}), (4, 4096, {1, 2, 3, 4}), (16, 0, {1, 2, 3})])
def test_warm_up_prefills_every_class_of_prompt_count_in_one_step(root, max_num_seqs, budget, want):
    """The first-token path runs eagerly over the prompts a prefill step ends, and each count's factors of two
    make Triton specialise its kernels anew (an int of 1 or of a multiple of 16, a pointer aligned or not): the
    warm-up ends 1, 2, 3, 4, 8 and 16 prompts in one step, where the seats and the prefill budget allow it."""
    lm = tiny_model(root, "base")
    probe = Engine(lm, engine_config())
    tokens = probe.prepare_prompt(build_spec(lm, warm_up_input(lm.config))).length
    engine = Engine(lm, engine_config(max_num_seqs=max_num_seqs, num_kv_blocks=512,
                                      max_num_batched_tokens=budget or 3 * tokens))
    ended: list[int] = []
    real = engine.runner.prefill

    def counting(work):
        ended.append(sum(w.is_last for w in work))
        return real(work)

    engine.runner.prefill = counting
    assert engine.warm_up() > 0 and not engine.has_unfinished()
    assert set(ended) - {0} == want
    assert engine.block_manager.num_free_blocks == engine.config.num_kv_blocks


def test_decoding_every_step_delivers_the_chunks_of_decoding_when_due(tmp_path):
    """With `codec_decode_every_step` the codec decodes each step's frames at once and holds the PCM:
    the client gets the chunks (sizes, audio within float32 tolerance) of decoding each chunk when due, for
    x-vector and in-context requests joining mid-run, and an aborted request leaves nothing held behind."""
    lm = tiny_model(tmp_path, "base")
    g = torch.Generator().manual_seed(5)
    emb, ref = torch.randn(64, generator=g), torch.randint(0, 2048, (7, 16), generator=g)
    specs = [build_spec(lm, SpeechInput("Hello there, how are you?", speaker_embedding=emb, x_vector_only=True)),
             build_spec(lm, SpeechInput("Another one.", speaker_embedding=emb, ref_code=ref, ref_text="Ref."))]

    def run(every: bool):
        reqs = [EngineRequest(f"e{i}", specs[i % 2], SamplingParams(seed=i, max_new_tokens=40),
                              max_frames=9 + 3 * i, ignore_eos=True) for i in range(5)]
        engine = Engine(lm, engine_config(chunk_ramp=True, chunk_frames=4, codec_decode_every_step=every))
        return engine, run_all(engine, reqs[:3], join_at={4: reqs[3:]})

    engine, every = run(True)
    _, due = run(False)
    for i in range(5):
        rid = f"e{i}"
        assert torch.equal(every.frames(rid), due.frames(rid))
        assert [a.size for a in every.audio[rid]] == [a.size for a in due.audio[rid]], rid
        assert every.pcm(rid).size == (9 + 3 * i) * 1920
        assert np.abs(every.pcm(rid) - due.pcm(rid)).max() < 1e-5, rid
    assert not engine.codec.streams and not engine.codec.pending
    engine.add_request(EngineRequest("gone", specs[0], SamplingParams(seed=1, max_new_tokens=40), max_frames=20,
                                     ignore_eos=True))
    for _ in range(6):
        engine.step()
    assert engine.abort("gone")
    while engine.has_unfinished():
        engine.step()
    assert not engine.codec.streams and not engine.codec.pending
