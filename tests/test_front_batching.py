"""The front's side of a worker process: what the I/O thread reads in one pass reaches the event loop in one
hand-over, and every stream still gets its own chunks, whole and in order (issue 22)."""

from __future__ import annotations

import asyncio

import numpy as np

from legato.engine.config import EngineConfig
from legato.pipeline import messages as m
from legato.pipeline import process_client as pc
from legato.pipeline.client import RequestRejected, StreamChunk


def _chunk(i: int, last: bool) -> StreamChunk:
    return StreamChunk(np.full(i + 1, i, np.float32), i + 1, finished=last, finish_reason="stop" if last else None,
                       codes=np.full((1, 16), i, np.int64))


def test_a_read_pass_is_one_hand_over_keeping_each_streams_chunks_and_order(tiny_checkpoint, monkeypatch):
    client = pc.ProcessEngineClient(tiny_checkpoint, EngineConfig(device="cpu"))  # not started: no worker runs
    hand_overs = []
    real_call = pc._call

    def counting(loop, fn, *args):
        hand_overs.append(fn)
        real_call(loop, fn, *args)

    monkeypatch.setattr(pc, "_call", counting)

    async def go():
        loop = asyncio.get_running_loop()
        streams = {rid: pc._Stream(loop, asyncio.Queue()) for rid in ("a", "b", "refused")}
        client._streams.update(streams)

        def read_pass() -> None:  # what the I/O thread does with the messages one poll found waiting
            for i in range(3):
                for rid in ("a", "b"):
                    client._receive(m.encode(m.Chunk(rid, _chunk(i, last=i == 2))))
            client._receive(m.encode(m.Rejected("refused", 429, "busy", 1.0)))
            client._flush()

        await asyncio.to_thread(read_pass)
        return {rid: [await s.queue.get() for _ in range(3 if rid != "refused" else 1)] for rid, s in streams.items()}

    got = asyncio.run(go())
    assert hand_overs == [pc._put_all]  # seven items, one cross-thread call
    for rid in ("a", "b"):
        assert [c.num_frames for c in got[rid]] == [1, 2, 3] and [c.finished for c in got[rid]] == [False, False, True]
        assert [c.audio.tolist() for c in got[rid]] == [[0.0], [1.0, 1.0], [2.0, 2.0, 2.0]]
        assert [c.codes[0, 0] for c in got[rid]] == [0, 1, 2]
    [refusal] = got["refused"]
    assert isinstance(refusal, RequestRejected) and refusal.status == 429
    assert client._streams == {} and client._pending == {}  # finished and refused streams are gone

