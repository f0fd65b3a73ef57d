"""The split topology's relay batches per event-loop pass (issue 22): a talker step's frames for every stream cross to
the codec worker in one message, a codec step's PCM comes back in one, and the codec thread wakes the event loop
once per step; every stream keeps its own frames and chunks, whole and in order, and an abort or a failed source
still follows the frames sent before it."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from legato.engine.config import EngineConfig
from legato.pipeline import codec_worker as cw
from legato.pipeline import messages as m
from legato.pipeline.client import StreamChunk
from legato.pipeline.codec_process import CodecFeed, ProcessCodecClient, _feed
from legato.pipeline.worker import ChunkOutbox


def _codes(n: int, value: int) -> np.ndarray:
    return np.full((n, 16), value, np.int64)


def test_a_frame_batch_crosses_whole_and_in_order():
    entries = [("a", _codes(1, 1), False), ("b", _codes(0, 0), False), ("a", _codes(3, 2), False),
               ("b", _codes(2, 3), True)]
    [header, codes] = m.encode(m.CodecFrameBatch(entries))  # one header, one codes frame
    got = m.decode([header, codes])
    assert isinstance(got, m.CodecFrameBatch)
    assert [(rid, k.tolist(), last) for rid, k, last in got.entries] == [
        (rid, k.tolist(), last) for rid, k, last in entries]
    short = _codes(5, 0).tobytes()  # the entries claim 6 frames
    for frames in ([header, short], [header.replace(b'"frames": 3', b'"frames": -1'), codes],
               [header.replace(b'"frames": 3', b'"frames": 2'), codes]):
        with pytest.raises(m.MessageError, match="codec_frame_batch"):
            m.decode(frames)


class _Posted:
    def __init__(self) -> None:
        self.messages: list[m.Message] = []

    def post(self, msg: m.Message) -> bool:
        self.messages.append(msg)
        return True

    async def abort(self, request_id: str, reason: str = "aborted") -> None:
        self.messages.append(m.Abort(request_id, reason))


async def _no_chunks():
    return
    yield


def test_a_talker_steps_frames_leave_the_front_as_one_message(tiny_checkpoint):
    client = ProcessCodecClient(tiny_checkpoint, EngineConfig(device="cpu"))  # not started: no worker runs
    posted = _Posted()
    client.worker = posted

    async def source(value: int, fail: bool = False):
        for step in range(2):
            yield _codes(1, 10 * value + step)
            await asyncio.sleep(0)  # the next step comes in a later pass, as the talker's do
        if fail:
            raise RuntimeError("talker gone")

    async def go():
        feeds = [asyncio.create_task(_feed(CodecFeed(client, rid, _no_chunks()), source(i, fail=rid == "c")))
                 for i, rid in enumerate("abc")]
        done = await asyncio.gather(*feeds, return_exceptions=True)
        await asyncio.sleep(0)  # the last pass's flush
        await client.abort("a")
        return done

    done = asyncio.run(go())
    assert isinstance(done[2], RuntimeError) and done[:2] == [None, None]
    kinds = [type(msg).__name__ for msg in posted.messages]
    # Each step's frames in one batch; c's failure flushes what was queued, then aborts c; a and b end last.
    assert kinds.count("CodecFrameBatch") >= 2 and kinds.count("CodecFrames") == 0, kinds
    assert kinds[-1] == "Abort" and posted.messages[-1].request_id == "a"
    per_stream: dict[str, list] = {}
    for msg in posted.messages:
        if isinstance(msg, m.CodecFrameBatch):
            for rid, k, last in msg.entries:
                per_stream.setdefault(rid, []).append((k[:, 0].tolist(), last))
        elif isinstance(msg, m.Abort) and msg.request_id == "c":
            per_stream.setdefault("c", []).append(("abort", msg.reason))
    assert per_stream["a"] == [([0], False), ([1], False), ([], True)]
    assert per_stream["b"] == [([10], False), ([11], False), ([], True)]
    assert per_stream["c"] == [([20], False), ([21], False), ("abort", "the code source failed")]


def test_a_codec_steps_chunks_leave_the_worker_as_one_message():
    sent: list[m.Message] = []
    outbox = ChunkOutbox(sent.append)

    async def go():
        async def stream(rid: str, n: int) -> None:
            for i in range(n):
                outbox.put((rid, StreamChunk(np.full(i + 1, i, np.float32), i + 1, finished=i == n - 1)))
                await asyncio.sleep(0)

        await asyncio.gather(stream("a", 2), stream("b", 2), stream("c", 1))
        await asyncio.sleep(0)

    asyncio.run(go())
    assert [type(msg).__name__ for msg in sent] == ["Chunks", "Chunks"]
    assert [rid for rid, _ in sent[0].chunks] == ["a", "b", "c"] and [rid for rid, _ in sent[1].chunks] == ["a", "b"]
    assert [c.num_frames for _, c in sent[1].chunks] == [2, 2] and all(c.finished for _, c in sent[1].chunks)


def test_a_message_sent_after_queued_chunks_follows_them_and_request_ends_follow_stats():
    sent: list = []
    outbox = ChunkOutbox(sent.append, before_end=lambda: "stats")

    async def go():
        outbox.put(("a", StreamChunk(np.zeros(1, np.float32), 1)))
        outbox.flush()  # what a worker's send() does before its own message
        sent.append("rejected b")
        outbox.put(("a", StreamChunk(np.zeros(1, np.float32), 2, finished=True, finish_reason="stop")))
        await asyncio.sleep(0)

    asyncio.run(go())
    assert [x if isinstance(x, str) else type(x).__name__ for x in sent] == ["Chunk", "rejected b", "stats", "Chunk"]


def test_the_codec_thread_wakes_each_event_loop_once_per_step():
    client = object.__new__(cw.LocalCodecClient)  # the delivery alone: no engine or thread is needed

    class Loop:
        def __init__(self) -> None:
            self.calls = 0

        def call_soon_threadsafe(self, fn, *args):
            self.calls += 1
            fn(*args)

    loops = [Loop(), Loop()]
    queues = {rid: asyncio.Queue() for rid in "abc"}
    client._sinks = {"a": cw.CodecSink(loops[0], queues["a"]), "b": cw.CodecSink(loops[0], queues["b"]),
                     "c": cw.CodecSink(loops[1], queues["c"])}
    out = [cw.CodecOutput(rid, np.full(2, i, np.float32), 1, rid == "b") for i, rid in enumerate("abcx")]
    client._deliver_step(out)
    assert [loop.calls for loop in loops] == [1, 1]
    assert [queues[rid].get_nowait().request_id for rid in "abc"] == ["a", "b", "c"]
    assert set(client._sinks) == {"a", "c"}  # b finished; x was never open


class _Feed:
    """What `_CodesToCodec` calls of a `CodecFeed`, recorded."""

    def __init__(self, bad_shape: bool = False) -> None:
        self.calls: list = []
        self.bad_shape = bad_shape

    def push(self, codes: np.ndarray) -> None:
        if self.bad_shape:
            np.asarray(codes).reshape(-1, 16)  # a [n, 15] array fails here, as CodecFeed.push's reshape does
        self.calls.append(("push", codes[:, 0].tolist()))

    def end(self) -> None:
        self.calls.append(("end",))

    def fail(self, error: BaseException) -> None:
        self.calls.append(("fail", error))


def _talker_chunk(frames: int, value: int, finished: bool = False, reason: str | None = None) -> StreamChunk:
    return StreamChunk(np.zeros(0, np.float32), frames, finished=finished, finish_reason=reason,
                       codes=_codes(1, value) if value >= 0 else None)


def test_a_pushed_talker_stream_passes_its_codes_and_its_end_to_the_codec_feed():
    """Split with worker processes pushes each talker chunk into its codec stream's feed, with no task between:
    the codes in order, a normal end as the feed's end, an abort or failure (and a refusal) as the feed's failure,
    which its reader raises; nothing after the end is passed on."""
    from legato.pipeline.client import RequestRejected
    from legato.pipeline.split import _CodesToCodec, _Progress, _TalkerEnded

    ok = _CodesToCodec(_Progress(), _Feed())
    for item in (_talker_chunk(1, 7), _talker_chunk(2, 8), _talker_chunk(2, -1, True, "length"), _talker_chunk(3, 9)):
        ok.put_nowait(item)
    assert ok.feed.calls == [("push", [7]), ("push", [8]), ("end",)] and ok.done
    assert ok.progress.last.num_frames == 2 and ok.progress.first_codes_at is not None

    aborted = _CodesToCodec(_Progress(), _Feed())
    aborted.put_nowait(_talker_chunk(1, 7))
    aborted.put_nowait(StreamChunk(np.zeros(0, np.float32), 1, finished=True, finish_reason="abort",
                                   error="operator"))
    [push, (kind, error)] = aborted.feed.calls
    assert kind == "fail" and isinstance(error, _TalkerEnded) and error.chunk.error == "operator"

    refused = _CodesToCodec(_Progress(), _Feed())
    refused.put_nowait(RequestRejected(409, "request id 'x' is already in flight"))
    refused.put_nowait(_talker_chunk(1, 7))
    [(kind, error)] = refused.feed.calls
    assert kind == "fail" and error.status == 409

    bad = _CodesToCodec(_Progress(), _Feed(bad_shape=True))  # its own failure, raised by its reader alone
    bad.put_nowait(StreamChunk(np.zeros(0, np.float32), 1, codes=np.zeros((1, 15), np.int64)))
    bad.put_nowait(_talker_chunk(2, 8))
    [(kind, error)] = bad.feed.calls
    assert kind == "fail" and isinstance(error, ValueError) and bad.done


def test_a_pushed_stream_whose_sink_fails_leaves_the_rest_of_the_hand_over_alone():
    """The I/O thread hands a message's chunks for every stream to the event loop in one call: a pushed stream's
    sink that raises must not cost the streams after it their chunks, and its end is still marked."""
    from legato.pipeline.client import put_all
    from legato.pipeline.process_client import _Pushed

    class Broken:
        def put_nowait(self, item):
            raise RuntimeError("sink bug")

    async def go():
        broken, queue = _Pushed(Broken()), asyncio.Queue()
        last = StreamChunk(np.zeros(0, np.float32), 1, finished=True, finish_reason="stop")
        put_all([(broken, last), (queue, last)])
        return broken.ended.is_set(), queue.qsize()

    assert asyncio.run(go()) == (True, 1)
