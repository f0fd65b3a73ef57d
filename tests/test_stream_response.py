"""The way from a request to its first audio, in the event loop: the engine request leaves and the response is
built in the request's own task (no loop pass of a helper task on the way), while a client leaving still ends
it at once and a cancellation from outside stays one."""

from __future__ import annotations

import asyncio
import sys
import time
from types import SimpleNamespace

import pytest
from server_helpers import FakeClient, frames_chunk, server_settings

from legato.models.qwen3_tts.inputs import SpeechInput
from legato.models.qwen3_tts.sampling import SamplingParams
from legato.pipeline.client import SynthesisRequest
from legato.server.metrics import ServerMetrics
from legato.server.streaming import SpeechResponder


def _responder(script) -> tuple[FakeClient, SpeechResponder, asyncio.Event]:
    """A responder on a scripted client, and an event set when the engine request started (its script ran)."""
    started = asyncio.Event()

    def marked(req):
        started.set()
        return script(req)

    client = FakeClient(marked)
    return client, SpeechResponder(client, server_settings(), ServerMetrics(client)), started


def _request(receive) -> SimpleNamespace:
    return SimpleNamespace(receive=receive, state=SimpleNamespace(started=time.perf_counter()))


def _req(rid: str) -> SynthesisRequest:
    return SynthesisRequest(rid, SpeechInput("Hi.", speaker="ryan"), SamplingParams())


async def _until_waiting(started: asyncio.Event) -> None:
    """Until the handler waits for its first chunk and the disconnect watcher for the client (each a pass)."""
    await asyncio.wait_for(started.wait(), 5)
    for _ in range(3):
        await asyncio.sleep(0)


async def _never() -> dict:
    await asyncio.Event().wait()
    return {}


@pytest.mark.skipif(sys.version_info < (3, 11), reason="Python 3.10 has no asyncio.timeout: each chunk's deadline "
                    "falls back to wait_for, which awaits in a task of its own")
@pytest.mark.parametrize("mode", ["audio", "sse"])
def test_a_ready_first_chunk_makes_the_response_in_the_same_loop_pass(mode):
    """With the engine's first chunk already there, `respond` sends the engine request and builds the streamed
    response in the pass that started it: each extra pass costs tens of milliseconds at hundreds of streams."""
    client, responder, _ = _responder(lambda req: [frames_chunk(1, 1), frames_chunk(1, 2, True, "stop")])

    async def main() -> tuple[int, object]:
        loop = asyncio.get_running_loop()
        passes = 0
        task = loop.create_task(responder.respond(_req("quick"), "pcm", mode, _request(_never)))

        def tick() -> None:
            nonlocal passes
            passes += 1
            if not task.done():
                loop.call_soon(tick)

        loop.call_soon(tick)
        response = await task
        await response.body_iterator.aclose()
        await response.on_close()
        return passes, response

    passes, response = asyncio.run(main())
    assert response.status_code == 200
    assert passes == 1


@pytest.mark.parametrize("mode", ["audio", "file"])
def test_a_client_leaving_before_the_first_audio_ends_the_engine_request_at_once(mode):
    client, responder, started = _responder(lambda req: [30.0, frames_chunk(1, 1, True, "stop")])

    async def main():
        left = asyncio.Event()

        async def receive() -> dict:
            await left.wait()
            return {"type": "http.disconnect"}

        request = _request(receive)
        task = asyncio.create_task(responder.respond(_req("gone"), "pcm", mode, request))
        await _until_waiting(started)
        left.set()
        response = await asyncio.wait_for(task, 5)
        return response, request.state.generation

    response, gen = asyncio.run(main())
    assert response.status_code == 499 and gen.outcome == 499
    assert client.closed_early == ["gone"]


def test_a_cancelled_request_stays_cancelled_while_it_waits_for_the_first_audio():
    """The server stopping cancels the handler: that is not a client leaving, and must not become a 499."""
    client, responder, started = _responder(lambda req: [30.0])

    async def main() -> None:
        task = asyncio.create_task(responder.respond(_req("stopped"), "pcm", "audio", _request(_never)))
        await _until_waiting(started)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert client.closed_early == ["stopped"]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="Python 3.10 does not count cancel requests (no uncancel)")
def test_a_cancel_from_outside_wins_over_a_client_leaving_at_the_same_moment():
    client, responder, started = _responder(lambda req: [30.0])

    async def main() -> None:
        left = asyncio.Event()

        async def receive() -> dict:
            await left.wait()
            return {"type": "http.disconnect"}

        task = asyncio.create_task(responder.respond(_req("both"), "pcm", "audio", _request(receive)))
        await _until_waiting(started)
        left.set()
        await asyncio.sleep(0)  # the watcher runs and cancels the handler, which has not run since
        task.cancel()  # and the server cancels it too, before it runs
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert client.closed_early == ["both"]
