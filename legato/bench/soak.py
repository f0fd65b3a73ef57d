"""`legato bench soak`: drive a running server for a long while with mixed formats (pcm/wav/mp3 as raw
streams, whole files and SSE) and random client disconnects mid-stream, and report whether it degrades.

Every `concurrency` client loops fixed-length requests (`ignore_eos` + `num_frames`, so each 200 has a
known complete size, see `speech_calls`) until the duration ends; each request leaves early with
probability `disconnect_rate`. The run is cut into windows (one per minute by default) and for each the
report gives the e2e latency p99 of completed requests, the server's peak RSS and the engine's KV usage;
it compares the first window with the last, and after the load it waits for the engine to drain and
counts the KV blocks that did not come back (leaked).

RSS comes from /proc/<pid>/status with `--pid` (a server on this host), else from the server's
`process_resident_memory_bytes` gauge if its /metrics has one, else it is not reported.

The operators' soak is ten minutes: `legato bench soak --duration 600 --pid $(pgrep -f 'legato serve')`.
All randomness (formats, lengths, who leaves and when) comes from `--seed`.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import httpx
import numpy as np

from .served import access_problem
from .speech_calls import KEEPALIVE_EXPIRY_S, KINDS, Outcome, speech_call

_TEXTS = (
    "Hello there, this is a soak test.",
    "The quick brown fox jumps over the lazy dog.",
    "Streaming speech should never leak memory.",
    "One more sentence, and then another one.",
)


@dataclass
class SoakConfig:
    url: str = "http://127.0.0.1:8000"
    duration_s: float = 600.0
    concurrency: int = 8
    disconnect_rate: float = 0.1
    windows: int | None = None  # None: one per minute, at least 2
    seed: int = 0
    min_frames: int = 8
    max_frames: int = 40
    voice: str | None = "ryan"
    pid: int | None = None
    timeout_s: float = 120.0  # one request's whole exchange; past it the request is a hang
    sample_every_s: float = 2.0
    drain_timeout_s: float = 60.0
    warmup: bool = True  # one request of every kind before the clock starts
    extra: dict = field(default_factory=dict)
    api_key: str | None = None  # sent as `Authorization: Bearer` (a server run with --api-key)

    def __post_init__(self) -> None:
        if self.duration_s <= 0 or self.concurrency < 1 or not 0 <= self.disconnect_rate <= 1:
            raise ValueError("duration must be > 0, concurrency >= 1 and disconnect rate in [0, 1]")
        if not 1 <= self.min_frames <= self.max_frames:
            raise ValueError("frames: need 1 <= min <= max")
        if self.windows is None:
            self.windows = max(2, round(self.duration_s / 60))
        if self.windows < 1:
            raise ValueError("windows must be >= 1")


def rss_bytes(pid: int) -> int | None:
    """VmRSS of a local process (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


async def _server_rss(http: httpx.AsyncClient, pid: int | None) -> int | None:
    if pid is not None:
        return rss_bytes(pid)
    text = (await http.get("/metrics")).text
    for line in text.splitlines():
        if line.startswith("process_resident_memory_bytes "):
            return int(float(line.split()[1]))
    return None


async def engine_stats(http: httpx.AsyncClient) -> dict:
    """The engine's stats from legato's /health; ValueError for a server whose /health has none (the soak's
    leak check needs them)."""
    response = await http.get("/health")
    try:
        engine = response.json()["engine"]
    except (ValueError, KeyError, TypeError):
        engine = None
    if not isinstance(engine, dict) or not {"running", "waiting", "free_kv_blocks", "num_kv_blocks"} <= engine.keys():
        raise ValueError(f"{http.base_url}/health (HTTP {response.status_code}) has no engine stats: the soak "
                         "needs a legato server")
    return engine


async def wait_drained(http: httpx.AsyncClient, timeout_s: float) -> dict:
    """Polls /health until nothing runs or waits and every KV block is free, or the deadline (a hang guard:
    the engine stats as last seen are returned either way, with how long it took)."""
    t0 = time.monotonic()
    while True:
        engine = await engine_stats(http)
        idle = engine["running"] == 0 and engine["waiting"] == 0 and engine["free_kv_blocks"] == engine["num_kv_blocks"]
        if idle or time.monotonic() - t0 > timeout_s:
            return {**engine, "drained": idle, "seconds": round(time.monotonic() - t0, 2),
                    "leaked_blocks": engine["num_kv_blocks"] - engine["free_kv_blocks"]}
        await asyncio.sleep(0.2)


class _Soak:
    def __init__(self, cfg: SoakConfig, http: httpx.AsyncClient) -> None:
        self.cfg = cfg
        self.http = http
        self.outcomes: list[Outcome] = []
        self.samples: list[dict] = []
        self.t0 = 0.0

    def _call(self, rng: random.Random, leave: bool):
        cfg = self.cfg
        return speech_call(self.http, rng.choice(KINDS), rng.randint(cfg.min_frames, cfg.max_frames),
                           rng.choice(_TEXTS), cfg.voice, timeout_s=cfg.timeout_s, extra=cfg.extra,
                           leave_after_chunks=rng.randint(1, 3) if leave else None,
                           leave_after_s=rng.uniform(0.2, 1.5) if leave else None)

    async def client(self, i: int, end: float) -> None:
        # one RNG per client: what client i sends does not depend on how the others were scheduled
        rng = random.Random(self.cfg.seed * 1_000_003 + i)
        while time.monotonic() < end:
            out = await self._call(rng, rng.random() < self.cfg.disconnect_rate)
            self.outcomes.append(out)
            if out.result == "rejected":  # back off a little, but not for Retry-After: this is a load test
                await asyncio.sleep(rng.uniform(0.05, 0.3))

    async def sampler(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            sample: dict = {"t": round(time.monotonic() - self.t0, 2)}
            try:
                engine = await engine_stats(self.http)
                sample.update(kv_usage=engine["kv_usage"], running=engine["running"], waiting=engine["waiting"],
                              rss_bytes=await _server_rss(self.http, self.cfg.pid))
            except (httpx.HTTPError, ValueError, KeyError) as e:
                sample["error"] = f"{type(e).__name__}: {e}"
            self.samples.append(sample)
            try:
                await asyncio.wait_for(stop.wait(), self.cfg.sample_every_s)
            except (TimeoutError, asyncio.TimeoutError):
                pass


def _window_of(t: float, window_s: float, n: int) -> int:
    return min(max(int(t // window_s), 0), n - 1)


def _windows(cfg: SoakConfig, outcomes: list[Outcome], samples: list[dict], t0: float) -> list[dict]:
    n = cfg.windows
    window_s = cfg.duration_s / n
    rows = []
    for w in range(n):
        # a request belongs to the window it ended in; those ending after the duration go to the last
        mine = [o for o in outcomes if _window_of(o.started + o.e2e_s - t0, window_s, n) == w]
        e2e = [o.e2e_s for o in mine if o.result == "ok"]
        seen = [s for s in samples if "error" not in s and _window_of(s["t"], window_s, n) == w]
        rss = [s["rss_bytes"] for s in seen if s.get("rss_bytes")]
        kv = [s["kv_usage"] for s in seen]
        rows.append({
            "window": w, "start_s": round(w * window_s, 1), "end_s": round((w + 1) * window_s, 1),
            "requests": len(mine), **{r: sum(o.result == r for o in mine) for r in ("ok", "rejected",
                                                                                    "disconnected", "bad")},
            "e2e_p50_s": round(float(np.percentile(e2e, 50)), 3) if e2e else None,
            "e2e_p99_s": round(float(np.percentile(e2e, 99)), 3) if e2e else None,
            "rss_mb": _mb(max(rss)) if rss else None,
            "kv_usage_max": round(max(kv), 4) if kv else None,
            "kv_usage_mean": round(float(np.mean(kv)), 4) if kv else None,
        })
    return rows


def _mb(b: int | None) -> float | None:
    return round(b / 2**20, 1) if b else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(b / a, 3) if a and b is not None else None


async def _run(cfg: SoakConfig) -> dict:
    limits = httpx.Limits(max_connections=cfg.concurrency + 8, max_keepalive_connections=cfg.concurrency + 8,
                          keepalive_expiry=KEEPALIVE_EXPIRY_S)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else None
    async with httpx.AsyncClient(base_url=cfg.url, timeout=cfg.timeout_s, limits=limits, headers=headers) as http:
        refused = access_problem((await http.get("/v1/models")).status_code, cfg.url, cfg.api_key)
        if refused is not None:  # every request would get the same 401/403: one line instead of a run of them
            raise ValueError(refused)
        soak = _Soak(cfg, http)
        warmup: list[Outcome] = []
        if cfg.warmup:
            warmup = list(await asyncio.gather(*[
                speech_call(http, kind, cfg.min_frames, _TEXTS[0], cfg.voice, timeout_s=cfg.timeout_s,
                            extra=cfg.extra) for kind in KINDS]))
        before = await engine_stats(http)
        rss_start = await _server_rss(http, cfg.pid)
        started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
        soak.t0 = time.monotonic()
        end = soak.t0 + cfg.duration_s
        stop = asyncio.Event()
        sampler = asyncio.create_task(soak.sampler(stop))
        try:
            # hang guard: every client stops starting requests at `end` and each request has its deadline
            await asyncio.wait_for(asyncio.gather(*[soak.client(i, end) for i in range(cfg.concurrency)]),
                                   cfg.duration_s + cfg.timeout_s + 30)
        finally:
            stop.set()
            await sampler
        ran_s = time.monotonic() - soak.t0
        drain = await wait_drained(http, cfg.drain_timeout_s)
        rss_end = await _server_rss(http, cfg.pid)
    return _result(cfg, soak, warmup, before, drain, started_at, ran_s, rss_start, rss_end)


def _result(cfg: SoakConfig, soak: _Soak, warmup: list[Outcome], before: dict, drain: dict, started_at: str,
            ran_s: float, rss_start: int | None, rss_end: int | None) -> dict:
    outs = soak.outcomes
    windows = _windows(cfg, outs, soak.samples, soak.t0)
    first, last = windows[0], windows[-1]
    statuses: dict[str, int] = {}
    for o in outs:
        key = str(o.status) if o.status is not None else "none"
        statuses[key] = statuses.get(key, 0) + 1
    aborted = {k: v - before["aborted"].get(k, 0) for k, v in drain["aborted"].items()}
    bad = [o for o in warmup + outs if o.result == "bad"]
    return {
        "config": asdict(cfg),
        "started_at": started_at,
        "ran_s": round(ran_s, 1),
        "totals": {"requests": len(outs), **{r: sum(o.result == r for o in outs) for r in
                                              ("ok", "rejected", "disconnected", "bad")},
                   "by_status": dict(sorted(statuses.items())),
                   "audio_s": round(sum(o.audio_s for o in outs), 1),
                   "warmup_bad": sum(o.result == "bad" for o in warmup)},
        "windows": windows,
        "first_last": {"p99_first_s": first["e2e_p99_s"], "p99_last_s": last["e2e_p99_s"],
                       "p99_ratio": _ratio(first["e2e_p99_s"], last["e2e_p99_s"]),
                       "rss_first_mb": first["rss_mb"], "rss_last_mb": last["rss_mb"],
                       "rss_ratio": _ratio(first["rss_mb"], last["rss_mb"])},
        "rss_mb": {"start": _mb(rss_start), "end": _mb(rss_end)},
        "drain": drain,
        "aborted_during_run": {k: v for k, v in aborted.items() if v},
        "bad": [{"kind": "/".join(o.kind), "frames": o.frames, "status": o.status, "detail": o.detail}
                for o in bad[:50]],
        "samples": soak.samples,
    }


def run_soak(cfg: SoakConfig) -> dict:
    """Runs the soak against `cfg.url` and returns the report (see the module doc)."""
    return asyncio.run(_run(cfg))


def passed(result: dict) -> bool:
    """No bad response (warm-up included) and the engine drained with every KV block back."""
    return not result["bad"] and result["drain"]["drained"] and result["drain"]["leaked_blocks"] == 0


def summary(result: dict) -> str:
    t, fl, d = result["totals"], result["first_last"], result["drain"]
    lines = [f"{'window':>6} {'span s':>11} {'reqs':>5} {'ok':>4} {'429/503':>7} {'left':>4} {'bad':>3} "
             f"{'p50 s':>6} {'p99 s':>6} {'RSS MB':>7} {'KV max':>6}"]
    for w in result["windows"]:
        def f(v, spec):
            return "-" if v is None else format(v, spec)
        lines.append(f"{w['window']:>6} {w['start_s']:>5.0f}-{w['end_s']:<5.0f} {w['requests']:>5} {w['ok']:>4} "
                     f"{w['rejected']:>7} {w['disconnected']:>4} {w['bad']:>3} {f(w['e2e_p50_s'], '6.2f')} "
                     f"{f(w['e2e_p99_s'], '6.2f')} {f(w['rss_mb'], '7.1f')} {f(w['kv_usage_max'], '6.3f')}")
    lines.append(f"soak: {t['requests']} requests in {result['ran_s']} s ({t['ok']} ok, {t['rejected']} refused, "
                 f"{t['disconnected']} left on purpose, {t['bad']} bad; statuses {t['by_status']}), "
                 f"{t['audio_s']} s of audio")
    rss = (f"RSS {fl['rss_first_mb']} -> {fl['rss_last_mb']} MB (x{fl['rss_ratio']})" if fl["rss_first_mb"] is not None
           else "RSS not read (give --pid)")
    lines.append(f"first vs last window: p99 {fl['p99_first_s']} -> {fl['p99_last_s']} s (x{fl['p99_ratio']}), {rss}")
    lines.append(f"after the drain ({d['seconds']} s): running {d['running']}, waiting {d['waiting']}, "
                 f"free KV blocks {d['free_kv_blocks']}/{d['num_kv_blocks']} (leaked {d['leaked_blocks']}); "
                 f"aborted during the run {result['aborted_during_run']}")
    for b in result["bad"][:10]:
        lines.append(f"BAD {b['kind']} frames={b['frames']} status={b['status']}: {b['detail']}")
    return "\n".join(lines)


def write_result(result: dict, out: str | Path) -> Path:
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return path
