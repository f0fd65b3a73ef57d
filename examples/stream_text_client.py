"""Speak an LLM's text while it is still being written: a client of legato's streaming-text WebSocket.

    pip install websockets
    legato serve &                                   # the embedded tiny model (random weights: noise, but timed)
    python examples/stream_text_client.py --voice ryan --tokens-per-s 40 "Sure! The weather in Paris is sunny."

It sends the text word by word at an LLM's pace (`--tokens-per-s`), writes the audio to a WAV file (`--out`) as it
arrives, and prints the time from the first word sent to the first audio received. `--cancel-after-s` sends a
barge-in `response.cancel` (once some audio has come) and prints how much audio had been sent.
Protocol: docs/streaming-text.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import wave

import websockets.exceptions
from websockets.asyncio.client import connect

SAMPLE_RATE = 24000  # the model's rate: the session asks for raw PCM at it


async def feed(ws, text: str, tokens_per_s: float, context_id: str) -> float:
    """Sends `text` a word at a time, as an LLM would; returns when the first word went out."""
    words = text.split(" ")
    started = time.monotonic()
    for i, word in enumerate(words):
        piece = word if i == len(words) - 1 else word + " "
        await ws.send(json.dumps({"type": "input_text.append", "context_id": context_id, "text": piece}))
        await asyncio.sleep(1.0 / tokens_per_s)
    await ws.send(json.dumps({"type": "input_text.end", "context_id": context_id}))
    return started


async def speak(url: str, text: str, out: str, voice: str | None, tokens_per_s: float, api_key: str | None,
                cancel_after_s: float | None = None, timeout_s: float = 120.0) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    session = {"response_format": "pcm", **({"voice": voice} if voice else {})}
    result: dict = {"audio_bytes": 0, "ttfp_s": None}
    async with connect(url, additional_headers=headers, open_timeout=30) as ws:
        await ws.send(json.dumps({"type": "session.update", "session": session}))
        started = time.monotonic()
        feeder = asyncio.create_task(feed(ws, text, tokens_per_s, "turn-1"))
        with wave.open(out, "wb") as wav:
            wav.setnchannels(1)
            wav.setsampwidth(2)
            wav.setframerate(SAMPLE_RATE)
            deadline = started + timeout_s
            while True:
                barge_in = cancel_after_s is not None and result["ttfp_s"] is not None
                if barge_in and time.monotonic() - started > cancel_after_s:  # the user spoke over it
                    await ws.send(json.dumps({"type": "response.cancel", "context_id": "turn-1"}))
                    cancel_after_s = None
                # wait_for, not asyncio.timeout: the example runs on Python 3.10 too
                msg = await asyncio.wait_for(ws.recv(), max(0.0, deadline - time.monotonic()))
                if isinstance(msg, bytes):  # one byte N, N bytes of context id, then the audio
                    audio = msg[1 + msg[0]:]
                    if result["ttfp_s"] is None:
                        result["ttfp_s"] = time.monotonic() - started
                    result["audio_bytes"] += len(audio)
                    wav.writeframes(audio)
                    continue
                event = json.loads(msg)
                if event["type"] == "error":
                    raise RuntimeError(event["error"]["message"])
                if event["type"] in ("response.audio.done", "response.cancelled"):
                    result["end"] = event
                    break
        feeder.cancel()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("text")
    p.add_argument("--url", default="ws://127.0.0.1:8000/v1/audio/speech/stream",
                   help="the server's streaming-text socket")
    p.add_argument("--out", default="out.wav", help="where the audio is written (WAV)")
    p.add_argument("--voice", required=True,
                   help="a preset speaker (the embedded model's: dylan, eric, ryan, serena), an OpenAI voice name such "
                        "as alloy, or a saved voice's id")
    p.add_argument("--tokens-per-s", type=float, default=40.0, help="the pace of the simulated LLM, in tokens/s")
    p.add_argument("--api-key", default=None, help="the server's API key, if it was started with one")
    p.add_argument("--cancel-after-s", type=float, default=None, help="barge in after this many seconds")
    args = p.parse_args()
    if not 0 < args.tokens_per_s < float("inf"):  # its feeder would divide by it, far from where it shows
        p.error("--tokens-per-s must be a number > 0")
    try:
        r = asyncio.run(speak(args.url, args.text, args.out, args.voice, args.tokens_per_s, args.api_key,
                              args.cancel_after_s))
    except (OSError, RuntimeError, asyncio.TimeoutError, websockets.exceptions.WebSocketException) as e:
        # the server's error event, a refused handshake, no server, no answer in time: one line, exit 1
        hint = ""
        if isinstance(e, websockets.exceptions.InvalidStatus) and e.response.status_code in (401, 403):
            hint = " (the server wants an API key: pass --api-key)"
        elif isinstance(e, ConnectionRefusedError):
            hint = f" (is `legato serve` running at {args.url}? see --url)"
        sys.exit(f"stream_text_client: {type(e).__name__ if not str(e) else e}{hint}")
    if r["ttfp_s"] is None:
        sys.exit(f"stream_text_client: no audio came ({r['end']})")
    print(f"first audio {r['ttfp_s'] * 1000:.0f} ms after the first word; {r['audio_bytes'] / 2 / SAMPLE_RATE:.2f} s "
          f"of audio in {args.out}; {r['end']}")


if __name__ == "__main__":
    main()
