"""Overload: four times the server's capacity (max_num_seqs + max_waiting) in concurrent clients, each
looping mixed requests (pcm/wav/mp3 as raw streams, whole files and SSE) for a fixed time: 20 s, or 60 s
with LEGATO_RELIABILITY_FULL=1.

Every request must either complete (200, whole body: see legato/bench/speech_calls.py) or be refused with
429/503 and a JSON error that says why (a 429 with Retry-After); no other status, no hang. Afterwards the
engine is back to idle with every KV block free, and the server's RSS is within 1.5x of its post-warm-up
figure. Timings are never asserted: the box is a loaded 2-core CI machine; deadlines are hang guards."""

from __future__ import annotations

import asyncio
import os
import random
import re
import time

import httpx
import pytest
from serve_process import ServeProcess

from legato.bench.soak import rss_bytes, wait_drained
from legato.bench.speech_calls import KEEPALIVE_EXPIRY_S, KINDS, Outcome, speech_call

pytestmark = pytest.mark.slow

DURATION_S = 60.0 if os.environ.get("LEGATO_RELIABILITY_FULL") == "1" else 20.0
MAX_NUM_SEQS, MAX_WAITING = 4, 4
CLIENTS = 4 * (MAX_NUM_SEQS + MAX_WAITING)
REQUEST_TIMEOUT_S = 120.0  # per request: a hang guard (a queued request waits for a whole batch ahead)
DIRTY = ("Traceback", "Exception in ASGI application", "returned without completing")


async def _client(http: httpx.AsyncClient, i: int, end: float, outcomes: list[Outcome]) -> None:
    rng = random.Random(i)
    while time.monotonic() < end:  # bounded: no new request after `end`, and each one has its deadline
        out = await speech_call(http, rng.choice(KINDS), rng.randint(6, 16), f"Client {i} under overload.",
                                timeout_s=REQUEST_TIMEOUT_S)
        outcomes.append(out)
        if out.result == "rejected":  # a short pause, not Retry-After: the point is to keep the pressure on
            await asyncio.sleep(rng.uniform(0.05, 0.3))


async def _overload(srv: ServeProcess) -> dict:
    limits = httpx.Limits(max_connections=CLIENTS + 8, max_keepalive_connections=CLIENTS + 8,
                          keepalive_expiry=KEEPALIVE_EXPIRY_S)
    async with httpx.AsyncClient(base_url=srv.url, timeout=REQUEST_TIMEOUT_S, limits=limits) as http:
        # warm-up: every kind once, concurrently (the batch-size buffers and the MP3 encoder get allocated)
        warm = await asyncio.gather(*[speech_call(http, kind, 6, "Warm up.") for kind in KINDS])
        assert all(o.result in ("ok", "rejected") for o in warm), [o.detail for o in warm]
        await wait_drained(http, 60)
        rss_before = rss_bytes(srv.proc.pid)
        outcomes: list[Outcome] = []
        t0 = time.monotonic()
        await asyncio.gather(*[_client(http, i, t0 + DURATION_S, outcomes) for i in range(CLIENTS)])
        ran_s = time.monotonic() - t0
        drain = await wait_drained(http, 120)
        metrics = (await http.get("/metrics")).text
    return {"outcomes": outcomes, "ran_s": ran_s, "drain": drain, "rss_before": rss_before,
            "rss_after": rss_bytes(srv.proc.pid), "metrics": metrics}


def test_four_times_capacity_completes_or_refuses_every_request_and_recovers(tmp_path):
    with ServeProcess(tmp_path, "--max-num-seqs", str(MAX_NUM_SEQS), "--max-waiting", str(MAX_WAITING)) as srv:
        # the whole-test hang guard, on top of every request's own deadline
        run = asyncio.run(asyncio.wait_for(_overload(srv), DURATION_S + REQUEST_TIMEOUT_S + 240))
        log = srv.log_text()

    outcomes, drain = run["outcomes"], run["drain"]
    statuses: dict[int | None, int] = {}
    for o in outcomes:
        statuses[o.status] = statuses.get(o.status, 0) + 1
    ok = [o for o in outcomes if o.result == "ok"]
    fivexx = sum(n for s, n in statuses.items() if s is not None and s >= 500 and s != 503)
    mb = run["rss_after"] / 2**20, run["rss_before"] / 2**20
    print(f"\noverload: {CLIENTS} clients x {DURATION_S:g} s (ran {run['ran_s']:.1f} s) against max_num_seqs "
          f"{MAX_NUM_SEQS} + max_waiting {MAX_WAITING}: {len(outcomes)} requests, {len(ok)} x 200, "
          f"{statuses.get(429, 0)} x 429, {statuses.get(503, 0)} x 503, {fivexx} other 5xx, "
          f"{sum(o.result == 'bad' for o in outcomes)} bad; {sum(o.audio_s for o in ok):.1f} s of audio served; "
          f"RSS {mb[1]:.1f} -> {mb[0]:.1f} MB (x{mb[0] / mb[1]:.3f}); KV blocks free "
          f"{drain['free_kv_blocks']}/{drain['num_kv_blocks']} after {drain['seconds']} s of drain")

    bad = [f"{'/'.join(o.kind)} frames={o.frames} status={o.status}: {o.detail}" for o in outcomes
           if o.result == "bad"]
    assert not bad, bad[:20]
    assert set(statuses) <= {200, 429, 503}, statuses
    assert ok and statuses.get(429, 0) > 0, statuses  # it really was overloaded, and still served
    assert drain["drained"], drain
    assert drain["running"] == drain["waiting"] == 0 and drain["free_kv_blocks"] == drain["num_kv_blocks"]
    assert run["rss_after"] < 1.5 * run["rss_before"]
    served = {m.group(1) for m in re.finditer(r'^legato_requests_total\{status="(\d+)"\}', run["metrics"], re.M)}
    assert not {s for s in served if s.startswith("5") and s != "503"}, served  # the server's own count agrees
    assert not [d for d in DIRTY if d in log], log[-3000:]
