"""Streaming text input through the in-process engine client: pieces appended while the request runs (some
before it is even admitted) give the codes of the whole text; a waiting request is counted, and an abort frees
it; topologies that cannot carry text yet refuse it."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch

from legato.engine.config import EngineConfig
from legato.models.qwen3_tts.inputs import SpeechInput
from legato.models.qwen3_tts.loader import load_model
from legato.models.qwen3_tts.sampling import SamplingParams
from legato.models.qwen3_tts.text_stream import TextStream
from legato.pipeline.client import EngineClient, RequestRejected, SynthesisRequest
from legato.pipeline.local import LocalEngineClient

EMB = torch.randn(64, generator=torch.Generator().manual_seed(0))
TEXT = "Streaming text arrives word by word, while the voice is already speaking it."


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint):
    torch.set_num_threads(1)
    return load_model(tiny_checkpoint)


def engine_config() -> EngineConfig:
    return EngineConfig(device="cpu", dtype="float32", max_num_seqs=4, num_kv_blocks=128, max_model_len=512,
                        max_num_batched_tokens=256, frames_per_text_token=2.0)


def make_client(loaded) -> LocalEngineClient:
    return LocalEngineClient(loaded, engine_config())


def request(rid: str, text: str, text_open: bool) -> SynthesisRequest:
    inp = SpeechInput(text, language="english", speaker_embedding=EMB, x_vector_only=True)
    return SynthesisRequest(rid, inp, SamplingParams(seed=5, max_new_tokens=200), text_open=text_open)


async def wait_for(predicate, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def drain(gen, sink: list) -> None:
    async for chunk in gen:
        sink.append(chunk)


def test_appended_text_gives_the_codes_of_the_whole_text(loaded):
    async def main():
        client = make_client(loaded)
        await client.start()
        try:
            whole = [c async for c in client.generate(request("whole", TEXT, False))]
            stream = TextStream()
            words = [w + " " for w in TEXT.split(" ")[:-1]] + [TEXT.split(" ")[-1]]
            first = ""
            while not first:
                first = stream.append(words.pop(0))
            chunks: list = []
            task = asyncio.create_task(drain(client.generate(request("s", first, True)), chunks))
            # A piece sent while the request is still on the admission thread follows it in order.
            await client.append_text("s", stream.append(words.pop(0)))
            await wait_for(lambda: client.stats().waiting_for_text == 1, "the request to run out of text")
            assert not chunks or not chunks[-1].finished
            for w in words:
                piece = stream.append(w)
                if piece:
                    await client.append_text("s", piece)
            await client.append_text("s", stream.close(), close=True)
            await asyncio.wait_for(task, 120)
            stats = client.stats()
        finally:
            await client.stop()
        return whole, chunks, stats

    whole, chunks, stats = asyncio.run(main())
    assert chunks[-1].finished and chunks[-1].finish_reason == whole[-1].finish_reason
    assert np.array_equal(np.concatenate([c.codes for c in chunks]), np.concatenate([c.codes for c in whole]))
    # The same codes decoded in other chunks: equal within the streaming decoder's 1e-5 (as test_split holds).
    got, want = np.concatenate([c.audio for c in chunks]), np.concatenate([c.audio for c in whole])
    assert got.shape == want.shape and np.abs(got - want).max() < 1e-5
    assert stats.text_wait_s > 0 and stats.free_kv_blocks == stats.num_kv_blocks


def test_abort_ends_a_request_waiting_for_text(loaded):
    async def main():
        client = make_client(loaded)
        await client.start()
        try:
            chunks: list = []
            task = asyncio.create_task(drain(client.generate(request("w", "Hello there", True)), chunks))
            await wait_for(lambda: client.stats().waiting_for_text == 1, "the request to run out of text")
            assert client.stats().free_kv_blocks < client.stats().num_kv_blocks
            await client.abort("w", "barge-in")
            await asyncio.wait_for(task, 60)
            await client.append_text("w", " more words")  # after its end: dropped, nothing breaks
            await wait_for(lambda: client.stats().free_kv_blocks == client.stats().num_kv_blocks, "blocks back")
            assert client.is_alive()
        finally:
            await client.stop()
        return chunks

    chunks = asyncio.run(main())
    assert chunks[-1].finished and chunks[-1].finish_reason == "abort"


def test_a_command_that_fails_on_the_engine_thread_ends_its_request_not_the_engine(loaded, monkeypatch):
    """Whatever handling one request's text raises on the engine thread aborts that request with the reason;
    the thread, and every other request, go on (an append that raised once ended the engine for all)."""
    async def main():
        client = make_client(loaded)

        def broken(rid, ids, close=False):
            raise RuntimeError("a fault in the text path")

        monkeypatch.setattr(client.engine, "append_text", broken)
        await client.start()
        try:
            chunks: list = []
            task = asyncio.create_task(drain(client.generate(request("w", "Hello there", True)), chunks))
            await wait_for(lambda: client.stats().waiting_for_text == 1, "the request to run out of text")
            await client.append_text("w", " more words")
            await asyncio.wait_for(task, 60)
            other = [c async for c in client.generate(request("after", "Hello again.", False))]
            alive = client.is_alive()
            stats = client.stats()
        finally:
            await client.stop()
        return chunks, other, alive, stats

    chunks, other, alive, stats = asyncio.run(main())
    assert chunks[-1].finished and chunks[-1].finish_reason == "abort"
    assert "a fault in the text path" in chunks[-1].error
    assert other[-1].finished and other[-1].finish_reason in ("stop", "length") and alive
    assert stats.free_kv_blocks == stats.num_kv_blocks


def test_split_holds_text_until_its_talker_stream_opens(loaded):
    """split in threads: text sent before the stream is read (the talker has not seen the request yet) is held
    and handed on in order, and the request waits for more; codes and audio equal the whole text's, a second
    open request under the same id is refused, and nothing is held once requests end."""
    from legato.pipeline.split import build_split_client

    async def main():
        client = build_split_client(lambda device: loaded, engine_config(), ["cpu"])
        await client.start()
        try:
            assert client.takes_text_input
            whole = [c async for c in client.generate(request("whole", TEXT, False))]
            stream = TextStream()
            pieces = [p for p in (stream.append(w + " ") for w in TEXT.split(" ")[:-1]) if p]
            gen = client.generate(request("s", pieces[0], True))
            await client.append_text("s", pieces[1])  # held: the talker stream opens at the first read
            assert client._text.held == {"s": [(pieces[1], False)]}
            with pytest.raises(RequestRejected) as dup:
                async for _ in client.generate(request("s", "Again.", True)):
                    pass
            assert dup.value.status == 409
            chunks: list = []
            task = asyncio.create_task(drain(gen, chunks))
            await wait_for(lambda: client.talker.stats().waiting_for_text == 1, "the request to run out of text")
            assert "s" not in client._text.held
            for p in pieces[2:]:
                await client.append_text("s", p)
            await client.append_text("s", stream.append(TEXT.split(" ")[-1]) + stream.close(), close=True)
            await asyncio.wait_for(task, 120)
            return whole, chunks, dict(client._text.held)
        finally:
            await client.stop()

    whole, chunks, held = asyncio.run(main())
    assert chunks[-1].finished and chunks[-1].finish_reason == whole[-1].finish_reason
    assert np.array_equal(np.concatenate([c.codes for c in chunks]), np.concatenate([c.codes for c in whole]))
    # The same codes decoded in other chunks: equal within the streaming decoder's 1e-5 (as test_split holds).
    got, want = np.concatenate([c.audio for c in chunks]), np.concatenate([c.audio for c in whole])
    assert got.shape == want.shape and np.abs(got - want).max() < 1e-5
    assert held == {}


@pytest.mark.parametrize("topology", ["single", "split"])
def test_text_past_the_engines_buffer_ends_the_request_with_its_code(loaded, topology):
    """Streamed text past max_text_tokens fails the request with `error_code` text_too_long on its last chunk,
    through the in-process client and through split (which passes its talker's end on), so the front tells the
    client's fault by the code, not by the message."""
    from legato.pipeline.split import build_split_client

    config = engine_config()
    config.max_text_tokens = 24

    async def main():
        if topology == "split":
            client = build_split_client(lambda device: loaded, config, ["cpu"])
        else:
            client = LocalEngineClient(loaded, config)
        await client.start()
        try:
            chunks: list = []
            task = asyncio.create_task(drain(client.generate(request("s", "Hello there. ", True)), chunks))
            for _ in range(8):
                await client.append_text("s", "and more words to say, ")
            await client.append_text("s", "", close=True)
            await asyncio.wait_for(task, 120)
            return chunks
        finally:
            await client.stop()

    last = asyncio.run(main())[-1]
    assert last.finished and last.finish_reason == "error", last
    assert last.error_code == "text_too_long" and "max_text_tokens" in last.error


def test_prefill_decode_in_process_hands_the_text_on_with_the_request(loaded):
    """1p1d in threads: text appended while the prefill engine has the request is held by the router and
    reaches the decode engine behind the handoff; the codes equal the whole text's, and both engines free
    everything."""
    from legato.pipeline.pd import PrefillDecodeRouter

    async def main():
        router = PrefillDecodeRouter([make_client(loaded)], [make_client(loaded)])
        await router.start()
        try:
            assert router.takes_text_input
            whole = [c async for c in router.generate(request("whole", TEXT, False))]
            stream = TextStream()
            pieces = [p for p in (stream.append(w + " ") for w in TEXT.split(" ")[:-1]) if p]
            gen = router.generate(request("s", pieces[0], True))
            for p in pieces[1:4]:  # before anything ran: held by the router
                await router.append_text("s", p)
            assert [t for t, _ in router._text.held["s"]] == pieces[1:4]
            chunks: list = []
            task = asyncio.create_task(drain(gen, chunks))
            decode = router.decode[0]
            await wait_for(lambda: decode.stats().waiting_for_text == 1, "the decode side to run out of text")
            assert "s" not in router._text.held and router._text.routes["s"] is decode
            for p in pieces[4:]:
                await router.append_text("s", p)
            await router.append_text("s", stream.append(TEXT.split(" ")[-1]) + stream.close(), close=True)
            await asyncio.wait_for(task, 120)
            stats = [e.stats() for e in (router.prefill.replicas[0], decode)]
            return whole, chunks, stats, (dict(router._text.held), dict(router._text.routes))
        finally:
            await router.stop()

    whole, chunks, stats, tables = asyncio.run(main())
    assert chunks[-1].finished and chunks[-1].finish_reason == whole[-1].finish_reason
    assert np.array_equal(np.concatenate([c.codes for c in chunks]), np.concatenate([c.codes for c in whole]))
    assert all(s.free_kv_blocks == s.num_kv_blocks for s in stats)
    assert tables == ({}, {})


REF = torch.randint(0, 2048, (20, 16), generator=torch.Generator().manual_seed(3))


def icl_request(rid: str, text: str, text_open: bool) -> SynthesisRequest:
    inp = SpeechInput(text, language="english", speaker_embedding=EMB, ref_code=REF, ref_text="The reference.")
    return SynthesisRequest(rid, inp, SamplingParams(seed=4, max_new_tokens=60), text_open=text_open)


@pytest.mark.parametrize("text", [TEXT, "Short one."], ids=["fills-the-reference", "closes-short"])
def test_an_in_context_clone_takes_streaming_text_once_it_fills_its_prompt(loaded, text):
    """ICL: the request waits, before admission, until its text fills the reference's positions (or closes
    short of them, when it gets the short text's padded prompt); then it runs on, taking the rest as it comes.
    Its codes equal the one-shot request's."""
    async def main():
        client = make_client(loaded)
        await client.start()
        try:
            whole = [c async for c in client.generate(icl_request("whole", text, False))]
            stream = TextStream()
            words = text.split(" ")
            pieces = [p for p in (stream.append(w + " ") for w in words[:-1]) if p]
            pieces.append(stream.append(words[-1]) + stream.close())
            chunks: list = []
            task = asyncio.create_task(drain(client.generate(icl_request("s", pieces[0], True)), chunks))
            await wait_for(lambda: "s" in client._text_waits, "the clone to wait for text")
            assert client.stats().running == 0 and not chunks  # not in the engine yet
            for p in pieces[1:-1]:
                await client.append_text("s", p)
            await client.append_text("s", pieces[-1], close=True)
            await asyncio.wait_for(task, 120)
            return whole, chunks, dict(client._text_waits), dict(client._early_text)
        finally:
            await client.stop()

    whole, chunks, waits, early = asyncio.run(main())
    assert chunks[-1].finished and chunks[-1].finish_reason == whole[-1].finish_reason
    assert np.array_equal(np.concatenate([c.codes for c in chunks]), np.concatenate([c.codes for c in whole]))
    assert waits == {} and early == {}


def test_an_in_context_clone_waiting_for_text_can_be_aborted(loaded):
    async def main():
        client = make_client(loaded)
        await client.start()
        try:
            chunks: list = []
            task = asyncio.create_task(drain(client.generate(icl_request("w", "Hello", True)), chunks))
            await wait_for(lambda: "w" in client._text_waits, "the clone to wait for text")
            await client.abort("w", "barge-in")
            await asyncio.wait_for(task, 60)
            stats = client.stats()
            return chunks, dict(client._text_waits), dict(client._early_text), stats
        finally:
            await client.stop()

    chunks, waits, early, stats = asyncio.run(main())
    assert len(chunks) == 1 and chunks[0].finish_reason == "abort" and chunks[0].error == "barge-in"
    assert waits == {} and early == {} and stats.free_kv_blocks == stats.num_kv_blocks


def test_prefill_decode_refuses_an_in_context_clones_streaming_text(loaded):
    from legato.pipeline.pd import PrefillDecodeRouter

    async def main():
        router = PrefillDecodeRouter([make_client(loaded)], [make_client(loaded)])
        await router.start()
        try:
            with pytest.raises(RequestRejected) as e:
                async for _ in router.generate(icl_request("p", "Hello", True)):
                    pass
            return e.value, router.stats()
        finally:
            await router.stop()

    err, stats = asyncio.run(main())
    assert err.status == 400 and "in-context" in err.message
    assert stats.free_kv_blocks == stats.num_kv_blocks


def test_a_text_stream_asked_for_and_never_read_is_forgotten_at_its_abort(loaded):
    """A caller may ask for a text_open stream, send text, and abort before ever reading it (a socket that
    cancels at once): every client that held the stream's text for it lets it go at the abort."""
    from legato.pipeline.pd import PrefillDecodeRouter
    from legato.pipeline.router import ReplicaRouter
    from legato.pipeline.split import build_split_client

    def held(client) -> list[dict]:
        tables = [getattr(client, name) for name in ("_early_text", "_placement", "_text_waits", "_admitting")
                  if hasattr(client, name)]
        if hasattr(client, "_text"):  # HeldText: text held for a next hop, and where it goes
            tables += [client._text.held, client._text.routes]
        for inner in (getattr(client, "replicas", None) or [], [getattr(client, "talker", None)],
                      getattr(client, "decode", None) or []):
            tables += [t for c in inner if c is not None for t in held(c)]
        return tables

    async def main():
        clients = [make_client(loaded), ReplicaRouter([make_client(loaded), make_client(loaded)]),
                   build_split_client(lambda device: loaded, engine_config(), ["cpu"]),
                   PrefillDecodeRouter([make_client(loaded)], [make_client(loaded)])]
        seen = []
        for client in clients:
            await client.start()
            try:
                gen = client.generate(request("never-read", "Hello there", True))
                await client.append_text("never-read", " and more", close=True)
                assert any("never-read" in t for t in held(client)), type(client).__name__
                await client.abort("never-read", "cancelled")
                seen.append((type(client).__name__, [dict(t) for t in held(client) if t]))
                del gen
            finally:
                await client.stop()
        return seen

    for name, left in asyncio.run(main()):
        assert left == [], (name, left)


def test_an_open_text_aborted_before_its_admission_ran_never_reaches_the_engine(loaded):
    """A worker process takes its front's Submit and starts the request's task, then handles the front's Abort (a
    context cancelled at once) before that task has run: the abort found nothing in the engine, and the request
    was admitted after it, waiting for text that never came, a slot and its blocks held for ever (a socket
    cancelling contexts right after their first words leaked one running request each). It now ends with its
    abort and never reaches the engine."""

    async def main():
        client = make_client(loaded)
        await client.start()
        try:
            sunk: list = []
            for how in ("generate_into", "generate"):
                rid = f"early-{how}"
                if how == "generate_into":  # the worker's way: asked for, then run as a task of its own
                    run = client.generate_into(request(rid, "Hello there", True), sunk.extend)
                else:
                    chunks: list = []
                    run = drain(client.generate(request(rid, "Hello there", True)), chunks)
                await client.abort(rid, "cancelled")
                await asyncio.wait_for(run, 60)
                ends = [c for _, c in sunk] if how == "generate_into" else chunks
                assert len(ends) == 1 and ends[0].finished and ends[0].finish_reason == "abort", how
            await wait_for(lambda: client.stats().running == 0 and client.stats().waiting == 0, "an empty engine")
            stats = client.stats()
            assert stats.waiting_for_text == 0 and stats.free_kv_blocks == stats.num_kv_blocks
            assert client._early_text == {}
        finally:
            await client.stop()

    asyncio.run(main())


def test_a_client_without_text_input_refuses_it():
    class NoText(EngineClient):
        start = stop = generate = abort = extract_voice = stats = is_alive = None

    client = NoText()
    assert not client.takes_text_input
    with pytest.raises(RequestRejected) as e:
        asyncio.run(client.append_text("r", "hi"))
    assert e.value.status == 501
