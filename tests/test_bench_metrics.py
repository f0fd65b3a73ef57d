"""Bench metrics on synthetic timelines, against hand-computed values.

Sample rate 1000 Hz throughout, so 2000 bytes of s16le PCM = 1 s of audio.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from legato.bench.metrics import (
    RequestRecord,
    SloError,
    aggregate,
    flatten,
    parse_slos,
    percentile,
    stream_underrun,
)

SR = 1000


def rec(index: int, times: list[float], nbytes: list[int], end: float | None, error: str | None = None):
    r = RequestRecord(index, f"u{index}", 10, chunk_times_s=times, chunk_bytes=nbytes, end_s=end)
    if error:
        r.fail(error, "boom")
    return r.finalize(SR)


def timeline():
    """A: late chunks (two underruns); B: ahead of real time; C: HTTP 500; D: every chunk exactly on time."""
    a = rec(0, [0.2, 0.5, 1.0, 2.5, 2.6], [1000, 1000, 400, 2000, 600], 2.7)
    b = rec(1, [0.1, 0.6], [2000, 1000], 0.7)
    c = rec(2, [], [], 0.3, error="http_500")
    d = rec(3, [0.05, 0.30], [500, 500], 0.55)
    return [a, b, c, d]


def test_per_request_metrics_of_a_late_stream():
    a = timeline()[0]
    assert a.ok
    assert a.ttfp_s == 0.2
    assert a.e2el_s == 2.7
    assert a.audio_s == 2.5
    assert a.rtf == pytest.approx(2.7 / 2.5)
    # Player starts at 0.2 s. At 2.5 s it has played 2.3 s but received 1.2 s (deficit 1.1); at 2.6 s it has
    # played 2.4 s and received 2.2 s (deficit 0.2). Earlier arrivals are 0.2 s ahead.
    assert a.underrun_s == pytest.approx(1.1)
    assert a.underrun_events == 2


def test_underrun_is_zero_when_ahead_or_exactly_on_time():
    _, b, _, d = timeline()
    assert (b.underrun_s, b.underrun_events) == (0.0, 0)
    assert d.underrun_s == 0.0 and d.underrun_events == 0  # deficit exactly 0 is not an event
    assert stream_underrun([1.0], [10], 2000) == (0.0, 0)  # one chunk: nothing to wait for


def test_stream_underrun_counts_every_late_arrival():
    # 0.1 s chunks (200 bytes at 2000 B/s) arriving every 0.3 s: deficits 0.2, 0.4, 0.6.
    worst, events = stream_underrun([0.0, 0.3, 0.6, 0.9], [200] * 4, 2000)
    assert worst == pytest.approx(0.6)
    assert events == 3


def test_failures_are_kept_with_their_kind():
    _, _, c, _ = timeline()
    assert not c.ok and c.error_kind == "http_500" and c.e2el_s is None and c.rtf is None
    empty = rec(4, [], [], 0.2)
    assert not empty.ok and empty.error_kind == "no_audio"
    odd = rec(5, [0.1], [3], 0.2)
    assert not odd.ok and odd.error_kind == "bad_audio"
    cut = rec(6, [0.1, 0.2], [200, 200], 0.25, error="stream_cut")
    assert not cut.ok and cut.ttfp_s == 0.1 and cut.audio_s == 0.2  # partial data is kept for inspection


def test_aggregates_by_hand():
    agg = aggregate(timeline(), duration_s=4.0)
    assert (agg["num_requests"], agg["completed"], agg["failed"]) == (4, 3, 1)
    assert agg["failures"] == {"http_500": 1}
    assert agg["request_throughput"] == pytest.approx(3 / 4)
    assert agg["audio_throughput"] == pytest.approx((2.5 + 1.5 + 0.5) / 4)
    # TTFP over completed requests: 200, 100, 50 ms.
    assert agg["ttfp_ms"]["mean"] == pytest.approx(350 / 3)
    assert agg["ttfp_ms"]["median"] == pytest.approx(100)
    assert agg["ttfp_ms"]["p90"] == pytest.approx(180)  # rank 1.8 between 100 and 200
    assert agg["ttfp_ms"]["p99"] == pytest.approx(198)
    assert agg["e2el_ms"]["median"] == pytest.approx(700)
    assert agg["underrun_s"]["mean"] == pytest.approx(1.1 / 3)
    # Continuity: B and D are continuous, A underran, C failed: 2 of 4 requests.
    assert agg["continuity_rate"] == pytest.approx(0.5)
    # Without SLOs every completed request is good.
    assert agg["goodput"]["good_requests"] == 3
    assert agg["goodput"]["request_goodput"] == pytest.approx(agg["request_throughput"])


def test_goodput_with_per_request_slos():
    agg = aggregate(timeline(), 4.0, parse_slos(["ttfp_ms=150", "rtf=1.2"]), num_gpus=2)
    g = agg["goodput"]
    # A misses ttfp (200 ms), C failed; B (100 ms, RTF 0.47) and D (50 ms, RTF 1.1) are good.
    assert g["good_requests"] == 2
    assert g["request_goodput"] == pytest.approx(2 / 4)
    assert g["audio_goodput"] == pytest.approx((1.5 + 0.5) / 4)
    assert g["request_goodput_per_gpu"] == pytest.approx(0.25)
    assert g["audio_goodput_per_gpu"] == pytest.approx(0.25)
    assert agg["request_throughput_per_gpu"] == pytest.approx(0.375)
    g2 = aggregate(timeline(), 4.0, parse_slos(["underrun_s=0.5"]))["goodput"]
    assert g2["good_requests"] == 2  # A's 1.1 s underrun breaks it


def test_run_percentile_slos_count_failures_as_infinite():
    # All requests' TTFP: 200, 100, inf (failed C), 50 → sorted 50, 100, 200, inf; p50 = 150.
    met = aggregate(timeline(), 4.0, parse_slos(["ttfp_p50_ms=150"]))["goodput"]
    assert met["run_slo_met"] and met["run_checks"][0]["measured"] == pytest.approx(150)
    assert met["request_goodput"] == pytest.approx(3 / 4)
    missed = aggregate(timeline(), 4.0, parse_slos(["ttfp_p50_ms=149", "rtf=5"]))["goodput"]
    assert not missed["run_slo_met"]
    assert missed["good_requests"] == 3  # still reported per request ...
    assert missed["request_goodput"] == 0.0 and missed["audio_goodput"] == 0.0  # ... but the run misses its SLO
    p99 = aggregate(timeline(), 4.0, parse_slos(["ttfp_p99_ms=10000"]))["goodput"]
    assert math.isinf(p99["run_checks"][0]["measured"]) and not p99["run_slo_met"]


def test_percentile_matches_numpy_and_handles_inf():
    rng = random.Random(1)
    for n in (1, 2, 5, 17):
        xs = [rng.uniform(0, 100) for _ in range(n)]
        for q in (0, 25, 50, 90, 99, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert percentile([1.0, math.inf], 50) == math.inf
    assert percentile([1.0, math.inf], 0) == 1.0
    assert math.isnan(percentile([], 50))


def test_parse_slos():
    slo = parse_slos(["ttfp_p50_ms=500", "underrun_s=0.5", "rtf=1", "e2el_p99.9_ms=9000", "underrun_p95_s=0.1"])
    assert slo.per_request == {"underrun_s": 0.5, "rtf": 1.0}
    assert [(s.metric, s.q, s.limit) for s in slo.run] == [
        ("ttfp_ms", 50.0, 500.0), ("e2el_ms", 99.9, 9000.0), ("underrun_s", 95.0, 0.1)]
    for bad in ("ttfp=5", "ttfp_ms", "ttfp_ms=abc", "rtf=-1", "ttfp_p50=3"):
        with pytest.raises(SloError):
            parse_slos([bad])


def test_flatten_skips_slo_limits_and_non_numbers():
    flat = flatten(aggregate(timeline(), 4.0, parse_slos(["rtf=2"])))
    assert flat["ttfp_ms.median"] == pytest.approx(100)
    assert flat["goodput.request_goodput"] == pytest.approx(0.75)
    assert not any(k.startswith("goodput.slo") for k in flat)


def test_the_run_table_names_the_slos_in_words_and_says_when_none_was_given():
    from legato.bench.metrics import SloSpec
    from legato.bench.report import run_table

    for slo, want in ((SloSpec(), "no SLO given (every completed request is good)"),
                      (SloSpec(per_request={"ttfp_ms": 500.0}), "SLO ttfp_ms<=500")):
        table = run_table({"aggregates": aggregate(timeline(), duration_s=4.0, slo=slo), "config": {}})
        assert want in table and "{" not in table.split("goodput:")[1].splitlines()[0]
        assert "continuity rate: 0.500 (requests whose audio never ran dry)" in table
