"""Per-request streaming metrics, their aggregates, and goodput under SLOs.

Definitions (all times are measured on the client with `time.perf_counter()`):

- A request's clock starts when it is *sent* (after it has waited for a concurrency slot, so client-side
  queueing behind `--max-concurrency` is not counted as server latency; the planned arrival time is kept in
  the record too). A "chunk" is one non-empty network read of the response body, not a server chunk.
- **TTFP**: first chunk arrival − send. **E2EL**: end of the response body − send.
- **audio_s**: received PCM bytes / (2 × sample_rate) (s16le mono). **RTF**: E2EL / audio_s.
- **Stream underrun**: a player starts at the first chunk and plays in real time without ever pausing. At
  each later chunk i, `deficit_i = (t_i − t_0) − audio_before_i` (seconds of audio that should already have
  played but had not arrived). `underrun_s = max(0, max_i deficit_i)`; `underrun_events` = the number of
  chunks i ≥ 1 with `deficit_i > 0`. A stream of one chunk has no underrun.
- **Continuity rate**: requests that completed with `underrun_s == 0`, divided by *all* requests (a failed
  request is not a continuous stream).
- A request **completes** when the status is 2xx, the body ended normally, and it carried audio. Everything
  else (non-2xx, timeout, cut stream, connection error, empty audio) is a failure with a kind and a message;
  failures are counted and listed, never dropped. Latency/RTF/underrun aggregates (mean, median, p90, p99)
  are over completed requests; their count is reported next to them.
- **Throughput**: completed requests / duration and completed audio seconds / duration, where duration runs
  from the first timed request's planned start (warm-ups excluded) to the last request's end.
- **Goodput**: per-request SLOs (`ttfp_ms`, `e2el_ms`, `rtf`, `underrun_s`) decide whether a request is
  *good*: it completed and every measured value is ≤ its limit. Run SLOs are percentiles
  (`ttfp_p50_ms`, `e2el_p99_ms`, `rtf_p90`, `underrun_p99_s`, ...) computed over *all* requests with a failed
  request counting as +inf; every run SLO must hold or the run's goodput is 0. Goodput = good requests /
  duration (and good audio seconds / duration), divided by the GPU count for the per-GPU figures. With no
  SLO given every completed request is good and goodput equals throughput.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import asdict, dataclass, field

PER_REQUEST_SLOS = {"ttfp_ms", "e2el_ms", "rtf", "underrun_s"}
_Q = r"p(\d{1,2}(?:\.\d+)?)"  # a percentile, 0-99.x
_RUN_SLO = re.compile(rf"^(ttfp|e2el)_{_Q}_ms$|^(rtf)_{_Q}$|^(underrun)_{_Q}_s$")
_EPS = 1e-9  # float slack when deciding "deficit > 0"
PERCENTILES = (("mean", None), ("median", 50.0), ("p90", 90.0), ("p99", 99.0))


@dataclass
class RequestRecord:
    """What one request did. Times are seconds; chunk times are relative to `sent_s`."""

    index: int
    utt_id: str
    text_chars: int
    num_frames: int | None = None  # fixed length requested (None: the model decides)
    scheduled_s: float = 0.0  # planned arrival, relative to the run start
    sent_s: float | None = None  # actual send, relative to the run start
    status: int | None = None
    error_kind: str | None = None
    error: str | None = None
    chunk_times_s: list[float] = field(default_factory=list)
    chunk_bytes: list[int] = field(default_factory=list)
    end_s: float | None = None  # relative to sent_s: end of body, or the moment it failed
    # Derived by finalize().
    ok: bool = False
    total_bytes: int = 0
    ttfp_s: float | None = None
    e2el_s: float | None = None
    audio_s: float = 0.0
    rtf: float | None = None
    underrun_s: float | None = None
    underrun_events: int | None = None

    def fail(self, kind: str, message: str) -> None:
        if self.error_kind is None:  # keep the first cause
            self.error_kind, self.error = kind, message

    def finalize(self, sample_rate: int) -> RequestRecord:
        bytes_per_s = 2 * sample_rate
        self.total_bytes = sum(self.chunk_bytes)
        self.audio_s = self.total_bytes / bytes_per_s
        self.ttfp_s = self.chunk_times_s[0] if self.chunk_times_s else None
        if self.error_kind is None and self.total_bytes == 0:
            self.fail("no_audio", "the response carried no audio bytes")
        if self.error_kind is None and self.total_bytes % 2:
            self.fail("bad_audio", f"odd byte count {self.total_bytes} for s16le PCM")
        self.ok = self.error_kind is None
        if self.chunk_times_s:
            self.underrun_s, self.underrun_events = stream_underrun(self.chunk_times_s, self.chunk_bytes, bytes_per_s)
        if self.ok:
            self.e2el_s = self.end_s
            self.rtf = self.e2el_s / self.audio_s
        return self

    def to_json(self) -> dict:
        return asdict(self)


def stream_underrun(times_s: list[float], nbytes: list[int], bytes_per_s: float) -> tuple[float, int]:
    """Worst deficit (s) and deficit event count of a never-pausing real-time player (see module doc)."""
    worst, events, received = 0.0, 0, 0
    t0 = times_s[0]
    for i, (t, b) in enumerate(zip(times_s, nbytes, strict=True)):
        if i > 0:
            deficit = (t - t0) - received / bytes_per_s
            if deficit > _EPS:
                events += 1
                worst = max(worst, deficit)
        received += b
    return worst, events


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), exact with +inf entries."""
    if not values:
        return math.nan
    xs = sorted(values)
    rank = q / 100.0 * (len(xs) - 1)
    lo = math.floor(rank)
    frac = rank - lo
    if frac == 0.0 or lo + 1 >= len(xs):
        return xs[lo]
    a, b = xs[lo], xs[lo + 1]
    return b if math.isinf(b) else a + (b - a) * frac


def describe(values: list[float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, q in PERCENTILES:
        if q is None:
            out[name] = sum(values) / len(values) if values else math.nan
        else:
            out[name] = percentile(values, q)
    return out


@dataclass(frozen=True)
class RunSlo:
    key: str
    metric: str  # ttfp_ms | e2el_ms | rtf | underrun_s
    q: float
    limit: float


@dataclass(frozen=True)
class SloSpec:
    per_request: dict[str, float] = field(default_factory=dict)
    run: tuple[RunSlo, ...] = ()

    def to_json(self) -> dict:
        return {"per_request": dict(self.per_request), "run": {s.key: s.limit for s in self.run}}


class SloError(ValueError):
    pass


def parse_slos(items: list[str] | None) -> SloSpec:
    """Parse `KEY=VALUE` items (see the module doc for the keys)."""
    per_request: dict[str, float] = {}
    run: list[RunSlo] = []
    for item in items or []:
        key, sep, value = item.partition("=")
        key = key.strip()
        try:
            limit = float(value)
        except ValueError:
            raise SloError(f"SLO {item!r}: expected KEY=NUMBER") from None
        if not sep or limit < 0:
            raise SloError(f"SLO {item!r}: expected KEY=NUMBER with a non-negative number")
        if key in PER_REQUEST_SLOS:
            per_request[key] = limit
            continue
        m = _RUN_SLO.match(key)
        if not m:
            raise SloError(
                f"unknown SLO key {key!r}; per-request keys: {sorted(PER_REQUEST_SLOS)}; run keys: "
                "ttfp_pNN_ms, e2el_pNN_ms, rtf_pNN, underrun_pNN_s"
            )
        groups = [g for g in m.groups() if g is not None]
        name, q = groups[0], float(groups[1])
        metric = {"ttfp": "ttfp_ms", "e2el": "e2el_ms", "rtf": "rtf", "underrun": "underrun_s"}[name]
        run.append(RunSlo(key, metric, q, limit))
    return SloSpec(per_request, tuple(run))


def _measure(rec: RequestRecord, metric: str) -> float:
    """A request's value of a SLO metric; +inf when it failed (or the value is undefined)."""
    if not rec.ok:
        return math.inf
    value = {
        "ttfp_ms": None if rec.ttfp_s is None else rec.ttfp_s * 1000.0,
        "e2el_ms": None if rec.e2el_s is None else rec.e2el_s * 1000.0,
        "rtf": rec.rtf,
        "underrun_s": rec.underrun_s,
    }[metric]
    return math.inf if value is None else value


def is_good(rec: RequestRecord, slo: SloSpec) -> bool:
    return rec.ok and all(_measure(rec, k) <= limit for k, limit in slo.per_request.items())


def aggregate(records: list[RequestRecord], duration_s: float, slo: SloSpec | None = None,
              num_gpus: int | None = None) -> dict:
    """Aggregate finalized records of one run (see the module doc for every definition)."""
    slo = slo or SloSpec()
    done = [r for r in records if r.ok]
    failures = Counter(r.error_kind for r in records if not r.ok)
    dur = duration_s if duration_s > 0 else math.nan
    audio_total = sum(r.audio_s for r in done)
    out: dict = {
        "num_requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "failures": dict(sorted(failures.items())),
        "duration_s": duration_s,
        "request_throughput": len(done) / dur,
        "audio_throughput": audio_total / dur,
        "total_audio_s": audio_total,
        "ttfp_ms": describe([r.ttfp_s * 1000.0 for r in done]),
        "e2el_ms": describe([r.e2el_s * 1000.0 for r in done]),
        "rtf": describe([r.rtf for r in done]),
        "audio_s": describe([r.audio_s for r in done]),
        "underrun_s": describe([r.underrun_s for r in done]),
        "underrun_events": describe([float(r.underrun_events) for r in done]),
        "continuity_rate": (sum(1 for r in done if r.underrun_s <= _EPS) / len(records)) if records else math.nan,
    }
    good = [r for r in records if is_good(r, slo)]
    checks = []
    for s in slo.run:
        measured = percentile([_measure(r, s.metric) for r in records], s.q)
        checks.append({"key": s.key, "measured": measured, "limit": s.limit, "ok": measured <= s.limit})
    run_ok = all(c["ok"] for c in checks)
    req_goodput = len(good) / dur if run_ok else 0.0
    audio_goodput = sum(r.audio_s for r in good) / dur if run_ok else 0.0
    out["goodput"] = {
        "slo": slo.to_json(),
        "good_requests": len(good),
        "run_slo_met": run_ok,
        "run_checks": checks,
        "request_goodput": req_goodput,
        "audio_goodput": audio_goodput,
    }
    if num_gpus:
        out["num_gpus"] = num_gpus
        out["goodput"]["request_goodput_per_gpu"] = req_goodput / num_gpus
        out["goodput"]["audio_goodput_per_gpu"] = audio_goodput / num_gpus
        out["request_throughput_per_gpu"] = out["request_throughput"] / num_gpus
        out["audio_throughput_per_gpu"] = out["audio_throughput"] / num_gpus
    return out


def flatten(aggregates: dict, prefix: str = "") -> dict[str, float]:
    """Numeric leaves of an aggregates dict as dotted keys (`ttfp_ms.p99`), for comparisons and tables."""
    flat: dict[str, float] = {}
    for key, value in aggregates.items():
        name = f"{prefix}{key}"
        if key == "slo":  # limits, not measurements
            continue
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            flat[name] = float(value)
    return flat
