"""The async streaming client: sends speech requests to any OpenAI-style `/v1/audio/speech` endpoint and
records, per request, when each chunk of raw PCM arrived.

Every request asks for `stream=true, stream_format="audio", response_format="pcm"` (s16le mono), so the body
is audio bytes and nothing else. Arrivals follow a Poisson process at `request_rate` (inf: all at once),
capped by `max_concurrency` in-flight requests; a request's clock starts when it is sent (see `metrics`).
Every failure (non-2xx, timeout, cut stream, connection error, empty audio) is recorded with its kind.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone

from . import MissingExtraError, wire
from .datasets import BenchRequest
from .metrics import RequestRecord
from .pace import Pace, frames_per_char


@dataclass(frozen=True)
class ClientConfig:
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "/v1/audio/speech"
    model: str | None = None  # sent as `model` when set
    max_concurrency: int | None = None  # None: no cap
    request_rate: float = math.inf  # requests/s of the Poisson arrival process
    num_warmups: int = 0
    timeout_s: float = 300.0  # whole-request deadline, first byte to last
    seed: int = 0  # seeds the arrival process
    sample_rate: int = 24000
    progress: bool = True
    api_key: str | None = None  # sent as `Authorization: Bearer` (a server run with --api-key)
    tick_s: float = 0.5  # how often the progress line and the pace check (pace.py) are brought up to date
    # Stop the run once the pace check shows its requests cannot meet the timeout (the bench's own default
    # concurrency, not one the user chose): what is still in flight or unsent fails as "stopped".
    stop_on_pace: bool = False

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        if not self.request_rate > 0:
            raise ValueError("request_rate must be > 0 (inf: all at once)")
        if self.timeout_s <= 0 or self.num_warmups < 0 or self.tick_s <= 0:
            raise ValueError("timeout_s and tick_s must be > 0 and num_warmups >= 0")


@dataclass
class RunOutput:
    records: list[RequestRecord]
    warmups: list[RequestRecord]
    duration_s: float
    started_at: str
    check_pcm: bytes | None = None  # the audio of one completed request, for a listening check
    check_utt_id: str | None = None
    warnings: list[dict] = field(default_factory=list)  # {"run", "at_s", "message"}: the pace check's, if any
    t0_s: float = 0.0  # time.perf_counter() at the run's start: the clock of `scheduled_s` and `sent_s`


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Planned send times (s from the run start): Poisson arrivals, the first at 0; all 0 when rate is inf."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


class _Connections:
    """One connection per request in flight (`wire.Connection`); taking one is what caps the concurrency.

    Not httpx's shared pool: httpcore scans every connection whenever a request starts or ends
    (`_assign_requests_to_connections`, each check going through anyio's typed attributes), a cost growing with
    the square of the load (40 % of the client's time at 64 streams), and its stack spent ~2 ms of CPU per
    request on the event loop that timestamps the chunks (docs/benchmarks.md, "the bench client")."""

    def __init__(self, cfg: ClientConfig, slots: int) -> None:
        import ssl

        tls = ssl.create_default_context()  # one for all: each would otherwise load the CA bundle (50 ms)
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else None
        self._idle: asyncio.Queue[wire.Connection] = asyncio.Queue()
        self._all = [wire.Connection(cfg.base_url, headers, tls) for _ in range(slots)]
        for c in self._all:
            self._idle.put_nowait(c)

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[wire.Connection]:
        conn = await self._idle.get()
        try:
            yield conn
        finally:
            self._idle.put_nowait(conn)

    async def aclose(self) -> None:
        for c in self._all:
            c.close()


def sample_rate_problem(streamed: object, expected: int, who: str) -> str | None:
    """Why a response's audio cannot be counted at `expected` Hz, `who` ("the server streamed") having said the
    rate `streamed` (an `X-Sample-Rate`, a session's `sample_rate`); None when it agrees or says nothing. The bench
    turns bytes into seconds at --sample-rate, so another rate would put every figure off by the ratio."""
    if streamed is None or str(streamed) == str(expected):
        return None
    return (f"{who} {streamed} Hz PCM and --sample-rate is {expected}: its audio seconds would be wrong "
            f"(give --sample-rate {streamed})")


class _Runner:
    def __init__(self, connections: _Connections, cfg: ClientConfig):
        self.connections = connections
        self.cfg = cfg
        self.check_pcm: bytes | None = None
        self.check_utt_id: str | None = None
        self.warnings: list[dict] = []
        self.stopped: str | None = None  # why the run was stopped early (`ClientConfig.stop_on_pace`)

    def body(self, req: BenchRequest) -> dict:
        body = {"model": self.cfg.model} if self.cfg.model else {}
        body.update(req.body)
        # Transport fields last: the metrics assume a raw s16le stream whatever the extra body says.
        body.update(stream=True, stream_format="audio", response_format="pcm")
        return body

    async def send(self, conn: wire.Connection, req: BenchRequest, rec: RequestRecord, t_run0: float,
                   capture: bool) -> None:
        t_sent = time.perf_counter()
        rec.sent_s = t_sent - t_run0
        audio = bytearray() if capture and self.check_pcm is None else None
        try:
            await asyncio.wait_for(self._stream(conn, req, rec, t_sent, audio), self.cfg.timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            rec.fail("timeout", f"no complete response within {self.cfg.timeout_s:g} s")
        except wire.TransportError as e:
            # After the headers a transport error means the audio stream was cut short.
            rec.fail("stream_cut" if rec.status is not None else "transport", str(e))
        except Exception as e:  # recorded as a failure of this request, never silently dropped
            rec.fail("client_error", f"{type(e).__name__}: {e}")
        if rec.end_s is None:
            rec.end_s = time.perf_counter() - t_sent
        rec.finalize(self.cfg.sample_rate)
        if rec.ok and audio is not None and self.check_pcm is None:
            self.check_pcm, self.check_utt_id = bytes(audio), rec.utt_id

    async def _stream(self, conn: wire.Connection, req: BenchRequest, rec: RequestRecord, t_sent: float,
                      audio: bytearray | None) -> None:
        resp = wire.Response(rec.chunk_times_s, rec.chunk_bytes, t_sent)  # filled as reads arrive (the pace check)
        resp.keep = audio is not None
        complete = False
        try:
            done = await conn.post(self.cfg.endpoint, self.body(req), resp)
            rec.status = resp.status
            await done
            complete = True
        finally:
            conn.finish(resp, complete)  # a response not read to its end leaves its connection unusable
            ctype = resp.headers.get("content-type", "")
            text = bytes(resp.body[:500]).decode("utf-8", errors="replace")
            error = resp.status is not None and not 200 <= resp.status < 300
            wrong_type = ctype.startswith(("application/json", "text/"))
            if error or wrong_type:  # a body that is not audio: its reads are no chunks
                rec.chunk_times_s.clear()
                rec.chunk_bytes.clear()
                if complete:
                    rec.fail(f"http_{resp.status}" if error else "bad_content_type",
                             text if error else f"{ctype}: {text}")
            elif complete and (wrong := sample_rate_problem(resp.headers.get("x-sample-rate"), self.cfg.sample_rate,
                                                                "the server streamed")):
                rec.fail("sample_rate_mismatch", wrong)
            elif complete:
                rec.end_s = resp.end - t_sent
                if audio is not None:
                    audio += resp.body

    async def run_all(self, reqs: list[BenchRequest], records: list[RequestRecord], capture: bool, desc: str,
                      pace: Pace | None = None) -> tuple[float, float]:
        """Sends every request on its schedule, each once it holds a connection (the cap); returns (the run's
        start on perf_counter, its duration)."""
        bar = _progress(len(reqs), desc, self.cfg.progress)
        pace = pace or Pace(records, self.cfg.timeout_s, self.cfg.sample_rate)
        t0 = time.perf_counter()
        finished: set[int] = set()

        async def one(req: BenchRequest, rec: RequestRecord) -> None:
            delay = t0 + rec.scheduled_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            async with self.connections.slot() as client:
                await self.send(client, req, rec, t0, capture)
            finished.add(rec.index)
            bar.update(1)

        everything = asyncio.ensure_future(asyncio.gather(*(one(q, r) for q, r in zip(reqs, records, strict=True))))
        ticker = asyncio.create_task(self._tick(bar, pace, t0, desc, everything))
        try:
            await everything
        except asyncio.CancelledError:
            if self.stopped is None:  # cancelled from outside, not by the pace check
                raise
            for rec in records:  # in flight or never sent: failed, with the reason the run stopped
                if rec.index not in finished:
                    rec.fail("stopped", self.stopped)
                    if rec.sent_s is not None and rec.end_s is None:
                        rec.end_s = time.perf_counter() - (t0 + rec.sent_s)
                    rec.finalize(self.cfg.sample_rate)
        finally:
            ticker.cancel()
            bar.close()
        return t0, time.perf_counter() - t0

    async def _tick(self, bar, pace: Pace, t0: float, run: str, everything: asyncio.Future) -> None:
        """Every `tick_s`: the frames received on the progress line, and the pace check, which warns once (and,
        with `stop_on_pace`, stops the run: `everything` is cancelled)."""
        expected = pace.expected_total()
        while True:
            await asyncio.sleep(self.cfg.tick_s)
            got = pace.total_frames()
            bar.set_postfix_str(f"{got:.0f}/{expected:.0f} frames" if expected else f"{got:.0f} frames")
            verdict = pace.check(time.perf_counter() - t0)
            if verdict is not None:
                at = time.perf_counter() - t0
                self.warnings.append({"run": run, "at_s": round(at, 3), "message": verdict.message()})
                bar.write(f"legato bench: warning: {verdict.message()}", file=sys.stderr)
                if self.cfg.stop_on_pace:
                    self.stopped = (f"stopped after {at:.0f} s: the run could not meet its timeout at this "
                                    f"concurrency (the server's decode slots); rerun with --max-concurrency "
                                    f"{verdict.fitting_concurrency}, or pass --max-concurrency to run at it anyway")
                    bar.write(f"legato bench: {self.stopped}", file=sys.stderr)
                    everything.cancel()
                    return


class _NoProgress:
    def update(self, n: int) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        pass

    def write(self, s: str, file=None) -> None:
        print(s, file=file or sys.stderr, flush=True)

    def close(self) -> None:
        pass


def _progress(total: int, desc: str, enabled: bool):
    if not enabled:
        return _NoProgress()
    try:
        from tqdm import tqdm
    except ImportError as e:
        hint = "the progress bar needs tqdm: pip install 'legato[bench]', or pass --no-progress"
        raise MissingExtraError(hint) from e
    return tqdm(total=total, desc=desc, unit="req", leave=False, file=sys.stderr)


def _records(reqs: list[BenchRequest], offsets: list[float]) -> list[RequestRecord]:
    return [RequestRecord(i, r.utt_id, r.text_chars, r.num_frames, scheduled_s=o)
            for i, (r, o) in enumerate(zip(reqs, offsets, strict=True))]


async def run_benchmark(cfg: ClientConfig, requests: list[BenchRequest], offsets: list[float] | None = None,
                        start_gate: Callable[[], None] | None = None) -> RunOutput:
    """Warm-ups (not measured), then every request once; returns finalized per-request records. `offsets`: the
    planned send times (default: `arrival_offsets` of the config); `start_gate` is called between the warm-ups
    and the run (a multi-process run waits there for its other processes, `multiproc.py`)."""
    if not requests:
        raise ValueError("no requests to send")
    # A connection per request the cap lets in flight, made before the clock starts: a request never waits for
    # one (that would count as latency), and none is shared (see _Connections).
    connections = _Connections(cfg, min(cfg.max_concurrency or len(requests), len(requests)))
    try:
        runner = _Runner(connections, cfg)
        warm_reqs = [requests[i % len(requests)] for i in range(cfg.num_warmups)]
        warmups = _records(warm_reqs, [0.0] * len(warm_reqs))
        if warm_reqs:
            await runner.run_all(warm_reqs, warmups, capture=False, desc="warm-up")
        if start_gate is not None:
            await asyncio.to_thread(start_gate)
        started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
        if offsets is None:
            offsets = arrival_offsets(len(requests), cfg.request_rate, cfg.seed)
        records = _records(requests, offsets)
        # The warm-ups' lengths tell the pace check how long a request of the model's own length runs.
        pace = Pace(records, cfg.timeout_s, cfg.sample_rate, frames_per_char(warmups))
        t0, duration = await runner.run_all(requests, records, capture=True, desc="bench", pace=pace)
    finally:
        await connections.aclose()
    return RunOutput(records, warmups, duration, started_at, runner.check_pcm, runner.check_utt_id,
                     runner.warnings, t0)


def run(cfg: ClientConfig, requests: list[BenchRequest]) -> RunOutput:
    return asyncio.run(run_benchmark(cfg, requests))
