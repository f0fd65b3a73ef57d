"""The contract between the HTTP server and whatever runs the engine (a thread in this process today;
worker processes behind a router with the topologies work).

The server sends a `SynthesisRequest` and reads `StreamChunk`s back; errors are values: a request the
engine refuses raises `RequestRejected` (with an HTTP-style status) before its first chunk, and a request
that fails later ends with a chunk whose `finish_reason` is "error" and whose `error` says why.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np

from legato.kv_transfer.handoff import Handoff
from legato.models.qwen3_tts.config import Qwen3TTSConfig, SpeechTokenizerConfig
from legato.models.qwen3_tts.inputs import SpeechInput, VoiceFeatures
from legato.models.qwen3_tts.prompt import supported_languages
from legato.models.qwen3_tts.sampling import SamplingParams


@dataclass
class SynthesisRequest:
    request_id: str
    input: SpeechInput
    sampling: SamplingParams
    max_frames: int | None = None  # None: sampling.max_new_tokens - 1
    ignore_eos: bool = False
    first_chunk_frames: int | None = None  # None: the engine's default
    handoff_only: bool = False  # prefill workers: stop after prefill, the last chunk carries the Handoff
    handoff_to: int | None = None  # process MpNd: the decode worker whose KV link takes the handoff
    # Streaming text input: `input.text` is the text's first piece (cut by `TextStream`); the rest comes through
    # `EngineClient.append_text`, and the request waits for it. Needs a client with `takes_text_input`.
    text_open: bool = False


@dataclass
class StreamChunk:
    """New audio of one request (may be empty), and on the last chunk how it ended."""

    audio: np.ndarray  # float32 mono PCM at the model's sample rate
    num_frames: int  # frames generated so far
    num_prompt_tokens: int = 0
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort | error
    error: str | None = None
    # On an "error" chunk the request itself caused, a machine-readable reason the front reports to its client
    # (the engine's TEXT_TOO_LONG); None for a failure of the server's.
    error_code: str | None = None
    seed: int = 0
    codes: np.ndarray | None = None  # [n, 16] int64: the new frames' codec codes (topology equivalence checks)
    handoff: Handoff | None = None  # on the last chunk of a `handoff_only` request (finish_reason "handoff")
    # On an "error" chunk: the failure was the deployment's, not the request's (its worker died, its KV
    # handoff did not cross), so the same request run elsewhere would give the same result.
    retryable: bool = False
    # On a request's first chunk with audio (a talker-only engine's: with codes), where its time went before it, in
    # seconds (`STAGES`), when the engine client measured it: the server logs them beside the TTFP.
    stages: dict[str, float] | None = None


# prepare: from the call to the engine thread's inbox (the voice, tokens and prompt, with their queues);
# inbox: until the engine thread took it in; engine: from then to the first audio handed over.
# `prepare` split, where the client saw each step: voice (the clip's voice found or encoded), queue (waiting for
# the admission thread), build (its batch's host part and prompts), resume (the caller's event loop picking it up).
# worker: in a worker process, from its request's message arriving to its first audio leaving (the three stages and
# the worker's own event-loop passes either side of them), so the server can tell the link's share of its wait.
# `split` (whose talker streams codes, not audio): the talker's stages are to its first codes; codec: from those codes
# reaching the split client to its first audio; codec_worker: the part of that inside a codec worker process (its
# first frames in -> first PCM out), the rest being the way there and back.
STAGES = ("prepare", "inbox", "engine", "voice", "queue", "build", "resume", "worker", "codec", "codec_worker")
# How long a request waits for its id's earlier, dropped request to finish ending (its last output out of the engine
# or the worker: a step or so) before it is refused with 409; the bound is for an engine that stops stepping.
ENDING_WAIT_S = 5.0


# The `code` of a 503 refusal: `shutting_down` while the server (or a worker) drains, which a client or a
# balancer reads as "go elsewhere, for good"; `engine_unavailable` when a worker is down (dead, not yet started),
# which a retry may outlive.
SHUTTING_DOWN = "shutting_down"
ENGINE_UNAVAILABLE = "engine_unavailable"


class RequestRejected(Exception):
    """The engine refused a request before running it. `status` follows HTTP (400 bad input, 413 too large,
    429 queue full, 503 shutting down or no engine serving); `retry_after` (seconds) is set for 429. `code` is
    the machine-readable reason the client sees, set where the refusal is made (a 503 is `SHUTTING_DOWN` or
    `ENGINE_UNAVAILABLE`, a prompt over the engine's text buffer `text_too_long`); None: the status's usual
    code (the server's `rejection_code`)."""

    def __init__(self, status: int, message: str, retry_after: float | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after = retry_after
        self.code = code

    @classmethod
    def shutting_down(cls, message: str = "server is shutting down") -> RequestRejected:
        """The 503 of a server or worker that drains."""
        return cls(503, message, code=SHUTTING_DOWN)


def unavailable_code(message: str) -> str:
    """The code of a 503 whose only record is an ended stream's text (an `abort` chunk's reason, which carries
    no code): `SHUTTING_DOWN` when it says so, else `ENGINE_UNAVAILABLE`. A refusal carries its own
    (`RequestRejected.code`)."""
    return SHUTTING_DOWN if "shutting down" in message else ENGINE_UNAVAILABLE


async def refused_stream(e: RequestRejected) -> AsyncIterator[StreamChunk]:
    """A stream that raises `e` at its first iteration (the contract of `generate`), for a `generate` that
    must decide at call time."""
    raise e
    yield  # pragma: no cover - makes this an async generator


@dataclass
class EngineStats:
    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    num_kv_blocks: int = 0
    free_kv_blocks: int = 0
    aborted: dict[str, int] = field(default_factory=dict)  # reason -> count
    recomputed: int = 0  # process MpNd: requests whose handoff failed and that were run again on a decode engine
    # Engine step timers, totals since start (EngineStats of several engines add up): steps, the host's time in
    # them, the device's time on their work, and the device's idle gaps between them (engine/step_copies.py).
    steps: int = 0
    decode_rows: int = 0  # streams decoded, summed over the steps: / steps, the streams a step carries
    step_host_s: float = 0.0
    step_gpu_s: float = 0.0
    step_gap_s: float = 0.0
    # Host time of the engine loop outside its steps while work is running (the inbox, handing outputs to the
    # event loop, stats): with the gaps above, where a step period goes that the step itself does not explain.
    loop_other_s: float = 0.0
    waiting_for_text: int = 0  # streaming text: running requests out of text at the last step
    text_wait_s: float = 0.0  # streaming text: seconds requests sat out decode steps waiting for text, summed
    # Engines of the deployment found dead (a replica, a decode engine): the gauges above leave them out, so a
    # router balancing on free blocks does not see capacity that is gone.
    engines_down: int = 0


@dataclass
class ModelInfo:
    name: str
    model_type: str  # base | custom_voice | voice_design
    model_size: str
    sample_rate: int
    languages: list[str]
    speakers: list[str]
    hidden_size: int

    @classmethod
    def from_configs(cls, name: str, config: Qwen3TTSConfig, speech: SpeechTokenizerConfig) -> ModelInfo:
        return cls(name=name, model_type=config.tts_model_type, model_size=config.tts_model_size,
                   sample_rate=speech.output_sample_rate, languages=supported_languages(config),
                   speakers=sorted(config.talker_config.spk_id), hidden_size=config.talker_config.hidden_size)


class EngineClient(abc.ABC):
    """What the server needs from the engine side. All methods are called from the server's event loop."""

    info: ModelInfo

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def stop(self, grace_s: float = 10.0) -> None:
        """Stops taking requests, lets running ones finish for up to `grace_s`, then aborts the rest."""

    @abc.abstractmethod
    def generate(self, req: SynthesisRequest) -> AsyncIterator[StreamChunk]:
        """Streams the request's chunks. Raises RequestRejected on the first iteration if it is refused.
        Closing the iterator early (client gone) aborts the request and frees its resources."""

    @abc.abstractmethod
    async def abort(self, request_id: str, reason: str = "aborted") -> None: ...

    # Streaming text input: what serves it overrides both. A topology that cannot carry text to a running
    # request yet refuses it here, so a client is told at once instead of waiting on a request that never ends.
    takes_text_input: bool = False

    async def append_text(self, request_id: str, text: str, close: bool = False) -> None:
        """More text for a `text_open` request (a piece cut by `TextStream`, so it tokenises on its own), in
        order; `close` ends its text. Text for a request that has finished is dropped (its last chunk is out)."""
        raise RequestRejected(501, f"streaming text input is not supported by {type(self).__name__}")

    @abc.abstractmethod
    async def extract_voice(self, samples: np.ndarray, sample_rate: int) -> VoiceFeatures:
        """Speaker embedding and reference codes of a clip (Base models); raises RequestRejected(400)."""

    @abc.abstractmethod
    def stats(self) -> EngineStats: ...

    @abc.abstractmethod
    def is_alive(self) -> bool:
        """True while the engine side can serve (its loop runs and it is not shutting down)."""


class HeldText:
    """Streaming text for requests whose next hop cannot take it yet (split's talker stream not open, a PD decode
    side not armed, a decode worker's handoff not landed): held per request in arrival order, then handed on in
    that order, after which later text goes straight to the same client."""

    def __init__(self) -> None:
        self.held: dict[str, list[tuple[str, bool]]] = {}
        self.routes: dict[str, EngineClient] = {}

    def hold(self, request_id: str) -> bool:
        """Starts holding `request_id`'s text; False when it is already held or routed (a duplicate id)."""
        if request_id in self.held or request_id in self.routes:
            return False
        self.held[request_id] = []
        return True

    async def append(self, request_id: str, text: str, close: bool) -> bool:
        """Holds or passes on one piece; False when this request is neither held nor routed here."""
        held = self.held.get(request_id)
        if held is not None:
            held.append((text, close))
        elif (client := self.routes.get(request_id)) is not None:
            await client.append_text(request_id, text, close)
        else:
            return False
        return True

    async def hand_on(self, request_id: str, client: EngineClient) -> None:
        """`client` can take the text now: what was held goes first (text arriving meanwhile joins the queue,
        so order holds), then text goes straight there. Nothing is held for a request not held here."""
        held = self.held.get(request_id)
        if held is None:
            return
        self.routes[request_id] = client
        while held:
            text, close = held.pop(0)
            await client.append_text(request_id, text, close)
        del self.held[request_id]

    def forget(self, request_id: str) -> None:
        """At the end of the request's stream, or at its abort (a stream asked for and never read has no end)."""
        self.held.pop(request_id, None)
        self.routes.pop(request_id, None)


def put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    """On the event loop: items handed over from another thread in one call, into their streams' queues, in order
    (one cross-thread call per batch, not per item)."""
    for q, item in items:
        q.put_nowait(item)
