"""The request body of `POST /v1/audio/speech`: OpenAI's fields plus the Qwen3-TTS extensions.

Pydantic checks types and static ranges (and rejects unknown fields, as OpenAI does); the checks that
depend on the served model or on the operator's limits (voice names, task type, input length,
`max_new_tokens` cap) are made by the speech service, with the same error shape. Every validation failure
is a 400 (see `errors.py`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from legato.server.encoding import MEDIA_TYPES, STREAMABLE, UNSUPPORTED
from legato.server.text import check_unicode, is_blank

# OpenAI's formats, so the schema clients read is OpenAI's; aac passes here and is refused by the speech
# service with the reason (encoding.py). Any other value is refused by `_known_format`, whose message lists only
# the formats that work (pydantic's own would list aac among them).
ResponseFormat = Literal["mp3", "opus", "aac", "flac", "wav", "pcm"]
TaskType = Literal["Base", "CustomVoice", "VoiceDesign"]

# Static bounds. They keep every value the engine receives inside what its batched tensors can hold
# (int64 seeds and top-k, finite temperatures) so no single request can fail the step it is batched in.
_MAX_TOP_K = 1 << 16
_MAX_FRAMES = 1 << 20


class VoiceRef(BaseModel):
    """OpenAI's custom-voice object form of `voice`: `{"id": "name"}`."""

    model_config = ConfigDict(extra="forbid")
    id: str = Field(min_length=1, max_length=256)


class SpeechRequest(BaseModel):
    # strict: "stream": "yes" or "speed": true are type errors, not guesses (ints still pass as floats)
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    # --- OpenAI fields ------------------------------------------------------------------------------
    model: str | None = Field(None, max_length=512, description="Served model name (see /v1/models).")
    input: str = Field(min_length=1, description="Text to speak.")
    voice: str | VoiceRef | None = Field(
        None, description="CustomVoice: a preset speaker (case-insensitive). Base: a saved voice name "
        "(omit it when giving ref_audio or speaker_embedding). VoiceDesign: omit.")
    response_format: ResponseFormat = Field(
        "mp3", description="mp3 (OpenAI's default), opus (Ogg), flac, wav, pcm (s16le mono); aac is refused.")
    speed: float = Field(1.0, description="Only 1.0 is supported (anything else is refused).")
    stream: bool | None = Field(
        None, description="Our extension. Unset: stream when the format allows it (mp3, opus, wav with an open "
        "length, pcm) and send flac whole; true: stream (a flac request is refused); false: the whole file, "
        "with usage headers.")
    stream_format: Literal["audio", "sse"] = Field(
        "audio", description="audio: the audio bytes (streamed as they are made, see `stream`); sse: "
        "speech.audio.delta events (base64 audio in response_format, PCM s16le for wav) then "
        "speech.audio.done with usage.")
    instructions: str | None = Field(
        None, description="Voice description (VoiceDesign) or speaking style (1.7B CustomVoice).")

    # --- Qwen3-TTS extensions -----------------------------------------------------------------------
    task_type: TaskType | None = Field(None, description="Must match the served model when given.")
    language: str | None = Field(None, max_length=64, description="'auto' (default) or a model language.")
    ref_audio: str | None = Field(None, description="Base: reference clip as a data URL, base64, file:// "
                                  "(under the allowed local media path) or http(s) (when allowed).")
    ref_text: str | None = Field(None, description="Base: transcript of ref_audio (in-context cloning).")
    x_vector_only_mode: bool = Field(False, description="Base: clone from the speaker embedding alone.")
    speaker_embedding: list[float] | None = Field(
        None, max_length=65536, description="Base: an x-vector of the model's hidden size.")
    non_streaming_mode: bool | None = Field(None, description="Prompt layout: whole text in the prompt.")
    sample_rate: int | None = Field(None, description="Our extension: the response's sample rate in Hz (default: "
                                    "the model's, 24000; resampled otherwise): 8000, 11025, 12000, 16000, 22050, "
                                    "24000, 32000, 44100 or 48000 (opus: 8000, 12000, 16000, 24000, 48000).")
    mp3_bitrate: int | None = Field(None, description="Our extension: an mp3 response's constant bitrate in kbit/s "
                                    "(default 80; 64 below 16 kHz), one of the MPEG layer III bitrates for the "
                                    "sample rate: 32-320 from 32 kHz up, 8-160 at 16-24 kHz, 8-64 below.")
    max_new_tokens: int | None = Field(None, ge=2, description="Cap on codec tokens (frames + 1).")
    seed: int | None = Field(None, ge=0, lt=1 << 63)
    do_sample: bool | None = None
    temperature: float | None = Field(None, ge=0.01, le=100.0)
    top_k: int | None = Field(None, ge=0, le=_MAX_TOP_K)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, ge=0.01, le=100.0)
    subtalker_do_sample: bool | None = None
    subtalker_temperature: float | None = Field(None, ge=0.01, le=100.0)
    subtalker_top_k: int | None = Field(None, ge=0, le=_MAX_TOP_K)
    subtalker_top_p: float | None = Field(None, gt=0.0, le=1.0)
    first_chunk_frames: int | None = Field(None, ge=1, le=4096, description="Frames in the first audio chunk.")
    ignore_eos: bool = Field(False, description="Benchmarks: never stop at EOS.")
    num_frames: int | None = Field(None, ge=1, le=_MAX_FRAMES, description="Benchmarks: exact frame count "
                                   "with ignore_eos (otherwise a cap).")

    @model_validator(mode="before")
    @classmethod
    def _null_is_not_given(cls, data: object) -> object:
        # Clients that write every field send null for the ones they leave unset (OpenAI's API takes that as "not
        # given", as our WebSocket session does): a known field's null means its default. A required field's null
        # still fails as missing, and an unknown field's null as unknown.
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k not in cls.model_fields}
        return data

    @field_validator("input")
    @classmethod
    def _input_not_blank(cls, value: str) -> str:
        if is_blank(value):
            raise ValueError("input is blank (only spaces, control or invisible characters)")
        return value

    @field_validator("response_format", mode="before")
    @classmethod
    def _known_format(cls, value: object) -> object:
        if isinstance(value, str) and (value in MEDIA_TYPES or value in UNSUPPORTED):
            return value
        shown = repr(value)[:40]
        raise PydanticCustomError("unsupported_format", "{given} is not a format; use one of {formats}",
                                  {"given": shown, "formats": ", ".join(MEDIA_TYPES)})

    @field_validator("model", "input", "voice", "instructions", "language", "ref_audio", "ref_text")
    @classmethod
    def _valid_text(cls, value: object) -> object:
        # JSON may carry lone surrogates ("\ud800"), which no tokenizer or log line can encode
        text = value.id if isinstance(value, VoiceRef) else value
        if isinstance(text, str):
            check_unicode(text)
        return value

    @property
    def voice_name(self) -> str | None:
        return self.voice.id if isinstance(self.voice, VoiceRef) else self.voice

    @property
    def mode(self) -> str:
        """How the response is delivered: sse events, a raw audio stream, or one file (see `stream`)."""
        if self.stream_format == "sse":
            return "sse"
        if self.stream is None:
            return "audio" if self.response_format in STREAMABLE else "file"
        return "audio" if self.stream else "file"


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "legato"
    # The served model this id runs: its own id, or for one of OpenAI's names (tts-1, ...) the model taken for it,
    # so a client listing models sees the aliases are one model, not several.
    root: str
    task_type: str
    sample_rate: int
    languages: list[str]
    voices: list[str]
    # legato's own fields, for load generators (OpenAI clients ignore them): each engine's --max-num-seqs and
    # the requests the whole deployment decodes at once (that times its decode engines).
    max_num_seqs: int | None = None
    decode_slots: int | None = None
    # The streaming-text WebSocket's cap on one client message (--ws-max-message-bytes): a session carrying a
    # reference clip inline must fit it.
    ws_max_message_bytes: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
