"""Code-predictor replica groups (`EngineConfig.mtp_replicas = K`): the crc32 pinning rule, the per-group
graph buckets, config validation, and codes identical to K = 1 on the CPU at concurrency 1 and 8, with
requests joining, leaving and being aborted mid-run. The CUDA path (streams, graphs) is in test_gpu.py."""

from __future__ import annotations

import zlib

import pytest
import torch
from engine_helpers import Collected, engine_config, run_all, tiny_model

from legato.engine.config import EngineConfig
from legato.engine.engine import Engine, EngineRequest
from legato.engine.mtp_replicas import BUCKETS, group_buckets, replica_group
from legato.models.qwen3_tts.inputs import SpeechInput, build_spec
from legato.models.qwen3_tts.sampling import SamplingParams


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    yield


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("mtp-models"), "base")


def _inputs() -> list[SpeechInput]:
    g = torch.Generator().manual_seed(11)
    emb = torch.randn(64, generator=g)
    ref = torch.randint(0, 2048, (5, 16), generator=g)
    return [
        SpeechInput("Hello world, this is a test.", language="english", speaker_embedding=emb, x_vector_only=True),
        SpeechInput("Please call Stella.", language="english", speaker_embedding=emb, x_vector_only=True,
                    non_streaming_mode=True),
        SpeechInput("The quick brown fox jumps.", speaker_embedding=emb, ref_code=ref, ref_text="A reference."),
    ]


def _requests(lm, prefix: str, n: int) -> list[EngineRequest]:
    """Seeded sampling with mixed knobs, every third request greedy; lengths differ so requests leave."""
    specs = [build_spec(lm, i) for i in _inputs()]
    reqs = []
    for i in range(n):
        if i % 3 == 2:
            params = SamplingParams(do_sample=False, subtalker_do_sample=False, max_new_tokens=9 + i)
        else:
            params = SamplingParams(seed=50 + i, max_new_tokens=7 + 2 * i, temperature=0.8 + 0.1 * (i % 2),
                                    top_k=[0, 40][i % 2], top_p=[1.0, 0.85][i % 2])
        reqs.append(EngineRequest(f"{prefix}{i}", specs[i % len(specs)], params, stream_audio=i % 2 == 0))
    return reqs


def _drive(engine: Engine, reqs, join_at=None, abort_at=None) -> Collected:
    """Like `run_all`, with `abort_at[step]` request ids aborted before that step."""
    out = Collected()
    for r in reqs:
        engine.add_request(r)
    join_at, abort_at = dict(join_at or {}), dict(abort_at or {})
    step = 0
    while engine.has_unfinished() or join_at:
        for r in join_at.pop(step, []):
            engine.add_request(r)
        for rid in abort_at.pop(step, []):
            assert engine.abort(rid)
        out.take(engine.step())
        step += 1
        assert step < 1000
    return out


def _assert_same(got: Collected, want: Collected, ids) -> None:
    for rid in ids:
        assert torch.equal(got.frames(rid), want.frames(rid)), rid
        assert got.finished[rid] == want.finished[rid] and got.finish_count[rid] == 1, rid


def _assert_drained(engine: Engine) -> None:
    assert engine.block_manager.num_free_blocks == engine.config.num_kv_blocks
    assert not engine.live and engine.scheduler.num_running == 0


# --- the rule and the buckets -------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 3, 7])
def test_group_is_crc32_of_the_request_id(k):
    for rid in ["a", "req-1", "日本語", "x" * 100, ""]:
        assert replica_group(rid, k) == zlib.crc32(rid.encode()) % k


def test_group_buckets_cover_the_batch():
    assert group_buckets(64, 1) == sorted((b for b in BUCKETS if b <= 64), reverse=True)
    assert group_buckets(64, 2) == [32, 24, 16, 8, 4, 2, 1]
    assert group_buckets(64, 3) == [22, 16, 8, 4, 2, 1]
    assert group_buckets(5, 3) == [2, 1]
    for limit in range(1, 70):
        for k in range(1, limit + 1):
            assert k * group_buckets(limit, k)[0] >= limit


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2"])
def test_mtp_replicas_must_be_a_positive_int(value):
    with pytest.raises(ValueError, match="mtp_replicas"):
        EngineConfig(mtp_replicas=value)


def test_mtp_replicas_cannot_exceed_max_num_seqs():
    with pytest.raises(ValueError, match=r"mtp_replicas \(9\) must be <= max_num_seqs \(8\)"):
        EngineConfig(max_num_seqs=8, mtp_replicas=9)
    assert EngineConfig(max_num_seqs=8, mtp_replicas=8).mtp_replicas == 8


def test_each_request_runs_in_its_crc32_group(lm):
    """Every decoded row is counted in its request's crc32 group: rows per group = frames of its requests."""
    reqs = _requests(lm, "c", 8)
    for r in reqs:
        r.ignore_eos = True
    engine = Engine(lm, engine_config(mtp_replicas=3))
    got = run_all(engine, reqs)
    want = [0, 0, 0]
    for r in reqs:
        want[zlib.crc32(r.request_id.encode()) % 3] += got.frames(r.request_id).shape[0]
    assert engine.runner.replica_rows == want
    assert all(want)  # the ids were picked so that every group runs something


# --- codes identical to K = 1 ---------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [2, 3])
def test_concurrency_1_matches_k1(lm, k):
    specs = [build_spec(lm, i) for i in _inputs()]
    reqs = [EngineRequest("s", specs[2], SamplingParams(seed=3, max_new_tokens=12)),
            EngineRequest("g", specs[0], SamplingParams(do_sample=False, subtalker_do_sample=False,
                                                        max_new_tokens=12))]
    for r in reqs:
        want = run_all(Engine(lm, engine_config()), [r])
        engine = Engine(lm, engine_config(mtp_replicas=k))
        got = run_all(engine, [r])
        _assert_same(got, want, [r.request_id])
        assert sum(engine.runner.replica_rows) == got.frames(r.request_id).shape[0] > 0
        _assert_drained(engine)


def test_concurrency_8_with_joins_leaves_and_aborts_matches_k1(lm):
    """Eight mixed requests at once; then four slots with requests joining mid-run, one aborted while
    running and one while waiting: every request's codes (up to the abort, for aborted ones) equal K = 1."""
    reqs = _requests(lm, "m", 8)
    ids = [r.request_id for r in reqs]
    scenarios = {
        "batch": lambda k: _drive(Engine(lm, engine_config(mtp_replicas=k)), _requests(lm, "m", 8)),
        "churn": lambda k: _drive(
            Engine(lm, engine_config(mtp_replicas=k, max_num_seqs=4)), (rs := _requests(lm, "m", 8))[:3],
            join_at={2: rs[3:6], 4: rs[6:]}, abort_at={5: ["m1"], 6: ["m7"]},
        ),
    }
    for name, run in scenarios.items():
        want = run(1)
        if name == "churn":
            assert want.finished["m1"] == "abort" and want.frames("m1").shape[0] > 0  # aborted while running
            assert want.finished["m7"] == "abort" and want.frames("m7").shape[0] == 0  # aborted while waiting
        for k in (2, 3):
            got = run(k)
            _assert_same(got, want, ids)


@pytest.mark.parametrize("k", [2, 3])
def test_engines_drain_after_k_groups(lm, k):
    engine = Engine(lm, engine_config(mtp_replicas=k, max_num_seqs=4, num_kv_blocks=64))
    reqs = _requests(lm, "j", 8)
    _drive(engine, reqs[:4], join_at={3: reqs[4:]}, abort_at={4: ["j0"], 5: ["j6"]})
    _assert_drained(engine)
    assert engine.block_manager.num_free_blocks == 64
    assert all(rows > 0 for rows in engine.runner.replica_rows)


# --- the graph path's bookkeeping, emulated on the CPU --------------------------------------------------------


class _EagerGraph:
    """Stands in for a captured graph on the CPU: runs the group's step on the padded inputs it is given, so
    the padding (per-group scratch slot and block), chunking and reordering run as they do on CUDA."""

    def __init__(self, runner, rep, batch: int, log: list) -> None:
        self.runner, self.rep, self.batch, self.log = runner, rep, batch, log

    def replay(self, inputs):
        slots = inputs[0]
        assert slots.shape[0] == self.batch
        real = int((slots != self.rep.scratch_slot).sum())
        assert bool((slots[real:] == self.rep.scratch_slot).all())  # padding is the group's own scratch
        self.log.append((self.rep.index, self.batch, real))
        return self.runner._decode_step(self.rep.kv, *inputs)


@pytest.mark.parametrize(("k", "buckets", "limit"), [(1, (2, 4), 8), (2, (2, 4), 8), (3, (1, 3), 8), (2, (2,), 3)])
def test_padded_chunked_replays_match_eager(lm, k, buckets, limit):
    """Rows padded to a bucket, groups split into several replays of their largest bucket, and groups past
    the graph limit running eagerly all give the codes of the plain eager K = 1 engine."""
    want = _drive(Engine(lm, engine_config()), _requests(lm, "m", 8))
    engine = Engine(lm, engine_config(mtp_replicas=k))
    log: list = []
    for rep in engine.runner.replicas:
        rep.graphs = {b: _EagerGraph(engine.runner, rep, b, log) for b in buckets}
    engine.runner.graph_limit = limit
    got = _drive(engine, _requests(lm, "m", 8))
    _assert_same(got, want, [f"m{i}" for i in range(8)])
    _assert_drained(engine)
    assert any(real < batch for _, batch, real in log)  # some replays were padded
    assert any(real == batch == max(buckets) for _, batch, real in log)  # and some were full chunks
    assert {g for g, _, _ in log} == set(range(k))
    eager_rows = sum(engine.runner.replica_rows) - sum(real for _, _, real in log)
    assert (eager_rows > 0) == (limit < 4)  # groups of 4 rows past a limit of 3 ran eagerly
