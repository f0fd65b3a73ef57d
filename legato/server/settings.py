"""Server settings: one dataclass, validated where it is built (the CLI builds it from flags)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from legato.models.qwen3_tts.loader import GENERATION_DEFAULTS
from legato.models.qwen3_tts.prompt import default_max_prompt_tokens
from legato.server.aliases import OPENAI_VOICE_ALIASES
from legato.server.media import parse_networks
from legato.server.ws_protocol import WS_DEFAULTS, WsLimits

MiB = 1024 * 1024


@dataclass(slots=True)
class ServerSettings:
    """Limits and switches of the HTTP server. The engine's own limits (batch size, waiting queue, chunk
    schedule) live in `EngineConfig`; these are the per-request limits the server enforces before a request
    reaches the engine."""

    model_name: str | None = None
    """Name served in /v1/models and accepted in a request's `model`; None takes the engine client's name."""
    max_input_chars: int = 4096
    """Longest `input` (and `instructions`, `ref_text`) in characters, as OpenAI caps `input`."""
    default_max_new_tokens: int | None = None
    """`max_new_tokens` of a request that gives none (capped by `max_new_tokens_limit`). None: no fixed cap;
    such a request runs to EOS or its text's frame cap (frame_budget.py), whatever its length."""
    max_new_tokens_limit: int = 4096
    """Largest `max_new_tokens` (and `num_frames` + 1) a request may ask for."""
    max_ref_audio_bytes: int = 10 * MiB
    max_ref_audio_seconds: float = 60.0
    # --- prompt-token limit (h-prompt) ---
    max_prompt_tokens: int | None = None
    """Most talker prompt tokens one request may bring (`--max-prompt-tokens`), checked after tokenising and
    before the engine sees the request (400 `prompt_too_long`): one long prompt holds prefill budget that
    every other request waits on. None sizes it from the model for the largest legitimate request
    (`prompt_token_limit`): max_input_chars at 3 tokens per character (the byte-level tokenizer's worst case
    for text of every language the model speaks; emoji cost up to four) for the input, again for instructions
    (models that take them) and for ref_text plus max_ref_audio_seconds x 12.5 frames (Base), plus 16
    template and control tokens. With the defaults: 12304 (0.6B CustomVoice), 24592 (1.7B CustomVoice,
    VoiceDesign), 25342 (Base)."""
    # --- end prompt-token limit ---
    allowed_local_media_path: str | None = None
    """`file://` reference audio is read only under this directory; None refuses every `file://`."""
    allow_remote_media: bool = False
    """Fetch http(s) reference audio URLs (off by default: a server fetching URLs is an SSRF risk)."""
    remote_media_allow_cidrs: tuple[str, ...] = ()
    """Non-public networks remote reference audio may still come from (an internal media server); by default
    only public addresses are fetched."""
    media_fetch_timeout_s: float = 10.0
    request_timeout_s: float | None = 600.0
    """A request still running after this long is aborted and reported (504 / error event / cut stream)."""
    shutdown_grace_s: float = 10.0
    """On shutdown, in-flight requests get this long to finish before they are aborted."""
    voices_dir: str | None = None
    """Where saved voices live (None: no voice store)."""
    voice_aliases: dict[str, str] = field(default_factory=lambda: dict(OPENAI_VOICE_ALIASES))
    """Voice names a request may use for another voice (OpenAI's `alloy`, `nova`, ... by default); a real
    voice of that name wins over an alias."""
    api_keys: tuple[str, ...] = ()
    """Bearer tokens, one of which every route but /health and /metrics requires; empty: no authentication."""
    protect_metrics: bool = False
    """Require the API key on /metrics too (by default it stays open, as vLLM's does, for scrapers)."""
    allowed_origins: tuple[str, ...] = ()
    """Web origins (scheme://host[:port], or "*") whose pages may call the server; CORS is answered for them
    and requests from any other origin are refused with 403. Empty: no cross-origin calls at all."""
    allowed_hosts: tuple[str, ...] | None = None
    """Host header names served (DNS-rebinding guard); None: any. The CLI sets loopback names when it binds
    loopback."""
    generation_defaults: dict[str, Any] = field(default_factory=lambda: dict(GENERATION_DEFAULTS))
    """The model's sampling defaults (`LoadedModel.generation_defaults`); request fields override them."""
    max_num_seqs: int | None = None
    """Each engine's --max-num-seqs, reported on /v1/models (None: not reported)."""
    ws_max_message_bytes: int = WS_DEFAULTS.max_message_bytes
    """Largest message a streaming-text WebSocket client may send (`WsLimits`)."""
    ws_max_contexts: int = WS_DEFAULTS.max_contexts
    """Contexts one streaming-text socket may run at once."""
    ws_idle_timeout_s: float = WS_DEFAULTS.idle_timeout_s
    """A socket with no message and no context running this long is closed."""
    ws_send_queue: int = WS_DEFAULTS.send_queue
    """Outgoing messages buffered for a socket whose client reads slowly."""
    ws_send_timeout_s: float = WS_DEFAULTS.send_timeout_s
    """A full send buffer that does not drain this long closes the socket."""
    decode_slots: int | None = None
    """Requests the deployment decodes at once (max_num_seqs x decode engines), reported on /v1/models so a
    load generator (`legato bench serve`) sizes its concurrency to it (None: not reported)."""
    freeze_heap: bool = False
    """Once the engine client has started, freeze the process's heap out of the garbage collector's passes and log
    long collection pauses (`pipeline.heap`): `legato serve` on a GPU, a process that serves one deployment for life."""

    def __post_init__(self) -> None:
        for name in ("max_input_chars", "default_max_new_tokens", "max_new_tokens_limit", "max_ref_audio_bytes"):
            value = getattr(self, name)
            if value is None and name == "default_max_new_tokens":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ServerSettings.{name} must be a positive int, got {value!r}")
        if self.max_new_tokens_limit < 2:
            raise ValueError("ServerSettings.max_new_tokens_limit must be >= 2 (one frame)")
        for name in ("max_ref_audio_seconds", "media_fetch_timeout_s", "shutdown_grace_s"):
            value = getattr(self, name)
            if not _positive(value) and not (name == "shutdown_grace_s" and value == 0):
                raise ValueError(f"ServerSettings.{name} must be a positive number, got {value!r}")
        if self.max_prompt_tokens is not None and (not isinstance(self.max_prompt_tokens, int)
                                                   or isinstance(self.max_prompt_tokens, bool)
                                                   or self.max_prompt_tokens < 1):
            raise ValueError(f"ServerSettings.max_prompt_tokens must be a positive int or None, "
                             f"got {self.max_prompt_tokens!r}")
        if self.request_timeout_s is not None and not _positive(self.request_timeout_s):
            raise ValueError("ServerSettings.request_timeout_s must be positive or None, "
                             f"got {self.request_timeout_s!r}")
        if self.allowed_local_media_path is not None and not Path(self.allowed_local_media_path).is_dir():
            raise ValueError(f"allowed local media path {self.allowed_local_media_path!r} is not a directory")
        try:
            parse_networks(self.remote_media_allow_cidrs)
        except (TypeError, ValueError) as e:
            raise ValueError(f"ServerSettings.remote_media_allow_cidrs: {e}") from e
        try:
            self.ws_limits()
        except ValueError as e:
            raise ValueError(f"ServerSettings' WebSocket limits: {e}") from e
        missing = [k for k in GENERATION_DEFAULTS if k not in self.generation_defaults]
        if missing:
            raise ValueError(f"ServerSettings.generation_defaults lacks {missing}")

    def ws_limits(self) -> WsLimits:
        """The streaming-text WebSocket's limits; the text of one context may be as long as one HTTP input."""
        return WsLimits(max_message_bytes=self.ws_max_message_bytes, max_text_chars=self.max_input_chars,
                        max_contexts=self.ws_max_contexts, idle_timeout_s=self.ws_idle_timeout_s,
                        send_queue=self.ws_send_queue, send_timeout_s=self.ws_send_timeout_s)

    @property
    def max_request_bytes(self) -> int:
        """Largest request body: base64 reference audio (4/3 of its bytes) plus room for the other fields."""
        return self.max_ref_audio_bytes * 4 // 3 + 1 * MiB

    def prompt_token_limit(self, model_type: str, model_size: str) -> int:
        """`max_prompt_tokens`, or when None the size the largest legitimate request needs on this model."""
        if self.max_prompt_tokens is not None:
            return self.max_prompt_tokens
        return default_max_prompt_tokens(model_type, model_size, self.max_input_chars, self.max_ref_audio_seconds)

    @property
    def max_new_tokens_default(self) -> int | None:
        if self.default_max_new_tokens is None:
            return None
        return min(self.default_max_new_tokens, self.max_new_tokens_limit)


def _positive(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
