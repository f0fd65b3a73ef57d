"""The streaming-text WebSocket's messages (`/v1/audio/speech/stream`, docs/streaming-text.md): what a client
may send, checked into plain values, and the events the server answers with.

In (JSON text frames): `session.update` {session: the speech request's fields but `input`, plus `audio_transport`
"binary" | "base64"}; `input_text.append` {context_id, text}; `input_text.flush` {context_id};
`input_text.end` {context_id}; `response.cancel` {context_id}. Any may carry an `event_id`, echoed on the error
it causes. Out: audio (binary frames: one byte N, N bytes of context id, the audio; or `response.audio.delta`
events with base64 audio), `response.audio.done` with usage, `response.cancelled` with the milliseconds of audio
sent, `session.updated`, and `error` in OpenAI's shape plus the context and event ids.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from legato.server.errors import error_body
from legato.server.json_body import parse_json
from legato.server.schemas import SpeechRequest

STREAM_PATH = "/v1/audio/speech/stream"
CONTEXT_ID = re.compile(r"[A-Za-z0-9._:\-]{1,64}")  # fullmatch; fits the binary frame's one-byte length
EVENT_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
EVENT_TYPES = ("session.update", "input_text.append", "input_text.flush", "input_text.end", "response.cancel")
# Fields of a speech request that make no sense for a session: its text comes in events, its audio in frames.
# (`num_frames` and `ignore_eos`, the benchmark fields, are session fields as they are HTTP fields: every context
# of the session then runs that many frames, speaking past its closed text with the end-of-text padding.)
_NOT_SESSION = ("input", "stream", "stream_format")
TRANSPORTS = ("binary", "base64")


@dataclass(frozen=True, slots=True)
class WsLimits:
    """What one socket may hold. Every wait has a deadline; every buffer a bound."""

    max_message_bytes: int = 64 * 1024  # one client message
    max_text_chars: int = 4096  # text of one context, all its appends together
    max_contexts: int = 8  # contexts running at once on one socket
    idle_timeout_s: float = 60.0  # no message and no context running this long: the socket is closed
    send_queue: int = 256  # outgoing messages buffered for a client that reads slowly
    send_timeout_s: float = 10.0  # a full buffer that does not drain this long: the client is gone, close

    def __post_init__(self) -> None:
        for name in ("max_message_bytes", "max_text_chars", "max_contexts", "send_queue"):
            if getattr(self, name) < 1:
                raise ValueError(f"WsLimits.{name} must be >= 1")
        if not (self.idle_timeout_s > 0 and self.send_timeout_s > 0):
            raise ValueError("WsLimits timeouts must be > 0")


WS_DEFAULTS = WsLimits()


class ProtocolError(Exception):
    """A client message the server refuses: answered with an `error` event, the socket stays open."""

    def __init__(self, message: str, code: str, param: str | None = None, context_id: str | None = None,
                 event_id: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.code, self.param = message, code, param
        self.context_id, self.event_id, self.status = context_id, event_id, status


@dataclass(slots=True)
class ClientEvent:
    type: str
    context_id: str | None = None
    text: str = ""
    session: dict[str, Any] | None = None
    event_id: str | None = None


def parse_event(raw: str, limits: WsLimits) -> ClientEvent:
    """One text frame into a `ClientEvent`; raises ProtocolError saying what is wrong with it."""
    if len(raw) > limits.max_message_bytes or len(raw.encode("utf-8", "surrogatepass")) > limits.max_message_bytes:
        raise ProtocolError(f"message exceeds {limits.max_message_bytes} bytes (the server's --ws-max-message-bytes); "
                            "a reference clip fits as a saved voice (voice: NAME), or as a file:// ref_audio URL "
                            "where the server allows local media (--allowed-local-media-path)",
                            "message_too_large")
    try:
        data = parse_json(raw)  # a session message may carry a clip inline: ~0.5 MB of base64
    except (ValueError, RecursionError) as e:
        raise ProtocolError(f"message is not JSON: {str(e)[:100]}", "invalid_json") from None
    if not isinstance(data, dict):
        raise ProtocolError("message must be a JSON object with a 'type'", "invalid_event")
    event_id = data.get("event_id")
    if event_id is not None and not (isinstance(event_id, str) and EVENT_ID.fullmatch(event_id)):
        raise ProtocolError("event_id must be 1-128 characters of [A-Za-z0-9._:-]", "invalid_event", "event_id")
    kind = data.get("type")
    if kind not in EVENT_TYPES:
        shown = kind[:64] if isinstance(kind, str) else kind
        raise ProtocolError(f"unknown event type {shown!r}; expected one of {', '.join(EVENT_TYPES)}",
                            "unknown_event", "type", event_id=event_id)
    allowed = {"type", "event_id", *_FIELDS[kind]}
    extra = sorted(k for k in data if k not in allowed)
    if extra:
        raise ProtocolError(f"{kind} takes no field {str(extra[0])[:64]!r}", "invalid_event", str(extra[0])[:64],
                            event_id=event_id)
    ev = ClientEvent(kind, event_id=event_id)
    if kind == "session.update":
        session = data.get("session")
        if not isinstance(session, dict):
            raise ProtocolError("session.update needs a 'session' object", "invalid_event", "session",
                                event_id=event_id)
        ev.session = session
        return ev
    cid = data.get("context_id")
    if not (isinstance(cid, str) and CONTEXT_ID.fullmatch(cid)):
        raise ProtocolError("context_id must be 1-64 characters of [A-Za-z0-9._:-]", "invalid_context_id",
                            "context_id", event_id=event_id)
    ev.context_id = cid
    if kind == "input_text.append":
        text = data.get("text")
        if not isinstance(text, str) or not text:
            raise ProtocolError("input_text.append needs a non-empty 'text' string", "invalid_event", "text",
                                context_id=cid, event_id=event_id)
        if any(0xD800 <= ord(c) <= 0xDFFF for c in text):
            raise ProtocolError("text holds unpaired surrogates (not valid Unicode)", "invalid_text", "text",
                                context_id=cid, event_id=event_id)
        ev.text = text
    return ev


_FIELDS = {
    "session.update": ("session",),
    "input_text.append": ("context_id", "text"),
    "input_text.flush": ("context_id",),
    "input_text.end": ("context_id",),
    "response.cancel": ("context_id",),
}


@dataclass(frozen=True, slots=True)
class SessionConfig:
    """A checked `session.update`: the speech request every new context starts from, and how audio travels."""

    speech: SpeechRequest
    transport: str = "binary"


def session_config(fields: dict[str, Any], current: SessionConfig) -> SessionConfig:
    """`fields` applied over `current` (a session.update changes what it names); raises ProtocolError."""
    fields = dict(fields)
    transport = fields.pop("audio_transport", current.transport)
    if transport is None:  # null clears it, as it clears any other session field
        transport = default_session().transport
    if transport not in TRANSPORTS:
        raise ProtocolError(f"audio_transport must be one of {', '.join(TRANSPORTS)}", "invalid_session",
                            "audio_transport")
    for name in _NOT_SESSION:
        if name in fields:
            raise ProtocolError(f"{name} is not a session field (text comes in input_text events)",
                                "invalid_session", name)
    merged = {**current.speech.model_dump(exclude_unset=True), **fields}
    session_defaults = default_session().speech.model_dump(exclude_unset=True)
    for name, value in fields.items():  # null clears a field: back to the session's default, whatever its type
        # A name the request does not have stays, so validation refuses it as it refuses any other value: a
        # misspelt field cleared with null must not pass without a word.
        if value is None and name in SpeechRequest.model_fields:
            if name in session_defaults:
                merged[name] = session_defaults[name]
            else:
                del merged[name]
    try:
        speech = SpeechRequest.model_validate(merged)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ())) or None
        raise ProtocolError(f"session: {where}: {err.get('msg', 'invalid')}"[:300], "invalid_session", where) from None
    return SessionConfig(speech, transport)


_ECHO_MAX_CHARS = 2048  # a reference URL is echoed; an inline clip (hundreds of kB of base64) is not


def session_echo(config: SessionConfig, sample_rate: int) -> dict:
    """`session.updated`'s session: what was set, less `input` and any inline data (a clip sent as a data URL or
    base64, a speaker embedding), which `omitted` names instead. Echoing a clip would send each client its own
    hundreds of kB back on every update."""
    session = config.speech.model_dump(exclude_unset=True, exclude={"input"})
    omitted = []
    ref = session.get("ref_audio")
    if ref is not None and (len(ref) > _ECHO_MAX_CHARS or not ref.startswith(("file://", "http://", "https://"))):
        omitted.append("ref_audio")
    if session.get("speaker_embedding") is not None:
        omitted.append("speaker_embedding")
    for name in omitted:
        del session[name]
    session.update(audio_transport=config.transport, sample_rate=config.speech.sample_rate or sample_rate)
    if omitted:
        session["omitted"] = omitted
    return session


def default_session(response_format: str = "pcm") -> SessionConfig:
    return SessionConfig(SpeechRequest(input=".", response_format=response_format))


def error_event(status: int, message: str, code: str, param: str | None = None, context_id: str | None = None,
                event_id: str | None = None) -> dict:
    """OpenAI's error object (`error_body`) as a Realtime-style event, naming the context and event it is about."""
    event = {"type": "error", **error_body(status, message, code, param)}
    if context_id is not None:
        event["context_id"] = context_id
    if event_id is not None:
        event["event_id"] = event_id
    return event


def binary_frame(context_id: str, audio: bytes) -> bytes:
    """One binary audio frame: the context id's length (one byte), the id, then the audio bytes."""
    cid = context_id.encode("ascii")
    return bytes([len(cid)]) + cid + audio


def split_binary_frame(frame: bytes) -> tuple[str, bytes]:
    """The inverse of `binary_frame` (for clients and tests)."""
    n = frame[0]
    return frame[1:1 + n].decode("ascii"), frame[1 + n:]
