"""The codec side of `split`, synchronous: a codec-only engine that turns streamed code frames into PCM.

`CodecEngine` is plain, like `Engine`: `open` a stream per request, `push` frames as the talker makes them, then
`end` it (its tail is decoded) or `abort` it; `step()` decodes every stream's due chunks, batched through the
engine's own `CodecStreamer`. The chunk schedule (`StreamSchedule`) is the one `single` streams:
`first_chunk_frames`, then `chunk_frames` (or the ramp up to it), the tail when the stream ends, in the same decode
windows. Frames that arrive in a burst are still cut at those boundaries, so the audio equals `single`'s (up to
float rounding of other batch make-ups). `codec_worker.py` runs one on a thread for the asyncio side.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from legato.engine.codec_graphs import graph_batches
from legato.engine.codec_streamer import CodecStreamer, StreamSchedule
from legato.models.qwen3_tts.codec_decoder import CodecDecoder
from legato.models.qwen3_tts.config import load_speech_tokenizer_config
from legato.models.qwen3_tts.loader import load_into, read_safetensors

EMPTY_PCM = np.zeros(0, np.float32)


def load_codec_decoder(model_dir: str | Path, device: str, dtype: torch.dtype = torch.float32) -> CodecDecoder:
    """Only the codec decoder of a model directory (`speech_tokenizer/`: config and `decoder.*` weights), for
    a codec worker that needs neither the talker nor the codec encoder. Keep it in fp32: the streamer folds
    its serving copy from it in the serving dtype."""
    path = Path(model_dir)
    decoder = CodecDecoder(load_speech_tokenizer_config(path).decoder_config)
    source = path / "speech_tokenizer" / "model.safetensors"
    tensors = read_safetensors(path / "speech_tokenizer")
    load_into(decoder, {k[len("decoder."):]: v for k, v in tensors.items() if k.startswith("decoder.")}, source)
    return decoder.to(device=device, dtype=dtype).eval()


@dataclass
class CodecOutput:
    """What one step produced for one stream: the PCM of `frames` new frames; the last says how it ended."""

    request_id: str
    audio: np.ndarray  # float32 PCM (empty on a failure, an abort or an empty tail)
    frames: int
    finished: bool = False
    error: str | None = None  # a failed or aborted stream (always finished)
    aborted: bool = False
    code: str | None = None  # CodecError.code of the failure


class CodecEngine:
    """Streams of code frames -> PCM chunks. Not thread-safe: one thread owns it."""

    def __init__(self, decoder: CodecDecoder, schedule: StreamSchedule | None = None, capacity: int = 64,
                 dtype: torch.dtype | None = None, graphs: bool = False) -> None:
        """`capacity`, `dtype` and `graphs` are the `CodecStreamer`'s (as the engine's: CUDA graphs on CUDA)."""
        self.streamer = CodecStreamer(decoder, schedule, capacity, graphs=graphs, dtype=dtype)
        if self.streamer.schedule.decode_every_step:  # frames come in bursts here, one at a time in `single`
            self.streamer.frames_per_call = 1
        self._pushed: dict[str, int] = {}  # frames received per open stream
        self._ended: set[str] = set()
        self.frames_decoded = 0
        self.failures: Counter[str] = Counter()

    @property
    def device(self) -> torch.device:
        return self.streamer.device

    @property
    def num_streams(self) -> int:
        return len(self._pushed)

    def open(self, request_id: str, ref_code: torch.Tensor | None = None,
             first_chunk_frames: int | None = None) -> None:
        """Starts a stream; an in-context clone's reference codes prime its state (this runs the decoder).
        Raises ValueError for a duplicate id or a bad chunk size, and whatever priming raises."""
        if request_id in self._pushed:
            raise ValueError(f"duplicate codec stream {request_id!r}")
        if first_chunk_frames is not None and not (isinstance(first_chunk_frames, int) and first_chunk_frames >= 1):
            raise ValueError("first_chunk_frames must be an integer >= 1")
        self.streamer.open(request_id, ref_code, first_chunk_frames)
        self._pushed[request_id] = 0

    def push(self, request_id: str, codes: np.ndarray | torch.Tensor) -> bool:
        """Appends frames [n, 16]; False for a stream that is not open (aborted, failed, ended)."""
        if request_id not in self._pushed or request_id in self._ended:
            return False
        codes = torch.as_tensor(codes, dtype=torch.long)
        if codes.ndim != 2 or codes.shape[1] != 16:
            raise ValueError(f"codes must be [n, 16], got {list(codes.shape)}")
        for frame in codes:
            self.streamer.push(request_id, frame)
        self._pushed[request_id] += codes.shape[0]
        return True

    def end(self, request_id: str) -> bool:
        """No more frames: the next step decodes the tail and finishes the stream."""
        if request_id not in self._pushed:
            return False
        self._ended.add(request_id)
        return True

    def abort(self, request_id: str) -> bool:
        self._ended.discard(request_id)
        self.streamer.close(request_id)
        return self._pushed.pop(request_id, None) is not None

    def warm_up(self) -> float:
        """Throwaway streams through the codec before it serves: for each row-count bucket of its CUDA graphs, that
        many streams of every chunk size and a tail, decoded as a burst is. The first burst then pays for none of
        what a first use costs (each graph's first replay, a pinned host buffer of each size for the read-back,
        the tail's path). Only while no stream is open; leaves none open and the counters at zero. Returns the
        seconds it took."""
        if self._pushed:
            raise RuntimeError("the codec warms up only while no stream is open")
        started = time.perf_counter()
        frames = sum(self.streamer.schedule.chunk_sizes()) + 1
        codes = np.zeros((frames, 16), np.int64)
        capacity = self.streamer.capacity
        for rows in sorted({min(b, capacity) for b in graph_batches(capacity)}):
            rids = [f"__warm_up_{rows}_{i}__" for i in range(rows)]
            for rid in rids:
                self.open(rid)
                self.push(rid, codes)
                self.end(rid)
            failed: list[str] = []
            for _ in range(frames + 2):  # one step normally ends them all; the bound keeps a stuck codec from hanging
                if not self._pushed:
                    break
                failed += [out.error for out in self.step() if out.error]
            if failed or self._pushed:  # not expected: a codec that cannot decode zeros cannot serve
                raise RuntimeError(f"codec warm-up failed: {failed[:1] or 'streams left open'}")
        self.frames_decoded = 0
        self.failures.clear()
        return time.perf_counter() - started

    def step(self) -> list[CodecOutput]:
        """Decodes every due chunk of every stream (several per stream after a burst, in schedule order, one
        frame a call where `single` decodes every step), then the tails of ended streams."""
        return [out for outputs in self.steps() for out in outputs]

    def steps(self) -> Iterator[list[CodecOutput]]:
        """`step`'s decode calls one at a time: each call's outputs as soon as its audio is back. After a burst
        (or a stall) a step decodes a backlog frame by frame, and a stream's first chunk need not wait for the
        whole backlog to be decoded."""
        streams = self.streamer.streams
        spf = self.streamer.decoder.samples_per_frame
        while True:
            outputs: list[CodecOutput] = []
            audio, failed = self.streamer.flush(set())
            if not audio and not failed and not self.streamer.backlog():
                break
            for rid, pcm in audio.items():
                n = pcm.size // spf
                self.frames_decoded += n
                outputs.append(CodecOutput(rid, pcm, n))
            outputs += self._failed(failed)
            yield outputs
        ended = self._ended & streams.keys()
        if ended:
            audio, failed = self.streamer.flush(ended)  # decodes the tails and closes these streams
            outputs = self._failed(failed)
            for rid in sorted(ended - failed.keys()):
                n = audio[rid].size // spf if rid in audio else 0
                self._pushed.pop(rid)
                self._ended.discard(rid)
                self.frames_decoded += n
                outputs.append(CodecOutput(rid, audio.get(rid, EMPTY_PCM), n, finished=True))
            yield outputs

    def _failed(self, failed: dict[str, str]) -> list[CodecOutput]:
        for rid in failed:
            self.abort(rid)
            self.failures["codec error"] += 1
        return [CodecOutput(rid, EMPTY_PCM, 0, finished=True, error=why) for rid, why in failed.items()]
