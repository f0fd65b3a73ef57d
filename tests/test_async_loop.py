"""The asynchronous engine loop (launch step t, then read step t - 1) against the synchronous one: the same
codes, finish reasons and frame counts, with EOS at every position, and an abort while a step is in flight."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import engine_config, run_all, tiny_model

from legato.engine.engine import Engine, EngineRequest
from legato.models.qwen3_tts.inputs import SpeechInput, build_spec
from legato.models.qwen3_tts.sampling import SamplingParams

TEXTS = ["Hello world, this is a test.", "Short.", "Please call Stella and ask her to bring these things."]


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    yield


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("async-models")


def _specs(lm, n: int) -> list:
    emb = torch.randn(64, generator=torch.Generator().manual_seed(4))
    return [build_spec(lm, SpeechInput(TEXTS[i % 3], speaker_embedding=emb, x_vector_only=True)) for i in range(n)]


def _force_eos(engine: Engine, at: dict[str, int]) -> None:
    """Makes the model say EOS after exactly `at[rid]` frames of request rid (0: its first token), by
    rewriting the stop column of the step's results on the device, as a sampled EOS would arrive."""
    eos = engine.eos_id
    prefill, decode = engine.runner.prefill, engine.runner.decode

    def slot_owner(slot: int) -> str | None:
        return next((rid for rid, live in engine.live.items() if live.req.slot == slot), None)

    def forced_prefill(work):
        slots, first = prefill(work)
        first = first.clone()
        for i, slot in enumerate(slots):
            if at.get(slot_owner(slot)) == 0:
                first[i] = eos
        return slots, first

    def forced_decode(work):
        rows = decode(work).clone()
        for i, w in enumerate(work):
            rid = slot_owner(w.slot)
            prompt_len = engine.live[rid].req.prompt_len
            if at.get(rid) == w.position - prompt_len + 1:  # the frame written at this position is the last
                rows[i, 16] = eos
        return rows

    engine.runner.prefill, engine.runner.decode = forced_prefill, forced_decode


def _run(lm, asynchronous: bool, reqs, at=None, **kw):
    engine = Engine(lm, engine_config(async_scheduling=asynchronous, **kw))
    if at:
        _force_eos(engine, at)
    return engine, run_all(engine, reqs)


def test_async_equals_sync_with_natural_eos(root):
    """A model whose EOS fires at varied frames (scaled EOS row), sampled and seeded, in a moving batch."""
    lm = tiny_model(root, "base", eos_logit_scale=30.0)
    specs = _specs(lm, 9)
    reqs = lambda: [EngineRequest(f"n{i}", s, SamplingParams(seed=i, max_new_tokens=60))  # noqa: E731
                    for i, s in enumerate(specs)]
    e_sync, sync = _run(lm, False, reqs(), max_num_seqs=4)
    e_async, asyn = _run(lm, True, reqs(), max_num_seqs=4)
    assert sync.finished == asyn.finished and "stop" in sync.finished.values()
    for r in reqs():
        assert torch.equal(sync.frames(r.request_id), asyn.frames(r.request_id)), r.request_id
        assert asyn.finish_count[r.request_id] == 1
    for e in (e_sync, e_async):
        assert e.block_manager.num_free_blocks == e.config.num_kv_blocks and not e.live


@pytest.mark.parametrize("asynchronous", [False, True])
def test_eos_at_every_position_ends_the_request_there(root, asynchronous):
    """EOS after 0 (the first token), 1, 2, ... 7 frames: exactly that many frames come out, with reason
    `stop`, the frame decoded past the end is never emitted, and the codes before it are those of a run with
    no EOS at all."""
    lm = tiny_model(root, "base")
    specs = _specs(lm, 8)
    at = {f"e{k}": k for k in range(8)}
    reqs = lambda: [EngineRequest(f"e{k}", specs[k], SamplingParams(seed=k, max_new_tokens=20))  # noqa: E731
                    for k in range(8)]
    engine, got = _run(lm, asynchronous, reqs(), at=at)
    _, free = _run(lm, asynchronous, reqs())
    for k in range(8):
        rid = f"e{k}"
        assert got.finished[rid] == "stop" and got.finish_count[rid] == 1
        assert got.frames(rid).shape[0] == k
        assert torch.equal(got.frames(rid), free.frames(rid)[:k])
        assert sum(len(a) for a in got.audio.get(rid, [])) == k * 1920
    assert engine.block_manager.num_free_blocks == engine.config.num_kv_blocks and not engine.live


def test_an_abort_during_an_in_flight_step(root):
    """Asynchronous: a request aborted while its step is on the device ends with `abort` and nothing after
    it; its blocks are free; the requests beside it get the codes of a synchronous run without the abort."""
    lm = tiny_model(root, "base")
    specs = _specs(lm, 3)
    reqs = lambda: [EngineRequest(f"a{i}", s, SamplingParams(seed=10 + i, max_new_tokens=12), max_frames=11,  # noqa: E731
                                  ignore_eos=True) for i, s in enumerate(specs)]
    engine = Engine(lm, engine_config(async_scheduling=True))
    for r in reqs():
        engine.add_request(r)
    outputs = []
    for _ in range(4):  # prefill, then frames; the 4th step is now in flight
        outputs += engine.step()
    assert engine._in_flight is not None and any(rid == "a1" for rid, _ in engine._in_flight.rows)
    assert engine.abort("a1", "client disconnected")
    while engine.has_unfinished():
        outputs += engine.step()
    a1 = [o for o in outputs if o.request_id == "a1"]
    assert a1[-1].finished and a1[-1].finish_reason == "abort" and sum(o.finished for o in a1) == 1
    frames_before_abort = sum(o.codes.shape[0] for o in a1)
    assert frames_before_abort < 11
    _, sync = _run(lm, False, reqs())
    for rid in ("a0", "a2"):
        got = torch.cat([o.codes for o in outputs if o.request_id == rid])
        assert torch.equal(got, sync.frames(rid)) and got.shape[0] == 11
    assert torch.equal(torch.cat([o.codes for o in a1]), sync.frames("a1")[:frames_before_abort])
    assert engine.block_manager.num_free_blocks == engine.config.num_kv_blocks and not engine.live
