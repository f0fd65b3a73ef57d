"""The wire contract between the server process and its engine workers.

Every message is a small dataclass. On the wire it is a ZMQ multipart message: frame 0 is a UTF-8 JSON
header `{"type": ..., "v": 1, "body": {...}, "arrays": [[name, dtype, shape], ...]}` and each later frame
is the raw C-order bytes of one array, in the order the header lists them. Nothing is pickled: decoding
only ever builds the types named here, and any header or frame that does not fit raises `MessageError`, as
does a message over `MAX_MESSAGE_BYTES` (both ends also set ZMQ's MAXMSGSIZE, so a far larger frame is never
even buffered: its connection is dropped).

Direction: Submit, AwaitHandoff, Abort, AppendText, ExtractVoice, Shutdown, Hello go server -> worker; Ready, Chunk,
Chunks, Rejected, VoiceResult, Stats, LinkStatus, Heartbeat go worker -> server. `request_id` doubles as the call id of
ExtractVoice/VoiceResult. A codec worker (`split`) takes CodecOpen, CodecFrames, CodecFrameBatch, Abort and
Shutdown, and answers with Ready, Chunk or Chunks (PCM; `num_frames` counts the frames decoded so far), Rejected,
Stats, Heartbeat.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from legato.models.qwen3_tts.inputs import SpeechInput
from legato.models.qwen3_tts.sampling import SamplingParams
from legato.pipeline.client import STAGES, EngineStats, ModelInfo, StreamChunk, SynthesisRequest

VERSION = 1
_DTYPES = {"float32", "int64"}  # the only array dtypes any message carries
# Far above any real message (a minute of 192 kHz reference audio as float32 is 46 MB), far below what
# would hurt a host: one bad or hostile frame costs a bounded allocation, then a logged drop.
MAX_MESSAGE_BYTES = 256 * 2**20


class MessageError(ValueError):
    """A frame sequence that is not a valid message of this contract; the text says what is wrong."""


# --- messages -----------------------------------------------------------------------------------------


@dataclass
class Submit:
    """Start streaming one request."""

    request: SynthesisRequest


@dataclass
class AwaitHandoff:
    """Decode worker of process MpNd: arm the KV link from prefill worker `peer` for `request_id`, then stream
    the request's chunks once its handoff lands (or end it with an error chunk when the transfer fails)."""

    request_id: str
    peer: int
    deadline_s: float


@dataclass
class CodecOpen:
    """Codec worker: start a stream (an in-context clone's reference codes prime it)."""

    request_id: str
    ref_code: np.ndarray | None = None  # [T, 16] int64
    first_chunk_frames: int | None = None


@dataclass
class CodecFrames:
    """Codec worker: the next frames of a stream ([n, 16] int64, n may be 0); `last` ends it (its tail is
    decoded and sent as the stream's last chunk)."""

    request_id: str
    codes: np.ndarray
    last: bool = False


@dataclass
class CodecFrameBatch:
    """Codec worker: several streams' next frames in one message, what the front relays from one talker step,
    as (request_id, codes [n, 16] int64, last) entries; each stream's entries keep their order across messages,
    and an entry means what a `CodecFrames` with its fields means."""

    entries: list[tuple[str, np.ndarray, bool]]


@dataclass
class LinkStatus:
    """A worker's KV link to worker `peer` of the other role: its state (not_ready | ready | failed), why it
    failed, and the connector's counters (sent, received, failed, timeouts, late, duplicate, unknown, ...)."""

    peer: int
    state: str
    error: str | None = None
    counters: dict[str, int] = field(default_factory=dict)


@dataclass
class Abort:
    request_id: str
    reason: str = "aborted"


@dataclass
class AppendText:
    """More text for a `text_open` request (a piece cut by `TextStream`), sent after its Submit; `close` ends it."""

    request_id: str
    text: str
    close: bool = False


@dataclass
class Chunk:
    """One `StreamChunk` of a request; the last has `chunk.finished`."""

    request_id: str
    chunk: StreamChunk


@dataclass
class Chunks:
    """Several requests' chunks in one message: what one engine step made for all its streams, so a step costs
    one header to write and read, not one per stream. Each request's chunks keep their order across messages."""

    chunks: list[tuple[str, StreamChunk]]


@dataclass
class Rejected:
    """The worker refused a request (Submit) or a voice extraction (ExtractVoice) before running it."""

    request_id: str
    status: int
    message: str
    retry_after: float | None = None
    code: str | None = None  # RequestRejected.code, carried so the front need not read it out of `message`


@dataclass
class ExtractVoice:
    request_id: str
    samples: np.ndarray  # float32 mono
    sample_rate: int


@dataclass
class VoiceResult:
    request_id: str
    speaker_embedding: np.ndarray  # [hidden] float32
    ref_code: np.ndarray  # [T, 16] int64


@dataclass
class Stats:
    stats: EngineStats


@dataclass
class Ready:
    """Sent once, after the worker has loaded its model and started its engine."""

    info: ModelInfo
    pid: int
    generation_defaults: dict[str, Any] = field(default_factory=dict)


@dataclass
class Shutdown:
    """Stop taking requests, let running ones finish for `grace_s`, abort the rest, exit."""

    grace_s: float = 10.0


@dataclass
class Heartbeat:
    seq: int


@dataclass
class Hello:
    """From a front process other than the one that started the worker (`legato serve --fronts N`): it asks for
    Stats and Ready on its own link, whenever it (re)starts."""

    front: int


Message = (Submit | AwaitHandoff | Abort | AppendText | Chunk | Chunks | Rejected | ExtractVoice | VoiceResult
           | Stats | LinkStatus | Ready | Shutdown | Heartbeat | Hello | CodecOpen | CodecFrames | CodecFrameBatch)


# --- encoding -----------------------------------------------------------------------------------------


def encode(msg: Message) -> list[bytes | memoryview]:
    """The frames of `msg`: a JSON header (bytes), then one frame per array (a byte view of the array, which the
    caller must not change before the frames are sent)."""
    tag, body, arrays = _ENCODERS[type(msg)](msg)
    listed = []
    frames: list[bytes | memoryview] = []
    for name, arr in arrays.items():
        if arr is None:
            continue
        arr = np.ascontiguousarray(arr)
        listed.append([name, str(arr.dtype), list(arr.shape)])
        # The array's own bytes, not a copy (ZMQ copies them as it sends): a step's 2 MB of audio cost the worker's
        # event loop a 2 MB `tobytes` copy and its page faults, ~2 ms of GIL a step at 256 streams.
        frames.append(memoryview(arr.reshape(-1).view(np.uint8)))
    header = json.dumps({"type": tag, "v": VERSION, "body": body, "arrays": listed}).encode()
    return [header, *frames]


def decode(frames: Sequence[bytes | memoryview], max_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    """The message in `frames`; raises MessageError on anything malformed or over `max_bytes` in all."""
    if not frames:
        raise MessageError("empty message")
    size = sum(memoryview(f).nbytes for f in frames)
    if size > max_bytes:
        raise MessageError(f"message of {len(frames)} frames is {size} bytes, over the limit of {max_bytes}")
    try:
        header = json.loads(bytes(frames[0]), parse_constant=_no_constant)
    # ValueError covers bad UTF-8, bad JSON, NaN/Infinity and integers past Python's digit limit;
    # RecursionError a deeply nested header.
    except (ValueError, RecursionError) as e:
        raise MessageError(f"header is not JSON: {str(e)[:200]}") from None
    if not isinstance(header, dict):
        raise MessageError("header is not a JSON object")
    if header.get("v") != VERSION:
        raise MessageError(f"unsupported message version {brief(header.get('v'))} (this side speaks {VERSION})")
    tag = header.get("type")
    if tag not in _DECODERS:
        raise MessageError(f"unknown message type {brief(tag)}")
    body = header.get("body")
    if not isinstance(body, dict):
        raise MessageError(f"{tag}: body is not an object")
    try:
        arrays = _arrays(tag, header.get("arrays"), frames[1:])
        return _DECODERS[tag](_Body(tag, body, arrays))
    except MessageError:
        raise
    # e.g. SamplingParams validation of a well-typed but bad value, or a shape numpy cannot build
    except (ValueError, TypeError, OverflowError) as e:
        raise MessageError(f"{tag}: {str(e)[:200]}") from None


def brief(value: Any) -> str:
    """A repr short enough for a log line or an error message, whatever a peer or a client sent (80 characters)."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def _arrays(tag: str, listed: Any, frames: Sequence[bytes | memoryview]) -> dict[str, np.ndarray]:
    if not isinstance(listed, list) or len(listed) != len(frames):
        count = len(listed) if isinstance(listed, list) else brief(listed)
        raise MessageError(f"{tag}: header lists {count} arrays, {len(frames)} frames follow")
    out = {}
    for entry, frame in zip(listed, frames, strict=True):
        ok = (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str) and entry[1] in _DTYPES
              and isinstance(entry[2], list) and all(_is_int(n) and n >= 0 for n in entry[2]))
        if not ok:
            raise MessageError(f"{tag}: bad array entry {brief(entry)} (want [name, float32|int64, [dims]])")
        name, dtype, shape = entry
        data = memoryview(frame).cast("B")
        want = math.prod(shape) * np.dtype(dtype).itemsize  # exact: numpy's int64 product would wrap
        if data.nbytes != want:
            raise MessageError(f"{tag}: array {brief(name)} {dtype}{brief(shape)} needs {want} bytes, "
                               f"got {data.nbytes}")
        out[name] = np.frombuffer(data, dtype=dtype).reshape(shape).copy()
    return out


class _Body:
    """Typed access to a header body and its arrays; every getter raises MessageError naming the field."""

    def __init__(self, tag: str, body: dict, arrays: dict[str, np.ndarray]) -> None:
        self.tag, self.body, self.arrays = tag, body, arrays

    def get(self, name: str, kind: type | tuple[type, ...], optional: bool = False, default: Any = None) -> Any:
        if name not in self.body:
            if optional:
                return default
            raise MessageError(f"{self.tag}: missing field {name!r}")
        value = self.body[name]
        if value is None and optional:
            return None
        kinds = kind if isinstance(kind, tuple) else (kind,)
        ok = any(_is_int(value) if k is int else
                 (isinstance(value, (int, float)) and not isinstance(value, bool)) if k is float else
                 isinstance(value, k) for k in kinds)
        if not ok:
            names = "|".join(k.__name__ for k in kinds)
            raise MessageError(f"{self.tag}: field {name!r} must be {names}, got {type(value).__name__}")
        return float(value) if kinds == (float,) else value

    def array(self, name: str, dtype: str, ndim: int, optional: bool = False, width: int | None = None):
        arr = self.arrays.get(name)
        if arr is None:
            if optional:
                return None
            raise MessageError(f"{self.tag}: missing array {name!r}")
        if str(arr.dtype) != dtype or arr.ndim != ndim or (width is not None and arr.shape[-1] != width):
            raise MessageError(f"{self.tag}: array {name!r} must be {dtype} with {ndim} dims"
                               f"{f' x {width}' if width else ''}, got {arr.dtype}{list(arr.shape)}")
        return arr


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _np(t: torch.Tensor | np.ndarray | None, dtype: str) -> np.ndarray | None:
    if t is None:
        return None
    if isinstance(t, torch.Tensor):
        # Through torch's own cast first: numpy has no bfloat16.
        t = t.detach().to("cpu", torch.float32 if dtype == "float32" else torch.int64).numpy()
    return np.asarray(t, dtype=dtype)


# --- per-message bodies -------------------------------------------------------------------------------

_INPUT_FIELDS = {"text": str, "language": str, "speaker": str, "instructions": str, "ref_sample_rate": int,
                 "ref_text": str, "x_vector_only": bool, "non_streaming_mode": bool, "ref_audio_key": str}
_SAMPLING_FIELDS = {"do_sample": bool, "temperature": float, "top_k": int, "top_p": float,
                    "repetition_penalty": float, "min_new_tokens": int, "max_new_tokens": int,
                    "subtalker_do_sample": bool, "subtalker_temperature": float, "subtalker_top_k": int,
                    "subtalker_top_p": float, "seed": int}
_REQUIRED_INPUT = {"text", "language", "ref_sample_rate", "x_vector_only"}


def _enc_submit(m: Submit):
    r, inp = m.request, m.request.input
    body = {
        "request_id": r.request_id, "max_frames": r.max_frames, "ignore_eos": r.ignore_eos,
        "first_chunk_frames": r.first_chunk_frames, "handoff_to": r.handoff_to, "text_open": r.text_open,
        "input": {k: getattr(inp, k) for k in _INPUT_FIELDS},
        "sampling": {k: getattr(r.sampling, k) for k in _SAMPLING_FIELDS},
    }
    arrays = {"ref_audio": _np(inp.ref_audio, "float32"), "speaker_embedding": _np(inp.speaker_embedding, "float32"),
              "ref_code": _np(inp.ref_code, "int64"),
              "text_ids": None if inp.text_ids is None else np.asarray(list(inp.text_ids), dtype="int64")}
    return "submit", body, arrays


def _dec_submit(b: _Body) -> Submit:
    sub = {}
    for part, fields in (("input", _INPUT_FIELDS), ("sampling", _SAMPLING_FIELDS)):
        inner = _Body(f"{b.tag}.{part}", b.get(part, dict), {})
        unknown = set(inner.body) - set(fields)
        if unknown:
            raise MessageError(f"{inner.tag}: unknown fields {brief(sorted(unknown))}")
        required = _REQUIRED_INPUT if part == "input" else set()
        sub[part] = {k: inner.get(k, t, optional=k not in required) for k, t in fields.items() if k in inner.body
                     or k in required}
    emb = b.array("speaker_embedding", "float32", 1, optional=True)
    code = b.array("ref_code", "int64", 2, optional=True, width=16)
    text_ids = b.array("text_ids", "int64", 1, optional=True)
    inp = SpeechInput(
        **sub["input"], ref_audio=b.array("ref_audio", "float32", 1, optional=True),
        speaker_embedding=None if emb is None else torch.from_numpy(emb),
        ref_code=None if code is None else torch.from_numpy(code),
        text_ids=None if text_ids is None else text_ids.tolist(),
    )
    return Submit(SynthesisRequest(
        request_id=b.get("request_id", str), input=inp, sampling=SamplingParams(**sub["sampling"]),
        max_frames=b.get("max_frames", int, optional=True), ignore_eos=b.get("ignore_eos", bool),
        first_chunk_frames=b.get("first_chunk_frames", int, optional=True),
        handoff_to=b.get("handoff_to", int, optional=True),
        text_open=bool(b.get("text_open", bool, optional=True, default=False)),
    ))


def _enc_chunk(m: Chunk):
    c = m.chunk
    body = {"request_id": m.request_id, "num_frames": c.num_frames, "num_prompt_tokens": c.num_prompt_tokens,
            "finished": c.finished, "finish_reason": c.finish_reason, "error": c.error, "error_code": c.error_code,
            "seed": c.seed, "retryable": c.retryable, "stages": c.stages}
    return "chunk", body, {"audio": _np(c.audio, "float32"), "codes": _np(c.codes, "int64")}


def _dec_chunk(b: _Body) -> Chunk:
    reason = b.get("finish_reason", str, optional=True)
    if reason not in (None, "stop", "length", "abort", "error", "handoff"):
        raise MessageError(f"chunk: unknown finish_reason {reason!r}")
    return Chunk(b.get("request_id", str), StreamChunk(
        audio=b.array("audio", "float32", 1), num_frames=b.get("num_frames", int),
        num_prompt_tokens=b.get("num_prompt_tokens", int), finished=b.get("finished", bool), finish_reason=reason,
        error=b.get("error", str, optional=True), error_code=b.get("error_code", str, optional=True),
        seed=b.get("seed", int), codes=b.array("codes", "int64", 2, optional=True, width=16),
        retryable=b.get("retryable", bool, optional=True, default=False), stages=_stages(b),
    ))


def _stages(b: _Body) -> dict[str, float] | None:
    stages = b.get("stages", dict, optional=True)
    if stages is None:
        return None
    if set(stages) - set(STAGES) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in stages.values()):
        raise MessageError(f"{b.tag}: stages must map {'/'.join(STAGES)} to seconds")
    return {k: float(v) for k, v in stages.items()}


# A chunk's numbers, one int64 row each in a Chunks message ("frames" -1: the chunk carries no codes).
_CHUNK_ROW = ("samples", "frames", "num_frames", "num_prompt_tokens", "seed", "finished")


def _enc_chunks(m: Chunks):
    """Columnar: the header holds the request ids and, only for the chunks that have them, the rare fields (an
    end's reason, error and error code, `retryable`, first-audio stages); every chunk's numbers are one row of an int64
    array, all the audio one array and all the codes another. A step of hundreds of streams then costs a few
    numpy calls and a list of ids to write and read, not a JSON object a stream (3-7x less CPU at 256 chunks,
    on both sides of the worker link)."""
    ids, rows, rare, audio, codes = [], [], {}, [], []
    for i, (rid, c) in enumerate(m.chunks):
        a = _np(c.audio, "float32").reshape(-1)
        k = _np(c.codes, "int64")
        ids.append(rid)
        rows.append((a.size, -1 if k is None else k.shape[0], c.num_frames, c.num_prompt_tokens, c.seed,
                     1 if c.finished else 0))
        if (c.finish_reason is not None or c.error is not None or c.error_code is not None or c.retryable
                or c.stages is not None):
            rare[str(i)] = {"finish_reason": c.finish_reason, "error": c.error, "error_code": c.error_code,
                            "retryable": c.retryable, "stages": c.stages}
        audio.append(a)
        if k is not None:
            codes.append(k.reshape(-1, 16))
    return "chunks", {"ids": ids, "rare": rare}, {
        "rows": np.array(rows, np.int64).reshape(-1, len(_CHUNK_ROW)),
        "audio": np.concatenate(audio) if audio else np.zeros(0, np.float32),
        "codes": np.concatenate(codes) if codes else np.zeros((0, 16), np.int64)}


def _dec_chunks(b: _Body) -> Chunks:
    ids, rare = b.get("ids", list), b.get("rare", dict)
    rows = b.array("rows", "int64", 2, width=len(_CHUNK_ROW))
    audio, codes = b.array("audio", "float32", 1), b.array("codes", "int64", 2, width=16)
    if len(ids) != rows.shape[0] or not all(isinstance(rid, str) for rid in ids):
        raise MessageError(f"chunks: {len(ids)} ids for {rows.shape[0]} rows, or an id that is not a string")
    samples, frames = rows[:, 0], rows[:, 1]
    # Each size within its array first, so the sums below cannot wrap.
    if ((samples < 0) | (samples > audio.size) | (frames < -1) | (frames > codes.shape[0])).any():
        raise MessageError("chunks: a row's sizes do not fit the arrays")
    if int(samples.sum()) != audio.size or int(np.maximum(frames, 0).sum()) != codes.shape[0]:
        raise MessageError(f"chunks: the rows cover {int(samples.sum())} samples and "
                           f"{int(np.maximum(frames, 0).sum())} frames of {audio.size} and {codes.shape[0]}")
    if (rows[:, 2:5] < 0).any() or ((rows[:, 5] != 0) & (rows[:, 5] != 1)).any():
        raise MessageError("chunks: a row has a negative count or seed, or `finished` other than 0/1")
    if not all(isinstance(k, str) and k.isdigit() and int(k) < len(ids) for k in rare):
        raise MessageError(f"chunks: `rare` must be keyed by row numbers below {len(ids)}")
    out, at, row = [], 0, 0
    for i, (rid, (n, f, frames_so_far, prompt_tokens, seed, finished)) in enumerate(
            zip(ids, rows.tolist(), strict=True)):
        chunk = StreamChunk(audio=audio[at:at + n], num_frames=frames_so_far, num_prompt_tokens=prompt_tokens,
                            finished=bool(finished), seed=seed, codes=None if f < 0 else codes[row:row + f])
        extra = rare.get(str(i))
        if extra is not None:
            _rare_fields(_Body(f"chunks[{i}]", extra, {}) if isinstance(extra, dict) else None, i, chunk)
        out.append((rid, chunk))
        at, row = at + n, row + max(f, 0)
    return Chunks(out)


def _rare_fields(e: _Body | None, i: int, chunk: StreamChunk) -> None:
    """Sets a Chunks row's rare fields from its `rare` entry."""
    if e is None:
        raise MessageError(f"chunks[{i}]: its `rare` entry is not an object")
    reason = e.get("finish_reason", str, optional=True)
    if reason not in (None, "stop", "length", "abort", "error", "handoff"):
        raise MessageError(f"chunks[{i}]: unknown finish_reason {reason!r}")
    chunk.finish_reason, chunk.error = reason, e.get("error", str, optional=True)
    chunk.error_code = e.get("error_code", str, optional=True)
    chunk.retryable, chunk.stages = e.get("retryable", bool, optional=True, default=False), _stages(e)


def _enc_frame_batch(m: CodecFrameBatch):
    """One header listing each entry's request, frame count and `last`; all the codes in one array."""
    listed, codes = [], []
    for rid, k, last in m.entries:
        k = _np(k, "int64").reshape(-1, 16)
        listed.append({"request_id": rid, "frames": int(k.shape[0]), "last": bool(last)})
        codes.append(k)
    return "codec_frame_batch", {"entries": listed}, {
        "codes": np.concatenate(codes) if codes else np.zeros((0, 16), np.int64)}


def _dec_frame_batch(b: _Body) -> CodecFrameBatch:
    codes = b.array("codes", "int64", 2, width=16)
    out, row = [], 0
    for i, entry in enumerate(b.get("entries", list)):
        if not isinstance(entry, dict):
            raise MessageError(f"codec_frame_batch: entry {i} is not an object")
        e = _Body(f"codec_frame_batch[{i}]", entry, {})
        frames = e.get("frames", int)
        if frames < 0 or row + frames > codes.shape[0]:
            raise MessageError(f"codec_frame_batch[{i}]: {frames} frames do not fit the codes array")
        out.append((e.get("request_id", str), codes[row:row + frames], e.get("last", bool)))
        row += frames
    if row != codes.shape[0]:
        raise MessageError(f"codec_frame_batch: the entries cover {row} of {codes.shape[0]} frames")
    return CodecFrameBatch(out)


def _enc_stats(m: Stats):
    s = m.stats
    return "stats", {"waiting": s.waiting, "running": s.running, "kv_usage": s.kv_usage,
                     "num_kv_blocks": s.num_kv_blocks, "free_kv_blocks": s.free_kv_blocks,
                     "aborted": dict(s.aborted), "steps": s.steps, "decode_rows": s.decode_rows,
                     "step_host_s": s.step_host_s, "step_gpu_s": s.step_gpu_s, "step_gap_s": s.step_gap_s,
                     "loop_other_s": s.loop_other_s, "waiting_for_text": s.waiting_for_text,
                     "text_wait_s": s.text_wait_s}, {}


def _dec_stats(b: _Body) -> Stats:
    aborted = b.get("aborted", dict)
    if not all(isinstance(k, str) and _is_int(v) for k, v in aborted.items()):
        raise MessageError("stats: field 'aborted' must map reasons to counts")
    return Stats(EngineStats(waiting=b.get("waiting", int), running=b.get("running", int),
                             kv_usage=b.get("kv_usage", float), num_kv_blocks=b.get("num_kv_blocks", int),
                             free_kv_blocks=b.get("free_kv_blocks", int), aborted=aborted,
                             steps=b.get("steps", int), decode_rows=b.get("decode_rows", int),
                             step_host_s=b.get("step_host_s", float), step_gpu_s=b.get("step_gpu_s", float),
                             step_gap_s=b.get("step_gap_s", float), loop_other_s=b.get("loop_other_s", float),
                             waiting_for_text=b.get("waiting_for_text", int, optional=True, default=0),
                             text_wait_s=b.get("text_wait_s", float, optional=True, default=0.0)))


def _enc_ready(m: Ready):
    i = m.info
    info = {"name": i.name, "model_type": i.model_type, "model_size": i.model_size, "sample_rate": i.sample_rate,
            "languages": list(i.languages), "speakers": list(i.speakers), "hidden_size": i.hidden_size}
    return "ready", {"info": info, "pid": m.pid, "generation_defaults": m.generation_defaults}, {}


def _dec_ready(b: _Body) -> Ready:
    i = _Body("ready.info", b.get("info", dict), {})
    lists = {k: i.get(k, list) for k in ("languages", "speakers")}
    if not all(isinstance(x, str) for v in lists.values() for x in v):
        raise MessageError("ready.info: languages and speakers must be lists of strings")
    info = ModelInfo(name=i.get("name", str), model_type=i.get("model_type", str), model_size=i.get("model_size", str),
                     sample_rate=i.get("sample_rate", int), hidden_size=i.get("hidden_size", int), **lists)
    return Ready(info, b.get("pid", int), b.get("generation_defaults", dict))


def _dec_link_status(b: _Body) -> LinkStatus:
    state, counters = b.get("state", str), b.get("counters", dict)
    if state not in ("not_ready", "ready", "failed"):
        raise MessageError(f"link_status: unknown state {state!r}")
    if not all(isinstance(k, str) and _is_int(v) for k, v in counters.items()):
        raise MessageError("link_status: field 'counters' must map names to counts")
    return LinkStatus(b.get("peer", int), state, b.get("error", str, optional=True), counters)


_ENCODERS = {
    Submit: _enc_submit,
    AwaitHandoff: lambda m: ("await_handoff", {"request_id": m.request_id, "peer": m.peer,
                                               "deadline_s": m.deadline_s}, {}),
    LinkStatus: lambda m: ("link_status", {"peer": m.peer, "state": m.state, "error": m.error,
                                           "counters": m.counters}, {}),
    Abort: lambda m: ("abort", {"request_id": m.request_id, "reason": m.reason}, {}),
    AppendText: lambda m: ("append_text", {"request_id": m.request_id, "text": m.text, "close": m.close}, {}),
    Chunk: _enc_chunk,
    Chunks: _enc_chunks,
    Rejected: lambda m: ("rejected", {"request_id": m.request_id, "status": m.status, "message": m.message,
                                      "retry_after": m.retry_after, "code": m.code}, {}),
    ExtractVoice: lambda m: ("extract_voice", {"request_id": m.request_id, "sample_rate": m.sample_rate},
                             {"samples": _np(m.samples, "float32")}),
    VoiceResult: lambda m: ("voice_result", {"request_id": m.request_id},
                            {"speaker_embedding": _np(m.speaker_embedding, "float32"),
                             "ref_code": _np(m.ref_code, "int64")}),
    Stats: _enc_stats,
    Ready: _enc_ready,
    Shutdown: lambda m: ("shutdown", {"grace_s": m.grace_s}, {}),
    Heartbeat: lambda m: ("heartbeat", {"seq": m.seq}, {}),
    Hello: lambda m: ("hello", {"front": m.front}, {}),
    CodecOpen: lambda m: ("codec_open", {"request_id": m.request_id, "first_chunk_frames": m.first_chunk_frames},
                          {"ref_code": _np(m.ref_code, "int64")}),
    CodecFrames: lambda m: ("codec_frames", {"request_id": m.request_id, "last": m.last},
                            {"codes": _np(m.codes, "int64")}),
    CodecFrameBatch: _enc_frame_batch,
}

_DECODERS = {
    "submit": _dec_submit,
    "await_handoff": lambda b: AwaitHandoff(b.get("request_id", str), b.get("peer", int), b.get("deadline_s", float)),
    "link_status": _dec_link_status,
    "abort": lambda b: Abort(b.get("request_id", str), b.get("reason", str)),
    "append_text": lambda b: AppendText(b.get("request_id", str), b.get("text", str), b.get("close", bool)),
    "chunk": _dec_chunk,
    "chunks": _dec_chunks,
    "rejected": lambda b: Rejected(b.get("request_id", str), b.get("status", int), b.get("message", str),
                                   b.get("retry_after", float, optional=True), b.get("code", str, optional=True)),
    "extract_voice": lambda b: ExtractVoice(b.get("request_id", str), b.array("samples", "float32", 1),
                                            b.get("sample_rate", int)),
    "voice_result": lambda b: VoiceResult(b.get("request_id", str), b.array("speaker_embedding", "float32", 1),
                                          b.array("ref_code", "int64", 2, width=16)),
    "stats": _dec_stats,
    "ready": _dec_ready,
    "shutdown": lambda b: Shutdown(b.get("grace_s", float)),
    "heartbeat": lambda b: Heartbeat(b.get("seq", int)),
    "hello": lambda b: Hello(b.get("front", int)),
    "codec_open": lambda b: CodecOpen(b.get("request_id", str),
                                      b.array("ref_code", "int64", 2, optional=True, width=16),
                                      b.get("first_chunk_frames", int, optional=True)),
    "codec_frames": lambda b: CodecFrames(b.get("request_id", str), b.array("codes", "int64", 2, width=16),
                                          b.get("last", bool)),
    "codec_frame_batch": _dec_frame_batch,
}
