"""HTTP routes for saved voices: list, create (multipart upload or JSON), delete.

    GET    /v1/audio/voices          -> 200 {"voices": [{name, source, created_at, has_ref_code, ...}]}
    POST   /v1/audio/voices          -> 201 {name, source, created_at, has_ref_code, ref_text, ref_frames}
    DELETE /v1/audio/voices/{name}   -> 200 {"deleted": true, "name": ...} | 404

POST takes either `multipart/form-data` (fields `name`, `file` (alias `audio_sample`) the clip, `ref_audio`,
`ref_text`, `x_vector_only` (alias `x_vector_only_mode`), `speaker_embedding` (a JSON list), `replace`) or a
JSON object (`name`, `ref_audio`, `ref_text`, `speaker_embedding`, `x_vector_only`, `replace`). `ref_audio` is
a data URL, base64, file:// or http(s):// URL as the media policy allows; exactly one of the uploaded file,
`ref_audio` and `speaker_embedding` is given. Bodies are capped before they are parsed. Every refusal
is a 4xx in the server's error shape (`errors.error_body`: `{"error": {"message", "type", "param", "code"}}`).
"""

from __future__ import annotations

import codecs
import json

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException

from legato.server.errors import error_body
from legato.server.head_routes import answer_head
from legato.server.media import MediaError, MediaPolicy, decode_ref_audio, resolve_ref_audio
from legato.server.text import check_unicode
from legato.server.voices import Voice, VoiceError, VoiceStore

# room for the fields around the audio (a 2048-float embedding as JSON is ~50 KiB)
_BODY_OVERHEAD = 256 * 1024
# form field -> request field (aliases for clients written against other servers)
_FORM_FIELDS = {
    "name": "name", "ref_audio": "ref_audio", "ref_text": "ref_text", "speaker_embedding": "speaker_embedding",
    "replace": "replace", "x_vector_only": "x_vector_only", "x_vector_only_mode": "x_vector_only",
}
_FORM_FILES = ("file", "audio_sample")

# machine-readable `code` of a refusal, by status; a 413 is named as every other 413 of the server is (the body
# limit, the engine's refusal), so a too-large clip is one code on this route and on /v1/audio/speech
_CODES = {400: "invalid_voice_request", 403: "forbidden_media", 404: "voice_not_found", 409: "voice_conflict",
          413: "request_too_large", 415: "unsupported_media_type"}


class CreateVoiceRequest(BaseModel):
    """A voice to save: exactly one of `ref_audio` (or an uploaded file) and `speaker_embedding`."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(max_length=64)
    ref_audio: str | None = None
    ref_text: str | None = None
    speaker_embedding: list[float] | None = Field(None, max_length=16384)
    x_vector_only: bool = Field(False, validation_alias=AliasChoices("x_vector_only", "x_vector_only_mode"))
    replace: bool = False

    @field_validator("name", "ref_audio", "ref_text")
    @classmethod
    def _valid_text(cls, value: str | None) -> str | None:
        # the speech request's rule: a voice whose text cannot be encoded could never be listed or served
        return value if value is None else check_unicode(value)


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    code = "invalid_ref_audio" if param == "ref_audio" and status == 400 else _CODES.get(status)
    return JSONResponse(error_body(status, message, code, param), status_code=status)


def voice_listing(store: VoiceStore) -> list[dict]:
    """Preset speakers of the model (CustomVoice) followed by the saved voices."""
    presets = [{"name": s, "source": "preset"} for s in store.client.info.speakers]
    return presets + [v.to_dict() for v in store.list()]


def build_voices_router(store: VoiceStore, policy: MediaPolicy) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/audio/voices")
    async def list_voices() -> JSONResponse:
        return JSONResponse({"voices": voice_listing(store)})

    @router.post("/v1/audio/voices", status_code=201)
    async def create_voice(request: Request) -> JSONResponse:
        try:
            voice = await _create(request, store, policy)
        except VoiceError as e:
            return _error(e.status, e.message)
        except MediaError as e:
            return _error(e.status, e.message, "ref_audio")
        return JSONResponse(voice.info().to_dict(), status_code=201)

    @router.delete("/v1/audio/voices/{name:path}")
    async def delete_voice(name: str) -> JSONResponse:
        voice = store.get(name)
        try:
            deleted = await store.delete(name)
        except VoiceError as e:
            return _error(e.status, e.message, "name")
        if not deleted:
            return _error(404, f"voice {name[:80]!r} not found", "name")
        return JSONResponse({"deleted": True, "name": voice.name if voice is not None else name})

    answer_head(router)
    return router


async def _create(request: Request, store: VoiceStore, policy: MediaPolicy) -> Voice:
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media in ("multipart/form-data", "application/x-www-form-urlencoded"):
        _require_utf8(request.headers.get("content-type", ""))
        body = await _read_body(request, policy.max_bytes + _BODY_OVERHEAD)
        fields, upload = await _parse_form(request, body, policy)
        req = _validate(fields)
    elif media in ("", "application/json") or media.endswith("+json"):
        body = await _read_body(request, policy.max_bytes * 4 // 3 + _BODY_OVERHEAD)
        req = _validate_json(body)
        upload = None
    else:
        raise VoiceError(415, f"unsupported content type {media!r}: send multipart/form-data or application/json")

    store.require_base()  # before what the body lacks: no body makes a voice on another kind of model
    sources = [upload is not None, req.ref_audio is not None, req.speaker_embedding is not None]
    if sum(sources) != 1:
        raise VoiceError(400, "give exactly one of an uploaded file, ref_audio or speaker_embedding")
    store.precheck(req.name, req.replace)  # refuse before decoding or fetching anything
    audio = None
    if upload is not None:
        audio = await decode_ref_audio(upload, policy)
    elif req.ref_audio is not None:
        audio = await resolve_ref_audio(req.ref_audio, policy)
    return await store.create(req.name, audio=audio, ref_text=req.ref_text,
                              speaker_embedding=req.speaker_embedding, x_vector_only=req.x_vector_only,
                              replace=req.replace)


def _require_utf8(content_type: str) -> None:
    """Form text is UTF-8. A client-chosen charset would decide how the server reads the text: with
    `unicode_escape`, plain ASCII bytes spell lone surrogates that pass every later check."""
    for param in content_type.split(";")[1:]:
        key, _, value = param.partition("=")
        if key.strip().lower() != "charset":
            continue
        charset = value.strip().strip('"').lower()
        try:
            name = codecs.lookup(charset).name
        except (LookupError, ValueError):  # ValueError: a NUL in the name ("utf-8\x00")
            name = None
        if name not in ("utf-8", "ascii"):
            raise VoiceError(415, f"form charset {charset[:40]!r} is not supported: send form text as UTF-8")


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 once it passes `limit` (declared or actually sent)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise VoiceError(400, "invalid Content-Length header")
        if int(declared) > limit:
            raise VoiceError(413, f"request body is {int(declared)} bytes; the limit is {limit}")
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > limit:
            raise VoiceError(413, f"request body is over the limit of {limit} bytes")
    return bytes(buf)


async def _parse_form(request: Request, body: bytes, policy: MediaPolicy) -> tuple[dict, bytes | None]:
    """Parses a buffered form body -> (text fields, uploaded clip bytes or None)."""
    replayed = False

    async def receive() -> dict:
        nonlocal replayed
        if replayed:  # the parser never reads past the end; this only guards a misbehaving caller
            return {"type": "http.disconnect"}
        replayed = True
        return {"type": "http.request", "body": body, "more_body": False}

    try:
        form = await Request(request.scope, receive).form(max_files=1, max_fields=16)
    except (MultiPartException, HTTPException) as e:
        raise VoiceError(400, f"malformed form body: {getattr(e, 'message', None) or e.detail}") from e
    try:
        fields: dict = {}
        upload: bytes | None = None
        for key, value in form.multi_items():
            if key in fields or (key in _FORM_FILES and upload is not None):
                raise VoiceError(400, f"form field {key!r} given twice")
            if key in _FORM_FILES:
                if not isinstance(value, UploadFile):
                    raise VoiceError(400, f"form field {key!r} must be an uploaded audio file")
                upload = await value.read(policy.max_bytes + 1)
                if len(upload) > policy.max_bytes:
                    raise VoiceError(413, f"uploaded audio is over the limit of {policy.max_bytes} bytes")
            elif key in _FORM_FIELDS:
                if isinstance(value, UploadFile):
                    raise VoiceError(400, f"form field {key!r} must be text, not a file")
                fields[_FORM_FIELDS[key]] = value
            elif key != "consent":  # sent by clients of other servers; nothing to check here
                raise VoiceError(400, f"unknown form field {key!r}; expected one of "
                                      f"{sorted(set(_FORM_FIELDS) | set(_FORM_FILES))}")
    finally:
        await form.close()
    if "speaker_embedding" in fields:
        try:
            fields["speaker_embedding"] = json.loads(fields["speaker_embedding"])
        except (ValueError, RecursionError) as e:  # deep nesting ("[[[[...") exhausts the parser's recursion
            raise VoiceError(400, "speaker_embedding must be a JSON list of numbers") from e
    return fields, upload


_FORM_BOOLS = {"true": True, "1": True, "on": True, "false": False, "0": False, "off": False}  # "on": a checkbox


def _validate(fields: dict) -> CreateVoiceRequest:
    for key in ("replace", "x_vector_only"):
        if key in fields:
            flag = _FORM_BOOLS.get(fields[key].strip().lower())
            if flag is None:
                raise VoiceError(400, f"form field {key!r} must be true or false")
            fields[key] = flag
    try:
        return CreateVoiceRequest.model_validate(fields, strict=True)
    except ValidationError as e:
        raise VoiceError(400, _describe(e)) from e


def _validate_json(body: bytes) -> CreateVoiceRequest:
    try:
        return CreateVoiceRequest.model_validate_json(body or b"{}", strict=True)
    except ValidationError as e:
        raise VoiceError(400, _describe(e)) from e


def _describe(err: ValidationError) -> str:
    # the field paths and reasons only: echoing the input could repeat megabytes of base64
    parts = []
    for e in err.errors(include_url=False)[:5]:
        where = ".".join(str(p) for p in e["loc"]) or "body"
        parts.append(f"{where}: {e['msg']}")
    more = err.error_count() - len(parts)
    return "invalid request: " + "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")
