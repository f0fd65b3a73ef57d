"""Rates over a run's steady middle: the engine's counters between the moments its decoded frames reach 20 % and
80 % of the run's total, so the ramp at the start (a burst of prompts all at once) and the drain at the end (the
last requests finishing with fewer streams beside them) weigh on neither the served run nor the engine alone.

A sample is a time and the engine's cumulative counters then (`decode_rows`: streams decoded summed over steps;
`steps`; any others, such as the step timers' seconds). `steady_rates` gives each counter's rise per second over
the window, the streams a step carried (`decode_rows / steps`), and the window itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Sample:
    t: float  # seconds, any clock that only moves forward
    counters: dict[str, float] = field(default_factory=dict)


def steady_rates(samples: Sequence[Sample], key: str = "decode_rows", lo: float = 0.2,
                 hi: float = 0.8) -> dict[str, float] | None:
    """Per-second rises of every counter between the first samples at which `key` has risen by `lo` and by `hi`
    of its whole rise, plus `<key>_per_step` (when `steps` is counted), `window_s`, and the window's share of the
    run (`window_share`). None when the samples cannot bound such a window (too few, or no rise)."""
    if not 0.0 <= lo < hi <= 1.0:
        raise ValueError(f"need 0 <= lo < hi <= 1, got lo={lo}, hi={hi}")
    if len(samples) < 3:
        return None
    base = samples[0].counters.get(key, 0.0)
    total = samples[-1].counters.get(key, 0.0) - base
    if total <= 0:
        return None
    start = next(s for s in samples if s.counters.get(key, 0.0) - base >= lo * total)
    end = next(s for s in samples if s.counters.get(key, 0.0) - base >= hi * total)
    span = end.t - start.t
    if span <= 0:
        return None
    out = {name: (end.counters.get(name, 0.0) - value) / span for name, value in start.counters.items()}
    steps = end.counters.get("steps", 0.0) - start.counters.get("steps", 0.0)
    if steps > 0:
        out[f"{key}_per_step"] = (end.counters.get(key, 0.0) - start.counters.get(key, 0.0)) / steps
    out["window_s"] = span
    out["window_share"] = span / (samples[-1].t - samples[0].t)
    return out


def steady_summary(samples: Sequence[Sample]) -> dict[str, float | None] | None:
    """What the benchmarks report of a run's steady middle: decoded rows and steps a second, rows a step, the
    window's length and the device's busy share there (from `gpu_s` and `gap_s`, when sampled)."""
    rates = steady_rates(samples)
    if rates is None:
        return None
    busy = rates.get("gpu_s", 0.0) + rates.get("gap_s", 0.0)
    return {"decode_rows_per_s": rates["decode_rows"], "steps_per_s": rates.get("steps"),
            "rows_per_step": rates.get("decode_rows_per_step"), "window_s": rates["window_s"],
            "gpu_busy": rates.get("gpu_s", 0.0) / busy if busy else None}
