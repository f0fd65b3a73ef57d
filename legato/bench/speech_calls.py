"""One speech request of any format and delivery mode, judged whole: the reliability campaigns (overload,
soak) need to know not just the status but whether a 200 carried all of its audio, and whether a refusal
said why.

Requests fix their length (`ignore_eos` + `num_frames`), so a complete body has a known size: raw PCM is
exactly frames × 1920 samples × 2 bytes (Qwen3-TTS's 12.5 Hz codec at 24 kHz), a WAV is that after its
header, an SSE stream ends with `speech.audio.done` whose usage counts the frames. An MP3 is decoded: a
whole file gives exactly the samples (its Info tag tells the decoder the encoder's delay and padding); a
stream cannot carry that tag up front, so it decodes to those samples plus the encoder's delay and the last
frame's padding (up to four 576-sample MPEG-2 frames are allowed).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time
from dataclasses import dataclass

import httpx
import soundfile as sf

SAMPLES_PER_FRAME = 1920
# How long a load client keeps an idle pooled connection: below the server's keep-alive (uvicorn's 5 s), so the
# client never sends on a connection the server is closing at that moment. httpx's default is also 5 s, and in a CI
# overload run one request went out on such a connection and got a ReadError with no response (2026-12-07).
KEEPALIVE_EXPIRY_S = 2.0
SAMPLE_RATE = 24000
FORMATS = ("pcm", "wav", "mp3")
MODES = ("stream", "file", "sse")
KINDS = tuple((fmt, mode) for fmt in FORMATS for mode in MODES)


@dataclass
class Outcome:
    """What one request came to. `result`: ok (200, complete body), rejected (429/503 that said why),
    disconnected (the client left on purpose), bad (anything else: detail says what)."""

    kind: tuple[str, str]
    frames: int
    result: str
    status: int | None = None
    detail: str = ""
    started: float = 0.0  # time.monotonic() at send
    e2e_s: float = 0.0

    @property
    def audio_s(self) -> float:
        return self.frames * SAMPLES_PER_FRAME / SAMPLE_RATE if self.result == "ok" else 0.0


def speech_body(kind: tuple[str, str], frames: int, text: str, voice: str | None, extra: dict | None = None) -> dict:
    fmt, mode = kind
    body = {"input": text, "response_format": fmt, "ignore_eos": True, "num_frames": frames, **(extra or {})}
    if voice is not None:
        body["voice"] = voice
    if mode == "sse":
        body["stream_format"] = "sse"
    else:
        body["stream"] = mode == "stream"
    return body


def _wav_problem(body: bytes, pcm_bytes: int) -> str | None:
    if body[:4] != b"RIFF" or body[8:12] != b"WAVE":
        return "not a WAV"
    at = body.find(b"data", 12)
    if at < 0:
        return "WAV without a data chunk"
    got = len(body) - (at + 8)
    return None if got == pcm_bytes else f"WAV data {got} bytes, expected {pcm_bytes}"


_MP3_SLACK = 4 * 576  # samples a streamed MP3 may decode to beyond its audio: encoder delay + last-frame padding


def _mp3_problem(body: bytes, frames: int, whole: bool) -> str | None:
    # an ID3 tag or an MPEG audio frame sync (11 set bits)
    if len(body) < 2 or not (body[:3] == b"ID3" or (body[0] == 0xFF and body[1] & 0xE0 == 0xE0)):
        return f"not an MP3: {body[:16]!r}"
    try:
        got = sf.info(io.BytesIO(body)).frames
    except (RuntimeError, sf.LibsndfileError) as e:
        return f"MP3 does not decode: {e}"
    want = frames * SAMPLES_PER_FRAME
    ok = got == want if whole else want <= got <= want + _MP3_SLACK
    return None if ok else f"MP3 decodes to {got} samples, expected {want}" + ("" if whole else f"..+{_MP3_SLACK}")


def body_problem(kind: tuple[str, str], frames: int, body: bytes) -> str | None:
    """Why a 200 body of a raw stream or file is not the complete audio (None: it is)."""
    fmt = kind[0]
    pcm_bytes = frames * SAMPLES_PER_FRAME * 2
    if fmt == "pcm":
        return None if len(body) == pcm_bytes else f"PCM {len(body)} bytes, expected {pcm_bytes}"
    return _wav_problem(body, pcm_bytes) if fmt == "wav" else _mp3_problem(body, frames, kind[1] == "file")


def sse_problem(kind: tuple[str, str], frames: int, events: list[dict]) -> str | None:
    """Why an SSE event list is not a complete stream (None: it is). SSE wav deltas carry bare PCM."""
    if not events or events[-1].get("type") != "speech.audio.done":
        last = events[-1] if events else None
        return f"SSE did not end with speech.audio.done: {str(last)[:200]}"
    tokens = events[-1].get("usage", {}).get("output_tokens")
    if tokens != frames:
        return f"speech.audio.done counts {tokens} frames, expected {frames}"
    audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1] if e.get("type") == "speech.audio.delta")
    if kind[0] == "mp3":
        return _mp3_problem(audio, frames, whole=False)
    want = frames * SAMPLES_PER_FRAME * 2
    return None if len(audio) == want else f"SSE audio {len(audio)} bytes, expected {want}"


def refusal_problem(resp: httpx.Response, body: bytes) -> str | None:
    """A 429/503 must say why in a JSON error body; a 429 must also say when to come back."""
    try:
        err = json.loads(body)["error"]
        if not (err["message"] and err["code"]):
            return f"{resp.status_code} error without message or code: {body[:200]!r}"
    except (ValueError, KeyError, TypeError):
        return f"{resp.status_code} without a JSON error body: {body[:200]!r}"
    if resp.status_code == 429 and not resp.headers.get("retry-after"):
        return "429 without Retry-After"
    return None


async def _exchange(http: httpx.AsyncClient, endpoint: str, body: dict, out: Outcome,
                    leave_after_chunks: int | None) -> None:
    kind = out.kind
    async with http.stream("POST", endpoint, json=body) as resp:
        out.status = resp.status_code
        if resp.status_code != 200:
            raw = await resp.aread()
            problem = refusal_problem(resp, raw) if resp.status_code in (429, 503) else \
                f"HTTP {resp.status_code}: {raw[:200]!r}"
            out.result, out.detail = ("bad", problem) if problem else ("rejected", "")
            return
        if kind[1] == "sse":
            events = []
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    if leave_after_chunks is not None and len(events) >= leave_after_chunks:
                        out.result = "disconnected"
                        return  # leaving the block closes the connection mid-stream
            problem = sse_problem(kind, out.frames, events)
        else:
            data = bytearray()
            chunks = 0
            async for part in resp.aiter_bytes():
                data += part
                chunks += 1
                if leave_after_chunks is not None and kind[1] == "stream" and chunks >= leave_after_chunks:
                    out.result = "disconnected"
                    return
            problem = body_problem(kind, out.frames, bytes(data))
        out.result, out.detail = ("bad", problem) if problem else ("ok", "")


async def speech_call(http: httpx.AsyncClient, kind: tuple[str, str], frames: int, text: str,
                      voice: str | None = "ryan", *, endpoint: str = "/v1/audio/speech", timeout_s: float = 120.0,
                      leave_after_chunks: int | None = None, leave_after_s: float | None = None,
                      extra: dict | None = None) -> Outcome:
    """Sends one request and judges it. A streamed request with `leave_after_chunks` leaves after that many
    chunks (SSE events); a whole-file one with `leave_after_s` leaves after that long if it is not done.
    `timeout_s` bounds the whole exchange: running past it is a hang, judged bad."""
    out = Outcome(kind, frames, "bad", started=time.monotonic())
    body = speech_body(kind, frames, text, voice, extra)
    leaving = leave_after_s is not None and kind[1] == "file"
    limit = min(timeout_s, leave_after_s) if leaving else timeout_s
    try:
        await asyncio.wait_for(_exchange(http, endpoint, body, out, leave_after_chunks), limit)
    except (TimeoutError, asyncio.TimeoutError):
        if leaving and limit < timeout_s:
            out.result = "disconnected"
        else:
            out.result, out.detail = "bad", f"no complete response within {timeout_s:g} s (hang)"
    except (httpx.HTTPError, ValueError) as e:  # a transport failure, or an SSE line that is not JSON
        out.result, out.detail = "bad", f"{type(e).__name__}: {e}"
    out.e2e_s = time.monotonic() - out.started
    return out
