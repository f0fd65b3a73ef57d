"""The split codec worker's warm-up: throwaway streams of every graph bucket before it serves, after which it decodes
exactly as a codec that never warmed up, with nothing left open; a warm-up that fails stops the worker's start."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from legato.engine import compile_watch
from legato.engine.codec_schedule import StreamSchedule
from legato.engine.config import EngineConfig
from legato.models.qwen3_tts.loader import load_model
from legato.pipeline.codec_engine import CodecEngine
from legato.pipeline.codec_worker import CodecError, LocalCodecClient, codec_engine_options

REF = torch.randint(0, 2048, (9, 16), generator=torch.Generator().manual_seed(1))
CODES = torch.randint(0, 2048, (12, 16), generator=torch.Generator().manual_seed(3))
SCHEDULE = StreamSchedule(first_chunk_frames=1, chunk_frames=4, chunk_ramp=True)


@pytest.fixture(scope="module")
def decoder(tiny_checkpoint):
    torch.set_num_threads(1)
    return load_model(tiny_checkpoint).speech_tokenizer.decoder


def decode_two(eng: CodecEngine) -> dict[str, list[np.ndarray]]:
    """An in-context clone and a plain stream, frames one a step: each stream's chunks."""
    eng.open("clone", ref_code=REF)
    eng.open("plain")
    chunks: dict[str, list[np.ndarray]] = {"clone": [], "plain": []}
    for i in range(len(CODES)):
        for rid in chunks:
            eng.push(rid, CODES[i : i + 1])
        for out in eng.step():
            chunks[out.request_id].append(out.audio)
    for rid in chunks:
        eng.end(rid)
    for out in eng.step():
        chunks[out.request_id].append(out.audio)
    assert eng.num_streams == 0
    return chunks


def test_warm_up_decodes_every_bucket_and_leaves_the_codec_as_it_was(decoder, monkeypatch):
    opened: list[int] = []
    real_open = CodecEngine.open

    def counting_open(self, request_id, *args, **kwargs):
        real_open(self, request_id, *args, **kwargs)
        opened.append(self.num_streams)

    warmed = CodecEngine(decoder, SCHEDULE, capacity=5)
    monkeypatch.setattr(CodecEngine, "open", counting_open)
    assert warmed.warm_up() >= 0
    monkeypatch.setattr(CodecEngine, "open", real_open)
    # Row counts 1, 2, 4 and 5 (the graphs' buckets, the last cut to the capacity), one group at a time.
    groups = [n for i, n in enumerate(opened) if i + 1 == len(opened) or opened[i + 1] <= n]
    assert groups == [1, 2, 4, 5]
    assert warmed.num_streams == 0 and warmed.frames_decoded == 0 and not warmed.failures
    assert not warmed.streamer.streams and warmed.streamer.capacity == 5  # the bank did not grow
    fresh = CodecEngine(decoder, SCHEDULE, capacity=5)
    got, want = decode_two(warmed), decode_two(fresh)
    for rid in want:
        assert [c.size for c in got[rid]] == [c.size for c in want[rid]]
        assert np.array_equal(np.concatenate(got[rid]), np.concatenate(want[rid])), rid
    assert warmed.frames_decoded == fresh.frames_decoded == 2 * len(CODES)
    warmed.open("busy")
    with pytest.raises(RuntimeError, match="no stream is open"):
        warmed.warm_up()


async def first_stream(client: LocalCodecClient) -> list:
    async def frames():
        yield CODES[:3].numpy()

    return [chunk async for chunk in client.decode("r", frames())]


def test_a_codec_client_warms_up_before_it_serves_and_a_failed_warm_up_stops_its_start(decoder, monkeypatch):
    async def serve_one(client: LocalCodecClient) -> list:
        await client.start()
        try:
            return await first_stream(client)
        finally:
            await client.stop()

    monkeypatch.setattr(compile_watch._WATCH, "armed", False)  # put back as it was when the test ends
    client = LocalCodecClient(decoder, SCHEDULE, warm_up=True, capacity=3)
    chunks = asyncio.run(serve_one(client))
    assert client._warmed.is_set() and chunks[-1].last and sum(c.frames for c in chunks) == 3
    assert client.stats().frames_decoded == 3  # the warm-up's frames are not counted
    assert compile_watch._WATCH.armed  # what compiles after the warm-up is logged as a miss

    def broken(self):
        raise ValueError("no decoder")

    monkeypatch.setattr(CodecEngine, "warm_up", broken)
    failing = LocalCodecClient(decoder, SCHEDULE, warm_up=True, capacity=3)
    with pytest.raises(RuntimeError, match="warm-up failed: ValueError: no decoder"):
        asyncio.run(failing.start())
    assert failing._stopped.wait(10) and not failing.is_alive()

    async def refused() -> None:
        with pytest.raises(CodecError, match="not running"):
            await first_stream(failing)

    asyncio.run(refused())


def test_a_codec_worker_warms_up_on_a_gpu_only():
    assert codec_engine_options(EngineConfig(device="cpu"))["warm_up"] is False
    cuda = codec_engine_options(EngineConfig(device="cuda:0", codec_dtype="float32"))
    assert cuda["warm_up"] is True and cuda["graphs"] is True
