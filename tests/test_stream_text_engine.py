"""Streaming text input in the engine: a request whose text is still arriving waits for it (keeping its KV and
slot, never feeding the 'text over' padding), and gives exactly the codes of the whole text sent at once."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from engine_helpers import Collected, engine_config, run_all, tiny_model

from legato.engine.engine import Engine, EngineRequest
from legato.models.qwen3_tts.inputs import SpeechInput, build_spec
from legato.models.qwen3_tts.prompt import PromptError
from legato.models.qwen3_tts.prompt_build import build_prompt
from legato.models.qwen3_tts.sampling import SamplingParams
from legato.models.qwen3_tts.text_stream import TextStream, segment_ids

TEXT = "Hello world, this is a test of text that arrives while it is spoken."


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    yield


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("stream-text-models")


def greedy(n: int = 60) -> SamplingParams:
    return SamplingParams(do_sample=False, subtalker_do_sample=False, max_new_tokens=n)


def seeded(seed: int, n: int = 60) -> SamplingParams:
    return SamplingParams(seed=seed, max_new_tokens=n, temperature=0.9, top_k=50)


def word_pieces(text: str) -> list[str]:
    words = text.split(" ")
    return [w + " " for w in words[:-1]] + words[-1:]


def bursts(text: str) -> list[str]:
    cuts = [0, 3, 4, 17, 18, 30, 41, 42, len(text)]
    return [text[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]


def stream_request(engine: Engine, lm, rid: str, pieces: list[str], params: SamplingParams,
                   steps_between: int, out: Collected, audio: bool = True) -> None:
    """Feeds `pieces` to a streaming request as an LLM would, `steps_between` engine steps apart; the request
    is added with its first committed piece, and closed after the last."""
    tok = lm.text_tokenizer
    stream = TextStream()
    started = False
    for p in [*pieces, None]:
        piece = stream.append(p) if p is not None else stream.close()
        if piece and not started:
            spec = build_spec(lm, SpeechInput(piece, language="english", speaker="ryan", non_streaming_mode=False))
            engine.add_request(EngineRequest(rid, dataclasses.replace(spec, text_open=True), params,
                                             stream_audio=audio))
            started = True
            if p is None:
                engine.append_text(rid, [], close=True)
        elif started and (piece or p is None):
            ids = segment_ids(tok, piece, first=False) if piece else []
            engine.append_text(rid, ids, close=p is None)
        for _ in range(steps_between):
            out.take(engine.step())
    while engine.has_unfinished():
        out.take(engine.step())


def one_shot(lm, params: SamplingParams, audio: bool = True, **cfg) -> Collected:
    spec = build_spec(lm, SpeechInput(TEXT, language="english", speaker="ryan", non_streaming_mode=False))
    return run_all(Engine(lm, engine_config(**cfg)), [EngineRequest("s", spec, params, stream_audio=audio)])


PATTERNS = {"words": word_pieces(TEXT), "chars": list(TEXT), "bursts": bursts(TEXT), "all": [TEXT]}


def check_patterns(lm, params, cfg: dict, runs: list[tuple[str, int]], audio: bool) -> None:
    expected = one_shot(lm, params, audio, **cfg)
    assert expected.frames("s").shape[0] > 20
    for name, gap in runs:
        engine = Engine(lm, engine_config(**cfg))
        out = Collected()
        stream_request(engine, lm, "s", PATTERNS[name], params, gap, out, audio)
        assert torch.equal(out.frames("s"), expected.frames("s")), (name, gap)
        if audio:  # the same audio too: the codec streams the same frames, waits or not
            assert np.array_equal(out.pcm("s"), expected.pcm("s")), (name, gap)
        assert out.finish_count["s"] == 1
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_streamed_text_gives_the_codes_and_audio_of_the_whole_text(root):
    """Greedy, with the codec streaming: word by word as an LLM slower than speech, in bursts, all at once,
    and character by character as fast as the engine steps."""
    lm = tiny_model(root, "custom_voice")
    check_patterns(lm, greedy(), dict(frames_per_text_token=2.0),
                   [("words", 2), ("bursts", 1), ("all", 0), ("chars", 0)], audio=True)


@pytest.mark.parametrize("params,async_scheduling", [(seeded(7), True), (greedy(), False), (seeded(3), False)],
                         ids=["seeded-async", "greedy-sync", "seeded-sync"])
def test_streamed_text_gives_the_codes_of_the_whole_text(root, params, async_scheduling):
    lm = tiny_model(root, "custom_voice")
    check_patterns(lm, params, dict(async_scheduling=async_scheduling, frames_per_text_token=2.0),
                   [("words", 3), ("bursts", 1), ("chars", 1)], audio=False)


def test_a_request_out_of_text_waits_holding_its_state(root):
    """Out of text, the request sits out decode steps with its blocks and slot held; the loop may then wait
    for a command; the next words let it go on; text after its close is refused."""
    lm = tiny_model(root, "custom_voice")
    engine = Engine(lm, engine_config())
    spec = build_spec(lm, SpeechInput("Hello there", speaker="ryan", non_streaming_mode=False))
    engine.add_request(EngineRequest("w", dataclasses.replace(spec, text_open=True), greedy(200)))
    out = Collected()
    for _ in range(20):
        out.take(engine.step())
    frames = sum(c.shape[0] for c in out.codes.get("w", []))
    known = len(spec.text_ids) - 8 - 1  # trailing tokens: every target token but the one in the prompt
    assert frames == known
    assert engine.waits_for_text_only()
    held = engine.block_manager.num_free_blocks
    assert held < engine.block_manager.num_blocks and engine.scheduler.num_running == 1
    out.take(engine.step())
    assert engine.block_manager.num_free_blocks == held and "w" not in out.finished
    assert engine.text_wait_s >= 0.0
    engine.append_text("w", segment_ids(lm.text_tokenizer, " and welcome", first=False))
    assert not engine.waits_for_text_only()
    engine.append_text("w", [], close=True)
    with pytest.raises(ValueError, match="closed"):
        engine.append_text("w", [5])
    while engine.has_unfinished():
        out.take(engine.step())
    assert out.finish_count["w"] == 1 and out.finished["w"] in ("length", "stop")
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.append_text("w", [5]) is False  # finished: nothing to append to


def test_abort_and_overflow_free_a_waiting_request(root):
    lm = tiny_model(root, "custom_voice")
    engine = Engine(lm, engine_config(max_text_tokens=16))
    spec = dataclasses.replace(build_spec(lm, SpeechInput("Hello there", speaker="ryan", non_streaming_mode=False)),
                               text_open=True)
    engine.add_request(EngineRequest("a", spec, greedy(200)))
    engine.add_request(EngineRequest("b", dataclasses.replace(spec), greedy(200)))
    out = Collected()
    for _ in range(10):
        out.take(engine.step())
    assert engine.waits_for_text_only()
    engine.abort("a", "barge-in")
    with pytest.raises(ValueError, match="text token ids"):
        engine.append_text("b", [-1])
    assert engine.append_text("b", [5] * 40)  # past max_text_tokens: the request fails with a reason
    while engine.has_unfinished():
        out.take(engine.step())
    assert out.finished == {"a": "abort", "b": "error"}
    assert "max_text_tokens" in out.errors["b"]
    assert out.error_codes == {"a": None, "b": "text_too_long"}  # the client's fault, by code, for the front
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_open_text_needs_the_streaming_layout(root):
    """The non-streaming layout holds the whole text: an open text cannot have it. (In-context clones can,
    once their text fills the reference's positions: the next test.)"""
    lm = tiny_model(root, "base")
    emb = torch.randn(64, generator=torch.Generator().manual_seed(0))
    ref = torch.randint(0, 2048, (5, 16), generator=torch.Generator().manual_seed(1))
    icl = build_spec(lm, SpeechInput("Hi there", speaker_embedding=emb, ref_code=ref, ref_text="Ref."))
    with pytest.raises(PromptError, match="streaming-text layout"):
        build_prompt(dataclasses.replace(icl, text_open=True, non_streaming_mode=True), lm.talker, lm.config)
    xvec = build_spec(lm, SpeechInput("Hi there", speaker_embedding=emb, x_vector_only=True))
    prompt = build_prompt(dataclasses.replace(xvec, text_open=True), lm.talker, lm.config)
    whole = build_prompt(xvec, lm.talker, lm.config)
    assert torch.equal(prompt.embeds, whole.embeds)
    assert torch.equal(prompt.trailing_text, whole.trailing_text[:-1])  # no eos until the close


@pytest.mark.parametrize("params", [greedy(), seeded(5)], ids=["greedy", "seeded"])
def test_an_open_request_handed_from_prefill_to_decode_takes_its_text_there(root, params):
    """Prefill-decode: the prefill engine hands on a request whose text is open (the handoff says so, with its
    text tokens so far); the decode engine waits for more text, takes appends (the first before the request is
    even admitted) and gives the codes of the whole text sent at once to one engine; both sides free
    everything."""
    lm = tiny_model(root, "custom_voice")
    expected = one_shot(lm, params, audio=False, frames_per_text_token=2.0)
    tok = lm.text_tokenizer
    stream = TextStream()
    pieces = [p for p in (stream.append(w) for w in word_pieces(TEXT)) if p] + [stream.close()]
    prefill = Engine(lm, engine_config(frames_per_text_token=2.0))
    decode = Engine(lm, engine_config(frames_per_text_token=2.0))
    spec = build_spec(lm, SpeechInput(pieces[0], language="english", speaker="ryan", non_streaming_mode=False))
    prefill.add_request(EngineRequest("s", dataclasses.replace(spec, text_open=True), params, handoff_only=True))
    handoff = None
    while prefill.has_unfinished():
        for o in prefill.step():
            if o.finished:
                assert o.finish_reason == "handoff", o.error
                handoff = o.handoff
    assert handoff is not None and handoff.text_open and handoff.text_tokens == len(spec.text_ids) - 8
    assert prefill.block_manager.num_free_blocks == prefill.block_manager.num_blocks
    decode.add_handoff(handoff, stream_audio=False)
    out = Collected()
    decode.append_text("s", segment_ids(tok, pieces[1], first=False))  # before its admission
    for p in pieces[2:-1]:
        for _ in range(3):
            out.take(decode.step())
        decode.append_text("s", segment_ids(tok, p, first=False))
    while not decode.waits_for_text_only():  # out of text: it waits, never feeding the end-of-text pad
        out.take(decode.step())
    assert "s" not in out.finished
    decode.append_text("s", segment_ids(tok, pieces[-1], first=False) if pieces[-1] else [], close=True)
    while decode.has_unfinished():
        out.take(decode.step())
    assert torch.equal(out.frames("s"), expected.frames("s"))
    assert out.finish_count["s"] == 1
    assert decode.block_manager.num_free_blocks == decode.block_manager.num_blocks


def test_an_in_context_clones_open_prompt_exists_once_its_text_fills_the_reference(root):
    """ICL lays reference transcript + target text beside codec_bos + the reference frames: an open text that
    does not fill those positions has no prompt yet (`open_text_missing` says how many tokens it lacks); once
    it does, the prompt is the whole text's and its trailing text the whole text's without the eos."""
    from legato.models.qwen3_tts.prompt import open_text_missing, with_more_text

    lm = tiny_model(root, "base")
    emb = torch.randn(64, generator=torch.Generator().manual_seed(0))
    ref = torch.randint(0, 2048, (20, 16), generator=torch.Generator().manual_seed(1))
    text = "Hi there, a somewhat longer sentence to fill the reference."
    whole = build_spec(lm, SpeechInput(text, speaker_embedding=emb, ref_code=ref, ref_text="Ref."))
    first, rest = "Hi", text[2:]  # a word's leading space rides with it, as TextStream cuts
    open_spec = dataclasses.replace(build_spec(lm, SpeechInput(first, speaker_embedding=emb, ref_code=ref,
                                                               ref_text="Ref.")), text_open=True)
    missing = open_text_missing(open_spec)
    assert missing > 0 and open_text_missing(whole) == 0
    with pytest.raises(PromptError, match=f"needs {missing} more"):
        build_prompt(open_spec, lm.talker, lm.config)
    ids = segment_ids(lm.text_tokenizer, rest, first=False)
    full = with_more_text(open_spec, ids, close=False)
    assert open_text_missing(full) == 0 and full.text_open
    assert list(full.text_ids) == list(whole.text_ids)  # word-boundary pieces tokenise as the whole text
    got, want = build_prompt(full, lm.talker, lm.config), build_prompt(whole, lm.talker, lm.config)
    assert torch.equal(got.embeds, want.embeds)
    assert torch.equal(got.trailing_text, want.trailing_text[:-1])  # no eos until the close
    assert not with_more_text(open_spec, [], close=True).text_open


def test_text_for_a_request_its_frame_limit_just_ended_is_dropped_and_the_engine_goes_on(root):
    """A request whose text is still open can reach its frame limit: the scheduler ends it when that step is
    launched (freeing its slot), and its final output comes when the step is collected, a step later. Text that
    arrives in between is for a request that has ended: it is dropped. It once reached the freed slot and raised
    in the engine thread, which stopped the engine for every client (found by an outside probe)."""
    lm = tiny_model(root, "custom_voice")
    engine = Engine(lm, engine_config(async_scheduling=True))
    spec = build_spec(lm, SpeechInput("Hello there ", language="english", speaker="ryan", non_streaming_mode=False))
    engine.add_request(EngineRequest("r", dataclasses.replace(spec, text_open=True), greedy(3)))
    ids = segment_ids(lm.text_tokenizer, "more words ", first=False)
    out, seen_window = Collected(), False
    for _ in range(50):
        out.take(engine.step())
        live = engine.live.get("r")
        if live is not None and live.req.status.is_finished:  # ended at launch, not yet collected
            seen_window = True
            assert engine.append_text("r", ids) is False
            assert engine.append_text("r", [], close=True) is False
        if not engine.has_unfinished():
            break
    assert seen_window
    assert out.finished["r"] == "length" and out.finish_count["r"] == 1
    # The engine serves on: another request runs to its end.
    engine.add_request(EngineRequest("next", spec, greedy(4)))
    while engine.has_unfinished():
        out.take(engine.step())
    assert out.finished["next"] == "length"
