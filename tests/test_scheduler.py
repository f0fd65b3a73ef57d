import random

import pytest

from legato.engine.block_manager import BlockManager
from legato.engine.config import EngineConfig
from legato.engine.request import Request, RequestStatus
from legato.engine.scheduler import (
    QueueFullError,
    RequestTooLargeError,
    Scheduler,
    SchedulerOutput,
    StepResult,
    fair_shares,
)

S = RequestStatus


def make(num_blocks: int = 64, **kw) -> Scheduler:
    kw = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "block_size": 4, "max_model_len": 1024, **kw}
    cfg = EngineConfig(num_kv_blocks=num_blocks, **kw)
    return Scheduler(cfg, BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching))


def results(out: SchedulerOutput, eos=(), frames_at_prefill: int = 1) -> list[StepResult]:
    """A fake runner: the last prompt chunk yields a frame, each decode yields a frame."""
    res = [StepResult(c.request.request_id, c.num_tokens, frames_at_prefill if c.is_last else 0,
                      stopped=c.request.request_id in eos and c.is_last) for c in out.prefills]
    res += [StepResult(r.request_id, 1, 1, stopped=r.request_id in eos) for r in out.decodes]
    return res


def step(s: Scheduler, eos=()) -> tuple[SchedulerOutput, list[Request]]:
    out = s.schedule()
    return out, s.update(results(out, eos))


def assert_idle(s: Scheduler) -> None:
    bm = s.block_manager
    assert not s.has_unfinished()
    assert bm.num_free_blocks == bm.num_blocks and bm.num_reserved_blocks == 0
    assert sorted(s._free_slots) == list(range(s.config.max_num_seqs))


# ---- add() -------------------------------------------------------------------------------------------

def test_add_rejects_what_could_never_run():
    s = make(num_blocks=8, max_model_len=100, enable_chunked_prefill=False, max_num_batched_tokens=16)
    with pytest.raises(RequestTooLargeError, match="max_model_len"):
        s.add(Request("long", prompt_len=90, max_frames=11))
    with pytest.raises(RequestTooLargeError, match=r"prompt_len 20 \+ max_frames 13 needs 9 KV blocks, the cache "
                                                   r"has 8 \(32 positions\): shorten the text or lower max_new_tokens"):
        s.add(Request("big", prompt_len=20, max_frames=13))  # 33 tokens > 8 blocks * 4
    with pytest.raises(RequestTooLargeError, match="chunked prefill off"):
        s.add(Request("wide", prompt_len=17, max_frames=1))
    s.add(Request("fits", prompt_len=16, max_frames=16))  # exactly 8 blocks
    s.add(Request("handoff", prompt_len=17, max_frames=1, kv_handoff=True))  # never prefilled here
    assert s.num_waiting == 2


def test_add_queue_full_and_duplicates():
    s = make(max_waiting=2)
    s.add(Request("a", 4, 4))
    with pytest.raises(ValueError, match="already in flight"):
        s.add(Request("a", 4, 4))
    s.add(Request("b", 4, 4))
    with pytest.raises(QueueFullError):
        s.add(Request("c", 4, 4))
    done = Request("d", 4, 4)
    done.transition(S.FINISHED_ABORTED)
    with pytest.raises(ValueError, match="expected WAITING"):
        s.add(done)


def test_config_and_block_manager_must_agree():
    cfg = EngineConfig(block_size=16)
    with pytest.raises(ValueError, match="block_size"):
        Scheduler(cfg, BlockManager(10, 8))
    with pytest.raises(ValueError, match="prefix_caching"):
        Scheduler(cfg, BlockManager(10, 16, enable_prefix_caching=True))
    with pytest.raises(ValueError, match="blocks"):
        Scheduler(EngineConfig(num_kv_blocks=12), BlockManager(10, 16))


# ---- schedule() / update() ---------------------------------------------------------------------------

def test_lifecycle_eos_and_length():
    s = make()
    a, b = Request("a", prompt_len=6, max_frames=3), Request("b", prompt_len=5, max_frames=10)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert [(c.request, c.start, c.num_tokens) for c in out.prefills] == [(a, 0, 6), (b, 0, 5)]
    assert out.new_requests == [a, b] and out.decodes == [] and out.num_batched_tokens == 11
    assert a.status is S.RUNNING and {a.slot, b.slot} == {0, 1}
    assert s.update(results(out)) == []
    assert (a.num_computed_tokens, a.num_frames) == (6, 1)
    out, fin = step(s)
    assert out.decodes == [a, b] and out.prefills == [] and out.num_batched_tokens == 2
    assert fin == []
    out, fin = step(s, eos={"b"})
    assert fin == [a, b]
    assert a.status is S.FINISHED_LENGTH and a.num_frames == 3 and a.finish_reason == "length"
    assert b.status is S.FINISHED_STOPPED and b.num_frames == 3 and b.finish_reason == "stop"
    assert a.slot is None and a.block_table == []
    assert s.stats.num_finished == 2
    assert_idle(s)


def test_max_frames_reached_at_prefill():
    s = make()
    a = Request("a", prompt_len=3, max_frames=1)
    s.add(a)
    _, fin = step(s)
    assert fin == [a] and a.status is S.FINISHED_LENGTH
    assert_idle(s)


def test_reservation_is_exact_when_prefill_yields_no_frame():
    # Runner convention where the first decode step yields frame 1: the KV reaches prompt_len + max_frames.
    s = make(num_blocks=2)
    a = Request("a", prompt_len=4, max_frames=4)  # 8 tokens = exactly the whole cache
    s.add(a)
    out = s.schedule()
    s.update(results(out, frames_at_prefill=0))
    fin = []
    while not fin:
        out = s.schedule()
        assert out.decodes == [a]
        fin = s.update(results(out, frames_at_prefill=0))
    assert a.status is S.FINISHED_LENGTH and a.num_frames == 4 and a.num_computed_tokens == 8
    assert_idle(s)


def test_decode_kv_grows_block_by_block():
    s = make()
    a = Request("a", prompt_len=4, max_frames=10)
    s.add(a)
    step(s)
    assert len(a.block_table) == 1
    out, _ = step(s)  # writes position 4: a second block
    assert out.decodes == [a] and len(a.block_table) == 2
    for _ in range(3):
        step(s)
    assert a.num_computed_tokens == 8 and len(a.block_table) == 2
    step(s)
    assert len(a.block_table) == 3


def test_runner_error_finishes_one_request():
    s = make()
    a, b = Request("a", 4, 5), Request("b", 4, 5)
    s.add(a)
    s.add(b)
    out = s.schedule()
    res = results(out)
    res[0].error = "nan in logits"
    assert s.update(res) == [a]
    assert a.status is S.FINISHED_ERROR and a.error == "nan in logits"
    assert b.status is S.RUNNING


def test_update_contract_is_checked():
    s = make()
    s.add(Request("a", 8, 5))
    s.schedule()
    with pytest.raises(RuntimeError, match="before update"):
        s.schedule()
    with pytest.raises(ValueError, match="scheduled 8 tokens"):
        s.update([StepResult("a", 7, 0)])
    s2 = make()
    s2.add(Request("a", 8, 5))
    s2.schedule()
    with pytest.raises(ValueError, match="no result"):
        s2.update([])
    s3 = make()
    s3.add(Request("a", 8, 2))
    s3.schedule()
    with pytest.raises(ValueError, match="exceed max_frames"):
        s3.update([StepResult("a", 8, 3)])


def test_empty_schedule_needs_no_update():
    s = make()
    out = s.schedule()
    assert out.is_empty and out.num_batched_tokens == 0
    assert s.schedule().is_empty


# ---- budgets and limits ------------------------------------------------------------------------------

def test_decodes_first_then_prefill_within_budget():
    s = make(max_num_seqs=4, max_num_batched_tokens=10)
    for i in range(3):
        s.add(Request(f"d{i}", prompt_len=3, max_frames=50))
    step(s)
    step(s)  # 3 decodes + nothing waiting
    big = Request("big", prompt_len=20, max_frames=5)
    s.add(big)
    out = s.schedule()
    assert len(out.decodes) == 3
    assert [(c.request, c.start, c.num_tokens) for c in out.prefills] == [(big, 0, 7)]
    assert out.num_batched_tokens == 10
    s.update(results(out))
    out = s.schedule()
    assert len(out.decodes) == 3 and [(c.start, c.num_tokens) for c in out.prefills] == [(7, 7)]
    assert not out.prefills[0].is_last
    s.update(results(out))
    out = s.schedule()
    assert [(c.start, c.num_tokens) for c in out.prefills] == [(14, 6)] and out.prefills[0].is_last
    assert out.num_batched_tokens == 9
    s.update(results(out))
    assert big.num_frames == 1 and not big.in_prefill
    out = s.schedule()
    assert big in out.decodes and len(out.decodes) == 4


def test_chunked_prefill_off_prefills_whole_or_waits():
    s = make(max_num_seqs=4, max_num_batched_tokens=10, enable_chunked_prefill=False)
    for i in range(3):
        s.add(Request(f"d{i}", prompt_len=3, max_frames=50))
    out, _ = step(s)
    assert [c.num_tokens for c in out.prefills] == [3, 3, 3]
    big = Request("big", prompt_len=8, max_frames=5)
    s.add(big)
    out, _ = step(s)  # 3 decodes leave 7 tokens: big waits whole
    assert out.prefills == [] and big.status is S.WAITING
    s.abort("d0")
    out, _ = step(s)
    assert [(c.request, c.start, c.num_tokens) for c in out.prefills] == [(big, 0, 8)]
    assert out.num_batched_tokens == 10


def test_prefill_chunks_share_one_budget_in_admission_order_without_fairness():
    s = make(max_num_seqs=4, max_num_batched_tokens=10, fair_prefill=False)
    reqs = [Request(f"r{i}", prompt_len=4, max_frames=5) for i in range(4)]
    for r in reqs:
        s.add(r)
    out = s.schedule()
    assert [(c.request.request_id, c.num_tokens) for c in out.prefills] == [("r0", 4), ("r1", 4), ("r2", 2)]
    assert reqs[3].status is S.WAITING  # budget spent, head-of-line waits
    s.update(results(out))
    out = s.schedule()
    assert [r.request_id for r in out.decodes] == ["r0", "r1"]
    assert [(c.request.request_id, c.start, c.num_tokens) for c in out.prefills] == [("r2", 2, 2), ("r3", 0, 4)]


def test_fair_prefill_splits_the_budget_and_spends_it_all():
    s = make(max_num_seqs=4, max_num_batched_tokens=10)
    reqs = [Request(f"r{i}", prompt_len=4, max_frames=5) for i in range(4)]
    for r in reqs:
        s.add(r)
    out = s.schedule()
    # Water-filling: 10 tokens over three 4-token prompts; the odd token goes to the earliest.
    assert [(c.request.request_id, c.num_tokens) for c in out.prefills] == [("r0", 4), ("r1", 3), ("r2", 3)]
    assert reqs[3].status is S.WAITING and out.num_batched_tokens == 10
    s.update(results(out))
    out = s.schedule()
    assert [r.request_id for r in out.decodes] == ["r0"]
    assert [(c.request.request_id, c.start, c.num_tokens) for c in out.prefills] == [
        ("r1", 3, 1), ("r2", 3, 1), ("r3", 0, 4)]


@pytest.mark.parametrize("fair", [True, False])
def test_a_short_prompt_behind_a_long_one_is_prefilled_in_its_first_step(fair):
    budget = 64
    s = make(num_blocks=256, max_num_seqs=4, max_num_batched_tokens=budget, fair_prefill=fair)
    long = Request("long", prompt_len=10 * budget, max_frames=4)
    short = Request("short", prompt_len=20, max_frames=2)
    s.add(long)
    out, _ = step(s)  # the long prompt alone takes the whole budget
    assert [(c.request, c.num_tokens) for c in out.prefills] == [(long, budget)]
    s.add(short)
    progress, short_steps, steps = [], None, 0
    while long.in_prefill or short.in_prefill or short.status is S.WAITING:
        steps += 1
        before = long.num_computed_tokens
        out, _ = step(s)
        assert out.num_batched_tokens == len(out.decodes) + sum(c.num_tokens for c in out.prefills) <= budget
        progress.append(long.num_computed_tokens - before)
        if short_steps is None and not short.in_prefill and short.status is not S.WAITING:
            short_steps = steps
    if fair:
        assert short_steps == 1  # admitted and prefilled whole in the first step after it arrived
        assert all(p > 0 for p in progress)  # the long prompt is never starved
    else:
        assert short_steps == 10  # waits for the whole long prompt (9 more budgets), then its own step
    assert not long.in_prefill and long.num_computed_tokens >= long.prompt_len


def test_fair_prefill_stays_off_in_batch_invariant_mode():
    s = make(num_blocks=256, max_num_seqs=4, max_num_batched_tokens=64, batch_invariant=True)
    long = Request("long", prompt_len=600, max_frames=4)
    short = Request("short", prompt_len=20, max_frames=2)
    s.add(long)
    step(s)
    s.add(short)
    out, _ = step(s)
    # Chunks stay cut at invariant_chunk whatever else waits: the short prompt does not take a share.
    assert [(c.request, c.num_tokens) for c in out.prefills] == [(long, s.invariant_chunk)]
    assert short.status is S.WAITING


@pytest.mark.parametrize("demands, budget, expected", [
    ([640, 20], 64, [44, 20]),
    ([640, 640], 64, [32, 32]),
    ([5, 5, 5], 10, [4, 3, 3]),
    ([3, 0, 9], 100, [3, 0, 9]),
    ([9, 9, 9], 2, [1, 1, 0]),
    ([], 8, []),
])
def test_fair_shares_water_fill(demands, budget, expected):
    shares = fair_shares(demands, budget)
    assert shares == expected and sum(shares) <= budget


def test_max_num_seqs_caps_running():
    s = make(max_num_seqs=2)
    reqs = [Request(f"r{i}", prompt_len=2, max_frames=3) for i in range(5)]
    for r in reqs:
        s.add(r)
    out, _ = step(s)
    assert len(out.new_requests) == 2 and s.num_running == 2 and s.num_waiting == 3
    out, fin = step(s)
    assert s.num_running == 2 and out.new_requests == []
    out, fin = step(s)
    assert fin == reqs[:2]
    out, _ = step(s)
    assert out.new_requests == reqs[2:4] and {r.slot for r in reqs[2:4]} == {0, 1}


def test_admission_reserves_whole_life():
    # 10 blocks of 4 tokens. Each request's life is 4 + 12 = 16 tokens = 4 blocks, though it needs 1 to start.
    s = make(num_blocks=10, max_num_seqs=4)
    reqs = [Request(f"r{i}", prompt_len=4, max_frames=12) for i in range(3)]
    for r in reqs:
        s.add(r)
    out, _ = step(s)
    assert out.new_requests == reqs[:2] and reqs[2].status is S.WAITING
    bm = s.block_manager
    assert bm.num_free_blocks == 8 and bm.num_reserved_blocks == 6
    # Run both to completion: no allocation ever fails, the third gets in once blocks come back.
    while reqs[0].status is S.RUNNING:
        step(s)
        assert bm.num_free_blocks >= bm.num_reserved_blocks
    assert reqs[2].status is S.WAITING
    step(s)
    assert reqs[2].status is S.RUNNING


def test_fifo_head_of_line():
    s = make(num_blocks=10, max_num_seqs=4)
    first = Request("first", prompt_len=4, max_frames=20)  # 6 blocks
    big = Request("big", prompt_len=4, max_frames=20)  # 6 blocks: does not fit beside first
    small = Request("small", prompt_len=2, max_frames=2)  # 1 block: would fit, must not overtake
    for r in (first, big, small):
        s.add(r)
    for _ in range(5):
        out, _ = step(s)
        assert big.status is S.WAITING and small.status is S.WAITING
    s.abort("first")
    out, _ = step(s)
    assert out.new_requests == [big, small]


def test_slots_are_lowest_free_and_stable():
    s = make(max_num_seqs=3)
    reqs = [Request(f"r{i}", prompt_len=2, max_frames=9) for i in range(3)]
    for r in reqs:
        s.add(r)
    step(s)
    assert [r.slot for r in reqs] == [0, 1, 2]
    s.abort("r1")
    s.add(late := Request("late", 2, 9))
    step(s)
    assert late.slot == 1 and [reqs[0].slot, reqs[2].slot] == [0, 2]


# ---- abort -------------------------------------------------------------------------------------------

def _in_state(s: Scheduler, state: str) -> tuple[Request, SchedulerOutput | None]:
    """A request driven into one of the live states (with a neighbour running beside it), and the step in
    flight for state "in_flight"."""
    s.add(Request("other", prompt_len=5, max_frames=40))
    if state == "waiting":
        s.add(r := Request("r", prompt_len=5, max_frames=4))
        s.add(Request("later", prompt_len=5, max_frames=4))
        return r, None
    if state == "handoff":
        s.add(r := Request("r", prompt_len=9, max_frames=4, kv_handoff=True))
        step(s)
        assert r.status is S.WAITING_FOR_HANDOFF
        return r, None
    s.add(r := Request("r", prompt_len=100, max_frames=4))
    step(s)  # 64-token budget: r is mid-prefill
    if state == "prefill":
        assert r.in_prefill and r.num_computed_tokens > 0
        return r, None
    step(s)
    step(s)
    assert state in ("decode", "in_flight") and not r.in_prefill and r.status is S.RUNNING
    return r, (s.schedule() if state == "in_flight" else None)


@pytest.mark.parametrize("state", ["waiting", "handoff", "prefill", "decode", "in_flight"])
def test_abort_in_every_state_frees_everything(state):
    s = make()
    r, in_flight = _in_state(s, state)
    slot = r.slot
    got = s.abort("r", "client disconnected")
    assert got is r and r.status is S.FINISHED_ABORTED and r.error == "client disconnected"
    assert r.block_table == [] and r.slot is None and r.finish_reason == "abort"
    assert s.get("r") is None
    if slot is not None:
        assert slot in s._free_slots
    assert s.abort("r") is None and s.stats.num_ignored_aborts == 1  # duplicate
    assert s.abort("nobody") is None and s.stats.num_ignored_aborts == 2  # unknown
    if in_flight is not None:
        # The step that was running when r was aborted reports r too: ignored, counted.
        assert r in in_flight.decodes
        assert s.update(results(in_flight)) == []
        assert s.stats.num_ignored_results == 1
    for rid in ("other", "later"):
        s.abort(rid)
    assert_idle(s)


def test_fail_finishes_with_error():
    s = make()
    s.add(r := Request("r", 4, 4))
    step(s)
    assert s.fail("r", "codec crashed") is r
    assert r.status is S.FINISHED_ERROR and r.error == "codec crashed"
    assert s.fail("r", "again") is None
    assert_idle(s)


# ---- handoff (prefill-decode disaggregation) ---------------------------------------------------------

def test_handoff_complete_path():
    s = make()
    r = Request("r", prompt_len=9, max_frames=4, kv_handoff=True)
    s.add(r)
    out = s.schedule()
    assert out.kv_receives == [r] and out.new_requests == [r] and out.is_empty and out.num_batched_tokens == 0
    assert r.status is S.WAITING_FOR_HANDOFF and r.slot == 0 and len(r.block_table) == 3
    assert s.num_receiving == 1 and s.num_running == 0
    assert s.block_manager.num_reserved_blocks == 1  # (9 + 4) tokens = 4 blocks, 3 held
    for _ in range(3):
        out = s.schedule()
        assert out.is_empty and r.num_computed_tokens == 0  # never prefilled here
    assert s.handoff_complete("r") is True
    assert r.status is S.RUNNING and r.num_computed_tokens == 9
    assert s.handoff_complete("r") is False and s.stats.num_ignored_handoffs == 1
    out, _ = step(s)
    assert out.decodes == [r] and out.prefills == []
    assert r.num_computed_tokens == 10 and len(r.block_table) == 3
    for _ in range(3):
        _, fin = step(s)
    assert fin == [r] and r.status is S.FINISHED_LENGTH and r.num_frames == 4
    assert_idle(s)


def test_handoff_failed_frees_blocks_and_slot():
    s = make()
    r = Request("r", prompt_len=9, max_frames=4, kv_handoff=True)
    s.add(r)
    assert s.handoff_failed("r", "too early") is None  # still WAITING: not a handoff target yet
    s.schedule()
    got = s.handoff_failed("r", "transfer deadline")
    assert got is r and r.status is S.FINISHED_ERROR and r.error == "transfer deadline"
    assert s.handoff_complete("r") is False and s.handoff_failed("r", "late") is None
    assert s.stats.num_ignored_handoffs == 3
    assert_idle(s)


def test_handoff_failed_with_quarantine():
    s = make(num_blocks=4)
    r = Request("r", prompt_len=8, max_frames=4, kv_handoff=True)
    s.add(r)
    s.schedule()
    blocks = list(r.block_table)
    s.block_manager.quarantine(blocks)
    s.handoff_failed("r", "cancelled")
    bm = s.block_manager
    assert bm.num_free_blocks == 2
    s.add(nxt := Request("n", prompt_len=8, max_frames=4))
    assert s.schedule().is_empty and nxt.status is S.WAITING  # cannot reserve 3 blocks yet
    bm.release_quarantine(blocks)
    out = s.schedule()
    assert out.new_requests == [nxt]


def test_handoff_requests_wait_for_slots_in_fifo_order():
    s = make(max_num_seqs=1)
    a, h = Request("a", 4, 3), Request("h", 4, 3, kv_handoff=True)
    s.add(a)
    s.add(h)
    step(s)
    assert h.status is S.WAITING
    step(s)
    step(s)
    out = s.schedule()
    assert out.kv_receives == [h] and h.slot == 0


# ---- prefix caching through the scheduler ------------------------------------------------------------

def test_prefix_cache_hit_skips_computed_blocks():
    s = make(enable_prefix_caching=True)
    keys = [("p", i) for i in range(3)]
    a = Request("a", prompt_len=14, max_frames=2, prefix_keys=keys)
    s.add(a)
    step(s)
    b = Request("b", prompt_len=14, max_frames=2, prefix_keys=keys)
    s.add(b)
    out = s.schedule()
    chunk = next(c for c in out.prefills if c.request is b)
    assert (chunk.start, chunk.num_tokens) == (12, 2) and b.num_cached_tokens == 12
    assert b.block_table[:3] == a.block_table[:3]
    s.update(results(out))
    for _ in range(3):
        step(s)
    assert_idle(s)
    assert s.block_manager.num_cached_blocks == 3


# ---- randomized simulation ---------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(6))
def test_random_simulation(seed):
    rng = random.Random(seed)
    chunked = seed % 2 == 0
    caching = seed % 3 == 0
    budget = 64
    s = make(num_blocks=rng.choice([40, 80, 200]), max_num_seqs=8, max_num_batched_tokens=budget,
             enable_chunked_prefill=chunked, enable_prefix_caching=caching, max_waiting=64)
    bm = s.block_manager
    pending = []
    for i in range(64):
        prompt_len = rng.randint(1, 60)
        shared = rng.random() < 0.5
        keys = [("shared" if shared else f"r{i}", j) for j in range(prompt_len // 4)]
        pending.append(Request(f"r{i}", prompt_len=prompt_len, max_frames=rng.randint(1, 40),
                               prefix_keys=keys, kv_handoff=rng.random() < 0.1))
    eos_at = {r.request_id: rng.randint(1, r.max_frames) for r in pending if rng.random() < 0.4}
    finished: list[Request] = []
    steps = 0
    while pending or s.has_unfinished():
        steps += 1
        assert steps < 5000, "simulation does not converge"
        for _ in range(rng.randint(0, 4)):
            if pending:
                s.add(pending.pop(0))
        for rid in list(s._receiving):
            if rng.random() < 0.5:
                if rng.random() < 0.2:
                    finished.append(s.handoff_failed(rid, "transfer failed"))
                else:
                    s.handoff_complete(rid)
        if rng.random() < 0.05 and s.num_running:
            finished.append(s.abort(rng.choice(list(s._running)), "client gone"))
        out = s.schedule()

        # Invariants of one step.
        assert s.num_running + s.num_receiving <= 8
        assert out.num_batched_tokens == len(out.decodes) + sum(c.num_tokens for c in out.prefills) <= budget
        running = list(s._running.values())
        assert {r.request_id for r in out.decodes} == {r.request_id for r in running if not r.in_prefill}
        slots = [r.slot for r in running + list(s._receiving.values())]
        assert len(set(slots)) == len(slots) and all(0 <= x < 8 for x in slots)
        for c in out.prefills:
            assert chunked or (c.start == c.request.num_cached_tokens and c.is_last)
            assert len(c.request.block_table) == bm.num_blocks_for(c.start + c.num_tokens)
        for r in out.decodes:
            assert len(r.block_table) == bm.num_blocks_for(r.num_computed_tokens + 1)
        assert bm.num_free_blocks >= bm.num_reserved_blocks >= 0

        # A fake runner: the last chunk and each decode produce a frame; EOS at a chosen frame.
        res = []
        for c in out.prefills:
            rid, n = c.request.request_id, int(c.is_last)
            res.append(StepResult(rid, c.num_tokens, n, stopped=bool(n) and eos_at.get(rid) == 1))
        for r in out.decodes:
            res.append(StepResult(r.request_id, 1, 1, stopped=eos_at.get(r.request_id) == r.num_frames + 1))
        # Sometimes a client disconnects while the step runs.
        if rng.random() < 0.05 and out.decodes:
            finished.append(s.abort(rng.choice(out.decodes).request_id, "client gone mid-step"))
        finished += s.update(res)

    ids = [r.request_id for r in finished]
    assert len(ids) == len(set(ids)) == 64
    for r in finished:
        assert r.is_finished and r.slot is None and r.block_table == []
        if r.status is S.FINISHED_STOPPED:
            assert r.num_frames == eos_at[r.request_id]
        elif r.status is S.FINISHED_LENGTH:
            assert r.num_frames == r.max_frames
            assert eos_at.get(r.request_id, r.max_frames) >= r.max_frames
        else:
            assert r.status in (S.FINISHED_ABORTED, S.FINISHED_ERROR) and r.error
    assert s.stats.num_finished == 64
    assert_idle(s)


# ---- prefill_interval ------------------------------------------------------------------------------------


@pytest.mark.parametrize("fair", [True, False])
def test_prefill_interval_takes_prompts_arriving_one_by_one_together(fair):
    """With k = 3 and one prompt arriving each step beside a running decode, prompts join on every third step
    only, together; nothing is lost and each still gets its whole life."""
    s = make(max_num_seqs=8, prefill_interval=3, fair_prefill=fair)
    s.add(Request("long", prompt_len=2, max_frames=30))
    out, _ = step(s)
    assert out.new_requests[0].request_id == "long"  # nothing decoding: admitted at once
    admitted_at = {}
    for t in range(1, 10):
        s.add(Request(f"q{t}", prompt_len=2, max_frames=2))
        out, _ = step(s)
        for r in out.new_requests:
            admitted_at[r.request_id] = t
    # step 1 and 2 hold (the last admission was step 0), step 3 takes q1..q3, step 6 q4..q6, step 9 q7..q9
    assert admitted_at == {f"q{t}": 3 * ((t + 2) // 3) for t in range(1, 10)}


def test_prefill_interval_never_delays_a_request_to_an_idle_engine_or_after_a_quiet_spell():
    s = make(max_num_seqs=8, prefill_interval=4)
    s.add(Request("a", prompt_len=2, max_frames=12))
    out, _ = step(s)
    assert [r.request_id for r in out.new_requests] == ["a"]
    for _ in range(5):  # a quiet spell: only a decoding
        out, _ = step(s)
        assert out.decodes and not out.new_requests
    s.add(Request("b", prompt_len=2, max_frames=2))
    out, _ = step(s)
    assert [r.request_id for r in out.new_requests] == ["b"]  # four steps passed since the last admission


def test_prefill_interval_holds_no_handoff():
    s = make(max_num_seqs=8, prefill_interval=5)
    s.add(Request("a", prompt_len=2, max_frames=12))
    step(s)
    s.add(h := Request("h", prompt_len=9, max_frames=4, kv_handoff=True))
    out, _ = step(s)
    assert out.kv_receives == [h] and h.status is S.WAITING_FOR_HANDOFF


def test_prefill_interval_must_be_a_positive_int():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="prefill_interval"):
            EngineConfig(prefill_interval=bad)
