"""The bench's live view of a run (issue 20, item 4): frames received, and a warning as soon as the pace shows
that requests cannot finish within their timeout, with a concurrency that would fit."""

from __future__ import annotations

import asyncio

import pytest
from bench_fake_server import FRAME_SAMPLES, FakeSpeechServer

from legato.bench import client as bench_client
from legato.bench.client import ClientConfig, run_benchmark
from legato.bench.datasets import BenchRequest
from legato.bench.metrics import RequestRecord
from legato.bench.pace import Pace, frames_per_char

FRAME_BYTES = 2 * FRAME_SAMPLES


def _flying(i: int, sent_s: float, frames: int, num_frames: int | None = 20, chars: int = 10) -> RequestRecord:
    rec = RequestRecord(i, f"u{i}", chars, num_frames, sent_s=sent_s)
    rec.chunk_bytes = [FRAME_BYTES] * frames
    rec.chunk_times_s = [0.1 * k for k in range(frames)]
    return rec


def test_requests_too_slow_for_the_timeout_are_called_out_once():
    # Four requests of 20 frames, sent at 0, each with 2 frames after 4 s: 40 s each, past a 10 s timeout.
    records = [_flying(i, 0.0, 2) for i in range(4)]
    pace = Pace(records, timeout_s=10.0, sample_rate=24000)
    verdict = pace.check(now_s=4.0)
    assert verdict is not None and verdict.projected_s == pytest.approx(40.0)
    assert verdict.frames_per_s == pytest.approx(2.0) and verdict.expected_frames == 20
    # 2 frames/s shared: one request of 20 frames takes 10 s, over 80 % of the timeout: one at a time.
    assert verdict.fitting_concurrency == 1
    assert "expect timeouts" in verdict.message() and "About 1 request at a time" in verdict.message()
    assert pace.check(now_s=5.0) is None  # said once
    assert pace.total_frames() == 8 and pace.expected_total() == 80


def test_a_pace_that_fits_or_too_little_to_judge_says_nothing():
    fast = [_flying(i, 0.0, 10) for i in range(4)]  # 10 of 20 frames after 4 s: 8 s, inside 10 s
    assert Pace(fast, 10.0, 24000).check(4.0) is None
    early = [_flying(i, 0.0, 1) for i in range(4)]  # under a second since sent: the first chunk's latency
    assert Pace(early, 10.0, 24000).check(0.5) is None
    silent = [_flying(i, 0.0, 0) for i in range(4)]  # no audio yet: no pace to judge
    assert Pace(silent, 10.0, 24000).check(4.0) is None
    unknown = [_flying(i, 0.0, 2, num_frames=None) for i in range(4)]  # the model's length, no estimate
    assert Pace(unknown, 10.0, 24000).check(4.0) is None
    # The same, with the warm-ups' 2 frames per character: 20 frames expected, 40 s projected.
    assert Pace(unknown, 10.0, 24000, frames_per_char=2.0).check(4.0) is not None


def test_frames_per_character_come_from_completed_requests():
    done = _flying(0, 0.0, 12, num_frames=None, chars=6)
    done.end_s = 1.0
    done.finalize(24000)
    failed = RequestRecord(1, "u1", 50, None, sent_s=0.0, end_s=1.0)
    failed.fail("timeout", "late")
    failed.finalize(24000)
    assert frames_per_char([done, failed]) == pytest.approx(2.0) and frames_per_char([failed]) is None


class _Bar:
    """A progress bar that keeps what it was told."""

    def __init__(self) -> None:
        self.postfixes: list[str] = []
        self.written: list[str] = []

    def update(self, n: int) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        self.postfixes.append(s)

    def write(self, s: str, file=None) -> None:
        self.written.append(s)

    def close(self) -> None:
        pass


def test_a_run_shows_its_frames_and_warns_before_the_first_timeout(monkeypatch):
    """Six 12-frame requests at once, a frame every 0.3 s (3.6 s each), a 3 s timeout: the run must say so
    while they run, before any of them times out, and the progress line counts frames."""
    bars: list[_Bar] = []
    monkeypatch.setattr(bench_client, "_progress", lambda total, desc, enabled: bars.append(_Bar()) or bars[-1])
    reqs = [BenchRequest(f"u{i}", {"input": "slow", "num_frames": 12}, 4, 12) for i in range(6)]

    async def go():
        server = await FakeSpeechServer(frame_delay_s=0.3).start()
        try:
            cfg = ClientConfig(base_url=server.url, timeout_s=3.0, tick_s=0.1)
            return await run_benchmark(cfg, reqs)
        finally:
            await server.close()

    out = asyncio.run(go())
    assert all(r.error_kind == "timeout" for r in out.records)
    [warning] = out.warnings
    first_timeout = min(r.sent_s + r.end_s for r in out.records)
    assert warning["run"] == "bench" and warning["at_s"] < first_timeout, (warning, first_timeout)
    assert "past the 3 s timeout" in warning["message"] and bars[-1].written == [
        f"legato bench: warning: {warning['message']}"]
    shown = [p for p in bars[-1].postfixes if not p.startswith("0/")]
    assert shown and all(p.endswith("/72 frames") for p in shown)


def test_a_run_at_the_bench_s_own_concurrency_stops_once_it_cannot_meet_its_timeout(monkeypatch):
    """`stop_on_pace` (the CLI sets it when the concurrency is the server's default): six 120-frame requests, three
    at a time, a frame every 0.3 s (36 s each) against a 30 s timeout. The run stops at the verdict, long before any
    timeout: what was in flight and what was never sent fail as "stopped", with the concurrency that would fit."""
    bars: list[_Bar] = []
    monkeypatch.setattr(bench_client, "_progress", lambda total, desc, enabled: bars.append(_Bar()) or bars[-1])
    reqs = [BenchRequest(f"u{i}", {"input": "slow", "num_frames": 120}, 4, 120) for i in range(6)]

    async def go():
        server = await FakeSpeechServer(frame_delay_s=0.3).start()
        try:
            cfg = ClientConfig(base_url=server.url, timeout_s=30.0, tick_s=0.1, max_concurrency=3, stop_on_pace=True)
            return await run_benchmark(cfg, reqs)
        finally:
            await server.close()

    out = asyncio.run(go())
    assert [r.error_kind for r in out.records] == ["stopped"] * 6
    assert out.duration_s < 30.0 and not any(r.ok for r in out.records)
    assert sum(r.sent_s is not None for r in out.records) == 3  # three were in flight, three never went
    assert "rerun with --max-concurrency" in out.records[0].error
    assert bars[-1].written[-1] == f"legato bench: {out.records[0].error}"
