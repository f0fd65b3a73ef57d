"""The server stand-in (`legato bench standin`) and the multi-process bench client (`--client-procs`): the
stand-in answers what `bench serve` reads of a server and streams exactly the audio asked for; records from
several client processes merge into the one run a single process would have recorded."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from legato.bench.client import ClientConfig, RunOutput, run_benchmark
from legato.bench.datasets import BenchRequest
from legato.bench.metrics import RequestRecord, aggregate
from legato.bench.multiproc import merge, run_processes, share, split
from legato.bench.standin import StandinConfig, StandinServer

ROOT = Path(__file__).resolve().parents[1]
FRAME_BYTES = 1920 * 2


def reqs(frames: list[int]) -> list[BenchRequest]:
    return [BenchRequest(f"u{i}", {"input": "hello", "voice": "ryan", "num_frames": n, "ignore_eos": True}, 5, n)
            for i, n in enumerate(frames)]


def test_standin_card_health_and_streams_of_the_length_asked():
    frames = [1, 3, 7, 30, 2, 12]

    async def go():
        server = await StandinServer(StandinConfig(speed=50.0, decode_slots=4)).start()
        try:
            async with httpx.AsyncClient(base_url=server.url) as c:
                card = (await c.get("/v1/models")).json()["data"][0]
                missing = (await c.get("/nope")).status_code
            out = await run_benchmark(ClientConfig(base_url=server.url, progress=False, max_concurrency=4),
                                      reqs(frames))
            async with httpx.AsyncClient(base_url=server.url) as c:
                health = (await c.get("/health")).json()
        finally:
            await server.close()
        return card, missing, out, health

    card, missing, out, health = asyncio.run(go())
    # What `bench serve` reads: the mode (CustomVoice: preset voices), the voice, the default concurrency.
    assert card["task_type"] == "CustomVoice" and card["voices"] == ["ryan"] and card["decode_slots"] == 4
    assert card["sample_rate"] == 24000
    assert missing == 404
    assert [r.ok for r in out.records] == [True] * len(frames)
    assert [r.total_bytes for r in out.records] == [n * FRAME_BYTES for n in frames]
    stats = health["standin"]
    assert health["status"] == "ok" and stats["requests"] == len(frames) and stats["completed"] == len(frames)
    assert stats["streams"] == 0
    # Every stream took one tick per frame: the longest needed 30.
    assert stats["ticks"] >= max(frames)


def test_standin_refuses_bad_settings():
    with pytest.raises(ValueError):
        StandinConfig(speed=0)
    with pytest.raises(ValueError):
        StandinConfig(chunk_frames=0)


def test_split_and_share_cover_every_request_and_slot():
    assert split(7, 3) == [[0, 3, 6], [1, 4], [2, 5]]
    assert [share(10, 3, p) for p in range(3)] == [4, 3, 3]
    assert share(None, 3, 1) is None


def _rec(i: int, ttfp: float, sent: float) -> RequestRecord:
    r = RequestRecord(i, f"u{i}", 5, 4, scheduled_s=0.0, sent_s=sent, status=200,
                      chunk_times_s=[ttfp, ttfp + 0.1], chunk_bytes=[FRAME_BYTES, FRAME_BYTES], end_s=ttfp + 0.2)
    return r.finalize(24000)


def test_merge_puts_records_back_in_order_on_one_clock_and_aggregates_their_union():
    # Process 0 ran requests 0 and 2 and started at t=100.0; process 1 ran 1 and 3, starting 0.5 s later.
    a = RunOutput([_rec(0, 0.1, 0.0), _rec(1, 0.3, 0.0)], [], 2.0, "A", None, None, [{"message": "x"}], 100.0)
    b = RunOutput([_rec(0, 0.2, 0.1), _rec(1, 0.9, 0.2)], [], 1.0, "B", b"pcm", "u1", [], 100.5)
    merged = merge([([0, 2], a), ([1, 3], b)], 4)
    assert [r.index for r in merged.records] == [0, 1, 2, 3]
    assert [r.utt_id for r in merged.records] == ["u0", "u0", "u1", "u1"]  # each process's own ids, in place
    assert [r.sent_s for r in merged.records] == pytest.approx([0.0, 0.6, 0.0, 0.7])  # the earliest start's clock
    assert merged.t0_s == 100.0 and merged.duration_s == 2.0 and merged.started_at == "A"
    assert merged.check_pcm == b"pcm" and merged.warnings == [{"message": "x", "process": 0}]
    # Percentiles of the union, not an average of each process's: the median of 100, 200, 300, 900 ms.
    assert aggregate(merged.records, merged.duration_s)["ttfp_ms"]["median"] == pytest.approx(250.0)
    with pytest.raises(ValueError):
        merge([([0, 2], a)], 4)


@pytest.fixture
def standin_process():
    """`legato bench standin` in a process of its own (the client processes must reach it), on a free port."""
    proc = subprocess.Popen([sys.executable, "-m", "legato.cli", "bench", "standin", "--port", "0", "--speed", "50"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        line = proc.stdout.readline()  # the stand-in's first line names its address once it listens
        m = re.search(r"http://127\.0\.0\.1:\d+", line)
        assert m, f"no address in {line!r}"
        yield m.group(0)
    finally:
        proc.terminate()
        proc.wait(30)


def test_client_processes_run_every_request_once_and_merge(standin_process):
    frames = [2, 5, 3, 4, 6, 1, 2]
    cfg = ClientConfig(base_url=standin_process, progress=False, max_concurrency=4, num_warmups=2)
    started = time.perf_counter()
    out = run_processes(cfg, reqs(frames), 2)
    assert [r.index for r in out.records] == list(range(len(frames)))
    assert [r.utt_id for r in out.records] == [f"u{i}" for i in range(len(frames))]
    assert [r.ok for r in out.records] == [True] * len(frames)
    assert [r.total_bytes for r in out.records] == [n * FRAME_BYTES for n in frames]
    assert len(out.warmups) == 2
    assert started <= out.t0_s and out.duration_s >= max(r.sent_s + r.end_s for r in out.records) - 1e-9
    health = httpx.get(f"{standin_process}/health").json()["standin"]
    assert health["requests"] == len(frames) + 2  # each request once, and the warm-ups
