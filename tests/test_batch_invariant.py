"""Batch-invariant mode (`EngineConfig.batch_invariant`): decode steps in fixed chunks of `invariant_rows`
padded rows, prefill chunks cut at fixed sizes, first tokens sampled alone. On the CPU the engine is batch
invariant anyway, so these tests prove the mode changes no result and that its shapes really are fixed;
that it makes GPU codes independent of the batch is measured on the H200 (docs/benchmarks.md)."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import engine_config, run_all, tiny_model

from legato.engine.config import EngineConfig
from legato.engine.engine import Engine, EngineRequest
from legato.models.qwen3_tts.inputs import SpeechInput, build_spec
from legato.models.qwen3_tts.sampling import SamplingParams


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    yield


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("invariant-models"), "base")


def _requests(lm, prefix: str, n: int) -> list[EngineRequest]:
    g = torch.Generator().manual_seed(5)
    emb = torch.randn(64, generator=g)
    ref = torch.randint(0, 2048, (90, 16), generator=g)  # a long ICL prompt: chunked prefill
    specs = [build_spec(lm, SpeechInput("Hello there, a plain x-vector request.", language="english",
                                        speaker_embedding=emb, x_vector_only=True)),
             build_spec(lm, SpeechInput("A longer in-context clone request.", speaker_embedding=emb, ref_code=ref,
                                        ref_text="The words of the reference clip, said slowly."))]
    reqs = []
    for i in range(n):
        greedy = i % 3 == 2
        params = SamplingParams(seed=70 + i, max_new_tokens=6 + i % 5, do_sample=not greedy,
                                subtalker_do_sample=not greedy)
        reqs.append(EngineRequest(f"{prefix}{i}", specs[i % 2], params, stream_audio=False))
    return reqs


def test_config_checks():
    with pytest.raises(ValueError, match="invariant_rows"):
        EngineConfig(batch_invariant=True, invariant_rows=0)
    with pytest.raises(ValueError, match="batch_invariant must be a bool"):
        EngineConfig(batch_invariant=1)
    with pytest.raises(ValueError, match="max_num_batched_tokens > max_num_seqs"):
        EngineConfig(batch_invariant=True, max_num_seqs=8, max_num_batched_tokens=8)


@pytest.mark.parametrize("mtp", [1, 2])
def test_codes_equal_the_default_engine_alone_and_batched(lm, mtp):
    want = run_all(Engine(lm, engine_config()), _requests(lm, "r", 8))
    for conc in (1, 8):
        engine = Engine(lm, engine_config(batch_invariant=True, invariant_rows=4, mtp_replicas=mtp,
                                          max_num_batched_tokens=64))
        reqs = _requests(lm, "r", 8)
        if conc == 1:
            got = run_all(engine, reqs[:1])
            for r in reqs[1:]:
                part = run_all(engine, [r])
                got.codes.update(part.codes)
                got.finished.update(part.finished)
        else:
            got = run_all(engine, reqs[:5], join_at={3: reqs[5:]})
        for r in reqs:
            assert torch.equal(got.frames(r.request_id), want.frames(r.request_id)), (conc, r.request_id)
            assert got.finished[r.request_id] == want.finished[r.request_id]
        assert engine.block_manager.num_free_blocks == engine.config.num_kv_blocks


def test_decode_runs_only_fixed_row_chunks(lm, monkeypatch):
    engine = Engine(lm, engine_config(batch_invariant=True, invariant_rows=4, max_num_batched_tokens=64))
    shapes, prefill_chunks = [], []
    step = engine.runner._decode_step
    monkeypatch.setattr(engine.runner, "_decode_step", lambda kv, slots, *a: (shapes.append(len(slots)),
                                                                             step(kv, slots, *a))[1])
    prefill = engine.runner.prefill
    monkeypatch.setattr(engine.runner, "prefill", lambda work: (prefill_chunks.extend(
        w.embeds.shape[0] for w in work), prefill(work))[1])
    run_all(engine, _requests(lm, "s", 7), join_at={2: _requests(lm, "t", 3)})
    assert shapes and set(shapes) == {4}  # 1..8 live rows, always run as padded chunks of 4
    chunk = engine.config.max_num_batched_tokens - engine.config.max_num_seqs
    assert max(prefill_chunks) == chunk and all(n <= chunk for n in prefill_chunks)
