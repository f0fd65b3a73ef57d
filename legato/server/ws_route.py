"""The streaming-text WebSocket route, `/v1/audio/speech/stream` (protocol: ws_protocol.py, docs/streaming-text.md).

The access rules are HTTP's: Host, Origin and API key run as the same ASGI middlewares (access.py), which refuse
a WebSocket before its handshake. A draining server refuses new sockets; what a socket does is ws_session.py's.
"""

from __future__ import annotations

from fastapi import APIRouter, WebSocket

from legato.pipeline.client import EngineClient
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

    return router
