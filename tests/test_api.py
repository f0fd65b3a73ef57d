"""The offline API: batched engine generation equals the reference loop (greedy); seeded runs repeat."""

from __future__ import annotations

import numpy as np
import torch

from legato.api import TTS
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
