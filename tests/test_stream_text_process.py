"""Streaming text input across the process boundary, a replica router, split's talker and codec workers and a
prefill-decode pair: the wire carries `text_open` and AppendText, and a request streamed to an engine worker
process (through a router of them, to a talker worker whose codes a codec worker decodes, or prefilled by one
worker and decoded by another, its text following the handoff) gives the codes and audio of the whole text; text
past a worker engine's buffer ends the request with its error code on the far side of the wire."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from legato.engine.config import EngineConfig
from legato.models.qwen3_tts.inputs import SpeechInput
from legato.models.qwen3_tts.sampling import SamplingParams
from legato.models.qwen3_tts.text_stream import TextStream
from legato.pipeline import messages as m
from legato.pipeline.client import SynthesisRequest
from legato.pipeline.topology import build_client, parse_topology

EMB = torch.randn(64, generator=torch.Generator().manual_seed(0))
TEXT = "Text streamed to a worker process, word by word, gives the codes of the whole text."


def request(rid: str, text: str, text_open: bool) -> SynthesisRequest:
    inp = SpeechInput(text, language="english", speaker_embedding=EMB, x_vector_only=True)
    return SynthesisRequest(rid, inp, SamplingParams(seed=9, max_new_tokens=40), text_open=text_open)


def test_append_text_and_text_open_cross_the_wire():
    msg = m.decode(m.encode(m.AppendText("r1", "wörld, ", close=True)))
    assert msg == m.AppendText("r1", "wörld, ", close=True)
    sub = m.decode(m.encode(m.Submit(request("r2", "Hi", True))))
    assert sub.request.text_open
    assert not m.decode(m.encode(m.Submit(request("r3", "Hi", False)))).request.text_open


@pytest.mark.parametrize("topology", ["single", "replicas:2", "split", "1p1d"])
def test_streamed_text_through_worker_processes_equals_the_whole_text(tiny_checkpoint, topology):
    config = EngineConfig(device="cpu", dtype="float32", max_num_seqs=4, num_kv_blocks=128, max_model_len=512,
                          max_num_batched_tokens=256)
    client = build_client(parse_topology(topology), None, config, workers="process", model_path=str(tiny_checkpoint),
                          process_options={"torch_threads": 1, "start_timeout_s": 60})
    assert client.takes_text_input

    async def main():
        await client.start()
        try:
            whole = [c async for c in client.generate(request("whole", TEXT, False))]
            stream = TextStream()
            pieces = [stream.append(w + " ") for w in TEXT.split(" ")[:-1]] + [stream.append(TEXT.split(" ")[-1])]
            pieces = [p for p in pieces if p]
            gen = client.generate(request("s", pieces[0], True))
            for p in pieces[1:]:  # all sent before the first chunk is read: they follow the Submit in order
                await client.append_text("s", p)
            await client.append_text("s", stream.close(), close=True)
            streamed = [c async for c in gen]
            stats = client.stats()
        finally:
            await client.stop()
        return whole, streamed, stats

    whole, streamed, stats = asyncio.run(asyncio.wait_for(main(), 300))
    assert streamed[-1].finished and streamed[-1].finish_reason == whole[-1].finish_reason
    assert np.array_equal(np.concatenate([c.codes for c in streamed]), np.concatenate([c.codes for c in whole]))
    # split: the codec worker decodes the streamed codes into the audio of the whole text
    # decoded in other chunks: equal within the streaming decoder's 1e-5
    got, want = np.concatenate([c.audio for c in streamed]), np.concatenate([c.audio for c in whole])
    assert got.shape == want.shape and np.abs(got - want).max() < 1e-5
    assert stats.free_kv_blocks == stats.num_kv_blocks


@pytest.mark.parametrize("topology", ["single", "replicas:2", "split", "1p1d"])
def test_text_past_a_worker_engines_buffer_crosses_the_wire_with_its_code(tiny_checkpoint, topology):
    """Streamed text past max_text_tokens fails the request in its worker process; the last chunk carries
    `error_code` text_too_long across the process boundary, so the front reports it by the code."""
    config = EngineConfig(device="cpu", dtype="float32", max_num_seqs=4, num_kv_blocks=128, max_model_len=512,
                          max_num_batched_tokens=256, max_text_tokens=24)
    client = build_client(parse_topology(topology), None, config, workers="process", model_path=str(tiny_checkpoint),
                          process_options={"torch_threads": 1, "start_timeout_s": 60})

    async def main():
        await client.start()
        try:
            gen = client.generate(request("s", "Hello there. ", True))
            for _ in range(8):
                await client.append_text("s", "and more words to say, ")
            await client.append_text("s", "", close=True)
            return [c async for c in gen]
        finally:
            await client.stop()

    last = asyncio.run(asyncio.wait_for(main(), 300))[-1]
    assert last.finished and last.finish_reason == "error", last
    assert last.error_code == "text_too_long" and "max_text_tokens" in last.error


def test_an_open_text_cancelled_at_once_leaves_nothing_running_in_its_worker(tiny_checkpoint):
    """A streaming-text context cancelled right after its first words (barge-in) sends its worker a Submit and at
    once an Abort: the worker handled the Abort before the request's task had run, and then admitted the request,
    which waited for text for ever (one leaked slot per such context; 64 and the server was full)."""
    config = EngineConfig(device="cpu", dtype="float32", max_num_seqs=4, num_kv_blocks=128, max_model_len=512,
                          max_num_batched_tokens=256)
    client = build_client(parse_topology("single"), None, config, workers="process", model_path=str(tiny_checkpoint),
                          process_options={"torch_threads": 1, "start_timeout_s": 60})

    async def main():
        await client.start()
        try:
            for i in range(3):
                rid = f"cancelled-{i}"
                client.generate(request(rid, "Hello there", True))  # asked for (sent), never read: a socket's way
                await client.abort(rid, "cancelled")
            deadline = asyncio.get_running_loop().time() + 60
            while client._streams:  # each one's last chunk, after the Stats that no longer count it
                assert asyncio.get_running_loop().time() < deadline, f"still listed: {list(client._streams)}"
                await asyncio.sleep(0.01)
            return client.stats()
        finally:
            await client.stop()

    stats = asyncio.run(asyncio.wait_for(main(), 300))
    assert stats.running == 0 and stats.waiting == 0 and stats.waiting_for_text == 0
    assert stats.free_kv_blocks == stats.num_kv_blocks
