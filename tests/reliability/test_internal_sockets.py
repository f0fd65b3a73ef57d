"""Garbage on the ZMQ sockets between the server and a process worker, both ways: truncated, unknown,
mistyped, hostile (deep nesting, huge integers, NaN, impossible shapes) and oversized frames. The side that
receives one drops it with a log line naming what was wrong, keeps running, and the next request gives the
codes it gave before (a request streaming meanwhile is not disturbed either)."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import numpy as np
import pytest
import zmq
from test_process_workers import _codes, _collect, _config, _req

from legato.pipeline import messages as m
from legato.pipeline.process_client import ProcessEngineClient
from legato.pipeline.topology import build_client, parse_topology

LIMIT = 1 << 20  # the test's message limit: an oversized frame stays cheap to send
WAIT_S = 20.0


def _header(tag: str, body: dict, arrays: list | None = None) -> bytes:
    return json.dumps({"type": tag, "v": m.VERSION, "body": body, "arrays": arrays or []}).encode()


def _garbage(wrong_direction: m.Message) -> list[tuple[str, list[bytes], str]]:
    """(what, frames, the words the receiver's log line must contain) for each kind of bad message."""
    submit = m.encode(m.Submit(_req(7)))  # a header and one array frame (the speaker embedding)
    text = submit[0].decode()
    deep = b'{"type": "abort", "v": 1, "body": ' + b"[" * 100_000
    huge_int = b'{"type": "heartbeat", "v": 1, "body": {"seq": ' + b"9" * 5000 + b"}}"
    voice = {"request_id": "v", "sample_rate": 16000}
    return [
        ("random bytes", [bytes(range(256))[::-1] * 4], "not JSON"),
        ("empty header", [b"", b"\x00" * 10], "not JSON"),
        ("truncated header", [submit[0][: len(submit[0]) // 2], *submit[1:]], "not JSON"),
        ("truncated array frame", [submit[0], submit[1][:-3]], "needs 256 bytes"),
        ("array frame missing", submit[:1], "frames follow"),
        ("unknown type", [text.replace('"submit"', '"pickle"', 1).encode(), *submit[1:]], "unknown message type"),
        ("wrong field type", [_header("abort", {"request_id": 7, "reason": "x"})], "'request_id' must be str"),
        ("wrong nested type", [text.replace('"temperature": 0.9', '"temperature": "hot"').encode(), *submit[1:]],
         "'temperature' must be float"),
        ("NaN", [text.replace('"temperature": 0.9', '"temperature": NaN').encode(), *submit[1:]], "NaN"),
        ("deep nesting", [deep], "recursion"),
        ("huge integer", [huge_int], "digits"),
        ("shape overflowing int64", [_header("extract_voice", voice, [["samples", "float32", [2**32, 2**32]]]),
                                     b""], "needs 73786976294838206464 bytes"),
        ("too many dims", [_header("extract_voice", voice, [["samples", "float32", [1] * 100]]), b"\x00" * 4],
         "dimension"),
        ("oversized", [b"x" * (LIMIT + 1)], "over the limit"),
        ("wrong direction", m.encode(wrong_direction), "not a"),
    ]


@pytest.fixture(scope="module")
def worker(tiny_checkpoint):
    client = build_client(parse_topology("single"), None, _config(), workers="process",
                          model_path=str(tiny_checkpoint),
                          process_options={"torch_threads": 1, "start_timeout_s": 60, "max_message_bytes": LIMIT})
    assert isinstance(client, ProcessEngineClient)
    asyncio.run(client.start())
    yield client
    asyncio.run(client.stop())


@pytest.fixture(scope="module")
def baseline(worker) -> np.ndarray:
    chunks = asyncio.run(_collect(worker, _req(0)))
    assert chunks[-1].finish_reason == "length"
    return _codes(chunks)


async def _logged(lines, words: str, what: str) -> str:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        hit = next((line for line in list(lines()) if words in line), None)
        if hit is not None:
            return hit
        await asyncio.sleep(0.02)
    raise AssertionError(f"{what}: no log line with {words!r}; saw {list(lines())[-5:]}")


async def _inject_all(send, cases, lines, clear) -> None:
    for what, frames, words in cases:
        clear()
        send(frames)
        await _logged(lines, words, what)


async def _serving_through(worker: ProcessEngineClient, inject) -> list:
    """Runs `inject()` while a long request streams; returns that request's chunks."""
    streaming = asyncio.ensure_future(_collect(worker, _req(5, frames=40, ignore_eos=True)))
    await asyncio.sleep(0)
    await inject()
    return await streaming


def _assert_still_serving(worker: ProcessEngineClient, baseline: np.ndarray, during: list) -> None:
    assert during[-1].finish_reason == "length" and during[-1].num_frames == 40
    assert worker.is_alive() and worker.proc.poll() is None
    assert all(t.is_alive() for t in worker._threads)  # the I/O thread, which also watches the worker
    after = asyncio.run(_collect(worker, _req(0)))
    assert after[-1].finish_reason == "length" and np.array_equal(_codes(after), baseline)


def test_garbage_into_the_worker_is_dropped_and_logged(worker, baseline):
    """Frames pushed down the command socket the worker reads: its log names each problem."""
    def send(frames: list[bytes]) -> None:
        with worker._lock:
            worker._cmd.send_multipart(frames)

    cases = _garbage(m.Heartbeat(1))  # worker -> server only
    during = asyncio.run(_serving_through(
        worker, lambda: _inject_all(send, cases, lambda: worker._log_tail, worker._log_tail.clear)))
    _assert_still_serving(worker, baseline, during)


def test_garbage_from_a_rogue_peer_into_the_server_is_dropped_and_logged(worker, baseline, caplog):
    """A second peer on the socket the server reads the worker from (its PULL takes any PUSH that connects),
    sending what a broken worker could."""
    caplog.set_level(logging.WARNING, logger="legato.pipeline.process_client")
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.PUSH)
    rogue.setsockopt(zmq.LINGER, 1000)
    rogue.connect(worker.endpoints[1])
    cases = _garbage(m.Submit(_req(8)))  # server -> worker only

    async def inject() -> None:
        await _inject_all(rogue.send_multipart, cases, lambda: [r.getMessage() for r in caplog.records],
                          caplog.clear)
        # Far past the limit, libzmq drops the rogue's connection instead of buffering the frame.
        rogue.send_multipart([b"y" * (4 * LIMIT)])

    try:
        during = asyncio.run(_serving_through(worker, inject))
    finally:
        rogue.close()
        ctx.term()
    _assert_still_serving(worker, baseline, during)


def test_an_opening_message_over_the_limit_is_refused_not_lost(worker):
    """The worker would drop it: the server refuses it (413) instead of waiting forever for an answer."""
    from legato.pipeline.client import RequestRejected

    clip = np.zeros(LIMIT // 4 + 1, np.float32)
    with pytest.raises(RequestRejected) as err:
        asyncio.run(worker.extract_voice(clip, 24000))
    assert err.value.status == 413 and "limit" in err.value.message
    assert worker._calls == {} and worker.is_alive()
