"""Many concurrent streaming clients against a live server with a small engine (max_num_seqs=8): every
request completes exactly once with its whole stream, and clients that leave mid-stream free everything."""

from __future__ import annotations

import asyncio
import base64
import json

import httpx
import pytest
from server_helpers import SAMPLES_PER_FRAME, LiveServer, local_client, server_settings, tiny_loaded

from legato.bench.speech_calls import KEEPALIVE_EXPIRY_S
from legato.server.app import build_app

NUM_KV_BLOCKS = 512


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    loaded = tiny_loaded(tmp_path_factory.getbasetemp(), "custom_voice")
    client = local_client(loaded, max_num_seqs=8, num_kv_blocks=NUM_KV_BLOCKS, chunk_frames=4)
    app = build_app(client, server_settings(loaded, max_new_tokens_limit=1000), None)
    with LiveServer(app) as srv:
        yield srv


async def _raw(http: httpx.AsyncClient, i: int) -> dict:
    frames = 8 + i % 13
    body = {"input": f"Client {i} says hello.", "voice": "ryan", "stream": True, "response_format": "pcm",
            "ignore_eos": True, "num_frames": frames}
    async with http.stream("POST", "/v1/audio/speech", json=body) as r:
        assert r.status_code == 200
        data = b"".join([part async for part in r.aiter_bytes()])
    return {"id": r.headers["x-request-id"], "bytes": len(data), "expected": frames * SAMPLES_PER_FRAME * 2}


async def _sse(http: httpx.AsyncClient, i: int) -> dict:
    body = {"input": f"Client {i} listens.", "voice": "serena", "stream_format": "sse", "response_format": "pcm",
            "max_new_tokens": 8 + i % 11}
    async with http.stream("POST", "/v1/audio/speech", json=body) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) async for line in r.aiter_lines() if line.startswith("data: ")]
    done = events[-1]
    assert done["type"] == "speech.audio.done" and done["request_id"] == r.headers["x-request-id"]
    audio = sum(len(base64.b64decode(e["audio"])) for e in events[:-1])
    expected = done["usage"]["output_tokens"] * SAMPLES_PER_FRAME * 2
    return {"id": done["request_id"], "bytes": audio, "expected": expected}


async def _watch(http: httpx.AsyncClient, seen: list[dict], stop: asyncio.Event) -> None:
    while not stop.is_set():
        seen.append((await http.get("/health")).json()["engine"])
        await asyncio.sleep(0.02)


async def _settled(http: httpx.AsyncClient, timeout: float = 15.0) -> dict:
    """The engine stats once nothing is running or waiting and every KV block is free (or the last seen)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        engine = (await http.get("/health")).json()["engine"]
        idle = engine["running"] == 0 and engine["waiting"] == 0 and engine["free_kv_blocks"] == NUM_KV_BLOCKS
        if idle or loop.time() > deadline:
            return engine
        await asyncio.sleep(0.05)


def test_64_concurrent_streams_all_complete_once(live):
    async def main():
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=100, keepalive_expiry=KEEPALIVE_EXPIRY_S)
        async with httpx.AsyncClient(base_url=live.url, timeout=120, limits=limits) as http:
            seen, stop = [], asyncio.Event()
            watcher = asyncio.create_task(_watch(http, seen, stop))
            results = await asyncio.wait_for(
                asyncio.gather(*[(_raw if i % 2 else _sse)(http, i) for i in range(64)]), timeout=120)
            stop.set()
            await watcher
            return results, seen, await _settled(http), (await http.get("/metrics")).text

    results, seen, engine, metrics = asyncio.run(main())
    assert len(results) == 64
    assert len({r["id"] for r in results}) == 64  # none lost, none duplicated
    for r in results:
        assert r["bytes"] == r["expected"] > 0, r
    assert max(s["running"] for s in seen) <= 8
    assert max(s["waiting"] for s in seen) > 0  # the engine really queued the excess
    assert engine["running"] == engine["waiting"] == 0 and engine["free_kv_blocks"] == NUM_KV_BLOCKS
    assert 'legato_requests_total{status="200"} 64.0' in metrics


def test_clients_leaving_mid_stream_free_every_block(live):
    async def leave_early(http: httpx.AsyncClient, i: int) -> int:
        body = {"input": f"Client {i} will not stay.", "voice": "dylan", "ignore_eos": True, "num_frames": 400,
                "response_format": "pcm", **({"stream": True} if i % 2 else {"stream_format": "sse"})}
        async with http.stream("POST", "/v1/audio/speech", json=body) as r:
            assert r.status_code == 200
            async for part in r.aiter_bytes():
                return len(part)  # leaving the block closes the connection mid-stream
        return 0

    async def main():
        limits = httpx.Limits(max_connections=50, keepalive_expiry=KEEPALIVE_EXPIRY_S)
        async with httpx.AsyncClient(base_url=live.url, timeout=60, limits=limits) as http:
            before = (await http.get("/health")).json()["engine"]["aborted"].get("client disconnected", 0)
            got = await asyncio.wait_for(asyncio.gather(*[leave_early(http, i) for i in range(20)]), timeout=60)
            return got, before, await _settled(http), (await http.get("/metrics")).text

    got, before, engine, metrics = asyncio.run(main())
    assert all(n > 0 for n in got)
    assert engine["running"] == 0 and engine["waiting"] == 0
    assert engine["free_kv_blocks"] == NUM_KV_BLOCKS and engine["kv_usage"] == 0.0
    assert engine["aborted"]["client disconnected"] - before == 20
    assert 'legato_request_aborts_total{reason="client_disconnect"} 20.0' in metrics


def test_a_full_engine_queue_answers_429_with_retry_after(tmp_path_factory):
    """One slot and one waiting place: of three long concurrent requests at least one is refused at once."""
    loaded = tiny_loaded(tmp_path_factory.getbasetemp(), "custom_voice")
    client = local_client(loaded, max_num_seqs=1, max_waiting=1, max_num_batched_tokens=256)
    app = build_app(client, server_settings(loaded, max_new_tokens_limit=1000), None)

    async def one(http: httpx.AsyncClient, i: int) -> httpx.Response:
        body = {"input": f"Request {i}.", "voice": "ryan", "ignore_eos": True, "num_frames": 30,
                "response_format": "pcm"}
        return await http.post("/v1/audio/speech", json=body)

    async def main():
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as http:
            return await asyncio.wait_for(asyncio.gather(*[one(http, i) for i in range(3)]), timeout=60)

    with LiveServer(app) as srv:
        responses = asyncio.run(main())
    codes = sorted(r.status_code for r in responses)
    assert codes[0] == 200 and codes[-1] == 429, codes
    for r in responses:
        if r.status_code == 429:
            # nothing finished yet, so the pace is unknown: one drain window (reliability/test_retry_after.py)
            assert r.headers["retry-after"] == "30" and r.json()["error"]["code"] == "queue_full"
        else:
            assert len(r.content) == 30 * SAMPLES_PER_FRAME * 2


def _gauge(metrics: str, name: str) -> float:
    line = next(x for x in metrics.splitlines() if x.startswith(name + "{"))
    return float(line.rsplit(" ", 1)[1])


def test_router_gauges_follow_the_load(live):
    """The vLLM-named gauges routers read move with the load: idle 0, then as many running as the engine
    holds (8) with the rest waiting while 12 long streams are open, then back to 0."""

    async def main():
        async with httpx.AsyncClient(base_url=live.url, timeout=120) as http:
            idle = (await http.get("/metrics")).text
            body = {"input": "Load.", "voice": "ryan", "response_format": "pcm", "ignore_eos": True, "num_frames": 400}
            streams = [asyncio.ensure_future(_raw_body(http, body)) for _ in range(12)]
            peak = {"running": 0.0, "waiting": 0.0, "kv": 0.0}
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 60
            while loop.time() < deadline and not (peak["running"] == 8 and peak["waiting"] >= 1):
                text = (await http.get("/metrics")).text
                peak["running"] = max(peak["running"], _gauge(text, "vllm:num_requests_running"))
                peak["waiting"] = max(peak["waiting"], _gauge(text, "vllm:num_requests_waiting"))
                peak["kv"] = max(peak["kv"], _gauge(text, "vllm:kv_cache_usage_perc"))
                await asyncio.sleep(0.02)
            for s in streams:
                s.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
            await _settled(http)
            return idle, peak, (await http.get("/metrics")).text

    idle, peak, after = asyncio.run(main())
    for text in (idle, after):
        assert _gauge(text, "vllm:num_requests_running") == 0 and _gauge(text, "vllm:num_requests_waiting") == 0
        assert _gauge(text, "vllm:kv_cache_usage_perc") == 0
    assert peak["running"] == 8 and peak["waiting"] >= 1, peak
    assert 0 < peak["kv"] <= 1


async def _raw_body(http: httpx.AsyncClient, body: dict) -> int:
    async with http.stream("POST", "/v1/audio/speech", json=body) as r:
        return sum([len(part) async for part in r.aiter_bytes()])
