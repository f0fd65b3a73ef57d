"""What a Ray Serve ingress in front of the server costs a streaming request: the extra hop, measured.

The alternative to a plain `legato serve` front is a Ray Serve application whose ingress (Serve's HTTP proxy
actor, then a replica) streams each request on. This puts exactly that hop in front of a running server, a
Serve deployment with a FastAPI ingress that forwards `POST /v1/audio/speech` and streams the body back, and
times the same requests both ways, alternating: time to the first audio byte and to the last.

    python benchmarks/serve_hop.py --requests 40 --frames 25 --out hop.json   # CPU, the embedded tiny model

Needs `ray[serve]`. Everything binds 127.0.0.1. Results: docs/ray.md ("The HTTP front stays a plain process").
"""

# No `from __future__ import annotations`: FastAPI must see the route annotations (local imports) as objects.

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready within {timeout_s:g} s")


def start_proxy(target: str, port: int) -> None:
    """A Serve app (FastAPI ingress, one replica) that streams every speech request on to `target`."""
    import ray
    from fastapi import FastAPI, Request
    from fastapi.responses import StreamingResponse
    from ray import serve

    ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=2,
             object_store_memory=80 * 1024 * 1024)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = FastAPI()

    @serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
    @serve.ingress(app)
    class SpeechProxy:
        def __init__(self) -> None:
            self.http = httpx.AsyncClient(base_url=target, timeout=120)

        @app.post("/v1/audio/speech")
        async def speech(self, request: Request) -> StreamingResponse:
            upstream = await self.http.send(self.http.build_request(
                "POST", "/v1/audio/speech", content=await request.body(),
                headers={"content-type": "application/json"}), stream=True)

            async def body():
                try:
                    async for part in upstream.aiter_raw():
                        yield part
                finally:
                    await upstream.aclose()
            return StreamingResponse(body(), status_code=upstream.status_code,
                                     media_type=upstream.headers.get("content-type"))

        @app.get("/health")
        async def health(self) -> dict:
            return {"status": "ok"}

    serve.run(SpeechProxy.bind(), route_prefix="/")


def timed(url: str, body: dict) -> tuple[float, float, int]:
    """(seconds to the first body byte, to the last, bytes) of one streamed request."""
    started = time.perf_counter()
    first = None
    size = 0
    with httpx.stream("POST", url, json=body, timeout=120) as r:
        r.raise_for_status()
        for part in r.iter_raw():
            if part and first is None:
                first = time.perf_counter() - started
            size += len(part)
    return first or 0.0, time.perf_counter() - started, size


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=40, help="requests each way (alternating)")
    p.add_argument("--frames", type=int, default=25, help="frames per request (ignore_eos)")
    p.add_argument("--out", default=None, help="a JSON of the figures")
    args = p.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    direct_port, serve_port = free_port(), free_port()
    server = subprocess.Popen([sys.executable, "-m", "legato.cli", "serve", "--device", "cpu", "--port",
                               str(direct_port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        direct = f"http://127.0.0.1:{direct_port}"
        wait_ready(f"{direct}/health", 300)
        start_proxy(direct, serve_port)
        via = f"http://127.0.0.1:{serve_port}"
        wait_ready(f"{via}/health", 120)
        body = {"input": "Hello there, this is a test.", "voice": "ryan", "response_format": "pcm",
                "ignore_eos": True, "num_frames": args.frames}
        for url in (direct, via):  # warm-up: connections, first use
            timed(f"{url}/v1/audio/speech", body)
        runs: dict[str, list[tuple[float, float, int]]] = {"direct": [], "ray_serve": []}
        for _ in range(args.requests):
            runs["direct"].append(timed(f"{direct}/v1/audio/speech", body))
            runs["ray_serve"].append(timed(f"{via}/v1/audio/speech", body))
    finally:
        server.terminate()
        server.wait(30)
    sizes = {len({r[2] for r in v}) for v in runs.values()}
    assert sizes == {1} and runs["direct"][0][2] == runs["ray_serve"][0][2], "both ways must carry the same audio"
    result = {"requests": args.requests, "frames": args.frames, "bytes": runs["direct"][0][2]}
    for name, rows in runs.items():
        result[name] = {"ttfb_p50_ms": 1000 * statistics.median(r[0] for r in rows),
                        "e2e_p50_ms": 1000 * statistics.median(r[1] for r in rows)}
    result["hop_ttfb_ms"] = result["ray_serve"]["ttfb_p50_ms"] - result["direct"]["ttfb_p50_ms"]
    result["hop_e2e_ms"] = result["ray_serve"]["e2e_p50_ms"] - result["direct"]["e2e_p50_ms"]
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
