"""Several front processes on one engine worker (`legato serve --fronts N`): every front gets the codes a single
front gets, a front that stops or restarts leaves the worker and the other fronts serving, and the server as a
whole spreads connections over its fronts, adds up their metrics, restarts a front that dies, and drains them
all on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import numpy as np
import pytest
import torch
from serve_process import ServeProcess, speech_body

from legato.cli import main as cli_main
from legato.engine.config import EngineConfig
from legato.models.qwen3_tts.inputs import SpeechInput
from legato.models.qwen3_tts.sampling import SamplingParams
from legato.pipeline.client import RequestRejected, StreamChunk, SynthesisRequest
from legato.pipeline.process_client import ProcessEngineClient, new_instance_id
from legato.pipeline.topology import build_client, parse_topology

EMB = torch.randn(64, generator=torch.Generator().manual_seed(0))


def _req(rid: str, seed: int, frames: int = 5, **kw) -> SynthesisRequest:
    inp = SpeechInput(f"Sentence {seed} is here.", language="english", speaker_embedding=EMB, x_vector_only=True)
    return SynthesisRequest(rid, inp, SamplingParams(seed=seed, max_new_tokens=frames + 1), **kw)


def _front(path, instance_id: str, front: int, topology: str = "single"):
    config = EngineConfig(device="cpu", dtype="float32", max_num_seqs=4, num_kv_blocks=128, max_model_len=512,
                          max_num_batched_tokens=256)
    return build_client(parse_topology(topology), None, config, workers="process", model_path=str(path),
                        instance_id=instance_id,
                        process_options={"torch_threads": 1, "start_timeout_s": 60, "front": front, "fronts": 2})


async def _codes(client, req) -> np.ndarray:
    chunks: list[StreamChunk] = [c async for c in client.generate(req)]
    assert chunks[-1].finish_reason == "length", chunks[-1]
    return np.concatenate([c.codes for c in chunks])


async def _until(predicate, timeout_s: float = 30.0) -> None:
    """Polls `predicate` (a hang guard, not a speed target)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


def test_two_fronts_share_one_worker(tiny_checkpoint):
    async def main() -> None:
        iid = new_instance_id()
        front0, front1 = _front(tiny_checkpoint, iid, 0), _front(tiny_checkpoint, iid, 1)
        assert isinstance(front1, ProcessEngineClient) and front1.attached
        await asyncio.gather(front1.start(), front0.start())  # either may come first
        try:
            assert front1.pid == front0.pid and front1.proc is None  # one worker, front 0's child
            alone = [await _codes(front0, _req(f"a{i}", 100 + i)) for i in range(3)]
            # Both fronts at once, each request on one of them: every front gets single's codes.
            mixed = await asyncio.gather(*(_codes((front0, front1)[i % 2], _req(f"b{i}", 100 + i % 3))
                                           for i in range(6)))
            for i, codes in enumerate(mixed):
                assert np.array_equal(codes, alone[i % 3]), i

            # An id in flight on one front is refused on the other, and the first stream is untouched.
            held = front0.generate(_req("dup", 7, frames=300, ignore_eos=True))
            first = await held.__anext__()
            with pytest.raises(RequestRejected) as err:
                await _codes(front1, _req("dup", 8))
            assert err.value.status == 409
            assert not first.finished and not (await held.__anext__()).finished
            await held.aclose()
            await _until(lambda: front0.stats().running == 0)

            # Front 1 stops (its worker does not) and a new front 1 attaches to the same worker.
            await front1.stop(1.0)
            assert front0.is_alive() and np.array_equal(await _codes(front0, _req("c", 100)), alone[0])
            again = _front(tiny_checkpoint, iid, 1)
            await again.start()
            assert np.array_equal(await _codes(again, _req("d", 101)), alone[1])

            # The worker gone: the attached front sees it through the worker's pid, and fails what it runs.
            stream = again.generate(_req("e", 9, frames=300, ignore_eos=True))
            await stream.__anext__()
            os.kill(front0.pid, signal.SIGKILL)
            rest = [c async for c in stream]
            assert rest[-1].finish_reason == "error" and "worker died" in rest[-1].error
            await _until(lambda: not again.is_alive())
            await again.stop(0.0)
        finally:
            await front0.stop(1.0)

    asyncio.run(main())


def test_two_fronts_over_replicas_give_singles_codes(tiny_checkpoint):
    """Each front's router holds a link to every replica; a request gets single's codes on either front."""

    async def main() -> tuple[list[np.ndarray], list[np.ndarray]]:
        single = _front(tiny_checkpoint, new_instance_id(), 0)
        await single.start()
        try:
            want = [await _codes(single, _req(f"s{i}", 100 + i)) for i in range(2)]
        finally:
            await single.stop(1.0)
        iid = new_instance_id()
        front0, front1 = (_front(tiny_checkpoint, iid, k, "replicas:2") for k in (0, 1))
        await front0.start()
        await front1.start()
        try:
            assert [r.pid for r in front1.replicas] == [r.pid for r in front0.replicas]
            got = await asyncio.gather(*(_codes((front0, front1)[i % 2], _req(f"r{i}", 100 + i // 4))
                                         for i in range(8)))
        finally:
            await front1.stop(1.0)
            await front0.stop(1.0)
        return want, got

    want, got = asyncio.run(main())
    for i, codes in enumerate(got):
        assert np.array_equal(codes, want[i // 4]), i


def test_serve_spreads_connections_over_fronts_and_adds_their_metrics(tmp_path):
    with ServeProcess(tmp_path, "--workers", "process", "--fronts", "2", "--device", "cpu") as server:
        body = speech_body(4, seed=5)

        async def burst(n: int) -> list[bytes]:
            async def one() -> bytes:  # a connection each: the kernel picks a front per connection
                async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
                    r = await client.post("/v1/audio/speech", json=body)
                    assert r.status_code == 200, r.text
                    return r.content

            return await asyncio.gather(*(one() for _ in range(n)))

        # Front 0's /health can answer before front 1 listens (the kernel sends nothing to a front not listening):
        # ask on fresh connections until front 1 has answered one.
        deadline = time.monotonic() + 120
        while not any(line.get("front") == 1 and "GET /health" in line["msg"] for line in server.log_lines()):
            assert time.monotonic() < deadline, "front 1 never answered"
            httpx.get(f"{server.url}/health", timeout=10)
        bodies = asyncio.run(burst(24))
        # Whole answers, whichever front served them (codes across fronts: test_two_fronts_share_one_worker).
        assert {len(b) for b in bodies} == {4 * 1920 * 2}
        served_by = [line.get("front") for line in server.log_lines() if "POST /v1/audio/speech" in line["msg"]]
        assert sorted(set(served_by)) == [0, 1], served_by  # 24 connections on one front: p = 2^-23
        # Whichever front answers a scrape counts every front's requests (each counts its own as the response
        # ends, so a scrape may come just before the last ones: polled).
        scrapes, deadline = 0, time.monotonic() + 60
        while scrapes < 4:
            assert time.monotonic() < deadline, "the fronts' requests never added up to 24"
            metrics = httpx.get(f"{server.url}/metrics", timeout=10).text  # a connection each: any front
            scrapes += 'legato_requests_total{status="200"} 24.0' in metrics

        # Streaming text over WebSockets, with sockets on both fronts (opened until front 1 has accepted one): each
        # front's appends reach the worker over its own link.
        assert all(n > 0 for n in asyncio.run(_ws_sessions(server)))

        # A front that dies is started again, and serves.
        started = server.wait_log(lambda line: line["msg"].startswith("front 1 started"))
        assert started is not None
        pid = int(started["msg"].split("pid ")[1].rstrip(")"))
        os.kill(pid, signal.SIGKILL)
        assert server.wait_log(lambda line: line["msg"].startswith(f"front 1 (pid {pid}) exited")) is not None
        restarted = server.wait_log(lambda line: line["msg"].startswith("front 1 started") and f"pid {pid})"
                                    not in line["msg"])
        assert restarted is not None
        assert server.wait_log(lambda line: line.get("front") == 1 and "startup complete" in line["msg"]
                               and line["ts"] > restarted["ts"]) is not None
        assert {len(b) for b in asyncio.run(burst(8))} == {4 * 1920 * 2}

        # SIGTERM to front 0: every front drains and the server exits 0.
        server.signal(signal.SIGTERM)
        assert server.wait_exit() == 0
        fronts = [line for line in server.log_lines() if line["msg"].startswith("Finished server process")]
        assert sorted(line.get("front") for line in fronts) == [0, 1]


async def _ws_sessions(server: ServeProcess) -> list[int]:
    """Opens streaming-text sockets until front 1 has accepted one (at least two), streams a text on each, and
    returns each one's audio bytes."""
    from websockets.asyncio.client import connect

    from legato.server.ws_protocol import STREAM_PATH

    def accepted_by_front_1() -> bool:
        return any(line.get("front") == 1 and "WebSocket" in line["msg"] and "accepted" in line["msg"]
                   for line in server.log_lines())

    sockets = []
    deadline = time.monotonic() + 60
    try:
        while len(sockets) < 2 or not accepted_by_front_1():
            assert time.monotonic() < deadline and len(sockets) < 64, "no socket reached front 1"
            sockets.append(await connect(f"ws://127.0.0.1:{server.port}{STREAM_PATH}", open_timeout=30))
            await asyncio.sleep(0.05)  # the accepting front writes its log line

        async def session(ws) -> int:
            audio = 0
            await ws.send(json.dumps({"type": "session.update", "session": {"voice": "ryan", "seed": 3,
                                                                            "max_new_tokens": 8}}))
            for word in ("Streaming ", "text ", "arrives."):
                await ws.send(json.dumps({"type": "input_text.append", "context_id": "a", "text": word}))
            await ws.send(json.dumps({"type": "input_text.end", "context_id": "a"}))
            async with asyncio.timeout(120):
                while True:
                    msg = await ws.recv()
                    if isinstance(msg, bytes):
                        audio += len(msg)
                        continue
                    event = json.loads(msg)
                    assert event["type"] != "error", event
                    if event["type"] == "response.audio.done":
                        return audio

        return await asyncio.gather(*(session(ws) for ws in sockets))
    finally:
        for ws in sockets:
            await ws.close()


@pytest.mark.parametrize("flags, why", [
    (["--workers", "thread"], "--workers process"),
    (["--workers", "process", "--topology", "split"], "single and replicas"),
    (["--fronts", "0"], "must be >= 1"),
])
def test_fronts_refused_where_they_cannot_run(flags, why, capsys):
    args = ["serve", "--device", "cpu", "--port", "0", "--fronts", "2", *flags]
    assert cli_main(args) == 2
    assert why in capsys.readouterr().err


_DYING_FRONT = """
import asyncio, sys, torch
sys.path.insert(0, {tests!r})
from test_fronts import _front, _req

async def main():
    front = _front({path!r}, {iid!r}, 1)
    await front.start()
    stream = front.generate(_req("orphan", 3, frames=2000, ignore_eos=True))
    await stream.__anext__()
    print("streaming", flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


def test_a_front_that_dies_has_its_requests_aborted_in_the_worker(tiny_checkpoint):
    """Nobody reads a dead front's audio: its requests end in the worker at once, not when their text runs out."""
    import subprocess
    import sys
    from pathlib import Path

    async def main() -> None:
        iid = new_instance_id()
        front0 = _front(tiny_checkpoint, iid, 0)
        await front0.start()
        code = _DYING_FRONT.format(tests=str(Path(__file__).parent), path=str(tiny_checkpoint), iid=iid)
        child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        try:
            line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 120)
            assert line.strip() == "streaming"
            await _until(lambda: front0.stats().running == 1)
            child.kill()
            await _until(lambda: front0.stats().running == 0)
            assert front0.stats().aborted == {"front process gone": 1}
            assert np.array_equal(await _codes(front0, _req("after", 100)), await _codes(front0, _req("again", 100)))
        finally:
            child.kill()
            child.wait(30)
            await front0.stop(1.0)

    asyncio.run(main())
