"""The OpenAI-compatible HTTP server: `build_app(client, settings, voice_store)` and `ServerSettings`.

Imported lazily so `legato synth` (and anything else importing `legato.server.cli`) does not pay for
FastAPI unless a server is actually built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from legato.server.app import build_app
    from legato.server.settings import ServerSettings

__all__ = ["ServerSettings", "build_app"]


def __getattr__(name: str):
    if name == "build_app":
        from legato.server.app import build_app

        return build_app
    if name == "ServerSettings":
        from legato.server.settings import ServerSettings

        return ServerSettings
    raise AttributeError(f"module 'legato.server' has no attribute {name!r}")
