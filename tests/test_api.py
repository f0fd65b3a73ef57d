"""The offline API: batched engine generation equals the reference loop (greedy); seeded runs repeat; token
ids drive it as text does; greedy is one flag; the finish reason comes back; it picks its device; and the
embedded default model stops by itself."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from legato.api import TTS
from legato.models.qwen3_tts.prompt import PromptError
from legato.models.qwen3_tts.sampling import SamplingParams


def test_batched_generate_equals_reference_loop(tiny_checkpoint):
    torch.set_num_threads(1)
    tts = TTS.load(tiny_checkpoint)
    emb = torch.randn(64, generator=torch.Generator().manual_seed(0))
    greedy = SamplingParams(do_sample=False, subtalker_do_sample=False, max_new_tokens=9)
    texts = ["Hello there.", "A second, longer sentence to say.", "Third."]
    batch = tts.generate(texts, sampling=greedy, speaker_embedding=emb, x_vector_only=True, language="english")
    assert len(batch) == 3
    for text, got in zip(texts, batch, strict=True):
        ref = tts.generate_reference(text, sampling=greedy, speaker_embedding=emb, x_vector_only=True,
                                     language="english")
        assert torch.equal(got.codes, ref.codes)
        assert got.audio.shape == ref.audio.shape == (got.codes.shape[0] * 1920,)
        assert np.abs(got.audio - ref.audio).max() < 1e-5
        assert got.sample_rate == 24000


def test_seeded_generate_repeats(tiny_checkpoint):
    tts = TTS.load(tiny_checkpoint)
    emb = torch.randn(64, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(seed=42, max_new_tokens=8)
    a = tts.generate("Seeded words.", sampling=params, speaker_embedding=emb, x_vector_only=True)
    other = SamplingParams(seed=7, max_new_tokens=5)
    b = tts.generate(["Other words first.", "Seeded words."], sampling=[other, params],
                     speaker_embedding=emb, x_vector_only=True)[1]
    assert torch.equal(a.codes, b.codes)


def test_token_ids_drive_the_model_as_the_text_does(tiny_checkpoint):
    """`generate(text_ids=...)`: the text's token ids (no chat template) give the codes the text gives."""
    tts = TTS.load(tiny_checkpoint)
    emb = torch.randn(64, generator=torch.Generator().manual_seed(2))
    text = "Token ids, as another implementation sends them."
    ids = tts.loaded.text_tokenizer.encode(text)
    kw = dict(speaker_embedding=emb, x_vector_only=True, language="english")
    by_text = tts.generate(text, sampling=SamplingParams(seed=5, max_new_tokens=10), **kw)
    by_ids = tts.generate(text_ids=ids, sampling=SamplingParams(seed=5, max_new_tokens=10), **kw)
    assert torch.equal(by_text.codes, by_ids.codes) and by_ids.codes.shape[0] > 0
    with pytest.raises(ValueError, match="either inputs or text_ids"):
        tts.generate("Both.", text_ids=ids, **kw)
    with pytest.raises(PromptError, match="token ids"):
        tts.generate(text_ids=[1.5, 2], **kw)


def test_a_blank_text_or_transcript_is_refused_as_the_server_refuses_it(tiny_checkpoint):
    """Zero-width or control characters are nothing to say: HTTP answers 400, and `generate` (and so `legato
    synth`) refuses them too instead of making noise."""
    tts = TTS.load(tiny_checkpoint)
    emb = torch.randn(64, generator=torch.Generator().manual_seed(4))
    params = SamplingParams(seed=1, max_new_tokens=3)
    for text in ("\u200b" * 10, "\x01\x02\x1f", "\u200e \ufeff"):
        with pytest.raises(PromptError, match="blank"):
            tts.generate(text, sampling=params, speaker_embedding=emb, x_vector_only=True)
    saved = dict(speaker_embedding=emb, ref_code=torch.zeros(4, 16, dtype=torch.long))  # a saved voice's fields
    with pytest.raises(PromptError, match="needs ref_text"):
        tts.generate("Hello.", sampling=params, ref_text="\u200b\u200b", **saved)
    assert tts.generate("Hello.", sampling=params, ref_text="Hi.", **saved).codes.shape[0] > 0


def test_greedy_is_one_flag_and_the_finish_reason_is_returned(tiny_checkpoint):
    tts = TTS.load(tiny_checkpoint)
    emb = torch.randn(64, generator=torch.Generator().manual_seed(3))
    kw = dict(speaker_embedding=emb, x_vector_only=True)
    a = tts.generate("Greedy.", sampling=SamplingParams(seed=1, max_new_tokens=7), greedy=True, **kw)
    b = tts.generate("Greedy.", sampling=SamplingParams(seed=2, max_new_tokens=7), greedy=True, **kw)
    ref = tts.generate_reference("Greedy.", sampling=SamplingParams(do_sample=False, subtalker_do_sample=False,
                                                                    max_new_tokens=7), **kw)
    assert torch.equal(a.codes, b.codes) and torch.equal(a.codes, ref.codes)  # argmax: no seed matters
    assert a.finish_reason == "length" and a.codes.shape[0] == 6


def test_load_picks_the_cpu_and_fp32_without_cuda(tiny_checkpoint):
    tts = TTS.load(tiny_checkpoint)
    weight = tts.loaded.talker.codec_head.weight
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert weight.device.type == want
    assert weight.dtype == (torch.bfloat16 if want == "cuda" else torch.float32)


def test_the_embedded_default_stops_by_itself_after_a_length_that_follows_the_text(tmp_path, monkeypatch):
    """The README's example text on the embedded default (random weights): the model itself ends the
    request (finish reason `stop`) after about 4 frames per text token, well inside the frame cap, and a
    longer text takes longer. Frame counts, not seconds: this holds on any machine."""
    monkeypatch.setenv("LEGATO_CACHE", str(tmp_path))
    tts = TTS.load()
    lengths = []
    for text in ("Hello there.", "Hello there, and welcome to a longer sentence than the first one."):
        tokens = len(tts.loaded.text_tokenizer.encode(text))
        out = tts.generate(text, sampling=SamplingParams(seed=0))
        assert out.finish_reason == "stop", (text, out.codes.shape)
        frames = out.codes.shape[0]
        assert 3 * tokens <= frames <= 6 * tokens + 10, (text, tokens, frames)
        assert frames < 8 * tokens + 50  # the frame cap never had to end it
        lengths.append(frames)
    assert lengths[1] > 2 * lengths[0]
    assert lengths[0] <= 50  # "Hello there." (7 tokens of the tiny tokenizer): under 4 s of audio


def test_generate_steps_the_engine_with_the_servers_thread_settings(tiny_checkpoint, monkeypatch):
    """Not a timing test: the settings under which every engine step runs, offline and in the server's engine
    client, must be the same: a thread of its own named "engine" (not the caller's, whose OpenMP team would
    spin at full count beside other processes: issue 20, item 6), the server's GIL switch interval and torch's
    thread count. The caller's switch interval is its own again afterwards."""
    import asyncio
    import sys
    import threading

    from client_helpers import EMB

    from legato.engine.engine import Engine
    from legato.models.qwen3_tts.inputs import SpeechInput
    from legato.pipeline.client import SynthesisRequest
    from legato.pipeline.local import LocalEngineClient

    monkeypatch.delenv("LEGATO_GIL_SWITCH_MS", raising=False)
    seen: list[tuple] = []
    real_step = Engine.step

    def step(self):
        me = threading.current_thread()
        seen.append((me.name, me is threading.main_thread(), sys.getswitchinterval(), torch.get_num_threads()))
        return real_step(self)

    monkeypatch.setattr(Engine, "step", step)
    tts = TTS.load(tiny_checkpoint)
    kw = dict(speaker_embedding=EMB, x_vector_only=True, language="english")
    before = sys.getswitchinterval()
    try:
        tts.generate("Offline words.", sampling=SamplingParams(seed=1, max_new_tokens=4), **kw)
        offline, after = set(seen), sys.getswitchinterval()
        seen.clear()

        async def served():
            client = LocalEngineClient(tts.loaded, tts._engine_config(1))
            await client.start()
            try:
                req = SynthesisRequest("s", SpeechInput("Served words.", **kw),
                                       SamplingParams(seed=1, max_new_tokens=4))
                return [c async for c in client.generate(req)]
            finally:
                await client.stop()

        assert asyncio.run(served())[-1].finished
        server = set(seen)
    finally:
        sys.setswitchinterval(before)  # the server's client sets it for the life of the process
    assert offline == server == {("engine", False, 0.001, torch.get_num_threads())}, (offline, server)
    assert after == before


def test_instructions_the_0_6b_custom_voice_model_drops_are_said_in_the_log(tmp_path, monkeypatch, caplog):
    """As the official package, the offline API leaves them out (the same codes), and says so (a walkthrough found
    them dropped without a word)."""
    import logging

    monkeypatch.setenv("LEGATO_CACHE", str(tmp_path))
    tts = TTS.load()
    params = SamplingParams(seed=4, max_new_tokens=6)
    plain = tts.generate("Hello there.", sampling=params)
    with caplog.at_level(logging.WARNING, logger="legato"):
        styled = tts.generate("Hello there.", sampling=params, instructions="Speak very angrily.")
    assert torch.equal(plain.codes, styled.codes)
    assert any("takes no instructions" in r.getMessage() for r in caplog.records)
