"""Streams codec frames into PCM chunks, batching the decode of every stream in one call.

The decoder is `StreamingCodecDecoder`: each stream owns a slot of its bank (conv histories, attention keys
and values, frame position) that the decoder reads and writes in place, so the chunks concatenate to the
decode of the whole utterance and a call moves no state around. On CUDA the decoder runs on a stream of its
own, so a call overlaps the talker step the engine has in flight, and it runs as CUDA graphs per row-count
bucket and frame count (`codec_graphs.py`).

The chunk schedule is `first_chunk_frames` (time to first audio), then chunks that double the audio already
sent (with `chunk_ramp`) up to `chunk_frames`; the tail goes out when the request finishes. The ramp is
what keeps a real-time player fed: after E frames (E x 80 ms of audio) the next chunk is E frames, which
the engine makes in far less than E x 80 ms, whereas a jump from 1 frame straight to 25 leaves the player
80 ms of audio to cover 25 frames of generation. In-context clones first run their reference codes through
their slot (output dropped), batched with every clone opened since the last call whose reference has the
same length; that equals the reference's decode-with-prefix-then-cut without re-decoding it.

Long utterances follow the reference's windowed decode (`CodecDecoder.decode`): windows of `window_frames`
frames (300), each decoded from a fresh state that starts `window_context` frames (25) before the window,
whose output is dropped. Streaming keeps that exactly with a second slot per stream: fresh at the last
`window_context` frames of the current window, it is fed the same codes as a second row of the same call
(output dropped) and takes over at the window's end. Positions count the reference frames of an in-context
clone, as the reference decodes reference and generated codes as one sequence. `window_frames=None` streams
with full context instead (the whole-utterance `forward`), which differs from the reference past 300 frames.

By default (`decode_every_step`) each call of `queue` decodes every frame that has arrived, one batched
call for all streams (one frame each, in the engine), and holds the PCM on the host until the stream's
next chunk is complete: the client sees the schedule's chunks, while the device runs one codec call per
engine step instead of one per chunk size due. Off, each chunk is decoded when it is due.

A call that raises leaves every slot as it was: positions and history copies move on only at its end, and
the keys it wrote sit at positions the slot has not reached. So a batch that raises is retried stream by
stream and fails only the streams that raise alone.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch

from legato.engine.codec_graphs import CodecGraphs
from legato.engine.codec_readback import AudioReadback
from legato.engine.codec_schedule import HeldAudio, StreamSchedule, next_chunk_frames
from legato.layers.host import upload
from legato.models.qwen3_tts.codec_decoder import CodecDecoder
from legato.models.qwen3_tts.streaming_codec import StreamingCodecDecoder

log = logging.getLogger(__name__)

SCRATCH = 0  # the slot that padded rows of a graph replay read and write (never a stream's)


@dataclass
class _Stream:
    slot: int  # this stream's slot in the decoder's bank
    first_chunk_frames: int
    pending: list[np.ndarray] = field(default_factory=list)  # [16] int64 frames not decoded yet
    emitted_frames: int = 0
    position: int = 0  # frames run through the decoder, reference frames included
    prime: torch.Tensor | None = None  # reference codes [T, 16] still to run through the slot
    next_slot: int | None = None  # fresh at the next window's left context, fed the same frames
    held: HeldAudio | None = None  # with `decode_every_step`
    release: bool = False  # out of input (streaming text): frames go out as they come, not in whole chunks


class CodecStreamer:
    def __init__(self, decoder: CodecDecoder, schedule: StreamSchedule | None = None, capacity: int = 64,
                 graphs: bool = False, dtype: torch.dtype | None = None) -> None:
        """Streams through a `StreamingCodecDecoder` folded from `decoder`, in `dtype` (default: the decoder's),
        with slots for `capacity` streams (two each, for the window handover) before its bank grows."""
        self.decoder = decoder
        self.schedule = schedule or StreamSchedule()
        self.streams: dict[str, _Stream] = {}
        self.capacity = capacity
        self.codec = StreamingCodecDecoder(decoder, 2 * capacity + 1, dtype=dtype)
        self.device = self.codec.device
        self._free_slots = list(range(1, self.codec.slots))
        self._fresh: list[int] = []  # slots to reset before their first use
        self.cuda_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.readback = AudioReadback(self.schedule, decoder.samples_per_frame, self.cuda_stream)
        self.graphs = CodecGraphs()
        # With `decode_every_step`: at most this many of a stream's frames a call (None: all that have arrived).
        # A codec fed from elsewhere (split's codec worker) sets 1, so a burst of frames is decoded as `single`
        # decodes them, one a call: the same call shapes, the same float rounding, the same audio bytes.
        self.frames_per_call: int | None = None
        if graphs and self.cuda_stream is not None:
            self._capture_graphs()

    def open(
        self, request_id: str, ref_code: torch.Tensor | None = None, first_chunk_frames: int | None = None
    ) -> None:
        """Starts a stream on a fresh slot; an in-context clone's reference codes run at the next call."""
        prime = ref_code.to(torch.long) if ref_code is not None and ref_code.shape[0] > 0 else None
        first = first_chunk_frames or self.schedule.first_chunk_frames
        held = HeldAudio(first) if self.schedule.decode_every_step else None
        self.streams[request_id] = _Stream(self._take_slot(), first, prime=prime, held=held)

    def push(self, request_id: str, frame: np.ndarray | torch.Tensor) -> None:
        """Queues one frame of codes [16]. Held as a numpy row: a step's frames for hundreds of streams are
        then stacked for the device in one numpy call instead of a torch op per stream."""
        if isinstance(frame, torch.Tensor):
            frame = frame.detach().cpu().numpy()
        self.streams[request_id].pending.append(np.asarray(frame, dtype=np.int64))

    def close(self, request_id: str, keep_audio: bool = False) -> None:
        """Frees the stream's slots; its audio still on the way is dropped unless `keep_audio` (a finished
        stream, whose last audio goes out with its closing mark)."""
        s = self.streams.pop(request_id, None)
        if s is not None:
            if s.held is not None and not keep_audio:
                s.held.dropped = True
            self._give_slot(s.slot)
            if s.next_slot is not None:
                self._give_slot(s.next_slot)

    def holds(self, request_id: str) -> bool:
        """Whether anything of `request_id` is here: its stream, or audio (or its closing mark) on its way back."""
        return request_id in self.streams or self.readback.holds(request_id)

    def release(self, request_id: str, on: bool) -> None:
        """`on`: the request is out of input (its text has not arrived), so the audio of the frames it has goes
        out now instead of waiting for a chunk that will not fill; off again when its input comes."""
        s = self.streams.get(request_id)
        if s is None:
            return
        s.release = on
        if s.held is not None:
            if on:
                self.readback.release(request_id, s.held)
            else:
                s.held.release = False

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
            self._reset_fresh_slots()
            self._prime(failed)
            sched = self.schedule
            groups: dict[int, list[str]] = defaultdict(list)  # chunk frames -> streams, batched per size
            windowed: list[tuple[str, int]] = []  # chunks that cross a window's context start or end: one call each
            for rid, s in self.streams.items():
                if rid in failed:
                    continue
                n = len(s.pending)
                if sched.decode_every_step:  # all that has arrived; `ready` cuts it into chunks
                    if n == 0:
                        continue
                    n = min(n, self.frames_per_call or n)
                else:
                    need = next_chunk_frames(s.emitted_frames, s.first_chunk_frames, sched.chunk_frames,
                                             sched.chunk_ramp)
                    if not ((rid in finished or s.release) and n) and n < need:
                        continue
                    n = n if rid in finished or s.release else need
                (groups[n].append(rid) if self._uncut(s, n) else windowed.append((rid, n)))
            for n, rids in groups.items():
                self._decode_group(rids, n, finished, failed)
            for rid, n in windowed:
                st = self.streams[rid]
                try:
                    wav = self._decode_windowed(st, upload(np.stack(st.pending[:n]), self.device))
                except Exception as e:
                    self._fail([rid], e, failed)
                    continue
                self._queue_readback([rid], n, wav[None])
            for rid in finished & self.streams.keys():
                # Closed now (its slots are free again; work queued later on this stream runs after its own);
                # reported closed once everything it has queued has come back.
                self.readback.close(rid, self.streams[rid].held)
                self.close(rid, keep_audio=True)
        return failed

    def ready(self, wait: bool = False) -> tuple[dict[str, np.ndarray], set[str]]:
        """The audio that has come back, in order (waiting for all of it with `wait`), and the streams whose
        last audio is in it. Never blocks without `wait`."""
        return self.readback.take(wait)

    def backlog(self) -> bool:
        """Frames that arrived and wait for a decode call (only with `frames_per_call`, after a burst)."""
        return self.frames_per_call is not None and any(s.pending for s in self.streams.values())

    @property
    def pending(self) -> bool:
        """Audio queued that has not come back through `ready`."""
        return self.readback.pending

    def _queue_readback(self, rids: list[str], n: int, wav: torch.Tensor) -> None:
        """Counts `n` frames of each stream as emitted and queues their PCM [B, n * spf] to the host."""
        holds = [self.streams[rid].held for rid in rids] if self.schedule.decode_every_step else None
        for rid in rids:
            st = self.streams[rid]
            del st.pending[:n]
            st.emitted_frames += n
        self.readback.send(rids, n, wav, holds)

    # --- decoding rows ------------------------------------------------------------------------------------

    def _rows_of(self, s: _Stream) -> list[int]:
        """The slots a stream's next frames go through: its own, and the next window's while it is primed."""
        return [s.slot] if s.next_slot is None else [s.slot, s.next_slot]

    def _decode_group(self, rids: list[str], n: int, finished: set[str], failed: dict[str, str]) -> None:
        """Decodes the next `n` frames of `rids` (none crossing a window's context start or end) in one call,
        or several when they need more rows than the largest graph. If a call raises, each stream is retried
        alone, so a fault fails only the streams that raise by themselves (a call that raised changed no
        slot: see the module doc)."""
        streams = [self.streams[r] for r in rids]
        try:
            for s in streams:
                self._enter_window_context(s)
            if n == 1:  # every step's case with `decode_every_step`
                codes = np.stack([s.pending[0] for s in streams])[:, None]
            else:
                codes = np.stack([np.stack(s.pending[:n]) for s in streams])
            codes = upload(codes, self.device)
            slots, index = [], []
            for i, s in enumerate(streams):
                for slot in self._rows_of(s):
                    slots.append(slot)
                    index.append(i)
            if len(index) != len(streams):
                codes = codes[torch.tensor(index, device=codes.device)]
            most = self.graphs.max_batch or len(slots)
            # Each stream's own slot comes first among its rows: its audio is at its first row.
            first_row = [index.index(i) for i in range(len(streams))]
            wavs = [self._decode_rows(slots[i: i + most], codes[i: i + most], final=finished.issuperset(rids))
                    for i in range(0, len(slots), most)]
            wav = wavs[0] if len(wavs) == 1 else torch.cat(wavs)
            if len(index) != len(streams):
                wav = wav[torch.tensor(first_row, device=wav.device)]
        except Exception as e:
            if len(rids) == 1:
                self._fail(rids, e, failed)
                return
            log.warning("codec decode of %d streams raised (%s); decoding them one by one", len(rids), e)
            for rid in rids:
                self._decode_group([rid], n, finished, failed)
            return
        for st in streams:
            self._advance(st, n)
        self._queue_readback(rids, n, wav)

    def _decode_rows(self, slots: list[int], codes: torch.Tensor, final: bool = False) -> torch.Tensor:
        """codes [B, n, 16] through `slots` (each advanced by n frames) -> wav [B, n * spf].

        `final`: these are the streams' last frames. Their state is never read again, so a tail of any length
        can replay the graph of a longer chunk, padded: every layer is causal, so the padding changes only
        samples past the tail, which are cut off."""
        b, n = codes.shape[0], codes.shape[1]
        most = self.graphs.max_batch
        if most and b > most:  # more rows than the largest graph: several replays of it
            return torch.cat([self._decode_rows(slots[i: i + most], codes[i: i + most], final).clone()
                              for i in range(0, b, most)])
        graph = self.graphs.exact(b, n)
        if graph is not None:
            return graph.replay(slots, codes)[:b]
        longer = self.graphs.longer(b, n) if final else None
        if longer is not None:
            padded = torch.zeros(b, longer.frames, codes.shape[2], dtype=codes.dtype, device=codes.device)
            padded[:, :n] = codes
            return longer.replay(slots, padded)[:b, : n * self.codec.samples_per_frame]
        pieces = self.graphs.pieces(b, n)
        if pieces:
            # A length no graph has (in-context priming of a whole reference, mostly) as several graph replays
            # back to back: the decoder is causal and its state carries across calls, so n frames in pieces
            # give what n frames in one call give. Each piece is copied out before a replay can reuse its buffer.
            wavs, at = [], 0
            for m in pieces:
                wavs.append(self.graphs.exact(b, m).replay(slots, codes[:, at: at + m])[:b].clone())
                at += m
            return torch.cat(wavs, dim=-1)
        index = upload(np.array(slots, dtype=np.int64), self.device)
        return self.codec.step(index, codes)

    def _reset_fresh_slots(self) -> None:
        if not self._fresh:
            return
        self.codec.reset(upload(np.array(self._fresh, dtype=np.int64), self.device))
        self._fresh = []

    def _prime(self, failed: dict[str, str]) -> None:
        """Runs the reference codes of streams opened since the last call, batched by reference length."""
        by_length: dict[int, list[str]] = defaultdict(list)
        for rid, s in self.streams.items():
            if s.prime is not None:
                by_length[s.prime.shape[0]].append(rid)
        for n, rids in by_length.items():
            streams = [self.streams[r] for r in rids]
            try:
                if self._uncut(streams[0], n):
                    primes = upload(torch.stack([s.prime for s in streams]), self.device)
                    self._decode_rows([s.slot for s in streams], primes)
                    for s in streams:
                        self._advance(s, n)
                else:  # a reference that reaches the first window's context: stream by stream, piece by piece
                    for s in streams:
                        self._decode_windowed(s, upload(s.prime, self.device))
            except Exception as e:
                self._fail(rids, e, failed)
                continue
            for s in streams:
                s.prime = None

    def _uncut(self, s: _Stream, n: int) -> bool:
        """True when `n` more frames lie on one side of the next window's context start, and end by its end."""
        window = self.schedule.window_frames
        if window is None:
            return True
        boundary = (s.position // window + 1) * window
        start = boundary - self.schedule.window_context
        return s.position + n <= start or (s.position >= start and s.position + n <= boundary)

    def _enter_window_context(self, s: _Stream) -> None:
        """At the next window's context start, takes a fresh slot that the frames from here on go through too."""
        window, context = self.schedule.window_frames, self.schedule.window_context
        if window is None or not context or s.next_slot is not None:
            return
        if s.position >= (s.position // window + 1) * window - context:
            s.next_slot = self._take_slot()
            self._reset_fresh_slots()

    def _advance(self, s: _Stream, n: int) -> None:
        """Counts `n` decoded frames; at a window's end the next window's slot (or a fresh one) takes over."""
        s.position += n
        window = self.schedule.window_frames
        if window is not None and s.position % window == 0:
            old = s.slot
            if s.next_slot is not None:
                s.slot, s.next_slot = s.next_slot, None
            else:  # no left context: the next window starts from nothing
                s.slot = self._take_slot()
                self._reset_fresh_slots()
            self._give_slot(old)

    def _decode_windowed(self, s: _Stream, codes: torch.Tensor) -> torch.Tensor:
        """Runs frames [n, 16] through one stream, cut at each window's context start and end; returns its
        PCM [n * spf]."""
        pieces, i, n = [], 0, codes.shape[0]
        window, context = self.schedule.window_frames, self.schedule.window_context
        while i < n:
            if window is None:
                m = n - i
            else:
                boundary = (s.position // window + 1) * window
                start = boundary - context
                m = min(n - i, (start if s.position < start else boundary) - s.position)
            self._enter_window_context(s)
            rows = self._rows_of(s)
            piece = codes[None, i: i + m].expand(len(rows), -1, -1)
            pieces.append(self._decode_rows(rows, piece)[0].clone())
            self._advance(s, m)
            i += m
        return torch.cat(pieces)

    # --- bookkeeping ------------------------------------------------------------------------------------

    def _on_stream(self) -> contextlib.AbstractContextManager:
        if self.cuda_stream is None:
            return contextlib.nullcontext()
        # Codes and state come from the host and from this stream's own earlier work: no wait on the
        # talker's stream, so the codec runs beside the step the engine has in flight.
        return torch.cuda.stream(self.cuda_stream)

    def _take_slot(self) -> int:
        if not self._free_slots:
            self._grow()
        slot = heapq.heappop(self._free_slots)
        self._fresh.append(slot)
        return slot

    def _give_slot(self, slot: int) -> None:
        if slot in self._fresh:
            self._fresh.remove(slot)
        heapq.heappush(self._free_slots, slot)

    def _grow(self) -> None:
        """Doubles the bank when every slot is taken (the captured graphs point at the old one: dropped)."""
        old = self.codec.slots
        with self._on_stream(), torch.inference_mode():  # where every other use of the bank runs
            self.codec.resize(2 * old - 1)
        self._free_slots = list(range(old, self.codec.slots))
        self.capacity = (self.codec.slots - 1) // 2
        self.graphs.clear()
        log.info("codec slot bank grown to %d streams (CUDA graphs of the codec dropped)", self.capacity)

    def _fail(self, rids: list[str], e: Exception, failed: dict[str, str]) -> None:
        log.exception("codec decode failed for %d streams", len(rids))
        for rid in rids:
            failed[rid] = f"codec decode failed: {type(e).__name__}: {e}"
            self.close(rid)

    def _capture_graphs(self) -> None:
        sizes = set(self.schedule.chunk_sizes()) if not self.schedule.decode_every_step else set()
        m = 1
        while m <= self.codec.max_call_frames:  # every step's frame, and pieces of any longer run
            sizes.add(m)
            m *= 2
        sizes = {n for n in sizes if n <= self.codec.max_call_frames}
        self.graphs.capture(self.codec, SCRATCH, self.capacity, sorted(sizes), self.cuda_stream)
