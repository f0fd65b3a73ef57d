"""`legato bench serve --stream-text`: each prompt goes through the streaming-text WebSocket
(`/v1/audio/speech/stream`, docs/streaming-text.md) as an LLM would write it, token by token at a set rate.

- A "token" is a piece of about `token_chars` characters (4: what LLM tokenizers average on English text);
  words longer than that are cut inside, as subword tokens are, and a word's leading space rides with its first
  piece. Pieces leave at `tokens_per_s` (inf: all at once), then `input_text.end`.
- A request's clock starts at its first `input_text.append`: **TTFP is from the first text**. Its session
  (`session.update`: the request body but `input`, as PCM over binary frames) is set before that.
- **Stalls**: the player model of `metrics.py` (real time from the first audio, never pausing) gives each gap
  in the audio. A gap counts as a **text stall** when, as the player ran dry, the audio received already covered
  all the text sent by then (its share of the request's whole text, with one chunk of slack): the server had
  nothing more to speak. Any other gap is an **engine underrun**. The two add up to `underrun_s`.
- `cancel_after_s`: once a context has received that much audio it is cancelled (`response.cancel`), as a user
  barging in. **Cancel latency** is from the cancel to the `response.cancelled` reply; the audio that still
  arrived after the cancel is reported beside it (`cancel_tail_ms`, how late the last audio byte came).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from itertools import count

from .client import ClientConfig, RunOutput, _progress, _records, arrival_offsets, sample_rate_problem
from .datasets import BenchRequest
from .metrics import RequestRecord, percentile

STREAM_PATH = "/v1/audio/speech/stream"
_STALL_SLACK_S = 0.16  # two frames of audio: what a chunk boundary may hold back without a text shortage
_WORD = re.compile(r"\s*\S+")


@dataclass(frozen=True)
class TextFeed:
    tokens_per_s: float = 50.0  # inf: the whole text in one append
    token_chars: int = 4
    cancel_after_s: float | None = None  # audio seconds after which each context is cancelled (None: never)

    def __post_init__(self) -> None:
        if not self.tokens_per_s > 0 or self.token_chars < 1:
            raise ValueError("--text-rate must be > 0 (inf: all at once) and --token-chars >= 1")
        if self.cancel_after_s is not None and not self.cancel_after_s >= 0:
            raise ValueError("--cancel-after must be >= 0 seconds of audio")


@dataclass
class StreamTextRecord:
    """What one context did beyond `RequestRecord`: when its text left, and its stalls and cancel."""

    text_times_s: list[float]  # each append, from the first
    text_chars: list[int]  # characters sent by each append, cumulated
    text_stall_s: float = 0.0
    engine_underrun_s: float = 0.0
    cancelled: bool = False
    cancel_ack_s: float | None = None  # cancel -> response.cancelled
    cancel_tail_s: float | None = None  # cancel -> the last audio byte after it (0: none came)


def text_tokens(text: str, token_chars: int = 4) -> list[str]:
    """`text` cut into LLM-like pieces of at most `token_chars` non-space characters; they join to `text`."""
    pieces: list[str] = []
    for word in _WORD.findall(text):
        lead = len(word) - len(word.lstrip())
        body = word[lead:]
        cut = [body[i:i + token_chars] for i in range(0, len(body), token_chars)]
        cut[0] = word[:lead] + cut[0]
        pieces += cut
    tail = text[len("".join(pieces)):]
    if tail:  # trailing whitespace
        pieces = [*pieces[:-1], pieces[-1] + tail] if pieces else [tail]
    return pieces


def split_stalls(rec: RequestRecord, st: StreamTextRecord, sample_rate: int) -> None:
    """Splits the record's audio gaps into text stalls and engine underruns (module doc)."""
    if not rec.chunk_times_s or not st.text_chars:
        return
    bytes_per_s = 2 * sample_rate
    total_chars = st.text_chars[-1]
    total_audio = rec.total_bytes / bytes_per_s
    t0 = rec.chunk_times_s[0]
    received = rec.chunk_bytes[0] / bytes_per_s
    worst = 0.0
    for t, b in zip(rec.chunk_times_s[1:], rec.chunk_bytes[1:], strict=True):
        deficit = (t - t0) - received
        if deficit > worst + 1e-9:
            dry_at = t0 + received + worst  # when the player ran out
            sent = max((c for ts, c in zip(st.text_times_s, st.text_chars, strict=True) if ts <= dry_at), default=0)
            covered = total_audio * sent / total_chars if total_chars else 0.0
            if received + _STALL_SLACK_S >= covered and sent < total_chars:
                st.text_stall_s += deficit - worst
            else:
                st.engine_underrun_s += deficit - worst
            worst = deficit
        received += b / bytes_per_s


class _Socket:
    """One WebSocket per request in flight, reused request after request (a voice agent keeps its socket)."""

    def __init__(self, url: str, headers: dict | None) -> None:
        self.url, self.headers = url, headers
        self.ws = None

    async def get(self):
        if self.ws is None:
            from websockets.asyncio.client import connect

            self.ws = await connect(self.url, additional_headers=self.headers, max_size=None, open_timeout=30)
        return self.ws

    async def close(self) -> None:
        if self.ws is not None:
            with contextlib.suppress(Exception):
                await self.ws.close()
            self.ws = None


class StreamTextRunner:
    def __init__(self, cfg: ClientConfig, feed: TextFeed, slots: int) -> None:
        self.cfg, self.feed = cfg, feed
        url = re.sub(r"^http", "ws", cfg.base_url.rstrip("/")) + STREAM_PATH
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else None
        self.sockets: asyncio.Queue[_Socket] = asyncio.Queue()
        self._all = [_Socket(url, headers) for _ in range(slots)]
        for s in self._all:
            self.sockets.put_nowait(s)
        self.extras: dict[int, StreamTextRecord] = {}
        self._ids = count()

    async def aclose(self) -> None:
        for s in self._all:
            await s.close()

    def session(self, req: BenchRequest) -> dict:
        return session_fields(self.cfg.model, req)

    async def run_all(self, reqs: list[BenchRequest], records: list[RequestRecord], desc: str) -> tuple[float, float]:
        bar = _progress(len(reqs), desc, self.cfg.progress)
        t0 = time.perf_counter()

        async def one(req: BenchRequest, rec: RequestRecord) -> None:
            delay = t0 + rec.scheduled_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            sock = await self.sockets.get()
            try:
                await self.send(sock, req, rec, t0)
            finally:
                self.sockets.put_nowait(sock)
            bar.update(1)

        try:
            await asyncio.gather(*(one(q, r) for q, r in zip(reqs, records, strict=True)))
        finally:
            bar.close()
        return t0, time.perf_counter() - t0

    async def send(self, sock: _Socket, req: BenchRequest, rec: RequestRecord, t_run0: float) -> None:
        st = StreamTextRecord([], [])
        self.extras[rec.index] = st
        try:
            await asyncio.wait_for(self._context(sock, req, rec, st, t_run0), self.cfg.timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            rec.fail("timeout", f"no complete response within {self.cfg.timeout_s:g} s")
            await sock.close()  # the context may still run: a fresh socket for the next request
        except Exception as e:  # a closed socket, a refused handshake: this request's failure, never dropped
            rec.fail("transport", f"{type(e).__name__}: {e}")
            await sock.close()
        if rec.sent_s is not None and rec.end_s is None:
            rec.end_s = time.perf_counter() - (t_run0 + rec.sent_s)
        rec.finalize(self.cfg.sample_rate)
        if rec.ok and not st.cancelled:  # a cancelled context's audio does not cover its whole text
            split_stalls(rec, st, self.cfg.sample_rate)

    async def _context(self, sock: _Socket, req: BenchRequest, rec: RequestRecord, st: StreamTextRecord,
                       t_run0: float) -> None:
        ws = await sock.get()
        await ws.send(json.dumps({"type": "session.update", "session": self.session(req)}))
        updated = await self._until(ws, lambda e: e["type"] == "session.updated")
        wrong = sample_rate_problem((updated.get("session") or {}).get("sample_rate"), self.cfg.sample_rate,
                                    "the session streams")
        if wrong:  # as over HTTP (X-Sample-Rate)
            rec.fail("sample_rate_mismatch", wrong)
            return
        cid = f"b{next(self._ids)}"
        tokens = text_tokens(req.body["input"], self.feed.token_chars)
        t_sent = time.perf_counter()
        rec.sent_s = t_sent - t_run0
        feeder = asyncio.create_task(self._feed(ws, cid, tokens, t_sent, st))
        try:
            cancel_at: float | None = None
            got_s = 0.0
            while True:
                msg = await ws.recv()
                now = time.perf_counter() - t_sent
                if isinstance(msg, bytes):
                    n = msg[0]
                    if msg[1:1 + n].decode("ascii", "replace") != cid or len(msg) == 1 + n:
                        continue
                    rec.chunk_times_s.append(now)
                    rec.chunk_bytes.append(len(msg) - 1 - n)
                    got_s += (len(msg) - 1 - n) / (2 * self.cfg.sample_rate)
                    if cancel_at is not None:
                        st.cancel_tail_s = now - cancel_at
                    elif self.feed.cancel_after_s is not None and got_s >= self.feed.cancel_after_s:
                        feeder.cancel()
                        cancel_at, st.cancelled, st.cancel_tail_s = now, True, 0.0
                        await ws.send(json.dumps({"type": "response.cancel", "context_id": cid}))
                    continue
                event = json.loads(msg)
                if event.get("context_id") not in (cid, None):
                    continue
                if event["type"] == "error":
                    err = event.get("error") or {}
                    rec.fail(f"ws_{err.get('code')}", str(err.get("message")))
                    rec.status = 400
                    return
                if event["type"] == "response.cancelled":
                    st.cancel_ack_s = now - cancel_at if cancel_at is not None else None
                    rec.end_s, rec.status = now, 200
                    return
                if event["type"] == "response.audio.done":
                    rec.end_s, rec.status = now, 200
                    if event.get("finish_reason") not in ("stop", "length"):
                        rec.fail("finish_" + str(event.get("finish_reason")), json.dumps(event)[:300])
                    return
        finally:
            feeder.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await feeder

    async def _feed(self, ws, cid: str, tokens: list[str], t_sent: float, st: StreamTextRecord) -> None:
        rate = self.feed.tokens_per_s
        pieces = ["".join(tokens)] if math.isinf(rate) else tokens
        chars = 0
        for i, piece in enumerate(pieces):
            delay = t_sent + i / rate - time.perf_counter() if not math.isinf(rate) else 0.0
            if delay > 0:
                await asyncio.sleep(delay)
            chars += len(piece)
            st.text_times_s.append(time.perf_counter() - t_sent)
            st.text_chars.append(chars)
            await ws.send(json.dumps({"type": "input_text.append", "context_id": cid, "text": piece}))
        await ws.send(json.dumps({"type": "input_text.end", "context_id": cid}))

    async def _until(self, ws, predicate) -> dict:
        """Reads the socket's events until one satisfies `predicate`; a socket-wide error refuses the session."""
        while True:
            msg = await ws.recv()
            if isinstance(msg, bytes):
                continue
            event = json.loads(msg)
            if event["type"] == "error" and event.get("context_id") is None:
                err = event.get("error") or {}
                hint = ("; a reference clip inline rarely fits one message: save the voice (docs/voices.md) and give "
                        "--voice NAME" if err.get("code") == "message_too_large" else "")
                raise RuntimeError(f"session refused: {err.get('code')}: {err.get('message')}{hint}")
            if predicate(event):
                return event


def session_fields(model: str | None, req: BenchRequest) -> dict:
    """A request's `session.update` fields: its HTTP body but `input`, audio as PCM over binary frames."""
    body = {"model": model} if model else {}
    body.update({k: v for k, v in req.body.items() if k != "input"})
    body.update(response_format="pcm", audio_transport="binary")
    return body


def largest_session_message(model: str | None, requests: list[BenchRequest]) -> int:
    """Bytes of the largest `session.update` message the requests send (a reference clip inline makes it big)."""
    return max((len(json.dumps({"type": "session.update", "session": session_fields(model, r)}).encode())
                for r in requests), default=0)


async def run_stream_text(cfg: ClientConfig, feed: TextFeed, requests: list[BenchRequest]
                          ) -> tuple[RunOutput, dict[int, StreamTextRecord]]:
    """Warm-ups, then every request once through the WebSocket; the records and each one's stream-text extras."""
    if not requests:
        raise ValueError("no requests to send")
    runner = StreamTextRunner(cfg, feed, min(cfg.max_concurrency or len(requests), len(requests)))
    try:
        warm_reqs = [requests[i % len(requests)] for i in range(cfg.num_warmups)]
        warmups = _records(warm_reqs, [0.0] * len(warm_reqs))
        if warm_reqs:
            await runner.run_all(warm_reqs, warmups, desc="warm-up")
        runner.extras.clear()
        started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
        records = _records(requests, arrival_offsets(len(requests), cfg.request_rate, cfg.seed))
        t0, duration = await runner.run_all(requests, records, desc="bench")
    finally:
        await runner.aclose()
    return RunOutput(records, warmups, duration, started_at, t0_s=t0), dict(runner.extras)


def stream_text_summary(feed: TextFeed, records: list[RequestRecord], extras: dict[int, StreamTextRecord]) -> dict:
    """The run's stream-text figures: stalls by cause, and the cancels' latencies (ms)."""
    done = [r for r in records if r.ok]
    ex = [extras[r.index] for r in done if r.index in extras]

    def stats(values: list[float], scale: float = 1.0) -> dict:
        if not values:
            return {"n": 0}
        return {"n": len(values), "mean": scale * sum(values) / len(values),
                "p50": scale * percentile(values, 50.0), "p99": scale * percentile(values, 99.0)}

    cancels = [e for e in ex if e.cancelled]
    # Stalls are split by cause only where the audio covers the whole text: a cancelled context's are not.
    whole = [e for e in ex if not e.cancelled]
    return {
        "tokens_per_s": feed.tokens_per_s, "token_chars": feed.token_chars, "cancel_after_s": feed.cancel_after_s,
        "completed": len(done), "uncancelled": len(whole),
        "text_stall_s": stats([e.text_stall_s for e in whole]),
        "engine_underrun_s": stats([e.engine_underrun_s for e in whole]),
        "requests_with_text_stalls": sum(e.text_stall_s > 0 for e in whole),
        "requests_with_engine_underruns": sum(e.engine_underrun_s > 0 for e in whole),
        "cancelled": len(cancels),
        "cancel_ack_ms": stats([e.cancel_ack_s for e in cancels if e.cancel_ack_s is not None], 1000.0),
        "cancel_tail_ms": stats([e.cancel_tail_s for e in cancels if e.cancel_tail_s is not None], 1000.0),
    }


def summary_line(s: dict) -> str:
    def ms(d: dict) -> str:
        return f"p50 {d['p50']:.0f} / p99 {d['p99']:.0f} ms" if d.get("n") else "-"

    whole = s.get("uncancelled", s["completed"])
    line = (f"stream-text ({s['tokens_per_s']:g} tokens/s of {s['token_chars']} chars): text stalls in "
            f"{s['requests_with_text_stalls']} of {whole} {'uncancelled ' if s['cancelled'] else ''}requests, "
            f"engine underruns in {s['requests_with_engine_underruns']}")
    if s["cancelled"]:
        line += (f"; {s['cancelled']} cancelled (their stalls not split by cause; the table's underrun_s counts "
                 f"them): cancel_ack_ms {ms(s['cancel_ack_ms'])}, cancel_tail_ms {ms(s['cancel_tail_ms'])}")
    return line
