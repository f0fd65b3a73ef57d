"""The admission thread (`pipeline/admission.py`): requests queued while it works are prepared as one batch, in
the order they came; a request that fails fails alone; closing fails what is still queued."""

from __future__ import annotations

import threading
from concurrent.futures import CancelledError

import pytest

from legato.engine.engine import EngineRequest
from legato.models.qwen3_tts.prompt import PromptError, PromptSpec
from legato.models.qwen3_tts.sampling import SamplingParams
from legato.pipeline.admission import Admission, AdmissionClosed

DEADLINE_S = 10.0


def request(rid: str, text: list[int] | None = None) -> EngineRequest:
    return EngineRequest(rid, PromptSpec(text_ids=text or [1, 2, 3]), SamplingParams())


class Builder:
    """A `build_prompts` that records each batch's specs, can hold a batch until released, and refuses specs whose
    first id is 0 (as a PromptError would)."""

    def __init__(self, hold_first: bool = False) -> None:
        self.batches: list[list[str]] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        if not hold_first:
            self.release.set()
        self.fail_with: Exception | None = None

    def __call__(self, specs):
        self.batches.append([str(s.text_ids[1]) for s in specs])
        self.entered.set()
        assert self.release.wait(DEADLINE_S)
        if self.fail_with is not None:
            raise self.fail_with
        return [PromptError("refused") if s.text_ids[0] == 0 else f"prompt-{s.text_ids[1]}" for s in specs]


def held(max_batch: int = 64, build: Builder | None = None) -> tuple[Builder, Admission]:
    """An admission thread inside its first batch's build (one "hold" request) until `build.release` is set:
    whatever is submitted meanwhile queues for the next batch."""
    build = build or Builder(hold_first=True)
    adm = Admission(build, needs_prompt=lambda r: True, max_batch=max_batch)
    adm.submit(lambda: request("hold", [1, 1, 3]))
    assert build.entered.wait(DEADLINE_S)
    return build, adm


def test_requests_queued_during_a_batch_form_the_next_batch_in_order():
    build = Builder(hold_first=True)
    adm = Admission(build, needs_prompt=lambda r: True, max_batch=64)
    try:
        first = adm.submit(lambda: request("a", [1, 100, 3]))
        assert build.entered.wait(DEADLINE_S)  # the thread is inside the first batch's build
        later = [adm.submit(lambda i=i: request(f"r{i}", [1, i, 3])) for i in range(10)]
        build.release.set()
        assert first.result(DEADLINE_S).prompt == "prompt-100"
        done = [f.result(DEADLINE_S) for f in later]
        assert [r.request_id for r in done] == [f"r{i}" for i in range(10)]
        assert [r.prompt for r in done] == [f"prompt-{i}" for i in range(10)]
        assert build.batches == [["100"], [str(i) for i in range(10)]]  # the ten queued meanwhile: one batch
        assert (adm.batches, adm.requests) == (2, 11)
        # Each future says when its batch was taken and built: the ten queued behind the held first batch were
        # taken after it was built, together.
        assert first.marks["taken"] <= first.marks["built"]
        assert {f.marks["taken"] for f in later} == {later[0].marks["taken"]}
        assert later[0].marks["taken"] >= first.marks["built"]
        assert all(f.marks["taken"] <= f.marks["built"] for f in later)
    finally:
        adm.close()


def test_a_batch_is_capped_at_max_batch():
    build, adm = held(max_batch=4)
    try:
        futures = [adm.submit(lambda i=i: request(f"r{i}", [1, i, 3])) for i in range(10)]
        build.release.set()
        for f in futures:
            f.result(DEADLINE_S)
        assert [len(b) for b in build.batches] == [1, 4, 4, 2]
    finally:
        adm.close()


def test_a_failing_request_fails_alone():
    build, adm = held()
    try:

        def broken():
            raise ValueError("no voice")

        good = adm.submit(lambda: request("good", [1, 7, 3]))
        host_fail = adm.submit(broken)
        prompt_fail = adm.submit(lambda: request("bad", [0, 8, 3]))
        after = adm.submit(lambda: request("after", [1, 9, 3]))
        build.release.set()
        assert good.result(DEADLINE_S).prompt == "prompt-7"
        with pytest.raises(ValueError, match="no voice"):
            host_fail.result(DEADLINE_S)
        with pytest.raises(PromptError, match="refused"):
            prompt_fail.result(DEADLINE_S)
        assert after.result(DEADLINE_S).prompt == "prompt-9"
        assert build.batches[1] == ["7", "8", "9"]  # the host failure never reached the build
    finally:
        adm.close()


def test_a_failed_build_fails_its_batch_with_the_reason_and_the_thread_goes_on():
    build = Builder()
    build.fail_with = RuntimeError("device lost")
    adm = Admission(build, needs_prompt=lambda r: True)
    try:
        with pytest.raises(RuntimeError, match="device lost"):
            adm.submit(lambda: request("a")).result(DEADLINE_S)
        build.fail_with = None
        assert adm.submit(lambda: request("b", [1, 5, 3])).result(DEADLINE_S).prompt == "prompt-5"
    finally:
        adm.close()


def test_a_batch_whose_build_fails_is_built_again_one_by_one_so_the_bad_request_fails_alone():
    class OneBreaksTheBatch(Builder):
        def __call__(self, specs):
            if any(s.text_ids[1] == 66 for s in specs):
                self.batches.append([str(s.text_ids[1]) for s in specs])
                raise RuntimeError("out of memory")
            return super().__call__(specs)

    build, adm = held(build=OneBreaksTheBatch(hold_first=True))
    try:
        futures = [adm.submit(lambda i=i: request(f"r{i}", [1, i, 3])) for i in (65, 66, 67)]
        build.release.set()
        assert futures[0].result(DEADLINE_S).prompt == "prompt-65"
        with pytest.raises(RuntimeError, match="out of memory"):
            futures[1].result(DEADLINE_S)
        assert futures[2].result(DEADLINE_S).prompt == "prompt-67"
        assert build.batches[1:] == [["65", "66", "67"], ["65"], ["66"], ["67"]]
    finally:
        adm.close()


def test_requests_that_need_no_prompt_skip_the_build():
    build = Builder()
    adm = Admission(build, needs_prompt=lambda r: r.request_id != "open")
    try:
        assert adm.submit(lambda: request("open")).result(DEADLINE_S).prompt is None
        assert build.batches == []
    finally:
        adm.close()


def test_close_fails_what_is_queued_and_refuses_what_comes_after():
    build = Builder(hold_first=True)
    adm = Admission(build, needs_prompt=lambda r: True)
    running = adm.submit(lambda: request("a", [1, 1, 3]))
    assert build.entered.wait(DEADLINE_S)
    queued = adm.submit(lambda: request("b"))
    cancelled = adm.submit(lambda: request("c"))
    assert cancelled.cancel()
    assert not adm.close(wait_s=0)  # the thread is inside a batch: it ends after it
    build.release.set()
    assert running.result(DEADLINE_S).prompt == "prompt-1"  # the batch in progress completes
    with pytest.raises(AdmissionClosed):
        queued.result(DEADLINE_S)
    with pytest.raises(CancelledError):
        cancelled.result(DEADLINE_S)
    with pytest.raises(AdmissionClosed):
        adm.submit(lambda: request("d")).result(DEADLINE_S)
    assert adm.close(wait_s=DEADLINE_S)  # ended


def test_a_cancelled_request_is_skipped():
    build, adm = held()
    try:
        made = []
        gone = adm.submit(lambda: made.append("gone") or request("gone", [1, 2, 3]))
        kept = adm.submit(lambda: request("kept", [1, 4, 3]))
        assert gone.cancel()
        build.release.set()
        assert kept.result(DEADLINE_S).prompt == "prompt-4"
        assert made == [] and build.batches[1] == ["4"]
    finally:
        adm.close()
