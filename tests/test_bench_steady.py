"""The rates over a run's steady middle (`legato.bench.steady`), which served cells and the engine alone both
report, so their ratio leaves out the start's burst and the end's drain."""

from __future__ import annotations

import pytest

from legato.bench.steady import Sample, steady_rates, steady_summary


def run(ramp: int = 10, steady: int = 60, drain: int = 10) -> list[Sample]:
    """A run sampled every 0.1 s: a slow ramp, a steady middle at 200 rows a step and 10 steps a second, a drain."""
    samples, rows, steps, gpu, gap = [], 0.0, 0.0, 0.0, 0.0
    for i in range(ramp + steady + drain + 1):
        samples.append(Sample(0.1 * i, {"decode_rows": rows, "steps": steps, "gpu_s": gpu, "gap_s": gap}))
        per_step = 200 if ramp <= i < ramp + steady else 20
        rows, steps, gpu, gap = rows + per_step, steps + 1, gpu + 0.075, gap + 0.025
    return samples


def test_the_window_lies_in_the_steady_middle_and_gives_its_rates():
    rates = steady_rates(run())
    assert rates["decode_rows"] == pytest.approx(2000.0)  # 200 rows a step, one step each 0.1 s
    assert rates["steps"] == pytest.approx(10.0)
    assert rates["decode_rows_per_step"] == pytest.approx(200.0)
    # 12,400 rows in all, 200 of them in the ramp: 20 % (2,480) is first reached at the sample of 2.2 s (2,600
    # rows), 80 % (9,920) at that of 5.9 s (10,000)
    assert rates["window_s"] == pytest.approx(3.7)
    assert rates["window_share"] == pytest.approx(3.7 / 8.0)


def test_the_summary_names_what_the_benchmarks_print():
    out = steady_summary(run())
    assert out["decode_rows_per_s"] == pytest.approx(2000.0) and out["rows_per_step"] == pytest.approx(200.0)
    assert out["steps_per_s"] == pytest.approx(10.0) and out["gpu_busy"] == pytest.approx(0.75)


def test_a_run_the_samples_cannot_bound_gives_none():
    assert steady_rates([]) is None
    assert steady_rates(run()[:2]) is None  # too few samples
    flat = [Sample(0.1 * i, {"decode_rows": 5.0, "steps": float(i)}) for i in range(10)]
    assert steady_rates(flat) is None and steady_summary(flat) is None  # nothing decoded
    one_jump = [Sample(0.0, {"decode_rows": 0.0}), Sample(0.1, {"decode_rows": 0.0}), Sample(0.2, {"decode_rows": 9.0})]
    assert steady_rates(one_jump) is None  # both bounds fall on one sample


def test_bounds_out_of_order_are_refused():
    with pytest.raises(ValueError, match="lo < hi"):
        steady_rates(run(), lo=0.8, hi=0.2)
