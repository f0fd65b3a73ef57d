"""Engine stats are true from the first read: before the engine thread has stepped, when a request's last
chunk arrives, and when a worker process says Ready (issue 20: a decode engine read as full at a 1p1d start,
and a test that read zero free blocks of an idle engine)."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch

from legato.engine.config import EngineConfig
from legato.models.qwen3_tts.inputs import SpeechInput
from legato.models.qwen3_tts.loader import load_model
from legato.models.qwen3_tts.sampling import SamplingParams
from legato.pipeline import messages as m
from legato.pipeline.client import EngineStats, StreamChunk, SynthesisRequest
from legato.pipeline.local import LocalEngineClient
from legato.pipeline.process_client import ProcessEngineClient
from legato.pipeline.worker import WorkerSpec, _Worker

EMB = torch.randn(64, generator=torch.Generator().manual_seed(0))
BLOCKS = 96


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint):
    torch.set_num_threads(1)
    return load_model(tiny_checkpoint)


def _config(**kw) -> EngineConfig:
    cfg = dict(device="cpu", dtype="float32", max_num_seqs=4, num_kv_blocks=BLOCKS, max_model_len=512,
               max_num_batched_tokens=256)
    return EngineConfig(**{**cfg, **kw})


def _request(rid: str, frames: int = 4) -> SynthesisRequest:
    inp = SpeechInput("Hello there.", language="english", speaker_embedding=EMB, x_vector_only=True)
    return SynthesisRequest(rid, inp, SamplingParams(seed=1, max_new_tokens=frames + 1), ignore_eos=True)


def _idle(s: EngineStats, blocks: int = BLOCKS) -> bool:
    return (s.num_kv_blocks == s.free_kv_blocks == blocks and s.kv_usage == 0.0
            and s.running == s.waiting == 0)


def test_stats_before_the_first_step_show_every_block_free(loaded):
    client = LocalEngineClient(loaded, _config())
    assert _idle(client.stats()), client.stats()  # constructed, its thread not started

    async def main():
        await client.start()
        try:
            return client.stats()  # started, and no step has run unless the thread was quick
        finally:
            await client.stop()

    assert _idle(asyncio.run(main()))


def test_profiled_blocks_are_reported_before_the_first_step(loaded):
    client = LocalEngineClient(loaded, _config(num_kv_blocks=None, max_num_seqs=2))
    blocks = client.engine.block_manager.num_blocks
    assert blocks == 2 * (512 // 16) and _idle(client.stats(), blocks)


def test_the_last_chunk_arrives_after_the_stats_that_free_its_blocks(loaded):
    """The engine thread is held just after it hands a request's last chunk over; the stats read on that chunk
    must already count the request out (they were refreshed only after the handing over, so they still held
    an aborted request, whose end comes in the step after the abort freed its blocks)."""
    client = LocalEngineClient(loaded, _config())
    read = threading.Event()
    deliver = client._deliver

    def deliver_then_hold(outputs):
        deliver(outputs)
        if any(o.finished for o in outputs):
            read.wait(timeout=10.0)  # bounded: a broken test must not hang the engine thread

    client._deliver = deliver_then_hold

    async def main():
        await client.start()
        try:
            seen = None
            async for chunk in client.generate(_request("a", frames=200)):
                if chunk.finished:
                    seen = client.stats()
                    read.set()
                elif chunk.audio.size and seen is None:
                    seen = "aborting"
                    await client.abort("a", "operator")
            return chunk, seen
        finally:
            read.set()
            await client.stop()

    last, seen = asyncio.run(main())
    assert last.finish_reason == "abort" and _idle(seen), seen
    assert seen.aborted == {"operator": 1}


class _FakeClient:
    """What `_Worker` calls on its engine client: one stream, and stats that say how many times they were read."""

    def __init__(self) -> None:
        self.reads = 0

    def stats(self) -> EngineStats:
        self.reads += 1
        return EngineStats(steps=self.reads)


def _fake_worker() -> tuple[_Worker, list[m.Message]]:
    spec = WorkerSpec(model_path="", engine_config={}, name="t", label="t-0", cmd_endpoint="", out_endpoint="",
                      parent_pid=0)
    worker = _Worker(spec, _FakeClient(), links=None)
    sent: list[m.Message] = []

    async def send(msg: m.Message) -> None:
        sent.append(msg)

    worker.send = send
    worker.emit = sent.append  # what the worker sends without waiting (a step's chunks)
    return worker, sent


def test_a_worker_sends_the_stats_before_a_requests_last_chunk():
    worker, sent = _fake_worker()

    async def run() -> None:  # what generate_into does: a step's chunks to the sink in one call, then it ends
        worker.send_chunks([("r", StreamChunk(np.zeros(4, np.float32), 1)),
                            ("r", StreamChunk(np.zeros(4, np.float32), 2, finished=True, finish_reason="length"))])

    async def main() -> None:
        await worker.run_request("r", run())
        await asyncio.sleep(0)  # one loop pass: the flush the first chunk scheduled

    asyncio.run(main())
    kinds = [type(x).__name__ for x in sent]
    # Both chunks came within one pass of the event loop (as a step's do): one message, the stats before it.
    assert kinds == ["Stats", "Chunks"], kinds
    assert sent[1].chunks[-1][1].finished and sent[0].stats.steps == 1  # read once, once the request had ended


def test_a_worker_that_fails_a_stream_sends_the_stats_first():
    worker, sent = _fake_worker()

    async def run() -> None:
        raise RuntimeError("boom")

    asyncio.run(worker.run_request("r", run()))
    assert [type(x).__name__ for x in sent] == ["Stats", "Chunk"] and sent[1].chunk.finish_reason == "error"


class _RecordingClient(ProcessEngineClient):
    """Notes the stats the server holds at the moment the worker's Ready arrives."""

    at_ready: EngineStats | None = None

    def _dispatch(self, msg: m.Message) -> None:
        if isinstance(msg, m.Ready):
            self.at_ready = self.stats()
        super()._dispatch(msg)


def test_a_worker_is_ready_with_its_own_stats(tiny_checkpoint):
    """The worker profiles its blocks (`num_kv_blocks=None`), so only its own Stats can say how many it has:
    they must reach the server before Ready does, since the server serves from Ready on."""
    client = _RecordingClient(tiny_checkpoint, _config(num_kv_blocks=None, max_num_seqs=2), torch_threads=1,
                              start_timeout_s=90)
    assert client.stats().num_kv_blocks == 0  # the server cannot know them before the worker says

    async def main():
        await client.start()
        try:
            return client.stats()
        finally:
            await client.stop()

    after_start = asyncio.run(main())
    assert client.at_ready is not None and _idle(client.at_ready, 64), client.at_ready
    assert _idle(after_start, 64)


def test_a_draining_worker_refuses_each_new_request_by_its_id():
    """After Shutdown, a new request (its id inside the Submit) or voice call gets a 503 its front can read."""
    worker, sent = _fake_worker()
    worker.draining = True
    submit = m.Submit(SynthesisRequest("late", SpeechInput("hi"), SamplingParams()))

    async def main() -> None:
        await worker.handle(submit)
        await worker.handle(m.ExtractVoice("voice-1", np.zeros(4, np.float32), 16000))

    asyncio.run(main())
    assert [(x.request_id, x.status) for x in sent] == [("late", 503), ("voice-1", 503)]
