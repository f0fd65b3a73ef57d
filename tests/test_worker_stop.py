"""How the server judges and stops its worker processes under CPU contention (issue 20): a stall of the
watching side never reads as a dead worker, a Shutdown refused for the moment is offered again instead of
turning into SIGTERM, and a worker that really stops answering is still found dead and killed."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from legato.engine.config import EngineConfig
from legato.pipeline import messages as m
from legato.pipeline.liveness import Liveness
from legato.pipeline.process_client import ProcessEngineClient


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_silence_counts_only_while_the_server_watches():
    clock = _Clock()
    live = Liveness(timeout_s=15.0, max_step_s=1.0, clock=clock)
    clock.now += 40.0  # the server stalled 40 s (its heartbeats queued up unread): one look costs 1 s at most
    assert not live.look() and live.silent_s == 1.0
    live.heard()  # then it reads them
    for _ in range(299):  # watched 50 ms at a time: 14.95 s of silence
        clock.now += 0.05
        assert not live.look()
    clock.now += 0.1
    assert live.look() and live.expired  # 15.05 s watched without a word: dead


def test_liveness_refuses_a_timeout_that_is_not_positive():
    with pytest.raises(ValueError):
        Liveness(0.0)


def _client(path, **kw) -> ProcessEngineClient:
    cfg = EngineConfig(device="cpu", dtype="float32", max_num_seqs=2, num_kv_blocks=32, max_model_len=256,
                       max_num_batched_tokens=64)
    return ProcessEngineClient(path, cfg, torch_threads=1, start_timeout_s=90, **kw)


def test_a_refused_shutdown_is_offered_again_not_turned_into_sigterm(tiny_checkpoint):
    client = _client(tiny_checkpoint)
    send, refusals = client._send, []

    def refuse_twice(msg, frames=None):
        if isinstance(msg, m.Shutdown) and len(refusals) < 2:
            refusals.append(msg)  # as zmq.Again does when the command pipe is full for a moment
            return False
        return send(msg, frames)

    client._send = refuse_twice

    async def main():
        await client.start()
        await client.stop(grace_s=5.0)

    asyncio.run(main())
    assert len(refusals) == 2 and client.proc.returncode == 0


def test_a_worker_that_stops_answering_is_found_dead_and_killed(tiny_checkpoint):
    client = _client(tiny_checkpoint, heartbeat_timeout_s=1.0)

    async def main():
        await client.start()
        try:
            assert client.is_alive()
            os.kill(client.proc.pid, signal.SIGSTOP)
            deadline = time.monotonic() + 60.0
            while client.dead_reason is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            return client.dead_reason, client.is_alive()
        finally:
            await client.stop()

    reason, alive = asyncio.run(main())
    assert reason == "worker died (no heartbeat for 1 s)" and not alive
    assert client.proc.returncode == -signal.SIGKILL


def test_a_stopped_worker_reads_idle_even_when_its_last_stats_go_unread(tiny_checkpoint):
    """The worker's final Stats can arrive after the server stopped reading; a worker that has exited holds
    nothing all the same, so its stats must not keep the request it was running when it stopped."""
    from client_helpers import EMB

    from legato.models.qwen3_tts.inputs import SpeechInput
    from legato.models.qwen3_tts.sampling import SamplingParams
    from legato.pipeline.client import SynthesisRequest

    client = _client(tiny_checkpoint)
    dispatch = client._dispatch

    def drop_stats_once_stopping(msg):
        if not (client._stopping and isinstance(msg, m.Stats)):
            dispatch(msg)

    client._dispatch = drop_stats_once_stopping
    req = SynthesisRequest("long", SpeechInput("A long one.", language="english", speaker_embedding=EMB,
                                               x_vector_only=True),
                           SamplingParams(seed=1, max_new_tokens=2000), ignore_eos=True)

    async def main():
        await client.start()
        stream = client.generate(req)
        first = await stream.__anext__()
        deadline = time.monotonic() + 30.0
        while client.stats().running == 0 and time.monotonic() < deadline:  # a heartbeat that counts it
            await asyncio.sleep(0.05)
        running = client.stats().running
        await client.stop(grace_s=0.0)
        rest = [c async for c in stream]
        return first, running, rest[-1] if rest else first

    first, running, last = asyncio.run(main())
    assert running == 1 and last.finished and last.finish_reason in ("abort", "error")
    stats = client.stats()
    assert stats.running == stats.waiting == 0 and stats.free_kv_blocks == stats.num_kv_blocks == 32
