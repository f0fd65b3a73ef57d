"""One worker's engine: `add_request`, `abort`, and `step()` = launch step t (schedule, queue the device
work) -> collect step t - 1 (codes, stop decisions, audio), yielding per-request streaming outputs (new
frames of 16 codes and new PCM).

The engine knows nothing of HTTP or other workers. Bad requests raise at `add_request` (PromptError,
QueueFullError, RequestTooLargeError, ValueError) before anything is allocated; a failure inside a step
fails the requests of that step with a reason, and the engine keeps serving.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from legato.engine.block_manager import BlockManager
from legato.engine.codec_streamer import CodecStreamer, StreamSchedule
from legato.engine.config import EngineConfig, codec_dtype_name
from legato.engine.disagg import make_handoff, model_hash, receive_handoff
from legato.engine.kv_cache import profile_kv_blocks
from legato.engine.model_runner import DecodeWork, ModelRunner, PrefillWork
from legato.engine.mtp_replicas import replica_group
from legato.engine.request import Request
from legato.engine.sampler import draw_seed
from legato.engine.scheduler import DuplicateRequestError, RequestTooLargeError, Scheduler, StepResult
from legato.engine.slot_state import SlotAssignment
from legato.engine.step_copies import PendingCopy, StepCopies, StepTimes
from legato.kv_transfer.handoff import Handoff, KVLayout
from legato.models.qwen3_tts.config import Qwen3TTSConfig
from legato.models.qwen3_tts.decoder_layer import pack_projections
from legato.models.qwen3_tts.inputs import SpeechInput, build_spec
from legato.models.qwen3_tts.loader import LoadedModel
from legato.models.qwen3_tts.prompt import PromptError, PromptSpec, TalkerPrompt, target_text_tokens
from legato.models.qwen3_tts.prompt_build import build_prompt, build_prompts
from legato.models.qwen3_tts.sampling import SamplingParams

log = logging.getLogger(__name__)

# The error of requests whose step ran a one-launch code-predictor pass that gave up at its grid barrier.
STACK_GAVE_UP = ("engine step failed: the code predictor's one-launch pass gave up waiting for its programs at a "
                 "grid barrier (they could not all run at once), so this step's codes are not valid; serve without "
                 "--code-predictor-stack if this repeats")


CODE_GROUPS = 16  # codebooks a frame: the released models' num_code_groups
# Counts of prompts the warm-up prefills at once after its first group of three (`Engine.warm_up`).
WARM_UP_PROMPTS_AT_ONCE = (1, 2, 4, 8, 16)
# How a request whose streamed text outgrew its buffer fails, and the code its final output carries to the front:
# the socket reports it as the client's error by the code, not by matching the message.
TEXT_OVERFLOW = "streamed text exceeds max_text_tokens"
TEXT_TOO_LONG = "text_too_long"


class TextTooLongError(ValueError):
    """A prompt whose text is already over `max_text_tokens` at admission: the client's text, not the server,
    is too much, so the front reports it as the streamed overflow is reported (TEXT_TOO_LONG), not as a
    generic bad request."""


class RequestIdEnding(DuplicateRequestError):
    """The id's earlier request has ended, but its last output is still on its way out of the engine: the id is
    free once that is delivered (a step or so). The engine's thread may hold the request until then."""


@dataclass
class EngineRequest:
    """A request as the engine takes it. `max_frames` None means `sampling.max_new_tokens - 1` (the
    reference's frame count); `ignore_eos` masks EOS for the whole request (fixed-length benchmarks)."""

    request_id: str
    spec: PromptSpec
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_frames: int | None = None
    ignore_eos: bool = False
    stream_audio: bool = True
    first_chunk_frames: int | None = None  # None: the engine's configured first chunk
    handoff_only: bool = False  # prefill worker: stop after prefill and emit a Handoff for a decode worker
    prompt: TalkerPrompt | None = None  # `Engine.prepare_prompt(spec)`, built off the engine's thread; None: at add


@dataclass
class RequestOutput:
    """What one step produced for one request: only the new frames and audio (deltas)."""

    request_id: str
    codes: torch.Tensor  # [n, 16] int64, new frames
    audio: np.ndarray | None  # float32 PCM, new samples (None when nothing was decoded)
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort | error
    error: str | None = None
    error_code: str | None = None  # on an "error" end the request itself caused (TEXT_TOO_LONG); None otherwise
    num_prompt_tokens: int = 0
    num_frames: int = 0  # total so far
    seed: int = 0
    handoff: Handoff | None = None  # set on the final output of a `handoff_only` request


@dataclass
class _Live:
    req: Request
    prompt: TalkerPrompt
    engine_req: EngineRequest
    seed: int
    ref_code: torch.Tensor | None = None
    incoming: Handoff | None = None  # a decode worker's request: the prefill it continues from
    outgoing: Handoff | None = None  # a prefill worker's request: what it hands on
    frame_cap: int | None = None  # set when the text-derived frame cap is what bounds this request
    started: bool = False  # its slot holds its state: appended text goes to the slot, not the prompt
    text_tokens: int = 0  # streaming text: target-text tokens known so far (the first rides in the prompt)
    waiting_since: float | None = None  # streaming text: when it last ran out of text
    new_codes: list[np.ndarray] = field(default_factory=list)  # [16] int64 frames not yet in an output
    frames: int = 0  # frames collected (a frame in flight past the request's end is never counted)
    reason: str | None = None  # how it ended, once it has
    error: str | None = None
    error_code: str | None = None  # RequestOutput.error_code of its end


@dataclass
class _Launched:
    """A step queued on the device and not yet collected: which request each result row belongs to (a
    "frame" row: 16 codes + the next codebook 0; a "first" row: the first codebook 0 of a prompt that
    ended), what ends with it (the scheduler already finished them: max_frames, or a handoff made), and
    the outputs of requests that failed or were aborted before it ran."""

    rows: list[tuple[str, str]] = field(default_factory=list)
    ending: dict[str, Request] = field(default_factory=dict)
    errors: list[RequestOutput] = field(default_factory=list)
    copy: PendingCopy | None = None
    stack_check: bool = False  # the copy's last row is the one-launch code predictor's barrier give-ups so far


def warm_up_input(cfg: Qwen3TTSConfig) -> SpeechInput:
    """A throwaway request of the model's kind that takes its prompt's longest path (Base: in-context)."""
    text = "Warming up the engine before the first request."
    if cfg.tts_model_type == "custom_voice":
        return SpeechInput(text, speaker=sorted(cfg.talker_config.spk_id)[0])
    if cfg.tts_model_type == "voice_design":
        return SpeechInput(text, instructions="A calm voice.")
    return SpeechInput(text, speaker_embedding=torch.zeros(cfg.talker_config.hidden_size),
                       ref_code=torch.zeros(8, 16, dtype=torch.long), ref_text="Warm up.")


class Engine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        groups = loaded.config.talker_config.num_code_groups
        if groups != CODE_GROUPS:
            # The step's rows, copies and kernels are laid out for 16 (a codebook-0 token, 15 predicted codes).
            raise ValueError(f"the engine serves models of {CODE_GROUPS} codebooks a frame, as every released "
                             f"Qwen3-TTS 12 Hz model has; this one has num_code_groups={groups}")
        self.loaded = loaded
        self.config = config
        talker = loaded.talker
        talker.pack_frame_table()  # a frame's 16 codebook embeddings in one gather (the tables become its views)
        if talker.codec_head.weight.is_cuda:
            # Packed serving copies of the projections exist before the KV cache is sized, so they count.
            pack_projections(talker)
            if config.code_predictor_stack:
                talker.code_predictor.pack_stack()
            else:
                talker.code_predictor.prepare_lookup()
        num_blocks = config.num_kv_blocks or profile_kv_blocks(loaded, config)
        config.num_kv_blocks = num_blocks
        pad_id = torch.tensor([loaded.config.tts_pad_token_id, loaded.config.tts_eos_token_id],
                              device=talker.codec_head.weight.device)
        with torch.inference_mode():
            tts_pad, self._tts_eos = talker.embed_text(pad_id)
        self.num_waiting_for_text = 0  # running requests that sat out the last step for want of text
        self.text_wait_s = 0.0  # streaming text: seconds requests sat out decode steps waiting for text, summed
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager)
        self.runner = ModelRunner(talker, config, num_blocks, tts_pad)
        # A talker-only engine (`split`) has no codec streamer: its codes go to a codec worker.
        graphs = talker.codec_head.weight.is_cuda and not config.enforce_eager
        codec_dtype = getattr(torch, codec_dtype_name(config.codec_dtype, config.device))
        self.codec = (CodecStreamer(loaded.speech_tokenizer.decoder, StreamSchedule.of(config), config.max_num_seqs,
                                    graphs=graphs, dtype=codec_dtype)
                      if config.emit_audio and not config.prefill_only else None)
        self.live: dict[str, _Live] = {}
        self._done: list[RequestOutput] = []
        self.eos_id = loaded.config.talker_config.codec_eos_token_id
        self.kv_layout = KVLayout.of_cache(self.runner.kv.k, model_hash(loaded))
        self.copies = StepCopies(2 * config.max_num_seqs, 17, self.runner.device)
        self._tails: dict[str, _Live] = {}  # ended, their last audio on its way back from the codec
        self.times = StepTimes()
        self._in_flight: _Launched | None = None
        # Barrier give-ups of the one-launch code predictor seen so far; those of earlier engines in this process
        # (the count is per device) are not this engine's.
        self._stack_gave_up = self.runner.stack_gave_up_so_far()

    # --- requests -------------------------------------------------------------------------------------

    def add_request(self, er: EngineRequest) -> int:
        """Admits a request to the waiting queue; returns its seed. Raises for bad or oversized requests."""
        self._check_id_free(er.request_id)
        if self.config.prefill_only and not er.handoff_only:
            raise ValueError("this engine only prefills (an MpNd prefill engine): its requests hand their prefill "
                             "on to a decode engine (handoff_only)")
        er.sampling.validate()
        if er.first_chunk_frames is not None and not (isinstance(er.first_chunk_frames, int) and
                                                      er.first_chunk_frames >= 1):
            raise ValueError("first_chunk_frames must be an integer >= 1")
        max_frames = er.max_frames if er.max_frames is not None else er.sampling.max_new_tokens - 1
        if max_frames < 1:
            raise ValueError("the request allows no frames (max_new_tokens must be >= 2)")
        prompt = er.prompt if er.prompt is not None else self.prepare_prompt(er.spec)
        limit = self.config.max_prompt_tokens
        if limit is not None and prompt.length > limit:
            # Refused before it queues: a prompt this long would hold prefill budget for many steps.
            raise RequestTooLargeError(f"prompt is {prompt.length} tokens; the limit is {limit} "
                                       "(max_prompt_tokens, --max-prompt-tokens)")
        frame_cap = None
        # An exact length is the caller's to choose; an open text is capped when it closes.
        if not er.spec.text_open and not (er.ignore_eos and er.max_frames is not None):
            frame_cap = self.frame_cap(er.spec)
            if frame_cap is not None and frame_cap < max_frames:
                max_frames = frame_cap
            else:
                frame_cap = None
        if prompt.trailing_text.shape[0] > self.config.max_text_tokens:
            raise TextTooLongError(
                f"input text of {prompt.trailing_text.shape[0]} tokens exceeds max_text_tokens="
                f"{self.config.max_text_tokens}; send a shorter input"
            )
        seed = er.sampling.seed if er.sampling.seed is not None else draw_seed()
        if er.handoff_only or self.codec is None:
            er.stream_audio = False  # the decode worker (or the codec worker) makes this request's audio
        req = Request(request_id=er.request_id, prompt_len=prompt.length, max_frames=max_frames)
        live = _Live(req, prompt, er, seed, ref_code=er.spec.ref_code, frame_cap=frame_cap)
        if er.spec.text_open:
            req.text_frames = prompt.trailing_text.shape[0]
            live.text_tokens = target_text_tokens(er.spec)
        self.scheduler.add(req)
        self.live[er.request_id] = live
        return seed

    # --- streaming text -------------------------------------------------------------------------------

    @torch.inference_mode()
    def append_text(self, request_id: str, ids: list[int], close: bool = False) -> bool:
        """Adds target-text token ids (no template) to a request whose text is open; `close` ends its text
        (tts_eos follows), after which it runs and finishes as a request given its whole text at once. Returns
        False for a request that is not live (finished or unknown: its final output is already out). Raises
        ValueError for a request whose text is not open; text past `max_text_tokens` fails the request."""
        live = self.live.get(request_id)
        if live is None:
            return False
        req = live.req
        if req.status.is_finished:
            # Ended by the scheduler at a launch (its frame limit) and not yet collected: it has no slot any
            # more, and its final output is on its way. Text for it is dropped, as for one already gone.
            return False
        if req.text_frames is None:
            raise ValueError(f"request {request_id!r} takes no more text (its text is closed)")
        vocab = self.loaded.config.talker_config.text_vocab_size
        if any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < vocab for i in ids):
            raise ValueError(f"text token ids must be integers in [0, {vocab})")
        parts = []
        if ids:
            device = self.runner.device
            parts.append(self.loaded.talker.embed_text(torch.tensor(ids, dtype=torch.long).to(device)))
        if close:
            parts.append(self._tts_eos.view(1, -1))
        if not parts:
            return True
        embeds = torch.cat(parts)
        start = req.text_frames
        if start + embeds.shape[0] > self.config.max_text_tokens:
            self._done += self._fail([req], f"{TEXT_OVERFLOW}={self.config.max_text_tokens}", TEXT_TOO_LONG)
            return True
        if live.started:
            self.runner.slots.extend_text(req.slot, start, embeds)
        else:
            live.prompt.trailing_text = torch.cat([live.prompt.trailing_text, embeds])
        live.text_tokens += len(ids)
        req.text_frames = None if close else start + embeds.shape[0]
        if live.waiting_since is not None:
            self.text_wait_s += time.monotonic() - live.waiting_since
            live.waiting_since = None
            if live.engine_req.stream_audio:
                self.codec.release(request_id, False)
        if close:
            self._cap_closed_text(live)
        return True

    def _cap_closed_text(self, live: _Live) -> None:
        """Now that its text is whole, the request gets the frame cap it would have had from the start (never
        below a frame past what it has already launched: the scheduler counts those)."""
        er, req = live.engine_req, live.req
        if er.ignore_eos and er.max_frames is not None:
            return
        cap = self.config.frame_cap_for(live.text_tokens)
        if cap is not None and cap < req.max_frames:
            req.max_frames = max(cap, req.num_frames + 1)
            live.frame_cap = req.max_frames

    def waits_for_text_only(self) -> bool:
        """True when a step could do nothing: every live request is out of text and nothing is in flight
        (a loop may then wait for a command instead of stepping)."""
        if self._done or self._tails or self._in_flight is not None or not self.live:
            return False
        return all(live.req.waits_for_text for live in self.live.values())

    def prepare_prompt(self, spec: PromptSpec) -> TalkerPrompt:
        """The talker prompt of `spec` (embeddings queued on the device). It reads only the weights, so a
        client may call it from its own threads and hand the result in `EngineRequest.prompt`, keeping the
        small embedding launches and the host work around them off the engine's critical path."""
        return build_prompt(spec, self.loaded.talker, self.loaded.config)

    def prepare_prompts(self, specs: Sequence[PromptSpec]) -> list[TalkerPrompt | PromptError]:
        """`prepare_prompt` for many specs in a few launches (each prompt the same bits as alone); a spec that
        cannot be a prompt gets its PromptError in its place."""
        return build_prompts(specs, self.loaded.talker, self.loaded.config)

    def frame_cap(self, spec: PromptSpec) -> int | None:
        """Most frames a request for this text may run (`EngineConfig.frames_per_text_token`), or None."""
        return self.config.frame_cap_for(target_text_tokens(spec))

    def add_handoff(self, h: Handoff, stream_audio: bool = True) -> int:
        """Admits a request prefilled by another engine; it decodes from the handoff's KV and side state.
        Raises LayoutMismatch when the handoff's KV layout is not this engine's."""
        self._check_id_free(h.request_id)
        self.kv_layout.check_compatible(h.layout)
        h.validate()
        prompt = TalkerPrompt(embeds=h.trailing_text[:0], trailing_text=h.trailing_text, tts_pad=self.runner.tts_pad)
        er = EngineRequest(h.request_id, spec=None, sampling=h.sampling, max_frames=h.max_frames,
                           ignore_eos=h.ignore_eos, stream_audio=stream_audio and self.codec is not None,
                           first_chunk_frames=h.first_chunk_frames)
        req = Request(request_id=h.request_id, prompt_len=h.num_tokens, max_frames=h.max_frames, kv_handoff=True)
        live = _Live(req, prompt, er, h.seed, ref_code=h.ref_code, incoming=h)
        if h.text_open:  # its text is still arriving: it waits for more, as it would have on the prefill engine
            req.text_frames = h.trailing_text.shape[0]
            live.text_tokens = h.text_tokens
        self.scheduler.add(req)
        self.live[h.request_id] = live
        return h.seed

    def _check_id_free(self, request_id: str) -> None:
        """Raises DuplicateRequestError for an id that is live here, RequestIdEnding for one whose earlier
        request has ended but not all of it has come out: its final output, a launched step's row, or audio on
        its way back. A new request under that id would be handed what is left of the old one (a client that
        reuses an id right after dropping its request; an outside probe found the old end delivered to the new
        stream, which then ran with nobody reading it)."""
        if request_id in self.live:
            raise DuplicateRequestError(f"duplicate request id {request_id!r}")
        launched = self._in_flight
        if (request_id in self._tails or any(o.request_id == request_id for o in self._done)
                or (launched is not None and any(rid == request_id for rid, _ in launched.rows))
                or (self.codec is not None and self.codec.holds(request_id))):
            raise RequestIdEnding(f"request id {request_id!r} is still ending (its earlier request's last output "
                                  "is on its way); retry it shortly")

    def abort(self, request_id: str, reason: str = "aborted") -> bool:
        """Frees the request's blocks and slot at once; its final output says `abort`. Unknown ids: False."""
        self.scheduler.abort(request_id, reason)  # may have ended it already, with its last step in flight
        live = self.live.pop(request_id, None) or self._tails.pop(request_id, None)
        if self.codec is not None:
            self.codec.close(request_id)
        if live is None:
            return False
        self._done.append(self._final(live, "abort", reason))
        return True

    def warm_up(self) -> float:
        """Runs throwaway requests through every path that compiles or captures on first use (packed
        prefill's Triton kernel, the compiled samplers, the codec's chunk sizes and, for Base models, the
        in-context priming), so the first real request pays for none of it. Returns the seconds it took."""
        started = time.perf_counter()
        frames = sum(StreamSchedule.of(self.config).chunk_sizes()) + 1
        spec = build_spec(self.loaded, warm_up_input(self.loaded.config))
        # Three at once: compiled functions specialise batch 1 apart from larger batches, and the first
        # burst of prompts ending in one step (their first-token sampling) must not be what compiles them. A
        # prefill engine's requests end at their handoff, as every request it serves does.
        self._warm_up_group(spec, min(3, self.config.max_num_seqs), frames)
        # Then groups of prompts ending in one prefill step, so that the eager first-token path (the head's
        # few-row products and the draw over the step's ending prompts) has met every specialisation a count of
        # them can make: Triton compiles a kernel again for an int argument of 1 or of a multiple of 16, and
        # for a pointer 16-byte aligned or not. The draw reads each sampling knob as a row of a [knob, rows]
        # table, so the row count's factors of two set the knob pointers' alignments; 1, 2, 3, 4, 8 and 16
        # rows cover every class. Missed, each cost its first burst a compile on the engine thread: 2.5 s for
        # a draw on a cold cache (an H100, docs/benchmarks.md, session of 2026-12-07 (6)).
        tokens = self.prepare_prompt(spec).length
        for n in WARM_UP_PROMPTS_AT_ONCE:  # the groups whose prompts fit one step's prefill budget
            if n <= self.config.max_num_seqs and n * tokens <= self.config.max_num_batched_tokens:
                self._warm_up_group(spec, n, 2)
        return time.perf_counter() - started

    def _warm_up_group(self, spec: PromptSpec, n: int, frames: int) -> None:
        """`n` throwaway requests added at once (their prompts prefill together), run to their end."""
        for i in range(n):
            self.add_request(EngineRequest(f"__warm_up_{n}_{i}__", spec, SamplingParams(seed=i), max_frames=frames,
                                           ignore_eos=True, handoff_only=self.config.prefill_only))
        while self.has_unfinished():
            self.step()

    def has_unfinished(self) -> bool:
        return bool(self.live or self._done or self._tails) or self._in_flight is not None

    # --- the loop -------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One engine step: launch step t on the device, then collect step t - 1, whose results the host
        reads while the device runs step t (`async_scheduling`; without it, a step is collected at once).

        Stop decisions come with the results, one step late: a request whose frame t - 1 ended it (codec
        EOS) has frame t in flight, which is dropped, never emitted. Its blocks and slot are freed when the
        stop is seen; work queued later on the same stream reuses them only after frame t is done."""
        started = time.perf_counter()
        launched = self._launch()
        ran = launched.copy is not None
        if not self.config.async_scheduling:
            outputs = launched.errors + self._collect(launched)
        else:
            previous = self._in_flight
            self._in_flight = launched if ran else None
            ran = ran or previous is not None
            outputs = launched.errors + self._collect(previous)
        # Audio is read back without waiting, except when the engine would only spin: synchronous mode, or
        # nothing left on the device but the codec's work.
        outputs += self._audio(wait=not self.config.async_scheduling or self._in_flight is None)
        if ran or outputs:  # an idle call (the engine thread's, after each 50 ms wait for work) is not a step
            self.times.steps += 1
            self.times.host_s += time.perf_counter() - started
        return outputs

    def _launch(self) -> _Launched:
        """Schedules and queues the next step's device work; the scheduler counts its tokens and frames
        at once (their values arrive when the step is collected)."""
        out = self.scheduler.schedule()
        self.num_waiting_for_text = len(out.waiting_for_text)
        if out.waiting_for_text:
            now = time.monotonic()
            for req in out.waiting_for_text:
                live = self.live.get(req.request_id)
                if live is not None and live.waiting_since is None:
                    live.waiting_since = now
                    if live.engine_req.stream_audio:
                        self.codec.release(req.request_id, True)
        launched = _Launched(errors=self._done)
        self._done = []
        self._start(out.new_requests, launched)
        prefills = [c for c in out.prefills if c.request.request_id in self.live]
        decodes = out.decodes
        if not prefills and not decodes:
            self.scheduler.update([])  # reports the step; results of requests failed above are not expected
            return launched
        begun = self.copies.begin()
        try:
            rows, results = self._run_prefills(prefills, launched)
            rows.append(self._run_decodes(decodes, launched))
            if self.runner.uses_stack and decodes:
                rows.append(self.runner.stack_gave_up_row())
                launched.stack_check = True
        except Exception as e:  # a step failure fails its requests, never the engine
            log.exception("engine step failed")
            launched.errors += self._fail([c.request for c in prefills] + decodes,
                                          f"engine step failed: {type(e).__name__}: {e}")
            self.scheduler.update([])
            launched.rows.clear()
            return launched
        results += [StepResult(r.request_id, 1, 1) for r in decodes]
        self.times.decode_rows += len(decodes)
        for req in self.scheduler.update(results):  # max_frames reached, or a handoff made
            launched.ending[req.request_id] = req
        launched.copy = self.copies.submit(torch.cat(rows) if len(rows) > 1 else rows[0], begun)
        return launched

    def _collect(self, launched: _Launched | None) -> list[RequestOutput]:
        """Reads a launched step's results: new frames, stop decisions, audio, and the final outputs."""
        if launched is None or launched.copy is None:
            return []
        host = launched.copy.wait()
        self.copies.account(launched.copy, self.times)
        if launched.stack_check:
            host, gave_up = host[:-1], int(host[-1, 0])
            if gave_up > self._stack_gave_up:  # this step's codes are not valid: its requests fail, loudly
                self._stack_gave_up = gave_up
                log.error("the code predictor's one-launch pass gave up at a grid barrier (%d so far)", gave_up)
                return self._fail([self.live[rid].req for rid, _ in launched.rows if rid in self.live], STACK_GAVE_UP)
        # Out of the pinned buffer, which a later step reuses; numpy rows, which cost far less per stream to
        # index and hand on than torch views (hundreds of streams a step).
        frames = host[:, :16].numpy().copy()
        eos = (host[:, 16] == self.eos_id).tolist()
        ending = {rid: (req, req.finish_reason) for rid, req in launched.ending.items()}
        touched: list[str] = []
        for i, (rid, kind) in enumerate(launched.rows):
            live = self.live.get(rid)
            if live is None:
                continue  # ended (aborted, failed, stopped) after this step was launched: its row is dropped
            touched.append(rid)
            if kind == "frame":
                live.new_codes.append(frames[i])
                live.frames += 1
                if live.engine_req.stream_audio:
                    self.codec.push(rid, frames[i])
            if eos[i] and live.outgoing is None:  # this was the request's last frame (or it has none)
                req = self.scheduler.stop(rid)  # None: the scheduler had ended it at launch (max_frames)
                ending[rid] = (req or live.req, "stop")
        streamed = {rid for rid, (req, _) in ending.items() if rid in self.live
                    and self.live[rid].engine_req.stream_audio}
        codec_errors = self.codec.queue(streamed) if self.codec is not None else {}
        for rid in codec_errors.keys() - ending.keys():
            self.scheduler.fail(rid, codec_errors[rid])
            ending[rid] = (self.live[rid].req, "error")
        outputs = []
        for rid in dict.fromkeys([*touched, *codec_errors]):
            live = self.live.get(rid)
            if live is None:
                continue
            req, reason = ending.get(rid, (None, None))
            if req is None:
                if not live.engine_req.stream_audio:  # a talker-only or prefill engine: its codes now
                    outputs += self._output(live)
                continue  # the codes ride with the request's next audio
            self.live.pop(rid, None)
            live.reason, live.error = reason, req.error
            if rid in codec_errors:  # it may have finished normally, but its audio is incomplete
                live.reason, live.error = "error", codec_errors[rid]
            if live.outgoing is not None and live.reason == "stop":
                live.reason = "handoff"
            if live.reason == "length" and live.frame_cap is not None:
                log.warning("request %s hit the frame cap: %d frames for its text (frames_per_text_token=%g, "
                            "frame_cap_margin=%d); finished with reason 'length'", rid, live.frame_cap,
                            self.config.frames_per_text_token, self.config.frame_cap_margin)
            if rid in streamed and rid not in codec_errors:
                self._tails[rid] = live  # its final output comes with its last audio
            else:
                outputs += self._output(live, finished=True)
        return outputs

    def _audio(self, wait: bool) -> list[RequestOutput]:
        """Outputs for the audio the codec has brought back (with the codes since each request's last
        output), and the final outputs of ended requests whose last audio is in it."""
        if self.codec is None:
            return []
        audio, closed = self.codec.ready(wait)
        outputs = []
        for rid in dict.fromkeys([*audio, *closed]):
            live = self.live.get(rid) or self._tails.get(rid)
            if live is None:
                continue  # aborted while its audio was on its way
            done = rid in closed
            if done:
                self._tails.pop(rid, None)
            outputs += self._output(live, audio.get(rid), finished=done)
        return outputs

    def _output(self, live: _Live, audio: np.ndarray | None = None, finished: bool = False) -> list[RequestOutput]:
        codes = torch.from_numpy(np.stack(live.new_codes)) if live.new_codes else torch.zeros(0, 16, dtype=torch.long)
        live.new_codes = []
        if not finished and codes.shape[0] == 0 and audio is None:
            return []
        return [RequestOutput(
            request_id=live.req.request_id, codes=codes, audio=audio, finished=finished,
            finish_reason=live.reason if finished else None, error=live.error if finished else None,
            error_code=live.error_code if finished else None,
            num_prompt_tokens=live.req.prompt_len, num_frames=live.frames, seed=live.seed, handoff=live.outgoing,
        )]

    def _start(self, reqs: list[Request], launched: _Launched) -> None:
        """Starts the step's new requests: their slots reset together, then each one's codec stream and, for
        a handed-off request, its KV and post-prefill state. A start that fails fails only its own request
        (all of them if the batched slot reset itself fails), before the model runs."""
        ready: list[tuple[Request, SlotAssignment]] = []
        for req in reqs:
            live = self.live[req.request_id]
            a = SlotAssignment(req.slot, live.prompt.trailing_text, live.engine_req.sampling, live.seed,
                               live.engine_req.ignore_eos)
            try:
                self.runner.slots.check(a)
            except Exception as e:
                launched.errors += self._start_failed([req], e)
                continue
            ready.append((req, a))
        try:
            self.runner.slots.assign_many([a for _, a in ready])
        except Exception as e:
            launched.errors += self._start_failed([req for req, _ in ready], e)
            return
        for req, _ in ready:
            self.live[req.request_id].started = True
        for req, _ in ready:
            try:
                self._open(req)
            except Exception as e:
                launched.errors += self._start_failed([req], e)

    def _start_failed(self, reqs: list[Request], e: Exception) -> list[RequestOutput]:
        log.exception("starting request(s) %s failed", ", ".join(r.request_id for r in reqs))
        return self._fail(reqs, f"request start failed: {type(e).__name__}: {e}")

    def _open(self, req: Request) -> None:
        live = self.live[req.request_id]
        if live.engine_req.stream_audio:
            self.codec.open(req.request_id, live.ref_code, live.engine_req.first_chunk_frames)
        if live.incoming is not None:
            # The prompt's KV and the state after its prefill land in this request's blocks and slot at once;
            # it decodes from the next step on.
            receive_handoff(self.runner, req.slot, list(req.block_table), live.incoming)
            live.incoming = None
            self.scheduler.handoff_complete(req.request_id)

    def _fail(self, reqs: list[Request], reason: str, code: str | None = None) -> list[RequestOutput]:
        """Finishes `reqs` with an error (`code`: RequestOutput.error_code): blocks, slot and codec stream are
        freed at once."""
        outputs = []
        for r in reqs:
            self.scheduler.fail(r.request_id, reason)
            if self.codec is not None:
                self.codec.close(r.request_id)
            live = self.live.pop(r.request_id, None)
            if live is not None:
                outputs.append(self._final(live, "error", reason, code))
        return outputs

    def _run_prefills(self, chunks, launched: _Launched) -> tuple[list[torch.Tensor], list[StepResult]]:
        """Queues every prefill chunk; a chunk that ends its prompt adds a result row (its first codebook-0
        token in column 16, where EOS means the request ends with no frame)."""
        if not chunks:
            return [], []
        work = []
        for c in chunks:
            live = self.live[c.request.request_id]
            embeds = live.prompt.embeds[c.start : c.start + c.num_tokens]
            work.append(PrefillWork(c.request.slot, embeds, c.start, list(c.request.block_table), c.is_last))
        slots, first = self.runner.prefill(work)
        ends = [c for c in chunks if c.is_last]
        handoffs = [c for c in ends if self.live[c.request.request_id].engine_req.handoff_only]
        # A prefill worker hands the request on right here, so it needs the first token now (one sync, on
        # prefill workers only).
        first_host = dict(zip(slots, first.tolist(), strict=True)) if handoffs else {}
        for c in handoffs:
            live = self.live[c.request.request_id]
            token = first_host[c.request.slot]
            if token != self.eos_id:
                live.outgoing = make_handoff(self.runner, c.request, live.prompt, live.engine_req, live.seed,
                                             token, live.ref_code, self.kv_layout, live.text_tokens)
        # A handed-on request is done here (its blocks are freed, the handoff holds a copy); so is one whose
        # first token is EOS.
        results = [StepResult(c.request.request_id, c.num_tokens, 0, stopped=c in handoffs) for c in chunks]
        rows = torch.zeros(len(ends), 17, dtype=torch.long, device=first.device)
        rows[:, 16] = first
        launched.rows += [(c.request.request_id, "first") for c in ends]
        return [rows], results

    def _run_decodes(self, reqs: list[Request], launched: _Launched) -> torch.Tensor:
        k = self.config.mtp_replicas
        work = [DecodeWork(r.slot, r.num_computed_tokens, list(r.block_table), replica_group(r.request_id, k))
                for r in reqs]
        launched.rows += [(r.request_id, "frame") for r in reqs]
        return self.runner.decode(work)

    def _final(self, live: _Live, reason: str, error: str | None, code: str | None = None) -> RequestOutput:
        live.reason, live.error, live.error_code = reason, error, code
        return self._output(live, finished=True)[0]
