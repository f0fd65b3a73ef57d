"""The streaming-text WebSocket on a real uvicorn server on 127.0.0.1, driven by a real client library
(`websockets`, the library uvicorn serves WebSockets with): the audio of a streamed text equals the HTTP request
of the whole text, a cancel frees everything, and the API key is checked at the handshake."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from server_helpers import LiveServer, local_client, server_settings, tiny_loaded

from legato.server.app import build_app
from legato.server.ws_protocol import STREAM_PATH, split_binary_frame

websockets = pytest.importorskip("websockets")
from websockets.asyncio.client import connect  # noqa: E402

TEXT = "Streaming text arrives word by word, while the voice is already speaking it."


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return tiny_loaded(tmp_path_factory.mktemp("ws-live-models"), "custom_voice")


async def until(ws, predicate, audio: dict, timeout_s: float = 60.0) -> dict:
    """Reads messages (collecting audio by context) until an event satisfies `predicate`; every read has a deadline."""
    async with asyncio.timeout(timeout_s):
        while True:
            msg = await ws.recv()
            if isinstance(msg, bytes):
                cid, data = split_binary_frame(msg)
                audio[cid] = audio.get(cid, b"") + data
                continue
            event = json.loads(msg)
            assert event["type"] != "error", event
            if predicate(event):
                return event


def test_a_real_client_streams_text_and_cancels(loaded):
    client = local_client(loaded, frames_per_text_token=2.0)
    app = build_app(client, server_settings(loaded, default_max_new_tokens=40, max_new_tokens_limit=512,
                                            api_keys=("k1",)))
    speaker = client.info.speakers[0]
    with LiveServer(app) as server:
        whole = httpx.post(f"{server.url}/v1/audio/speech", timeout=120, headers={"Authorization": "Bearer k1"},
                           json={"input": TEXT, "voice": speaker, "response_format": "pcm", "seed": 3,
                                 "stream": False, "non_streaming_mode": False})
        assert whole.status_code == 200, whole.text
        url = f"ws://127.0.0.1:{server.port}{STREAM_PATH}"

        async def main():
            with pytest.raises(websockets.exceptions.InvalidStatus) as refused:
                async with connect(url, open_timeout=30):
                    pass
            assert refused.value.response.status_code == 403
            audio: dict = {}
            async with connect(url, additional_headers={"Authorization": "Bearer k1"}, open_timeout=30) as ws:
                await ws.send(json.dumps({"type": "session.update", "session": {"voice": speaker, "seed": 3}}))
                await until(ws, lambda e: e["type"] == "session.updated", audio)
                parts = TEXT.split(" ")
                for w in [p + " " for p in parts[:-1]] + parts[-1:]:
                    await ws.send(json.dumps({"type": "input_text.append", "context_id": "a", "text": w}))
                await ws.send(json.dumps({"type": "input_text.end", "context_id": "a"}))
                # alone: the codes of a request never depend on its batch, its audio can by a float rounding
                await until(ws, lambda e: e["type"] == "response.audio.done" and e["context_id"] == "a", audio)
                await ws.send(json.dumps({"type": "session.update", "session": {"max_new_tokens": 400}}))
                await ws.send(json.dumps({"type": "input_text.append", "context_id": "b", "text": "Hello there "}))
                await until(ws, lambda e: e["type"] == "session.updated", audio)
                await ws.send(json.dumps({"type": "response.cancel", "context_id": "b"}))
                cancelled = await until(ws, lambda e: e["type"] == "response.cancelled", audio)
            return audio, cancelled

        audio, cancelled = asyncio.run(main())
        assert audio["a"] == whole.content
        assert cancelled["audio_ms_sent"] == round(len(audio.get("b", b"")) / 2 * 1000 / 24000)
        metrics = ""
        for _ in range(3000):  # the server finishes the socket and gives the blocks back: polled, with a bound
            metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
            stats = client.stats()
            if "legato_ws_open_sockets 0.0" in metrics and stats.free_kv_blocks == stats.num_kv_blocks:
                break
            asyncio.run(asyncio.sleep(0.01))
        else:
            raise AssertionError("the socket or its blocks were not given back")
        assert "legato_ws_cancels_total 1.0" in metrics


def test_compression_is_off_unless_the_flag_asks_and_session_updated_does_not_echo_inline_data(loaded):
    """A client offering permessage-deflate (websockets does by default) gets plain frames from `legato serve`
    unless --ws-per-message-deflate is set: deflating every audio frame cost the server more CPU than the rest of
    a socket's work. And session.updated names an inline clip or embedding instead of sending it back."""
    import argparse

    from legato.server.cli import add_serve_parser, uvicorn_ws_options

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))

    clip = "data:audio/wav;base64," + "A" * 40_000  # under the default 64 kB message limit
    for argv, extensions in (([], []), (["--ws-per-message-deflate"], ["permessage-deflate"])):
        app = build_app(local_client(loaded), server_settings(loaded, default_max_new_tokens=20,
                                                              max_new_tokens_limit=512))  # an app starts once
        with LiveServer(app, **uvicorn_ws_options(parser.parse_args(["serve", *argv]))) as server:
            async def main():
                url = f"ws://127.0.0.1:{server.port}{STREAM_PATH}"
                async with connect(url, open_timeout=30, max_size=None) as ws:
                    await ws.send(json.dumps({"type": "session.update", "session": {
                        "ref_audio": clip, "speaker_embedding": [0.5] * 8, "seed": 4}}))
                    raw = await asyncio.wait_for(ws.recv(), 30)
                    return [e.name for e in ws.protocol.extensions], raw

            negotiated, raw = asyncio.run(main())
            assert negotiated == extensions
            assert len(raw) < 1000
            session = json.loads(raw)["session"]
            assert session["omitted"] == ["ref_audio", "speaker_embedding"] and session["seed"] == 4
            assert "ref_audio" not in session and "speaker_embedding" not in session


def test_a_message_cap_raised_past_uvicorns_default_is_the_cap(loaded):
    """--ws-max-message-bytes is the largest client message, but uvicorn closed the socket (1009) on any message over
    its own 16 MiB default first: a server raised to 20 MiB (for inline clips) dropped a 17 MiB session.update with
    the connection instead of reading it."""
    import argparse

    from legato.server.cli import add_serve_parser, uvicorn_ws_options, ws_settings

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--ws-max-message-bytes", str(20 << 20)])
    app = build_app(local_client(loaded), server_settings(loaded, **ws_settings(args)))
    with LiveServer(app, **uvicorn_ws_options(args)) as server:
        async def main():
            async with connect(f"ws://127.0.0.1:{server.port}{STREAM_PATH}", open_timeout=30, max_size=None) as ws:
                await ws.send("x" * (17 << 20))  # read by the session: not JSON, and said so
                return json.loads(await asyncio.wait_for(ws.recv(), 60))

        reply = asyncio.run(main())
    assert reply["type"] == "error" and reply["error"]["code"] == "invalid_json"


@pytest.mark.parametrize("parser", ["httptools", "h11"])
def test_websockets_never_count_against_the_clients_share_of_slow_connections(loaded, parser):
    """A WebSocket is a request that finished (its upgrade): however many a client opens one after another,
    and however long each stays open, none is counted as a connection still sending its request. They were,
    from 1 s in and forever, so the client's share ran out after 64 sockets and the next ones had an HTTP 429
    written into their WebSocket stream (the client saw 'reserved bits must be 0')."""
    import time

    from legato.server.connections import guarded_http

    protocol = guarded_http(10.0, slow_per_client=2, slow_after_s=0.1, parser=parser)
    app = build_app(local_client(loaded), server_settings(loaded, default_max_new_tokens=20, max_new_tokens_limit=512))
    with LiveServer(app, http=protocol) as server:
        async def one_socket() -> str:
            async with connect(f"ws://127.0.0.1:{server.port}{STREAM_PATH}", open_timeout=30) as ws:
                await asyncio.sleep(0.5)  # past slow_after_s: a slow-connection timer left armed has fired
                await ws.send(json.dumps({"type": "session.update", "session": {"seed": 1}}))
                return json.loads(await asyncio.wait_for(ws.recv(), 30))["type"]

        assert [asyncio.run(one_socket()) for _ in range(5)] == ["session.updated"] * 5
        deadline = time.monotonic() + 30
        while protocol.slow.held("127.0.0.1") and time.monotonic() < deadline:
            time.sleep(0.02)
        assert protocol.slow.held("127.0.0.1") == 0


def test_the_example_client_streams_and_cancels(loaded, tmp_path):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent.parent / "examples" / "stream_text_client.py"
    spec = importlib.util.spec_from_file_location("stream_text_client", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    client = local_client(loaded)
    app = build_app(client, server_settings(loaded, default_max_new_tokens=20, max_new_tokens_limit=512))
    with LiveServer(app) as server:
        url = f"ws://127.0.0.1:{server.port}{STREAM_PATH}"
        out = tmp_path / "out.wav"
        r = asyncio.run(example.speak(url, TEXT, str(out), client.info.speakers[0], 200.0, None))
        assert r["end"]["type"] == "response.audio.done" and r["audio_bytes"] > 0 and r["ttfp_s"] is not None
        assert out.stat().st_size == 44 + r["audio_bytes"]
        # 2 words a second: the request waits for its text long after the first audio, when the cancel goes
        r = asyncio.run(example.speak(url, TEXT, str(out), client.info.speakers[0], 2.0, None, cancel_after_s=0.0))
        assert r["end"]["type"] == "response.cancelled"
    # a pace of 0 is refused at once (it hung until its timeout, the ZeroDivisionError swallowed by its feeder)
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(path), "--voice", "ryan", "--tokens-per-s", "0", "Hi."],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--tokens-per-s must be a number > 0" in done.stderr
