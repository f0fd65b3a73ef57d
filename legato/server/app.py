"""The FastAPI application, built by `build_app` from its dependencies (no module-level state).

Routes: `POST /v1/audio/speech` (speech.py), the voice routes (voices_api.py, when a voice store is given),
`GET /v1/models` (the served model's card, then one per OpenAI name taken for it; `/v1/models/{id}`, one card),
`GET /health`, `GET /metrics`. Two pure-ASGI middlewares run first: request ids (taken from a valid
`X-Request-Id` or generated, echoed on every response, set for the logs) and a request-body size cap. The
lifespan starts the engine client. Shutdown (lifecycle.py): on the first SIGTERM/SIGINT the app drains (new
speech/voice requests and /health answer 503 "server is shutting down" / "stopping") and the engine is stopped
with the grace, so requests still running at its end get their format's error ending; uvicorn exits once
nothing is in flight, and the lifespan waits for that same engine stop.
"""

from __future__ import annotations

import functools
import importlib.resources
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from legato.pipeline import heap
from legato.pipeline.client import EngineClient
from legato.server.access import ApiKeyAuth, HostCheck, OriginCheck, scope_header
from legato.server.errors import ApiError, ErrorResponse, error_body, install_error_handlers
from legato.server.head_routes import answer_head
from legato.server.lifecycle import DrainMiddleware, Lifecycle
from legato.server.logs import current_request_id
from legato.server.metrics import ServerMetrics
from legato.server.prompt_limit import PromptLimit
from legato.server.schemas import ModelCard, ModelList
from legato.server.settings import ServerSettings
from legato.server.speech import SPEECH_PATH, SpeechService, build_speech_router
from legato.server.streaming import RESPONSE_HEADERS, SpeechResponder
from legato.server.voices import VoiceStore
from legato.server.ws_protocol import WsLimits
from legato.server.ws_route import build_stream_router

log = logging.getLogger(__name__)

REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9._:\-]{1,128}")  # fullmatch: `$` would let a final "\n" in


DEMO_PATH = "/demo"


@functools.cache
def demo_html() -> str:
    """The speak-as-you-type page (static/demo.html): a client of the streaming-text WebSocket."""
    return (importlib.resources.files("legato.server") / "static" / "demo.html").read_text(encoding="utf-8")


def build_app(client: EngineClient, settings: ServerSettings, voice_store: VoiceStore | None = None,
              lifecycle: Lifecycle | None = None, prompt_limit: PromptLimit | None = None,
              ws_limits: WsLimits | None = None) -> FastAPI:
    """The server for one engine client. The app owns the client's lifetime (start/stop in its lifespan);
    `lifecycle` is shared with the server that drains it on a signal (cli.py), else the app makes its own.
    `prompt_limit` holds requests to --max-prompt-tokens before they reach the client (None: not here).
    `ws_limits` bounds the streaming-text WebSocket (None: the defaults, its text per context max_input_chars)."""
    lifecycle = lifecycle or Lifecycle(client, settings.shutdown_grace_s)
    service = SpeechService(client, settings, voice_store, prompt_limit)
    metrics = ServerMetrics(client, service.model_name)
    responder = SpeechResponder(client, settings, metrics)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await client.start()
        if settings.freeze_heap:  # started and warmed up: full collections walk only what serving allocates
            heap.freeze_heap()
        log.info("serving %s (%s) at %d Hz", service.model_name, service.task_type, client.info.sample_rate)
        if aliases := service.alias_table():
            log.info("voice aliases: %s", ", ".join(f"{a}={v}" for a, v in aliases.items()))
        for alias, voice in service.unanswered_aliases().items():
            log.warning("--voice-alias %s=%s: the model has no voice %r (it has %s): requests saying %r get 400",
                        alias, voice, voice, ", ".join(client.info.speakers), alias)
        try:
            yield
        finally:
            if not lifecycle.draining:
                log.info("shutting down: in-flight requests get %.1f s", settings.shutdown_grace_s)
            await lifecycle.stop_engine()
            log.info("engine stopped")

    app = FastAPI(title="legato", version=_version(), lifespan=lifespan,
                  description="OpenAI-compatible text-to-speech for Qwen3-TTS models.")
    install_error_handlers(app)
    app.include_router(build_speech_router(service, responder))
    ws_limits = ws_limits or settings.ws_limits()
    app.include_router(build_stream_router(client, service, metrics, ws_limits, lifecycle))
    if voice_store is not None:
        from legato.server.voices_api import build_voices_router

        app.include_router(build_voices_router(voice_store, service.media_policy))

    def model_card() -> ModelCard:
        """The served model's card; an alias's is this one under the alias's id (the same model answers it)."""
        info = client.info
        saved = info.model_type == "base" and voice_store is not None
        voices = [v.name for v in voice_store.list()] if saved else info.speakers
        return ModelCard(
            id=service.model_name, created=created, root=service.model_name, task_type=service.task_type,
            sample_rate=info.sample_rate, languages=info.languages, voices=voices,
            max_num_seqs=settings.max_num_seqs, decode_slots=settings.decode_slots,
            ws_max_message_bytes=ws_limits.max_message_bytes,
        )

    @app.get("/v1/models", response_model=ModelList)
    async def list_models() -> ModelList:
        card = model_card()  # one voice-store listing, however many ids share it
        return ModelList(data=[card.model_copy(update={"id": i}) for i in service.model_ids])

    # `:path`: a served name defaults to a hub id ("Qwen/..."), whose slash a plain parameter would not match
    @app.get("/v1/models/{model_id:path}", response_model=ModelCard,
             responses={404: {"model": ErrorResponse, "description": "No model of that id is served here."}})
    async def retrieve_model(model_id: str) -> ModelCard:
        """The card `/v1/models` lists, for the OpenAI SDK's `models.retrieve`."""
        ids = service.model_ids
        if model_id not in ids:
            # the speech route's code for an unknown model, so a client handles both alike
            raise ApiError(404, f"model {model_id!r} is not served here; available: {ids!r}",
                           "model_not_found", "model")
        return model_card().model_copy(update={"id": model_id})

    @app.get("/", include_in_schema=False)
    async def root() -> RedirectResponse:
        """A browser pointed at the server lands on the demo page, not on a JSON 404."""
        return RedirectResponse(DEMO_PATH, status_code=307)

    @app.get(DEMO_PATH, response_class=HTMLResponse, include_in_schema=False)
    async def demo_page() -> HTMLResponse:
        return HTMLResponse(demo_html())

    @app.get("/health",
             responses={503: {"description": "The engine has stopped or died, or the server is shutting down."}})
    async def health() -> JSONResponse:
        """200 while the engine runs ("ok", or "degraded" with some of a deployment's engines dead); 503 once it
        has died ("unavailable") or the server is shutting down ("stopping"). `engine` carries its live stats
        (queue depth, running requests, KV blocks, engines down) for operators and tests."""
        alive = engine_alive(client) and not lifecycle.draining
        s = client.stats()
        # "degraded": serving, with an engine of the deployment dead (its capacity is out of the figures below)
        status = ("degraded" if s.engines_down else "ok") if alive else "stopping" if lifecycle.draining \
            else "unavailable"
        body = {"status": status, "model": service.model_name, "engine": {
            "waiting": s.waiting, "running": s.running, "kv_usage": s.kv_usage, "num_kv_blocks": s.num_kv_blocks,
            "free_kv_blocks": s.free_kv_blocks, "aborted": s.aborted, "engines_down": s.engines_down,
        }}
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    answer_head(app)
    _document_errors_as_400(app)
    app.add_middleware(DrainMiddleware, lifecycle=lifecycle)  # innermost: its 503s are counted and carry ids
    app.add_middleware(SpeechStatusCounter, metrics=metrics)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_bytes)
    app.add_middleware(ContentEncodingCheck)
    _add_access_checks(app, settings)
    app.add_middleware(RequestIdMiddleware)  # added last = outermost: even a 413 carries the request id
    app.state.metrics = metrics
    app.state.client = client
    app.state.speech = service
    app.state.lifecycle = lifecycle
    return app


def _add_access_checks(app: FastAPI, settings: ServerSettings) -> None:
    """Outermost first: Host, then CORS (it answers preflights, which carry no credentials), Origin, key."""
    if settings.api_keys:
        app.add_middleware(ApiKeyAuth, keys=settings.api_keys, protect_metrics=settings.protect_metrics)
    app.add_middleware(OriginCheck, allowed=settings.allowed_origins)
    if settings.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins),
                           allow_methods=["GET", "POST", "DELETE"], allow_credentials=False,
                           # Any request header: OpenAI's JavaScript SDK in a page sends its own (x-stainless-*),
                           # and a preflight naming one failed. Which origins may call is the control, not headers.
                           allow_headers=["*"],
                           expose_headers=list(RESPONSE_HEADERS))
    if settings.allowed_hosts is not None:
        app.add_middleware(HostCheck, allowed=settings.allowed_hosts)


def _document_errors_as_400(app: FastAPI) -> None:
    """FastAPI documents a 422 for every route with a body; this server answers validation errors with 400
    (errors.py), so the 422 entries are dropped from the schema clients and fuzzers read."""
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = generate()
            for operations in schema.get("paths", {}).values():
                for op in operations.values():
                    op.get("responses", {}).pop("422", None)
        return app.openapi_schema

    app.openapi = openapi


def engine_alive(client: EngineClient) -> bool:
    return bool(client.is_alive())


class RequestIdMiddleware:
    """Takes `X-Request-Id` when it is 1-128 characters of [A-Za-z0-9._:-], generates a uuid4 hex
    otherwise, and echoes it on the response. A malformed client id is refused with 400 (not silently
    replaced); that refusal carries a fresh id."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = scope_header(scope, b"x-request-id")
        valid = given is None or REQUEST_ID_PATTERN.fullmatch(given) is not None
        rid = given if given is not None and valid else uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"] = rid
        state["started"] = time.perf_counter()
        token = current_request_id.set(rid)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": headers + [(b"x-request-id", rid.encode())]}
            await send(message)

        try:
            if valid:
                await self.app(scope, receive, send_with_id)
            else:
                body = error_body(400, "X-Request-Id must be 1-128 characters of letters, digits, '.', '_', ':', "
                                  "'-'", "invalid_request_id", "X-Request-Id")
                await JSONResponse(body, status_code=400)(scope, receive, send_with_id)
        finally:
            current_request_id.reset(token)


class ContentEncodingCheck:
    """Refuses a request body sent with a `Content-Encoding` (gzip, br, ...) with 415 before it is read. The
    server decodes no content coding: parsed as it comes, a gzip body is binary garbage, and inflating one
    would let a small upload expand past the body limit. `identity` is no coding and passes."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        coding = scope_header(scope, b"content-encoding") if scope["type"] == "http" else None
        codings = [c.strip().lower() for c in (coding or "").split(",") if c.strip()]
        if any(c != "identity" for c in codings):
            message = (f"Content-Encoding {coding[:40]!r} is not supported: send the body uncompressed (this server "
                       "decodes no content coding)")
            body = error_body(415, message, "unsupported_content_encoding", "Content-Encoding")
            await JSONResponse(body, status_code=415, headers={"Accept-Encoding": "identity"})(scope, receive, send)
            return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Refuses request bodies over `max_bytes` with 413, by Content-Length up front or while reading."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = scope_header(scope, b"content-length")
        message = f"request body exceeds the limit of {self.max_bytes} bytes"
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await JSONResponse(error_body(413, message, "request_too_large"), status_code=413)(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    raise StarletteHTTPException(413, message)  # FastAPI re-raises it from body parsing
            return msg

        await self.app(scope, counted, send)


class SpeechStatusCounter:
    """Counts every speech request once, by its final status: the status of a refusal, or the outcome the
    request's `Generation` recorded (which differs from the 200 already sent when a stream fails or the
    client leaves)."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != SPEECH_PATH:
            await self.app(scope, receive, send)
            return
        sent = 500

        async def watch(message: Message) -> None:
            nonlocal sent
            if message["type"] == "http.response.start":
                sent = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            gen = scope.get("state", {}).get("generation")
            outcome = gen.outcome if gen is not None and gen.outcome is not None else sent
            self.metrics.requests.labels(str(outcome)).inc()


def _version() -> str:
    from legato import __version__

    return __version__
