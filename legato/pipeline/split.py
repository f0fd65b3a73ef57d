"""`split`: a talker worker streams code frames to a codec worker, which streams the audio.

The talker is any `EngineClient` whose engine runs with `emit_audio=False` (a thread, or a worker process):
it builds prompts, runs the talker and code predictor, and streams each step's codes with no audio. The
codec worker decodes every request's codes on the chunk schedule of `single`, batched across requests: a
thread of this process (`LocalCodecClient`), or with process workers a process of its own
(`ProcessCodecClient`, the codes crossing as `[n, 16]` int64 frames). `SplitClient` joins the two per
request: the talker's codes flow into a codec stream, and each chunk it yields carries the new audio and the
codes that came with it, so a seeded request's codes and audio equal what `single` gives.

In-context voice clones given as reference audio have their reference codes extracted first (by the talker
worker, which holds the codec encoder), so the codec worker can prime its state with them, as `single` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from legato.engine.codec_schedule import StreamSchedule
from legato.engine.config import EngineConfig
from legato.models.qwen3_tts.codec_decoder import CodecDecoder
from legato.models.qwen3_tts.inputs import VoiceFeatures
from legato.models.qwen3_tts.loader import LoadedModel
from legato.pipeline.client import (
    EngineClient,
    EngineStats,
    HeldText,
    RequestRejected,
    StreamChunk,
    SynthesisRequest,
    refused_stream,
)
from legato.pipeline.codec_engine import load_codec_decoder
from legato.pipeline.codec_worker import CodecChunk, CodecError, LocalCodecClient, codec_engine_options
from legato.pipeline.launchers import Launcher, WorkerPlan

if TYPE_CHECKING:
    import torch

    from legato.pipeline.codec_process import CodecFeed, ProcessCodecClient

_EMPTY = np.zeros(0, np.float32)


class _TalkerEnded(Exception):
    """The talker's request ended without its codes being complete (abort, error): no tail to decode."""

    def __init__(self, chunk: StreamChunk) -> None:
        super().__init__(chunk.error or chunk.finish_reason)
        self.chunk = chunk


@dataclass
class _Progress:
    """One request's talker side as seen so far: codes not yet passed on, the latest chunk's counters, and the
    talker's stages of its first codes until the first audio carries them."""

    codes: list[np.ndarray] = field(default_factory=list)
    last: StreamChunk | None = None
    stages: dict[str, float] | None = None
    first_codes_at: float | None = None  # perf_counter() when the first codes came: the start of `codec`
    stamped: bool = False  # the first audio has its stages

    def took(self, chunk: StreamChunk) -> None:
        self.last = chunk
        if chunk.codes is not None and chunk.codes.size:
            self.codes.append(chunk.codes)
            if self.first_codes_at is None:
                self.first_codes_at = time.perf_counter()
                self.stages = chunk.stages

    def chunk(self, audio: np.ndarray, finished: bool = False, reason: str | None = None,
              error: str | None = None, error_code: str | None = None, retryable: bool = False,
              codec_stages: dict[str, float] | None = None) -> StreamChunk:
        codes = np.concatenate(self.codes) if self.codes else np.zeros((0, 16), np.int64)
        self.codes = []
        last = self.last or StreamChunk(_EMPTY, 0)
        if finished and reason is None:
            reason = last.finish_reason
        return StreamChunk(audio=audio, num_frames=last.num_frames, num_prompt_tokens=last.num_prompt_tokens,
                           finished=finished, finish_reason=reason, error=error, error_code=error_code,
                           retryable=retryable, seed=last.seed, codes=codes,
                           stages=self._first_audio_stages(codec_stages) if audio.size else None)

    def _first_audio_stages(self, codec_stages: dict[str, float] | None) -> dict[str, float] | None:
        """Once, on the first audio: the talker's stages to its first codes, `codec` from then to now, and what a
        codec worker process measured of that (`codec_worker`)."""
        if self.first_codes_at is None or self.stamped:
            return None
        self.stamped = True
        return {**(self.stages or {}), **(codec_stages or {}), "codec": time.perf_counter() - self.first_codes_at}


class _CodesToCodec:
    """A worker-process talker's items for one request (its `StreamSink`), on the event loop as they come: the
    counters to `progress`, the codes to the codec feed, the talker's end to the feed (the last frames, or the
    failure the reader then raises: `_TalkerEnded`, or the talker's refusal)."""

    def __init__(self, progress: _Progress, feed: CodecFeed) -> None:
        self.progress, self.feed = progress, feed
        self.done = False  # the talker's end was passed on, or the reader left: later items are dropped

    def put_nowait(self, item: StreamChunk | RequestRejected) -> None:
        if self.done:
            return
        try:
            if isinstance(item, RequestRejected):
                self.done = True
                self.feed.fail(item)
                return
            self.progress.took(item)
            if item.codes is not None and item.codes.size:
                self.feed.push(item.codes)
            if item.finished:
                self.done = True
                if item.finish_reason in ("stop", "length"):
                    self.feed.end()
                else:
                    self.feed.fail(_TalkerEnded(item))
        except Exception as e:  # codes of a bad shape: this stream fails, with the reason, and no other
            self.done = True
            self.feed.fail(e)


class SplitClient(EngineClient):
    """A talker `EngineClient` (its engine built with `emit_audio=False`) and a codec worker, as one engine.
    Aborts reach both; voices, stats (the talker's KV, plus codec failures) and model info are the talker's."""

    def __init__(self, talker: EngineClient, codec: LocalCodecClient | ProcessCodecClient) -> None:
        self.talker = talker
        self.codec = codec
        # Worker processes on both sides (a ProcessEngineClient talker, a ProcessCodecClient): the talker's chunks
        # are pushed into the codec's feeds (_decode_pushed) rather than read by a task per stream woken for every
        # frame (docs/benchmarks.md: front_path.py's paced split at c=64 on a CPU, the front's CPU a request
        # 4.1-4.3 -> 3.6-3.8 ms, server TTFP p50 51-63 -> 46 ms).
        self._pushes = hasattr(talker, "push_generate") and hasattr(codec, "open_feed")
        # Streaming text of a text_open request whose talker stream is not open yet (its voice may still be
        # extracted, or the codec not yet reading): held in order, handed on when the talker has it.
        self._text = HeldText()

    @property
    def info(self):  # a worker process learns its model info at start-up
        return self.talker.info

    async def start(self) -> None:
        await asyncio.gather(self.talker.start(), self.codec.start())

    async def stop(self, grace_s: float = 10.0) -> None:
        # The talker first: the requests it finishes in its grace end their codec streams, then the codec
        # worker drains them.
        await self.talker.stop(grace_s)
        await self.codec.stop(grace_s)

    @property
    def takes_text_input(self) -> bool:
        return self.talker.takes_text_input

    async def append_text(self, request_id: str, text: str, close: bool = False) -> None:
        if not await self._text.append(request_id, text, close):  # ended: the talker drops it
            await self.talker.append_text(request_id, text, close)

    def generate(self, req: SynthesisRequest) -> AsyncIterator[StreamChunk]:
        # A text_open request takes text from this call on, before its stream is read.
        if req.text_open and not self._text.hold(req.request_id):
            return refused_stream(RequestRejected(409, f"duplicate request id {req.request_id!r}"))
        return self._generate(req)

    async def _talker_stream(self, req: SynthesisRequest) -> AsyncIterator[StreamChunk]:
        chunks = self.talker.generate(req)
        await self._text.hand_on(req.request_id, self.talker)
        return chunks

    async def _generate(self, req: SynthesisRequest) -> AsyncIterator[StreamChunk]:
        try:
            # Closed with this generator, not when the loop finalizes it: a client that leaves has both halves
            # of its request abandoned before a retry under its id looks for them.
            async with contextlib.aclosing(self._generate_audio(req)) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            self._text.forget(req.request_id)

    async def _generate_audio(self, req: SynthesisRequest) -> AsyncIterator[StreamChunk]:
        if req.handoff_only:  # a prefill role has no audio: the talker answers it alone
            async with contextlib.aclosing(self.talker.generate(req)) as chunks:
                async for chunk in chunks:
                    yield chunk
            return
        if not self.codec.is_alive():
            raise RequestRejected(503, "the codec worker is not running")
        req = await self._with_reference_codes(req)
        inp = req.input
        ref_code = None if inp.x_vector_only else inp.ref_code
        progress = _Progress()

        async def frames() -> AsyncIterator[np.ndarray]:
            async with contextlib.aclosing(await self._talker_stream(req)) as chunks:
                async for chunk in chunks:
                    progress.took(chunk)
                    if chunk.codes is not None and chunk.codes.size:
                        yield chunk.codes
                    if chunk.finished and chunk.finish_reason not in ("stop", "length"):
                        raise _TalkerEnded(chunk)

        try:
            if self._pushes:
                decoding = self._decode_pushed(req, ref_code, progress)
            else:
                decoding = self.codec.decode(req.request_id, frames(), ref_code, req.first_chunk_frames)
            async with contextlib.aclosing(decoding) as pieces:
                async for piece in pieces:
                    yield progress.chunk(piece.audio, finished=piece.last, codec_stages=piece.stages)
        except _TalkerEnded as e:
            # The talker's end as it was: its code (the client's fault) and whether another worker could run it
            yield progress.chunk(_EMPTY, finished=True, reason=e.chunk.finish_reason, error=e.chunk.error,
                                 error_code=e.chunk.error_code, retryable=e.chunk.retryable)
        except CodecError as e:
            if progress.last is None and not self.codec.is_alive():  # refused before anything ran
                raise RequestRejected(503, e.reason, code=e.code) from None
            await self.talker.abort(req.request_id, e.reason if e.aborted else "codec failed")
            yield progress.chunk(_EMPTY, finished=True, reason="abort" if e.aborted else "error", error=e.reason)

    async def _decode_pushed(self, req: SynthesisRequest, ref_code: torch.Tensor | None,
                             progress: _Progress) -> AsyncIterator[CodecChunk]:
        """`codec.decode` of the talker's codes, with both workers processes: the talker's chunks are pushed into
        the codec stream's feed as they come (`_CodesToCodec`), not read by a task per stream. Each talker step
        reaches every stream's feed in one pass of the event loop, and the frames cross on together."""
        feed = await self.codec.open_feed(req.request_id, ref_code, req.first_chunk_frames)
        to_codec = _CodesToCodec(progress, feed)
        leave, reading, why = None, False, "client disconnected"
        try:
            try:
                leave = await self.talker.push_generate(req, to_codec)
            except RequestRejected as e:  # the codec stream is open: failing it ends it, and the reader raises e
                to_codec.done = True
                feed.fail(e)
            await self._text.hand_on(req.request_id, self.talker)
            reading = True
            async with contextlib.aclosing(self.codec.read(feed)) as pieces:
                async for piece in pieces:
                    yield piece
        except CodecError as e:
            why = e.reason if e.aborted else "codec failed"  # the talker's abort says why (its stats count it)
            raise
        finally:
            if not to_codec.done:  # left before the talker's end (client gone, codec failed): abort it there
                to_codec.done = True
                if leave is not None:
                    leave(why)
            if not reading:  # cancelled before the codec stream was read: nothing else ends it in the worker
                feed.fail(CodecError(why))

    async def _with_reference_codes(self, req: SynthesisRequest) -> SynthesisRequest:
        """An in-context clone given as reference audio, as the equivalent saved voice (x-vector + codes):
        the codec worker needs the codes; the talker then builds the very same prompt from them."""
        inp = req.input
        if inp.ref_audio is None or inp.x_vector_only or inp.speaker_embedding is not None:
            return req  # nothing to extract (or a conflict the talker reports)
        voice = await self.talker.extract_voice(inp.ref_audio, inp.ref_sample_rate)
        inp = dataclasses.replace(inp, ref_audio=None, speaker_embedding=voice.speaker_embedding,
                                  ref_code=voice.ref_code)
        return dataclasses.replace(req, input=inp)

    async def abort(self, request_id: str, reason: str = "aborted") -> None:
        self._text.forget(request_id)  # a stream asked for and never read: nothing else frees it
        await self.talker.abort(request_id, reason)
        await self.codec.abort(request_id, reason)

    async def extract_voice(self, samples: np.ndarray, sample_rate: int) -> VoiceFeatures:
        return await self.talker.extract_voice(samples, sample_rate)

    def stats(self) -> EngineStats:
        stats = self.talker.stats()
        failures = self.codec.stats().failures
        if not failures:
            return stats
        aborted = dict(stats.aborted)
        for k, v in failures.items():
            aborted[k] = aborted.get(k, 0) + v
        return dataclasses.replace(stats, aborted=aborted)

    def is_alive(self) -> bool:
        return self.talker.is_alive() and self.codec.is_alive()


def build_split_client(
    load: Callable[[str], LoadedModel] | None,
    config: EngineConfig,
    devices: list[str] | None = None,
    name: str = "legato",
    workers: str = "thread",
    model_path: str | None = None,
    instance_id: str | None = None,
    process_options: dict | None = None,
    memory_shares: list[float] | None = None,
    load_codec: Callable[[str], CodecDecoder] | None = None,
    launcher: Launcher | None = None,
) -> SplitClient:
    """The `split` topology: `devices` is [talker device, codec device], or one device for both.

    Where each part runs:
    - the talker engine, with `emit_audio=False` (it never runs the codec decoder), on `devices[0]`: with
      `workers="thread"` on a thread of this process (`load(device)` loads its model here); with
      `workers="process"` in its own worker process (`ProcessEngineClient`) that loads `model_path` itself.
    - the codec worker, on `devices[-1]`: with `workers="thread"` a thread of this process (the server's),
      which shares the talker's decoder weights on one device and otherwise loads only the codec decoder
      (`load_codec(device)`, by default the `speech_tokenizer` decoder weights of the model directory; it
      decodes in `config.codec_dtype`, with the engine's CUDA graphs on CUDA); with `workers="process"` a
      process of its own (`ProcessCodecClient`) that loads only the codec decoder itself.

    `memory_shares` ([talker] or [talker, codec]) sets the talker's `gpu_memory_utilization`; the codec
    worker has no KV cache and sizes nothing up front (its activations fit in the reserve the talker's
    budget leaves), so its entry is only checked. Without it the talker takes `config`'s share whole:
    sharing one device, the codec's activations replace the ones `single` would have had."""
    from legato.pipeline.local import LocalEngineClient

    devices = devices or [config.device]
    if len(devices) not in (1, 2):
        raise ValueError(f"split runs a talker and a codec worker; give 1 device or 2, got {devices}")
    if memory_shares is not None and (len(memory_shares) not in (1, 2)
                                      or not all(0.0 < s <= 1.0 for s in memory_shares)):
        raise ValueError(f"split takes 1 or 2 memory shares in (0, 1], got {memory_shares}")
    if workers not in ("thread", "process"):
        raise ValueError(f"workers must be 'thread' or 'process', got {workers!r}")
    if workers == "process" and model_path is None:
        raise ValueError("workers='process' needs model_path (the talker worker loads the model itself)")
    talker_device, codec_device = devices[0], devices[-1]
    cfg = dataclasses.replace(config, device=talker_device, emit_audio=False)
    if memory_shares is not None:
        cfg.gpu_memory_utilization = memory_shares[0]
    if workers == "process":
        from legato.pipeline.codec_process import ProcessCodecClient
        from legato.pipeline.process_client import ProcessEngineClient, new_instance_id

        instance_id = instance_id or new_instance_id()
        if launcher is not None:
            launcher.plan(_split_plan(talker_device, codec_device, cfg.gpu_memory_utilization))
        talker = ProcessEngineClient(model_path, cfg, talker_device, name, instance_id, 0, **(process_options or {}),
                                     launcher=launcher, worker_name="talker")
        codec = ProcessCodecClient(model_path, dataclasses.replace(config, device=codec_device), codec_device,
                                   name, instance_id, 1, **(process_options or {}), launcher=launcher,
                                   worker_name="codec")
        return SplitClient(talker, codec)
    loaded = load(talker_device)
    local_talker = LocalEngineClient(loaded, cfg, name=name)
    decoder = loaded.speech_tokenizer.decoder if len(devices) == 1 else None
    if decoder is None:
        decoder = (load_codec(codec_device) if load_codec is not None else
                   load_codec_decoder(loaded.path, codec_device))
    local_codec = LocalCodecClient(decoder, StreamSchedule.of(config), name=f"{name}-codec",
                                   **codec_engine_options(dataclasses.replace(config, device=codec_device)))
    return SplitClient(local_talker, local_codec)


def _split_plan(talker_device: str, codec_device: str, talker_share: float) -> list[WorkerPlan]:
    """The GPUs of split's two workers: a device each, or on one device the talker its memory share and the
    codec worker (no KV cache) the rest."""
    if not talker_device.startswith("cuda"):
        gpus = (0.0, 0.0 if not codec_device.startswith("cuda") else 1.0)
    elif talker_device != codec_device:
        gpus = (1.0, 1.0 if codec_device.startswith("cuda") else 0.0)
    else:
        gpus = (talker_share, max(0.05, round(1.0 - talker_share, 3)))
    return [WorkerPlan("talker", gpus[0]), WorkerPlan("codec", gpus[1])]
