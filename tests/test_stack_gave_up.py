"""The engine with the one-launch code predictor (`EngineConfig.code_predictor_stack`): each step's barrier give-up
count rides to the host with its results, is stripped before the codes are read, and a step whose passes gave up
fails its requests with a message instead of emitting codes the kernel did not finish. The kernel itself needs a
GPU; here the runner's count is replaced (`stack_gave_up_row`), so the engine's side runs on the CPU."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import engine_config, run_all, tiny_model

from legato.engine.engine import STACK_GAVE_UP, Engine, EngineRequest
from legato.models.qwen3_tts.inputs import SpeechInput, build_spec
from legato.models.qwen3_tts.sampling import SamplingParams


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    yield


def _model_and_spec(tmp_path):
    lm = tiny_model(tmp_path, "base")
    emb = torch.randn(64, generator=torch.Generator().manual_seed(0))
    return lm, build_spec(lm, SpeechInput("Hello there, how are you?", language="english", speaker_embedding=emb,
                                          x_vector_only=True))


def _requests(spec, tag: str, n: int = 3) -> list[EngineRequest]:
    return [EngineRequest(f"{tag}{i}", spec, SamplingParams(seed=i, max_new_tokens=8 + i)) for i in range(n)]


def _counting(engine: Engine, gave_up_from_call: int | None) -> dict[str, int]:
    """Makes the engine believe it runs the stack; the count of give-ups becomes 1 from that call on."""
    calls = {"n": 0}

    def row() -> torch.Tensor:
        calls["n"] += 1
        gave_up = int(gave_up_from_call is not None and calls["n"] >= gave_up_from_call)
        return torch.full((1, 17), gave_up, dtype=torch.long)

    engine.runner.uses_stack = True
    engine.runner.stack_gave_up_row = row
    return calls


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_without_give_ups_the_check_row_changes_no_code(tmp_path, async_scheduling):
    lm, spec = _model_and_spec(tmp_path)
    want = run_all(Engine(lm, engine_config(async_scheduling=async_scheduling)), _requests(spec, "r"))
    engine = Engine(lm, engine_config(async_scheduling=async_scheduling))
    calls = _counting(engine, gave_up_from_call=None)
    got = run_all(engine, _requests(spec, "r"))
    assert calls["n"] >= 8  # one check row per step that decoded
    for i in range(3):
        assert torch.equal(got.frames(f"r{i}"), want.frames(f"r{i}")), i
        assert got.finished[f"r{i}"] == want.finished[f"r{i}"] and got.errors[f"r{i}"] is None


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_step_whose_pass_gave_up_fails_its_requests_and_the_engine_serves_on(tmp_path, async_scheduling):
    lm, spec = _model_and_spec(tmp_path)
    engine = Engine(lm, engine_config(async_scheduling=async_scheduling))
    _counting(engine, gave_up_from_call=3)
    got = run_all(engine, _requests(spec, "a"))
    for i in range(3):
        assert got.finished[f"a{i}"] == "error" and got.errors[f"a{i}"] == STACK_GAVE_UP, i
        assert got.finish_count[f"a{i}"] == 1
        assert 1 <= got.frames(f"a{i}").shape[0] < 8  # the frames of the steps before it, none after
    assert engine.block_manager.num_free_blocks == engine.config.num_kv_blocks
    # The count stays at 1: no new give-up, so the next requests finish normally.
    after = run_all(engine, _requests(spec, "b", 2))
    assert all(after.finished[f"b{i}"] == "length" and after.errors[f"b{i}"] is None for i in range(2))
    assert engine.block_manager.num_free_blocks == engine.config.num_kv_blocks


def test_give_ups_counted_before_the_engine_existed_fail_none_of_its_requests(tmp_path, monkeypatch):
    """The count is per device and outlives engines: an engine made after another's give-up starts from it (on the
    H200 an engine failed every request of its first step over a count it had not made)."""
    from legato.engine.model_runner import ModelRunner

    lm, spec = _model_and_spec(tmp_path)
    monkeypatch.setattr(ModelRunner, "stack_gave_up_so_far", lambda self: 1)
    engine = Engine(lm, engine_config())
    _counting(engine, gave_up_from_call=1)  # the count reads 1 from the first step on
    got = run_all(engine, _requests(spec, "c"))
    assert all(got.finished[f"c{i}"] == "length" and got.errors[f"c{i}"] is None for i in range(3))


def test_decode_runs_in_inference_mode(tmp_path):
    """The runner's decode builds no autograd record (a lost `inference_mode` made a server's RSS grow ~5x under
    tests/reliability/test_overload.py): its rows are inference tensors."""
    lm, spec = _model_and_spec(tmp_path)
    engine = Engine(lm, engine_config())
    seen = []
    decode = engine.runner.decode

    def spy(work):
        rows = decode(work)
        seen.append(rows)
        return rows

    engine.runner.decode = spy
    run_all(engine, _requests(spec, "i", 1))
    assert seen and all(t.is_inference() for t in seen)
