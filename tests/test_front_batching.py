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



def test_a_steps_chunks_cross_in_one_message_each_whole_and_in_order():
    chunks = [("a", _chunk(0, last=False)), ("b", StreamChunk(np.zeros(0, np.float32), 3, codes=None)),
              ("a", _chunk(2, last=True)), ("c", StreamChunk(np.ones(5, np.float32), 1, finished=True,
                                                             finish_reason="error", error="boom", retryable=True)),
              ("d", StreamChunk(np.zeros(0, np.float32), 4, finished=True, finish_reason="error", error="long",
                                error_code="text_too_long"))]
    [header, rows, audio, codes] = m.encode(m.Chunks(chunks))  # one header for all, one frame per array kind
    got = m.decode([header, rows, audio, codes])
    assert isinstance(got, m.Chunks) and [rid for rid, _ in got.chunks] == ["a", "b", "a", "c", "d"]
    for (_, want), (_, have) in zip(chunks, got.chunks, strict=True):
        assert have.audio.tolist() == want.audio.tolist() and have.num_frames == want.num_frames
        assert (have.codes is None) == (want.codes is None)
        if want.codes is not None:
            assert have.codes.tolist() == want.codes.tolist()
        assert (have.finished, have.finish_reason, have.error, have.error_code, have.retryable) == (
            want.finished, want.finish_reason, want.error, want.error_code, want.retryable)


def _refused(frames: list, what: str) -> None:
    try:
        m.decode(frames)
    except m.MessageError as e:
        assert "chunks" in str(e), e
    else:
        raise AssertionError(f"a chunks message with {what} was accepted")


def test_chunks_whose_rows_do_not_fit_their_arrays_are_refused():
    header, rows, audio, codes = m.encode(m.Chunks([("a", _chunk(1, last=False)), ("b", _chunk(2, last=True))]))
    table = np.frombuffer(rows, np.int64).reshape(2, 6)

    def with_rows(**change) -> bytes:  # column name -> (row, value)
        t = table.copy()
        for name, (i, value) in change.items():
            t[i, ("samples", "frames", "num_frames", "num_prompt_tokens", "seed", "finished").index(name)] = value
        return t.tobytes()

    _refused([header, rows, np.zeros(4, np.float32).tobytes(), codes], "less audio than its rows say")
    _refused([header, with_rows(samples=(0, -1)), audio, codes], "a negative size")
    _refused([header, with_rows(samples=(0, 2**62), frames=(1, 2**62)), audio, codes], "sizes that would wrap")
    _refused([header, with_rows(frames=(0, -2)), audio, codes], "frames below -1")
    _refused([header, with_rows(frames=(0, -1)), audio, codes], "codes no row claims")
    _refused([header, with_rows(finished=(0, 2)), audio, codes], "`finished` of 2")
    _refused([header, with_rows(seed=(1, -5)), audio, codes], "a negative seed")
    _refused([header, rows[:48], audio, codes], "one row for two ids")
    _refused([header.replace(b'"a"', b'7'), rows, audio, codes], "an id that is not a string")
    _refused([header.replace(b'"rare": {"1"', b'"rare": {"9"'), rows, audio, codes], "a rare entry past its rows")
    _refused([header.replace(b'"finish_reason": "stop"', b'"finish_reason": "done"'), rows, audio, codes],
             "an unknown finish reason")


def test_a_steps_message_round_trips_every_field_of_many_chunks():
    rng = np.random.default_rng(0)
    chunks = []
    for i in range(300):
        n, f = int(rng.integers(0, 4000)), int(rng.integers(-1, 3))
        chunks.append((f"r{i % 97}", StreamChunk(
            rng.standard_normal(n).astype(np.float32), int(rng.integers(0, 5000)),
            num_prompt_tokens=int(rng.integers(0, 9000)), finished=bool(i % 7 == 0),
            finish_reason=("stop", "length", "abort", "error", "handoff")[i % 5] if i % 7 == 0 else None,
            error="boom" if i % 35 == 0 else None, error_code="text_too_long" if i % 49 == 0 else None,
            seed=int(rng.integers(0, 2**63 - 1)),
            codes=None if f < 0 else rng.integers(0, 2048, (f, 16)), retryable=i % 70 == 0,
            stages={"engine": 0.01 * i} if i % 11 == 0 else None)))
    got = m.decode(m.encode(m.Chunks(chunks)))
    assert [rid for rid, _ in got.chunks] == [rid for rid, _ in chunks]
    for (_, want), (_, have) in zip(chunks, got.chunks, strict=True):
        assert np.array_equal(have.audio, want.audio) and have.audio.dtype == np.float32
        assert (have.codes is None) == (want.codes is None)
        assert want.codes is None or np.array_equal(have.codes, want.codes)
        for field in ("num_frames", "num_prompt_tokens", "finished", "finish_reason", "error", "error_code", "seed",
                      "retryable", "stages"):
            assert getattr(have, field) == getattr(want, field), field


def test_the_front_takes_a_steps_message_like_its_chunks(tiny_checkpoint):
    client = pc.ProcessEngineClient(tiny_checkpoint, EngineConfig(device="cpu"))

    async def go():
        loop = asyncio.get_running_loop()
        streams = {rid: pc._Stream(loop, asyncio.Queue()) for rid in ("a", "b")}
        client._streams.update(streams)

        def read_pass() -> None:
            client._receive(m.encode(m.Chunks([("a", _chunk(0, False)), ("b", _chunk(0, False))])))
            client._receive(m.encode(m.Chunks([("a", _chunk(1, True)), ("b", _chunk(1, True))])))
            client._flush()

        await asyncio.to_thread(read_pass)
        return {rid: [await s.queue.get() for _ in range(2)] for rid, s in streams.items()}

    got = asyncio.run(go())
    assert all([c.num_frames for c in got[rid]] == [1, 2] and got[rid][1].finished for rid in "ab")
    assert client._streams == {}


def test_a_first_chunks_stages_cross_both_message_kinds_and_bad_ones_are_refused():
    stages = {"prepare": 0.012, "inbox": 0.0005, "engine": 0.04, "voice": 0.001, "queue": 0.005, "build": 0.004,
              "resume": 0.002}
    first = StreamChunk(np.ones(3, np.float32), 1, stages=stages)
    [(_, one)] = [(None, m.decode(m.encode(m.Chunk("a", first))).chunk)]
    many = m.decode(m.encode(m.Chunks([("a", first), ("b", _chunk(1, last=False))])))
    assert one.stages == stages and many.chunks[0][1].stages == stages and many.chunks[1][1].stages is None
    for bad in ({"prepare": "soon"}, {"elsewhere": 1.0}, {"engine": True}):
        header, *arrays = m.encode(m.Chunk("a", StreamChunk(np.ones(3, np.float32), 1, stages=bad)))
        try:
            m.decode([header, *arrays])
        except m.MessageError as e:
            assert "stages" in str(e)
        else:
            raise AssertionError(f"stages {bad} were accepted")
