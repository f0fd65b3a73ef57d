"""`POST /v1/audio/speech`: the route, and the service that turns a validated `SpeechRequest` into a
`SynthesisRequest` for the engine (voice resolution, per-model rules, the operator's limits, sampling).

Delivery (whole file, raw stream, SSE) is `streaming.SpeechResponder`'s job; the route only joins the two.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from fastapi import APIRouter, Request
from fastapi.responses import Response

from legato.models.qwen3_tts.inputs import SpeechInput
from legato.models.qwen3_tts.sampling import SamplingParams, SamplingParamsError
from legato.pipeline.client import EngineClient, SynthesisRequest
from legato.pipeline.messages import brief
from legato.server.aliases import (
    OPENAI_TTS_MODELS,
    OPENAI_VOICE_ALIASES,
    is_openai_voice,
    model_ids,
    preset_of,
    resolve_alias,
)
from legato.server.encoding import (
    MEDIA_TYPES,
    STREAMABLE,
    AudioFormat,
    audio_options_problem,
)
from legato.server.errors import ApiError, ErrorResponse
from legato.server.frame_budget import FrameBudget, LengthAsk
from legato.server.json_body import FastJsonRoute
from legato.server.media import ClipCache, MediaError, MediaPolicy, resolve_ref_clip
from legato.server.prompt_limit import PromptLimit
from legato.server.schemas import SpeechRequest
from legato.server.settings import ServerSettings
from legato.server.streaming import SpeechResponder
from legato.server.text import is_blank
from legato.server.voices import VoiceStore, parse_speaker_embedding

SPEECH_PATH = "/v1/audio/speech"
TASK_TYPES = {"base": "Base", "custom_voice": "CustomVoice", "voice_design": "VoiceDesign"}
_BASE_ONLY = ("ref_audio", "ref_text", "speaker_embedding", "x_vector_only_mode")


@dataclass
class PreparedSpeech:
    synthesis: SynthesisRequest
    audio: AudioFormat
    mode: str  # file | audio | sse
    budget: FrameBudget | None = None  # its frame limit and the cap behind it (None: the front has no tokenizer)


class SpeechService:
    """Checks a request against the served model and the limits, and builds its `SynthesisRequest`.
    Every refusal is an `ApiError` naming the field and, where there is a choice, what is available."""

    def __init__(self, client: EngineClient, settings: ServerSettings, voice_store: VoiceStore | None,
                 prompt_limit: PromptLimit | None = None) -> None:
        self.client = client
        self.settings = settings
        self.voice_store = voice_store
        self.prompt_limit = prompt_limit  # None: the engines' own admission check is the only one
        self.voice_aliases = {k.lower(): v.lower() for k, v in settings.voice_aliases.items()}
        self.media_policy = MediaPolicy(
            allowed_local_media_path=settings.allowed_local_media_path, allow_remote=settings.allow_remote_media,
            max_bytes=settings.max_ref_audio_bytes, max_seconds=settings.max_ref_audio_seconds,
            timeout_s=settings.media_fetch_timeout_s, allow_remote_networks=settings.remote_media_allow_cidrs,
        )
        self.clips = ClipCache()  # inline reference clips, decoded once per server however often they come

    @property
    def model_name(self) -> str:
        return self.settings.model_name or self.client.info.name

    @property
    def model_ids(self) -> list[str]:
        """The ids a request's `model` may take (the served name first), as /v1/models lists them."""
        return model_ids(self.model_name)

    @property
    def task_type(self) -> str:
        return TASK_TYPES.get(self.client.info.model_type, self.client.info.model_type)

    async def prepare(self, body: SpeechRequest, request_id: str, text_open: bool = False) -> PreparedSpeech:
        """`text_open`: `body.input` is the first piece of a text still arriving (the streaming-text WebSocket):
        the request takes the streaming-text layout, and its frame budget is left to the engine, which caps it by
        its whole text when the text closes (the first piece would cap it far too short)."""
        self._check_request(body)
        sampling, max_frames = self._sampling(body)
        inp = await self._speech_input(body)
        if text_open:
            if inp.non_streaming_mode:
                raise ApiError(400, "streaming text input needs non_streaming_mode false (the text is not all "
                                    "there to put in the prompt)", "unsupported_field", "non_streaming_mode")
            inp.non_streaming_mode = False
        budget = None
        if self.prompt_limit is not None and not text_open:
            budget = self.prompt_limit.check(inp, self._length_ask(body))
        if budget is not None:  # the smallest cap, passed on: the engine's own caps are never smaller
            sampling.max_new_tokens = budget.frames + 1
            max_frames = budget.frames if max_frames is not None else None
        mode = body.mode
        synthesis = SynthesisRequest(
            request_id=request_id, input=inp, sampling=sampling, max_frames=max_frames,
            ignore_eos=body.ignore_eos, first_chunk_frames=body.first_chunk_frames, text_open=text_open,
        )
        audio = AudioFormat(body.response_format, body.sample_rate, body.mp3_bitrate)
        return PreparedSpeech(synthesis, audio, mode, budget)

    def _length_ask(self, body: SpeechRequest) -> LengthAsk:
        default = self.settings.max_new_tokens_default
        if body.num_frames is not None:
            return LengthAsk(body.num_frames, "num_frames", exact=body.ignore_eos)
        if body.max_new_tokens is not None:
            return LengthAsk(body.max_new_tokens - 1, "max_new_tokens")
        return LengthAsk(default_frames=None if default is None else default - 1)

    # --- checks that need the model or the limits ------------------------------------------------------

    def _check_request(self, body: SpeechRequest) -> None:
        if body.model is not None and body.model not in self.model_ids:
            raise ApiError(404, f"model {body.model!r} is not served here; available: [{self.model_name!r}] (or "
                                f"one of OpenAI's names: {', '.join(sorted(OPENAI_TTS_MODELS))})",
                           "model_not_found", "model")
        if body.speed != 1.0:
            raise ApiError(400, f"speed {body.speed:g} is not supported: the only supported speed is 1.0 (no "
                                "time-stretch yet)", "unsupported_speed", "speed")
        problem = audio_options_problem(body.response_format, body.sample_rate, body.mp3_bitrate,
                                        self.client.info.sample_rate)
        if problem is not None:
            raise ApiError(400, *problem)
        if body.task_type is not None and body.task_type != self.task_type:
            raise ApiError(400, f"task_type {body.task_type} does not match the served model, which is a "
                                f"{self.task_type} model", "task_type_mismatch", "task_type")
        if body.stream_format == "sse" and body.stream is False:
            raise ApiError(400, "stream_format sse always streams; drop stream=false", "conflicting_stream", "stream")
        streamed = body.stream is True or body.stream_format == "sse"
        if streamed and body.response_format not in STREAMABLE:
            raise ApiError(400, f"response_format {body.response_format} cannot be streamed; streamable: "
                                f"{', '.join(STREAMABLE)}", "unsupported_format", "response_format")
        limit = self.settings.max_input_chars
        for name in ("input", "instructions", "ref_text"):
            value = getattr(body, name)
            if value is not None and len(value) > limit:
                raise ApiError(400, f"{name} is {len(value)} characters; the limit is {limit}",
                               f"{name}_too_long", name)
        cap = self.settings.max_new_tokens_limit
        if body.max_new_tokens is not None and body.max_new_tokens > cap:
            raise ApiError(400, f"max_new_tokens {body.max_new_tokens} exceeds the limit of {cap}",
                           "max_new_tokens_too_large", "max_new_tokens")
        if body.num_frames is not None and body.num_frames + 1 > cap:
            raise ApiError(400, f"num_frames {body.num_frames} exceeds the limit of {cap - 1}",
                           "num_frames_too_large", "num_frames")
        # Both name the request's length: num_frames N is max_new_tokens N + 1. Two different lengths leave no
        # way to tell which the client meant, and taking one silently would run a request it did not ask for.
        if (body.num_frames is not None and body.max_new_tokens is not None
                and body.max_new_tokens != body.num_frames + 1):
            raise ApiError(400, f"num_frames {body.num_frames} and max_new_tokens {body.max_new_tokens} ask for "
                                f"different lengths (num_frames N is max_new_tokens N + 1): give one of them",
                           "conflicting_length", "max_new_tokens")

    def _sampling(self, body: SpeechRequest) -> tuple[SamplingParams, int | None]:
        def pick(value: Any, default: Any) -> Any:
            return default if value is None else value

        # Without a default the request's frame budget sets it (prepare); without a tokenizer in the front to
        # work that out, the largest ask stands in and the engine's frame cap still holds the request.
        fallback = self.settings.max_new_tokens_default or self.settings.max_new_tokens_limit
        max_new_tokens = pick(body.max_new_tokens, fallback)
        max_frames = None
        if body.num_frames is not None:
            max_frames = body.num_frames
            max_new_tokens = body.num_frames + 1
        try:
            params = SamplingParams.from_generation_defaults(
                self.settings.generation_defaults,
                do_sample=body.do_sample, temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
                repetition_penalty=body.repetition_penalty, max_new_tokens=max_new_tokens,
                subtalker_do_sample=body.subtalker_do_sample, subtalker_temperature=body.subtalker_temperature,
                subtalker_top_k=body.subtalker_top_k, subtalker_top_p=body.subtalker_top_p, seed=body.seed,
            )
        except SamplingParamsError as e:
            raise ApiError(400, str(e), "invalid_sampling") from e
        return params, max_frames

    # --- the voice, per model type --------------------------------------------------------------------

    async def _speech_input(self, body: SpeechRequest) -> SpeechInput:
        info = self.client.info
        common = dict(text=body.input, language=self._language(body.language),
                      non_streaming_mode=body.non_streaming_mode)
        if info.model_type != "base":
            for name in _BASE_ONLY:
                if getattr(body, name) not in (None, False):
                    raise ApiError(400, f"{name} is for Base (voice clone) models; this server runs a "
                                        f"{self.task_type} model", "unsupported_field", name)
        if info.model_type == "custom_voice":
            if body.instructions and info.model_size == "0b6":
                raise ApiError(400, "the 0.6B CustomVoice model takes no instructions (the 1.7B CustomVoice and "
                                    "the VoiceDesign models do)", "unsupported_field", "instructions")
            return SpeechInput(speaker=self._preset_speaker(body.voice_name), instructions=body.instructions,
                               **common)
        if info.model_type == "voice_design":
            if not body.instructions or is_blank(body.instructions):
                raise ApiError(400, "a VoiceDesign model needs instructions describing the voice",
                               "missing_instructions", "instructions")
            # The OpenAI SDK requires a voice: one of OpenAI's names beside the instructions is taken as that and
            # left out (the instructions are the voice); any other name is refused.
            if body.voice_name is not None and not is_openai_voice(body.voice_name):
                raise ApiError(400, "a VoiceDesign model has no voices: describe the voice in instructions (an "
                                    "OpenAI voice name, which the OpenAI SDK requires, may stand beside them)",
                               "unsupported_field", "voice")
            return SpeechInput(instructions=body.instructions, **common)
        if body.instructions:
            raise ApiError(400, "a Base (voice clone) model takes no instructions", "unsupported_field",
                           "instructions")
        return SpeechInput(**common, **await self._clone_fields(body))

    def alias_table(self) -> dict[str, str]:
        """Each voice alias -> the preset it speaks with on the served CustomVoice model (stand-ins included;
        logged at start, so which voice answers `alloy` is never a guess). Empty for other model types."""
        if self.client.info.model_type != "custom_voice":
            return {}
        by_lower = {s.lower(): s for s in self.client.info.speakers}
        resolved = {a: resolve_alias(a, self.voice_aliases, by_lower) for a in self.voice_aliases}
        return {a: by_lower[v] for a, v in resolved.items() if v is not None}

    def unanswered_aliases(self) -> dict[str, str]:
        """The operator's aliases (`--voice-alias NAME=VOICE`) whose voice the served CustomVoice model lacks: a
        request saying NAME would get a 400, so the server says so at start. (A Base model's aliases name saved
        voices, which may come later.)"""
        if self.client.info.model_type != "custom_voice":
            return {}
        served = {s.lower() for s in self.client.info.speakers}
        return {a: v for a, v in self.voice_aliases.items()
                if OPENAI_VOICE_ALIASES.get(a) != v and resolve_alias(a, self.voice_aliases, served) is None}

    def _language(self, language: str | None) -> str:
        if language is None:
            return "auto"
        known = {x.lower(): x for x in self.client.info.languages}
        if language.lower() not in known:
            raise ApiError(400, f"unsupported language {language!r}; supported: {sorted(known.values())}",
                           "unsupported_language", "language")
        return known[language.lower()]

    def _preset_speaker(self, voice: str | None) -> str:
        speakers = self.client.info.speakers
        if voice is None:
            raise ApiError(400, f"voice is required: a preset speaker, one of {speakers}", "missing_voice", "voice")
        preset = preset_of(voice, self.voice_aliases, speakers)
        if preset is None:
            by_lower = {s.lower(): s for s in speakers}
            aliases = sorted(a for a in self.voice_aliases if resolve_alias(a, self.voice_aliases, by_lower))
            raise ApiError(400, f"unknown voice {brief(voice)}; available: {speakers}"
                                + (f", or an alias: {aliases}" if aliases else ""), "unknown_voice", "voice")
        return preset

    async def _clone_fields(self, body: SpeechRequest) -> dict[str, Any]:
        """SpeechInput fields of a Base request: exactly one of a saved voice, ref_audio or an embedding."""
        sources = [n for n in ("voice", "ref_audio", "speaker_embedding")
                   if (body.voice_name if n == "voice" else getattr(body, n)) is not None]
        if not sources:
            raise ApiError(400, "a Base model clones a voice: give voice (a saved voice; available: "
                                f"{self._saved_voices()}), ref_audio (+ ref_text) or speaker_embedding",
                           "missing_voice", "voice")
        if len(sources) > 1:
            raise ApiError(400, f"give only one voice source, got {' and '.join(sources)}", "conflicting_voice",
                           sources[1])
        if body.voice_name is not None:
            return self._saved_voice(body)
        if body.speaker_embedding is not None:
            if body.ref_text is not None:
                raise ApiError(400, "ref_text needs ref_audio: a speaker_embedding clones from the x-vector "
                                    "alone", "unsupported_field", "ref_text")
            return {"speaker_embedding": self._embedding(body.speaker_embedding), "x_vector_only": True}
        if not body.x_vector_only_mode and not (body.ref_text and not is_blank(body.ref_text)):
            raise ApiError(400, "in-context cloning needs ref_text (the transcript of ref_audio); or set "
                                "x_vector_only_mode", "missing_ref_text", "ref_text")
        try:
            clip = await resolve_ref_clip(body.ref_audio, self.media_policy, self.clips)
        except MediaError as e:
            # the voices route's codes (voices_api._CODES): a path or URL the media policy forbids is
            # `forbidden_media` there, a clip over the policy's bytes or seconds `request_too_large`, and the
            # same refusal should not change its name between routes
            code = _MEDIA_CODES.get(e.status, "invalid_ref_audio")
            raise ApiError(e.status, e.message, code, "ref_audio") from e
        return {"ref_audio": clip.samples, "ref_sample_rate": clip.rate, "ref_audio_key": clip.key,
                "ref_text": body.ref_text, "x_vector_only": body.x_vector_only_mode}

    def _saved_voices(self) -> str:
        """The saved voices for an error message: the first few by name (the listing route has them all)."""
        names = [v.name for v in self.voice_store.list()] if self.voice_store is not None else []
        shown = ", ".join(names[:_LISTED]) or "none"
        return shown + (f" and {len(names) - _LISTED} more (GET /v1/audio/voices)" if len(names) > _LISTED else "")

    def _saved_voice(self, body: SpeechRequest) -> dict[str, Any]:
        voice = self.voice_store.get(body.voice_name) if self.voice_store is not None else None
        alias = self.voice_aliases.get(body.voice_name.lower())
        if voice is None and alias is not None and self.voice_store is not None:
            voice = self.voice_store.get(alias)
        if voice is None:
            raise ApiError(400, f"unknown voice {brief(body.voice_name)}; saved voices: {self._saved_voices()}",
                           "unknown_voice", "voice")
        if body.ref_text is not None:
            raise ApiError(400, "a saved voice carries its own ref_text", "unsupported_field", "ref_text")
        fields = voice.speech_fields()
        if body.x_vector_only_mode:
            fields.update(ref_code=None, ref_text=None, x_vector_only=True)
        return fields

    def _embedding(self, values: list[float]) -> torch.Tensor:
        try:
            return parse_speaker_embedding(values, self.client.info.hidden_size)
        except ValueError as e:
            raise ApiError(400, str(e), "invalid_speaker_embedding", "speaker_embedding") from e


_LISTED = 20  # saved voices an error message names
# a MediaError's code by status (voices_api._CODES names them alike); any other status is a clip we cannot use
_MEDIA_CODES = {403: "forbidden_media", 413: "request_too_large"}


_ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 403, 404, 409, 413, 415, 429, 500, 503, 504)}
_AUDIO = {"content": {t: {"schema": {"type": "string", "format": "binary"}}
                      for t in (*MEDIA_TYPES.values(), "text/event-stream")},
          "description": "The audio (file or stream) or an SSE event stream."}


def build_speech_router(service: SpeechService, responder: SpeechResponder) -> APIRouter:
    router = APIRouter(route_class=FastJsonRoute)  # clone bodies carry ~0.5 MB clips: parsed in Rust

    @router.post(SPEECH_PATH, responses={200: _AUDIO, **_ERRORS}, response_class=Response)
    async def create_speech(body: SpeechRequest, request: Request) -> Response:
        rid = request.state.request_id
        responder.claim(rid)
        try:
            prepared = await service.prepare(body, rid)
            return await responder.respond(prepared.synthesis, prepared.audio, prepared.mode, request,
                                           prepared.budget)
        except BaseException:
            if getattr(request.state, "generation", None) is None:  # a Generation releases its id itself
                responder.release(rid)
            raise

    return router
