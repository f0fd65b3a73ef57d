"""The codec worker process's side of `split` (codec_process._CodecWorker), run in this process against a real codec
thread on the tiny model: frames reach the codec thread as one hand-over per message and every stream's outputs come
back without a task or queue per stream, on the single chunk schedule, whole and in order; a decode call's audio
leaves as soon as it is back, not after a burst's whole backlog; aborts, duplicates and a shutdown with streams open
each end their streams with a reason."""

from __future__ import annotations

import asyncio
import os
import time

import numpy as np
import pytest
import torch

from legato.engine.codec_schedule import StreamSchedule
from legato.models.qwen3_tts.loader import load_model
from legato.pipeline import messages as m
from legato.pipeline.codec_engine import CodecEngine
from legato.pipeline.codec_process import _CodecWorker
from legato.pipeline.codec_worker import LocalCodecClient
from legato.pipeline.worker import WorkerSpec

SCHEDULE = StreamSchedule(first_chunk_frames=1, chunk_frames=4)  # the ramp: 1, 1, 2, 4, 4, ...
CODES = torch.randint(0, 2048, (11, 16), generator=torch.Generator().manual_seed(5)).numpy()


@pytest.fixture(scope="module")
def decoder(tiny_checkpoint):
    torch.set_num_threads(1)
    return load_model(tiny_checkpoint).speech_tokenizer.decoder


class _Out:
    """A worker's PUSH socket: every message it sends, decoded, in order."""

    def __init__(self) -> None:
        self.messages: list[m.Message] = []

    def send_multipart(self, frames) -> asyncio.Future:
        self.messages.append(m.decode(frames))
        done = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    def chunks(self, rid: str) -> list:
        out = []
        for msg in self.messages:
            pairs = msg.chunks if isinstance(msg, m.Chunks) else [(msg.request_id, msg.chunk)] if isinstance(
                msg, m.Chunk) else []
            out += [c for r, c in pairs if r == rid]
        return out


class _Deaf:
    """A command socket nothing arrives on (the test hands the worker its messages itself)."""

    async def recv_multipart(self):
        await asyncio.Event().wait()


def _spec() -> WorkerSpec:
    return WorkerSpec("unused", {}, "codec", "t-0", "inproc://cmd", "inproc://out", os.getppid(), role="codec")


async def _until(pred, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        await asyncio.sleep(0.01)


def _reference(decoder, codes: np.ndarray) -> np.ndarray:
    """The stream's audio from a codec engine fed frame by frame, as `single` decodes."""
    eng = CodecEngine(decoder, SCHEDULE)
    eng.open("ref")
    outs = []
    for frame in codes:
        eng.push("ref", frame[None])
        outs += eng.step()
    eng.end("ref")
    outs += eng.step()
    return np.concatenate([o.audio for o in outs])


def test_a_burst_s_decode_calls_come_out_one_call_at_a_time(decoder):
    """After a burst a step decodes the backlog frame by frame; `steps` hands over each call's audio as it comes
    back (a stream's first chunk first), and all of it equals `step`'s."""
    engines = [CodecEngine(decoder, SCHEDULE) for _ in range(2)]
    for eng in engines:
        eng.open("a")
        eng.open("b")
        eng.push("a", CODES[:6])
        eng.push("b", CODES[:1])
    calls = list(engines[0].steps())
    whole = engines[1].step()
    # One frame of each stream a call; the chunks complete at frames 1, 2 and 4 (frames 5 and 6 stay held).
    assert [sorted((o.request_id, o.frames) for o in call) for call in calls if call] == [
        [("a", 1), ("b", 1)], [("a", 1)], [("a", 2)]]
    flat = [o for call in calls for o in call]
    assert [(o.request_id, o.frames) for o in flat] == [(o.request_id, o.frames) for o in whole]
    assert all(np.array_equal(x.audio, y.audio) for x, y in zip(flat, whole, strict=True))


def test_the_worker_streams_every_stream_on_the_schedule_without_a_task_each(decoder):
    codec = LocalCodecClient(decoder, SCHEDULE)
    out = _Out()

    async def main():
        await codec.start()
        worker = _CodecWorker(_spec(), codec, out)
        tasks_before = len(asyncio.all_tasks())
        await worker.handle(m.CodecOpen("a"))
        await worker.handle(m.CodecOpen("b", first_chunk_frames=2))
        await worker.handle(m.CodecOpen("a"))  # a duplicate is refused; "a" itself goes on
        await worker.handle(m.CodecFrameBatch([("a", CODES[:5], False), ("b", CODES[:3], True)]))
        assert len(asyncio.all_tasks()) == tasks_before  # no task per stream
        await worker.handle(m.CodecFrames("a", CODES[5:], True))
        await worker.handle(m.CodecFrames("gone", CODES[:1], False))  # frames of no open stream are dropped
        await _until(lambda: not worker.streams, "both streams ended")
        await asyncio.sleep(0)  # the last pass's chunks leave
        return worker.stats()

    try:
        stats = asyncio.run(main())
    finally:
        asyncio.run(codec.stop())
    rejected = [msg for msg in out.messages if isinstance(msg, m.Rejected)]
    assert [(r.request_id, r.status) for r in rejected] == [("a", 400)]
    for rid, codes, sizes in (("a", CODES, [1, 1, 2, 4, 3]), ("b", CODES[:3], [2, 1])):
        chunks = out.chunks(rid)
        assert np.diff([0] + [c.num_frames for c in chunks]).tolist() == sizes
        assert chunks[-1].finished and chunks[-1].finish_reason == "stop" and not any(c.finished for c in chunks[:-1])
        audio = np.concatenate([c.audio for c in chunks])
        np.testing.assert_allclose(audio, _reference(decoder, codes), atol=1e-5)
        assert list(chunks[0].stages) == ["codec_worker"] and not any(c.stages for c in chunks[1:])
    ends = [i for i, msg in enumerate(out.messages) if any(
        c.finished for _, c in (msg.chunks if isinstance(msg, m.Chunks) else [(0, msg.chunk)]
                                if isinstance(msg, m.Chunk) else []))]
    assert ends and all(isinstance(out.messages[i - 1], m.Stats) for i in ends)  # fresh stats before each end
    assert stats.running == 0


def test_an_abort_and_a_shutdown_end_open_streams_with_their_reasons(decoder):
    codec = LocalCodecClient(decoder, SCHEDULE)
    out = _Out()

    async def main():
        await codec.start()
        worker = _CodecWorker(_spec(), codec, out)
        serving = asyncio.create_task(worker.serve(_Deaf()))
        for rid in ("cut", "held"):
            await worker.handle(m.CodecOpen(rid))
            await worker.handle(m.CodecFrames(rid, CODES[:2], False))
        await _until(lambda: len(out.chunks("cut")) == 2 and len(out.chunks("held")) == 2, "the first chunks")
        await worker.handle(m.Abort("cut", "operator"))
        await _until(lambda: "cut" not in worker.streams, "the aborted stream ended")
        await worker.handle(m.CodecFrames("cut", CODES[2:4], False))  # after its end: dropped
        await worker.handle(m.Shutdown(grace_s=0.2))  # "held" never ends on its own
        await asyncio.wait_for(serving, 30)
        await worker.handle(m.CodecOpen("late"))  # refused while draining
        return worker

    worker = asyncio.run(main())
    cut, held = out.chunks("cut"), out.chunks("held")
    assert (cut[-1].finish_reason, cut[-1].error, cut[-1].num_frames) == ("abort", "operator", 2)
    assert held[-1].finish_reason == "error" and "stopped" in held[-1].error and held[-1].num_frames == 2
    late = [msg for msg in out.messages if isinstance(msg, m.Rejected)]
    assert [(r.request_id, r.status) for r in late] == [("late", 503)]
    assert not worker.streams and isinstance(out.messages[-1], m.Rejected)
    assert any(isinstance(msg, m.Stats) and msg.stats.running == 0 for msg in out.messages)
    assert not codec.is_alive()



def test_an_output_that_cannot_be_passed_on_fails_only_its_own_stream(decoder):
    """The codec thread hands a decode call's outputs for every stream over in one call; one that raises in the
    worker's handler ends its own stream with a reason, and the others' outputs still go out."""
    from legato.pipeline.client import put_all
    from legato.pipeline.codec_engine import CodecOutput

    codec = LocalCodecClient(decoder, SCHEDULE)  # not started: a dropped stream's command waits in its inbox
    out = _Out()

    async def main():
        worker = _CodecWorker(_spec(), codec, out)
        for rid in ("bad", "good"):
            await worker.handle(m.CodecOpen(rid))
        broken = CodecOutput("bad", None, 1)  # no audio array: passing it on raises
        put_all([(worker, broken), (worker, CodecOutput("good", np.ones(1920, np.float32), 1))])
        await asyncio.sleep(0)
        return worker

    worker = asyncio.run(main())
    [bad], [good] = out.chunks("bad"), out.chunks("good")
    assert bad.finish_reason == "error" and "codec worker error" in bad.error and bad.num_frames == 0
    assert good.num_frames == 1 and not good.finished and list(worker.streams) == ["good"]
    assert ("abort", "bad", None) in [codec._inbox.get_nowait() for _ in range(codec._inbox.qsize())]
