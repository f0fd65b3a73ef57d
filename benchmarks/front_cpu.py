"""The server front's CPU per streamed request, per HTTP parser: the real app and its guarded protocol
(connections.py) in a subprocess, a scripted engine client that answers at once (so only the front works), and
one raw-socket keep-alive client here sending x-vector requests with an inline clip, one at a time.

CPU is the server process's own (user + system, from /proc), per request; the chunk count per request is
`--chunks` (a first chunk, then even ones, as the engine's ramp sends them).

    python3 benchmarks/front_cpu.py --parsers h11,httptools --chunks 4,16 --requests 1500 \\
        --data .bench-data/prompts --out docs/benchmarks/s42-cpu/front-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SERVER = r'''
import sys, uvicorn
sys.path.insert(0, sys.argv[5] + "/tests")
from server_helpers import FakeClient, frames_chunk, server_settings
from legato.server.app import build_app
from legato.server.body_deadline import BodyTimeoutMiddleware
from legato.server.connections import guarded_http
parser, port, chunks, loop = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
frames = 2 * (chunks - 1) + 1
script = [frames_chunk(1, 1)] + [frames_chunk(2, 1 + 2 * i) for i in range(1, chunks - 1)]
script.append(frames_chunk(2, frames, True, "length"))
client = FakeClient(lambda req: list(script), model_type="base")
app = BodyTimeoutMiddleware(build_app(client, server_settings(), None), 30.0, None)
uvicorn.run(app, host="127.0.0.1", port=port, http=guarded_http(10.0, 64, parser=parser), loop=loop,
            log_level="warning", lifespan="on")
'''


def request_bytes(body: bytes) -> bytes:
    return (b"POST /v1/audio/speech HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def read_response(sock: socket.socket, buf: bytearray) -> None:
    """Reads one chunked response (to its terminating empty chunk) off a kept-alive connection."""
    end = b"\r\n0\r\n\r\n"
    while end not in buf:
        data = sock.recv(1 << 20)
        if not data:
            raise RuntimeError("the server closed the connection")
        buf += data
    del buf[:buf.index(end) + len(end)]


def process_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(parser: str, chunks: int, requests: int, body: bytes, loop: str) -> dict:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", SERVER, parser, str(port), str(chunks), loop, str(ROOT)],
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                sock = socket.create_connection(("127.0.0.1", port), timeout=30)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the {parser} server did not start") from None
                time.sleep(0.1)
        req, buf = request_bytes(body), bytearray()
        with sock:
            for _ in range(50):  # warm: first-use costs out of the count
                sock.sendall(req)
                read_response(sock, buf)
            cpu0, t0 = process_cpu_s(proc.pid), time.perf_counter()
            for _ in range(requests):
                sock.sendall(req)
                read_response(sock, buf)
            cpu1, t1 = process_cpu_s(proc.pid), time.perf_counter()
    finally:
        proc.terminate()
        proc.wait(30)
    return {"parser": parser, "loop": loop, "chunks": chunks, "requests": requests, "body_bytes": len(body),
            "server_cpu_ms_per_request": 1e3 * (cpu1 - cpu0) / requests,
            "wall_ms_per_request": 1e3 * (t1 - t0) / requests}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parsers", default="h11,httptools")
    p.add_argument("--chunks", default="4,16", help="audio chunks per request (comma list)")
    p.add_argument("--requests", type=int, default=1500)
    p.add_argument("--rounds", type=int, default=2, help="each cell this many times, parsers interleaved")
    p.add_argument("--loop", default="asyncio", choices=["asyncio", "uvloop"])
    p.add_argument("--data", default=str(ROOT / ".bench-data" / "prompts"), help="prompt set (its first clip is sent)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    from legato.bench.datasets import data_url

    clip = sorted(Path(args.data).rglob("*.wav"))[0]
    body = json.dumps({"input": "The quick brown fox jumps over the lazy dog.", "ref_audio": data_url(clip),
                       "x_vector_only_mode": True, "ignore_eos": True, "num_frames": 30, "stream": True,
                       "response_format": "pcm"}).encode()
    cells = []
    for _ in range(args.rounds):
        for chunks in (int(c) for c in args.chunks.split(",")):
            for parser in args.parsers.split(","):
                cell = measure(parser, chunks, args.requests, body, args.loop)
                print(json.dumps(cell), flush=True)
                cells.append(cell)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        Path(args.out).write_text(json.dumps({"commit": commit.stdout.strip(), "cells": cells}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
