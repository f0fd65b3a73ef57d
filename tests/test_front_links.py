"""A worker's links to several front processes (`legato serve --fronts N`): each request's answers go back to
the front it came from, in order, and what concerns every front goes to all; a front cannot open an id another
front holds, nor act on another front's request. Also the shared voice store of those fronts."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import zmq.asyncio
from voice_helpers import HIDDEN, FakeClient

from legato.models.qwen3_tts.inputs import SpeechInput
from legato.models.qwen3_tts.sampling import SamplingParams
from legato.pipeline import messages as m
from legato.pipeline.client import EngineStats, StreamChunk, SynthesisRequest
from legato.pipeline.front_links import FrontLinks, front_endpoints
from legato.pipeline.ipc import zmq_endpoint
from legato.pipeline.process_client import new_instance_id
from legato.server.voices import VoiceStore


@pytest.fixture
def links():
    ctx = zmq.asyncio.Context()
    iid = new_instance_id()
    base = (zmq_endpoint(iid, "0-cmd"), zmq_endpoint(iid, "0-out"))  # nobody binds them: routing only
    made = []

    def make(fronts: int) -> FrontLinks:
        made.append(FrontLinks(ctx, [front_endpoints(base, k) for k in range(fronts)], 2**20))
        return made[-1]

    yield make
    for link in made:
        link.close()
    ctx.term()


def _submit(rid: str) -> m.Submit:
    return m.Submit(SynthesisRequest(request_id=rid, input=SpeechInput(text="hi"), sampling=SamplingParams()))


def _chunk(frames: int, finished: bool = False) -> StreamChunk:
    return StreamChunk(np.full(2, frames, np.float32), frames, finished=finished,
                       finish_reason="length" if finished else None)


def test_front_endpoints_keep_front_0s_names_and_suffix_the_others():
    base = ("ipc://@legato-x-0-cmd", "ipc://@legato-x-0-out")
    assert front_endpoints(base, 0) == base
    assert front_endpoints(base, 2) == ("ipc://@legato-x-0-cmd2", "ipc://@legato-x-0-out2")
    assert len({front_endpoints(base, k) for k in range(4)}) == 4


def test_one_front_routes_everything_to_it_without_bookkeeping(links):
    one = links(1)
    assert one.admit(_submit("a"), 0) is None and one.admit(_submit("a"), 0) is None  # the engine refuses twice
    chunks = m.Chunks([("a", _chunk(1)), ("b", _chunk(2, True))])
    assert one.route(chunks) == [(0, chunks)]
    assert one.origin == {}


def test_answers_go_to_the_front_that_opened_the_request(links):
    three = links(3)
    for rid, front in (("a", 0), ("b", 1), ("c", 2), ("d", 1)):
        assert three.admit(_submit(rid), front) is None
    assert three.admit(m.ExtractVoice("voice-1", np.zeros(4, np.float32), 16000), 2) is None
    step = m.Chunks([("a", _chunk(1)), ("b", _chunk(1)), ("d", _chunk(1)), ("b", _chunk(2, True)),
                     ("c", _chunk(1))])
    routed = dict(three.route(step))
    assert sorted(routed) == [0, 1, 2]
    assert isinstance(routed[0], m.Chunk) and routed[0].request_id == "a"
    # front 1's part keeps the step's order: b, d, then b's last chunk
    assert [(rid, c.num_frames, c.finished) for rid, c in routed[1].chunks] == [("b", 1, False), ("d", 1, False),
                                                                                  ("b", 2, True)]
    assert routed[2].request_id == "c"
    assert "b" not in three.origin and three.origin["d"] == 1  # a last chunk ends the claim
    assert three.route(m.Rejected("d", 429, "full")) == [(1, m.Rejected("d", 429, "full"))]
    result = m.VoiceResult("voice-1", np.zeros(HIDDEN, np.float32), np.zeros((3, 16), np.int64))
    assert [f for f, _ in three.route(result)] == [2]
    assert set(three.origin) == {"a", "c"}


def test_what_concerns_the_worker_goes_to_every_front(links):
    three = links(3)
    for msg in (m.Stats(EngineStats()), m.Heartbeat(3), m.LinkStatus(0, "up", None, {})):
        assert [f for f, _ in three.route(msg)] == [0, 1, 2]


def test_a_front_cannot_take_or_touch_another_fronts_request(links):
    two = links(2)
    assert two.admit(_submit("x"), 0) is None
    assert "in flight" in two.admit(_submit("x"), 1)
    assert two.admit(m.Abort("x", "client disconnected"), 1) is not None
    assert two.admit(m.AppendText("x", "more", False), 1) is not None
    assert two.admit(m.Abort("x", "client disconnected"), 0) is None
    assert two.admit(m.Abort("unknown", "late"), 1) is None  # nothing to protect: the worker ignores it
    assert two.origin == {"x": 0}


def test_fronts_sharing_a_voice_directory_see_each_others_changes(tmp_path):
    async def main() -> None:
        a = VoiceStore(tmp_path, FakeClient(), shared=True)
        b = VoiceStore(tmp_path, FakeClient(), shared=True, tidy=False)
        emb = [0.5] * HIDDEN
        await a.create("Alice", speaker_embedding=emb)
        seen = b.get("alice")
        assert seen is not None and seen.name == "Alice" and [i.name for i in b.list()] == ["Alice"]
        await b.create("alice", speaker_embedding=[0.25] * HIDDEN, replace=True)  # replaced by the other front
        assert float(a.get("ALICE").speaker_embedding[0]) == 0.25
        assert await a.delete("alice")
        assert b.get("alice") is None and b.list() == []
        assert not await b.delete("alice")

    asyncio.run(main())


def test_a_store_of_one_process_still_reads_its_directory_once(tmp_path):
    async def main() -> None:
        a = VoiceStore(tmp_path, FakeClient())
        b = VoiceStore(tmp_path, FakeClient())
        await a.create("bob", speaker_embedding=[0.5] * HIDDEN)
        assert b.get("bob") is None  # not shared: the directory was read at start only
        assert VoiceStore(tmp_path, FakeClient()).get("bob") is not None

    asyncio.run(main())


def test_a_front_that_does_not_tidy_leaves_another_fronts_write_alone(tmp_path):
    (tmp_path / ".tmp-abc.safetensors").write_bytes(b"half")
    (tmp_path / "bad.safetensors").write_bytes(b"not a voice")
    VoiceStore(tmp_path, FakeClient(), shared=True, tidy=False)
    assert (tmp_path / ".tmp-abc.safetensors").exists() and (tmp_path / "bad.safetensors").exists()
    VoiceStore(tmp_path, FakeClient(), shared=True)
    assert not (tmp_path / ".tmp-abc.safetensors").exists() and not (tmp_path / "bad.safetensors").exists()
