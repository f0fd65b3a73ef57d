"""The streaming-text WebSocket route, `/v1/audio/speech/stream` (protocol: ws_protocol.py, docs/streaming-text.md).

The access rules are HTTP's: Host, Origin and API key run as the same ASGI middlewares (access.py), which refuse
a WebSocket before its handshake. A draining server refuses new sockets; what a socket does is ws_session.py's.
A plain HTTP GET of the path (no handshake) is 426 Upgrade Required.
"""

from __future__ import annotations

from fastapi import APIRouter, WebSocket
from fastapi.responses import JSONResponse

from legato.pipeline.client import EngineClient
from legato.server.errors import error_body
from legato.server.head_routes import answer_head
from legato.server.lifecycle import Lifecycle
from legato.server.metrics import ServerMetrics
from legato.server.speech import SpeechService
from legato.server.ws_protocol import STREAM_PATH, WsLimits
from legato.server.ws_session import StreamSession


def build_stream_router(client: EngineClient, service: SpeechService, metrics: ServerMetrics, limits: WsLimits,
                        lifecycle: Lifecycle) -> APIRouter:
    router = APIRouter()

    @router.websocket(STREAM_PATH)
    async def speech_stream(websocket: WebSocket) -> None:
        if lifecycle.draining:
            await websocket.close(1013, "server is shutting down")
            return
        await websocket.accept()
        metrics.ws_sockets.inc()
        try:
            session = StreamSession(client, service, metrics, limits, websocket.receive, websocket.send_text,
                                    websocket.send_bytes, lambda code, reason: websocket.close(code, reason),
                                    in_flight=lifecycle)
            await session.run()
        finally:
            metrics.ws_sockets.dec()

    @router.get(STREAM_PATH, include_in_schema=False)
    async def speech_stream_without_upgrade() -> JSONResponse:
        # a browser or curl opening the URL without the handshake: the route exists, over another protocol, so
        # not the 404 a websocket-only route gives an HTTP request. RFC 9110 puts Upgrade on a 426, and Connection
        # names it as every sender of Upgrade must.
        message = (f"{STREAM_PATH} is a WebSocket endpoint: open it with a WebSocket handshake "
                   f"(ws:// or wss://, GET with Upgrade: websocket); see docs/streaming-text.md")
        return JSONResponse(error_body(426, message, "upgrade_required"), status_code=426,
                            headers={"Upgrade": "websocket", "Connection": "Upgrade"})

    answer_head(router)
    return router
