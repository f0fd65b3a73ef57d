"""JSON request bodies parsed by pydantic's parser instead of the standard library's.

A voice-clone request carries its reference clip inline: ~0.5 MB of base64 for an 8 s clip. `json.loads` took
~0.45 ms of the event loop's time for such a body, about a fifth of the server front's busy time at 256 streams
(py-spy on the H200, docs/benchmarks.md); pydantic-core's parser (already a dependency, through pydantic) takes
~0.05 ms. A body it refuses is parsed again by `json.loads`, so what was refused before is refused with the same
error (FastAPI turns a `JSONDecodeError` into the 400 naming the position), and what `json.loads` alone accepts
(a UTF-8 byte-order mark, a lone surrogate escape) is still accepted.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Coroutine
from typing import Any

import pydantic_core
from fastapi import Request, Response
from fastapi.routing import APIRoute


def parse_json(body: bytes | str) -> Any:
    """`json.loads(body)`, parsed faster: what json.loads refuses, it refuses with json.loads's own error. Its
    refusals that are not a `JSONDecodeError` (bytes that are not UTF-8, a number past Python's digit limit,
    nesting past the recursion limit) become one, so they reach the client as the same readable 400 and not as
    FastAPI's "There was an error parsing the body"."""
    try:
        return pydantic_core.from_json(body)
    except (ValueError, TypeError):  # TypeError: a str holding a lone surrogate, which has no UTF-8
        pass
    try:
        return json.loads(body)
    except json.JSONDecodeError:
        raise
    except UnicodeDecodeError as e:  # the position in characters, as for other bad JSON: of the text before it
        at = len(e.object[:e.start].decode("utf-8", errors="replace"))
        raise json.JSONDecodeError(f"the body is not UTF-8 text (byte 0x{e.object[e.start]:02x})", "", at) from e
    except ValueError as e:  # int(): "Exceeds the limit (4300 digits) for integer string conversion"
        raise json.JSONDecodeError(f"a number of more than {sys.get_int_max_str_digits()} digits", "", 0) from e
    except RecursionError as e:
        raise json.JSONDecodeError("arrays or objects nested too deeply", "", 0) from e


class FastJsonRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = parse_json(await self.body())
        return self._json


class FastJsonRoute(APIRoute):
    """An `APIRoute` whose JSON body goes through `parse_json` (FastAPI's documented custom-request hook)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            return await handler(FastJsonRequest(request.scope, request.receive))

        return route
