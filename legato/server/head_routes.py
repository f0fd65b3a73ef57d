"""HEAD on GET routes: load balancers and link checkers probe with it, and FastAPI answers 405 for a route that
names GET alone. uvicorn sends no body for a HEAD, so the GET's endpoint can answer it (its status and headers)."""

from __future__ import annotations

from fastapi import APIRouter, FastAPI
from fastapi.routing import APIRoute


def answer_head(router: FastAPI | APIRouter) -> None:
    """Adds a HEAD route beside each GET route of `router`, out of the schema (one route for both methods gave the
    schema two operations of one id). Call it on a router before it is included in the app: an included router's
    routes are not among the app's own."""
    routes = [r for r in router.routes if isinstance(r, APIRoute)]
    answered = {r.path for r in routes if "HEAD" in r.methods}
    for route in routes:
        if "GET" in route.methods and route.path not in answered:
            router.add_api_route(route.path, route.endpoint, methods=["HEAD"], include_in_schema=False,
                                 response_class=route.response_class, dependencies=route.dependencies,
                                 name=f"{route.name}_head")
