"""Streams codec frames into PCM chunks, batching the decode of every stream in one call per chunk size.

Each stream owns a row of one preallocated state bank (conv tails, transposed-conv overhangs, the
attention window's keys and values, its frame position), so the chunks concatenate to the decode of the
whole utterance. A call gathers the rows of the streams it decodes, runs the decoder, and scatters the new
state back: no per-call concatenation or splitting of per-stream states. On CUDA the decoder runs on a
stream of its own, so a flush overlaps the talker step the engine has in flight, and the common chunk sizes
run as CUDA graphs per batch bucket.

The chunk schedule is `first_chunk_frames` (time to first audio), then chunks that double the audio already
sent (with `chunk_ramp`) up to `chunk_frames`; the tail goes out when the request finishes. The ramp is
what keeps a real-time player fed: after E frames (E x 80 ms of audio) the next chunk is E frames, which
the engine makes in far less than E x 80 ms, whereas a jump from 1 frame straight to 25 leaves the player
80 ms of audio to cover 25 frames of generation. In-context clones first run their reference codes through
their row (output dropped), batched with every clone opened since the last flush whose reference has the
same length; that equals the reference's decode-with-prefix-then-cut without re-decoding it.

Long utterances follow the reference's windowed decode (`CodecDecoder.decode`): windows of `window_frames`
frames (300), each decoded from a fresh state that starts `window_context` frames (25) before the window,
whose output is dropped. Streaming keeps that exactly with a second state per stream: it starts, fresh, at
the last `window_context` frames of the current window (fed the same codes, output dropped) and takes over
at the window's end. Positions count the reference frames of an in-context clone, as the reference decodes
reference and generated codes as one sequence. Chunks that touch a window's edge run stream by stream;
`window_frames=None` streams with full context instead (the whole-utterance `forward`), which differs from
the reference past 300 frames.

By default (`decode_every_step`) each call of `queue` decodes every frame that has arrived, one batched
call for all streams (one frame each, in the engine), and holds the PCM on the host until the stream's
next chunk is complete: the client sees the schedule's chunks, while the device runs one codec call per
engine step instead of one per chunk size due. On an H200 at 64 streams the chunk schedule alone made
five to seven small calls a step, whose launches and fixed costs took the GPU time of the talker's step
from 10 to 16 ms. Off, each chunk is decoded when it is due (the decode then waits for its frames).
"""

from __future__ import annotations

import collections
import contextlib
import heapq
import logging
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch

from legato.engine.codec_graphs import CodecGraphs, store_rows
from legato.engine.codec_schedule import HeldAudio, StreamSchedule, next_chunk_frames
from legato.layers.host import upload
from legato.models.qwen3_tts.codec_decoder import CodecDecoder
from legato.models.qwen3_tts.codec_streaming import CodecStreamState

log = logging.getLogger(__name__)


@dataclass
class _Readback:
    """Decoded audio on its way to the host (`pcm` is complete once `event` has fired), or, with no rows, the
    mark that the streams in `closing` have nothing more coming (each with its held audio, or None).
    `holds` (one per row, or None) are where held streams collect their PCM."""

    rids: list[str]
    n: int
    pcm: torch.Tensor | None  # [B, n * spf] float32 on the host
    event: torch.cuda.Event | None
    closing: dict[str, HeldAudio | None] = field(default_factory=dict)
    holds: list[HeldAudio] | None = None


@dataclass
class _Stream:
    row: int  # this stream's row of the state bank
    first_chunk_frames: int
    pending: list[torch.Tensor] = field(default_factory=list)  # [16] frames not decoded yet
    emitted_frames: int = 0
    position: int = 0  # frames run through the decoder, reference frames included
    prime: torch.Tensor | None = None  # reference codes [T, 16] still to run through the row
    next_window: CodecStreamState | None = None  # primed on the next window's left context
    held: HeldAudio | None = None  # with `decode_every_step`


class CodecStreamer:
    def __init__(self, decoder: CodecDecoder, schedule: StreamSchedule | None = None, capacity: int = 64,
                 graphs: bool = False) -> None:
        self.decoder = decoder
        self.schedule = schedule or StreamSchedule()
        self.streams: dict[str, _Stream] = {}
        weight = next(decoder.parameters())
        self.device = weight.device
        self.capacity = capacity
        # One row per stream, plus a scratch row that the padded rows of a graph replay read and write.
        self.bank = decoder.new_stream_state(capacity + 1)
        self._free_rows = list(range(capacity))
        self._fresh: list[int] = []  # rows to zero before their first use
        self._readbacks: collections.deque[_Readback] = collections.deque()  # audio on its way to the host
        self._backlog: dict[str, HeldAudio] = {}  # held streams with a complete chunk not delivered yet
        self.cuda_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.graphs = CodecGraphs()
        if graphs and self.cuda_stream is not None:
            self._capture_graphs()

    @property
    def scratch_row(self) -> int:
        return self.capacity

    def open(
        self, request_id: str, ref_code: torch.Tensor | None = None, first_chunk_frames: int | None = None
    ) -> None:
        """Starts a stream on a fresh row; an in-context clone's reference codes run at the next flush."""
        if not self._free_rows:
            self._grow()
        row = heapq.heappop(self._free_rows)
        self._fresh.append(row)
        prime = ref_code.to(torch.long) if ref_code is not None and ref_code.shape[0] > 0 else None
        first = first_chunk_frames or self.schedule.first_chunk_frames
        held = HeldAudio(first) if self.schedule.decode_every_step else None
        self.streams[request_id] = _Stream(row, first, prime=prime, held=held)

    def push(self, request_id: str, frame: torch.Tensor) -> None:
        self.streams[request_id].pending.append(frame)

    def close(self, request_id: str, keep_audio: bool = False) -> None:
        """Frees the stream's row; its audio still on the way is dropped unless `keep_audio` (a finished
        stream, whose last audio goes out with its closing mark)."""
        s = self.streams.pop(request_id, None)
        if s is not None:
            if s.held is not None and not keep_audio:
                s.held.dropped = True
            if s.row in self._fresh:
                self._fresh.remove(s.row)
            heapq.heappush(self._free_rows, s.row)

    @torch.inference_mode()
    def flush(self, finished: set[str]) -> tuple[dict[str, np.ndarray], dict[str, str]]:
        """Decodes every due chunk and waits for it; requests in `finished` flush their tail and are closed.

        Returns (new PCM by request, failures by request). A stream whose decode raises (alone: a
        batched call that raises is retried stream by stream) is closed and reported with the reason; the
        others still get their audio."""
        failed = self.queue(finished)
        audio, _closed = self.ready(wait=True)
        return audio, failed

    @torch.inference_mode()
    def queue(self, finished: set[str]) -> dict[str, str]:
        """Queues the decode of every due chunk (streams in `finished` flush their tail and are closed);
        the audio comes back through `ready`. Returns the failures by request, each closed at once."""
        failed: dict[str, str] = {}
        with self._on_stream():
            self._reset_fresh_rows()
            self._prime(failed)
            sched = self.schedule
            groups: dict[int, list[str]] = defaultdict(list)  # chunk frames -> streams, batched per size
            windowed: list[tuple[str, int]] = []  # chunks that reach a window's left context: one call each
            for rid, s in self.streams.items():
                if rid in failed:
                    continue
                n = len(s.pending)
                if sched.decode_every_step:  # all that has arrived; `ready` cuts it into chunks
                    if n == 0:
                        continue
                else:
                    need = next_chunk_frames(s.emitted_frames, s.first_chunk_frames, sched.chunk_frames,
                                             sched.chunk_ramp)
                    if not (rid in finished and n) and n < need:
                        continue
                    n = n if rid in finished else need
                (groups[n].append(rid) if self._in_one_window(s, n) else windowed.append((rid, n)))
            most = self.graphs.max_batch or len(self.streams)
            for n, rids in groups.items():
                for i in range(0, len(rids), most):  # one decoder call (or graph replay) each
                    self._decode_group(rids[i: i + most], n, finished, failed)
            for rid, n in windowed:
                st = self.streams[rid]
                try:
                    wav = self._decode_windowed(st, upload(torch.stack(st.pending[:n]), self.device))
                except Exception as e:
                    self._fail([rid], e, failed)
                    continue
                self._queue_readback([rid], n, wav[None], finished)
            for rid in finished & self.streams.keys():
                # Closed now (its row is free again; work queued later on this stream runs after its own);
                # reported closed once everything it has queued has come back.
                self._readbacks.append(_Readback([], 0, None, None, {rid: self.streams[rid].held}))
                self.close(rid, keep_audio=True)
        return failed

    def ready(self, wait: bool = False) -> tuple[dict[str, np.ndarray], set[str]]:
        """The audio that has come back, in order (waiting for all of it with `wait`), and the streams whose
        last audio is in it. Never blocks without `wait`."""
        audio: dict[str, list[np.ndarray]] = defaultdict(list)
        closed: set[str] = set()
        touched: dict[str, HeldAudio] = {}
        while self._readbacks:
            rb = self._readbacks[0]
            if rb.event is not None and not wait and not rb.event.query():
                break
            if rb.event is not None:
                rb.event.synchronize()
            self._readbacks.popleft()
            if rb.pcm is not None:
                pcm = rb.pcm.numpy()
                for i, (rid, w) in enumerate(zip(rb.rids, pcm, strict=True)):
                    held = rb.holds[i] if rb.holds is not None else None
                    if held is None:
                        audio[rid].append(w)
                    elif not held.dropped:
                        held.parts.append(w.copy())  # a view would keep the whole pinned buffer alive
                        held.frames += rb.n
                        touched[rid] = held
            touched.update((rid, held) for rid, held in rb.closing.items() if held is not None)
            closed |= rb.closing.keys()
        # One chunk per stream per call, as when each chunk was decoded when due; the rest waits in the backlog.
        for rid, held in {**self._backlog, **touched}.items():
            self._backlog.pop(rid, None)
            if held.dropped:
                continue
            if (part := held.take(self.schedule, self.decoder.samples_per_frame, everything=rid in closed)) is not None:
                audio[rid].append(part)
            if rid not in closed and held.due(self.schedule) > 0:
                self._backlog[rid] = held
        return {rid: np.concatenate(parts) if len(parts) > 1 else parts[0] for rid, parts in audio.items()}, closed

    @property
    def pending(self) -> bool:
        """Audio queued that has not come back through `ready`."""
        return bool(self._readbacks or self._backlog)

    def _queue_readback(self, rids: list[str], n: int, wav: torch.Tensor, finished: set[str]) -> None:
        """Counts `n` frames of each stream as emitted and queues their PCM [B, n * spf] to the host."""
        holds = [self.streams[rid].held for rid in rids] if self.schedule.decode_every_step else None
        for rid in rids:
            st = self.streams[rid]
            del st.pending[:n]
            st.emitted_frames += n
        if self.cuda_stream is None:
            self._readbacks.append(_Readback(rids, n, wav.float(), None, holds=holds))
            return
        pcm = wav.float().to("cpu", non_blocking=True)  # into pinned memory, filled when the event fires
        event = torch.cuda.Event()
        event.record(self.cuda_stream)
        self._readbacks.append(_Readback(rids, n, pcm, event, holds=holds))

    # --- decoding rows of the bank ----------------------------------------------------------------------

    def _decode_group(self, rids: list[str], n: int, finished: set[str], failed: dict[str, str]) -> None:
        """Decodes the next `n` frames of `rids` in one call. If that call raises, each stream is retried
        alone, so a fault fails only the streams that raise by themselves. That is sound because a call that
        raised left every row as it was: the eager call stores the new state after it returns, and a graph
        replay only raises on a device fault, which no retry survives anyway."""
        streams = [self.streams[r] for r in rids]
        try:
            codes = upload(torch.stack([torch.stack(s.pending[:n]) for s in streams]), self.device)
            wav = self._decode_rows([s.row for s in streams], codes, final=finished.issuperset(rids))
        except Exception as e:
            if len(rids) == 1:
                self._fail(rids, e, failed)
                return
            log.warning("codec decode of %d streams raised (%s); decoding them one by one", len(rids), e)
            for rid in rids:
                self._decode_group([rid], n, finished, failed)
            return
        for st in streams:
            st.position += n
        self._queue_readback(rids, n, wav[:, 0], finished)

    def _decode_rows(self, rows: list[int], codes: torch.Tensor, final: bool = False) -> torch.Tensor:
        """codes [B, n, 16] through the bank rows `rows` (each advanced by n frames) -> wav [B, 1, n * spf].

        `final`: these are the streams' last frames. Their state is never read again, so a tail of any length
        can replay the graph of a longer chunk, padded: every layer is causal, so the padding changes only
        samples past the tail, which are cut off."""
        b, n = codes.shape[0], codes.shape[1]
        most = self.graphs.max_batch
        if most and b > most:  # more streams than the largest graph: several replays of it
            return torch.cat([self._decode_rows(rows[i: i + most], codes[i: i + most], final).clone()
                              for i in range(0, b, most)])
        graph = self.graphs.exact(b, n)
        if graph is not None:
            return graph.replay(rows, codes)[:b]
        longer = self.graphs.longer(b, n) if final else None
        if longer is not None:
            padded = torch.zeros(b, longer.frames, 16, dtype=codes.dtype, device=codes.device)
            padded[:, :n] = codes
            return longer.replay(rows, padded)[:b, :, : n * self.decoder.samples_per_frame]
        pieces = self.graphs.pieces(b, n)
        if pieces:
            # A length no graph has (in-context priming of a whole reference, mostly) as several graph replays
            # back to back: the decoder is causal and its state carries across calls, so n frames in pieces
            # give what n frames in one call give. Each piece is copied out before a replay can reuse its buffer.
            wavs, at = [], 0
            for m in pieces:
                wavs.append(self.graphs.exact(b, m).replay(rows, codes[:, at: at + m])[:b].clone())
                at += m
            return torch.cat(wavs, dim=-1)
        index = upload(np.array(rows, dtype=np.int64), self.device)
        wav, new = self.decoder.stream_step(codes, self.bank.select(index))
        self._store(index, new)
        return wav

    def _store(self, index: torch.Tensor, state: CodecStreamState) -> None:
        store_rows(self.bank, index, state)

    def _reset_fresh_rows(self) -> None:
        if not self._fresh:
            return
        index = upload(np.array(self._fresh, dtype=np.int64), self.device)
        self.bank.position.index_fill_(0, index, 0)
        for buf in self.bank.buffers.values():
            buf.index_fill_(0, index, 0)
        self._fresh = []

    def _prime(self, failed: dict[str, str]) -> None:
        """Runs the reference codes of streams opened since the last flush, batched by reference length."""
        by_length: dict[int, list[str]] = defaultdict(list)
        for rid, s in self.streams.items():
            if s.prime is not None:
                by_length[s.prime.shape[0]].append(rid)
        for n, rids in by_length.items():
            streams = [self.streams[r] for r in rids]
            try:
                if self._in_one_window(streams[0], n):
                    primes = upload(torch.stack([s.prime for s in streams]), self.device)
                    self._decode_rows([s.row for s in streams], primes)
                    for s in streams:
                        s.position += n
                else:  # a reference longer than the first window: stream by stream, window by window
                    for s in streams:
                        self._decode_windowed(s, upload(s.prime, self.device))
            except Exception as e:
                self._fail(rids, e, failed)
                continue
            for s in streams:
                s.prime = None

    def _in_one_window(self, s: _Stream, n: int) -> bool:
        """True when `n` more frames touch neither the next window's left context nor its start."""
        window = self.schedule.window_frames
        if window is None:
            return True
        boundary = (s.position // window + 1) * window
        # The last frame must lie before the next window's left context, and before the window's end
        # itself (where the state is swapped) when there is no context.
        return s.position + n <= min(boundary - self.schedule.window_context, boundary - 1)

    def _decode_windowed(self, s: _Stream, codes: torch.Tensor) -> torch.Tensor:
        """Runs frames [n, 16] through one stream's state(s), window by window; returns its PCM [n * spf]."""
        index = upload(np.array([s.row], dtype=np.int64), self.device)
        state = self.bank.select(index)
        window, context = self.schedule.window_frames, self.schedule.window_context
        if window is None:
            wav, state = self.decoder.stream_step(codes[None], state)
            s.position += codes.shape[0]
            self._store(index, state)
            return wav[0, 0]
        pieces, i, n = [], 0, codes.shape[0]
        while i < n:
            boundary = (s.position // window + 1) * window
            context_start = boundary - context
            if s.position < context_start:
                m = min(n - i, context_start - s.position)
            else:  # inside the next window's left context: its state sees these frames too
                m = min(n - i, boundary - s.position)
                if s.next_window is None:
                    s.next_window = self.decoder.new_stream_state(1)
                _, s.next_window = self.decoder.stream_step(codes[None, i : i + m], s.next_window)
            wav, state = self.decoder.stream_step(codes[None, i : i + m], state)
            pieces.append(wav[0, 0])
            s.position += m
            i += m
            if s.position == boundary:
                state, s.next_window = s.next_window or self.decoder.new_stream_state(1), None
        self._store(index, state)
        return torch.cat(pieces)

    # --- bookkeeping ------------------------------------------------------------------------------------

    def _on_stream(self) -> contextlib.AbstractContextManager:
        if self.cuda_stream is None:
            return contextlib.nullcontext()
        # Codes and state come from the host and from this stream's own earlier work: no wait on the
        # talker's stream, so the codec runs beside the step the engine has in flight.
        return torch.cuda.stream(self.cuda_stream)

    def _grow(self) -> None:
        """Doubles the bank when more streams are open than it has rows (graphs keep the old scratch row)."""
        old, rows = self.bank, self.capacity
        self.capacity *= 2
        with self._on_stream(), torch.inference_mode():  # where every other use of the bank runs
            self.bank = self.decoder.new_stream_state(self.capacity + 1)
            index = torch.arange(rows + 1, device=self.device)
            self._store(index, old.select(index))
        self._free_rows = list(range(rows + 1, self.capacity))
        heapq.heappush(self._free_rows, rows)  # the old scratch row is an ordinary row now
        self.graphs.clear()  # they point at the old bank
        log.info("codec state bank grown to %d streams (CUDA graphs of the codec dropped)", self.capacity)

    def _fail(self, rids: list[str], e: Exception, failed: dict[str, str]) -> None:
        log.exception("codec decode failed for %d streams", len(rids))
        for rid in rids:
            failed[rid] = f"codec decode failed: {type(e).__name__}: {e}"
            self.close(rid)

    def _capture_graphs(self) -> None:
        sizes = set(self.schedule.chunk_sizes())
        if self.schedule.decode_every_step:
            sizes.add(1)  # what every step decodes
        self.graphs.capture(self.decoder, self.bank, self.scratch_row, self.capacity, sorted(sizes), self.cuda_stream)
        if self.graphs:
            with self._on_stream(), torch.inference_mode():
                self._reset_rows(range(self.capacity + 1))  # the captures wrote the scratch row: start clean

    def _reset_rows(self, rows) -> None:
        self._fresh = list(rows)
        self._reset_fresh_rows()
