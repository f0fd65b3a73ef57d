"""`legato serve` as a real subprocess on 127.0.0.1 (the embedded tiny model on CPU), for the tests that need
its signal handling or its sockets: start, wait until healthy, read its JSON log, stop."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
LONG = 2000  # frames: minutes on the tiny CPU model, so such a stream is still running whenever a test acts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def speech_body(frames: int, sse: bool = False, **extra) -> dict:
    body = {"input": "Hello.", "voice": "ryan", "stream": True, "response_format": "pcm", "ignore_eos": True,
            "num_frames": frames, **extra}
    if sse:
        body["stream_format"] = "sse"
    return body


class ServeProcess:
    """One `legato serve` process; its stderr (the JSON log) goes to a file, so a full pipe never blocks it."""

    def __init__(self, tmp: Path, *flags: str, start_timeout: float = 180.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / f"serve-{self.port}.log"
        self.start_timeout = start_timeout
        self.flags = ["--port", str(self.port), "--log-format", "json", "--max-num-seqs", "4", "--chunk-frames", "2",
                      *flags]
        self.env = {**os.environ, "LEGATO_CACHE": str(tmp / "cache"), "OMP_NUM_THREADS": "1",
                    "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> ServeProcess:
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "legato.cli", "serve", *self.flags], env=self.env,
                                     stdout=subprocess.DEVNULL, stderr=self._log)
        deadline = time.monotonic() + self.start_timeout
        while not self.healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"legato serve did not come up:\n{self.log_text()[-3000:]}")
            time.sleep(0.2)
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self._log.close()

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def signal(self, sig: int = signal.SIGTERM) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait_exit(self, timeout: float = 120.0) -> int:
        """The exit code; the timeout is a hang guard, not a speed target."""
        assert self.proc is not None
        return self.proc.wait(timeout)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_lines(self) -> list[dict]:
        lines = []
        for line in self.log_text().splitlines():
            if line.startswith("{"):
                try:
                    lines.append(json.loads(line))
                except json.JSONDecodeError:  # a line still being written
                    pass
        return lines

    def wait_log(self, predicate, timeout: float = 60.0) -> dict | None:
        """The first log line matching `predicate`, polling until `timeout` (a hang guard)."""
        deadline = time.monotonic() + timeout
        while True:
            for line in self.log_lines():
                if predicate(line):
                    return line
            if time.monotonic() > deadline:
                return None
            time.sleep(0.1)


def raw_request(port: int, method: str, path: str, body: bytes = b"", headers: dict | None = None,
                timeout: float = 60.0) -> socket.socket:
    """A socket on which one HTTP/1.1 request was sent (its body whole); the caller reads the answer."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    head = [f"{method} {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", f"Content-Length: {len(body)}"]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + body)
    return sock


def read_head(sock: socket.socket) -> tuple[int, bytes]:
    """Reads up to the end of the response head -> (status, whatever of the body came with it)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        data = sock.recv(65536)
        if not data:
            raise ConnectionError(f"closed before the response head ended: {buf!r}")
        buf += data
    head, _, rest = buf.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), rest


def read_to_eof(sock: socket.socket, initial: bytes = b"") -> bytes:
    buf = bytearray(initial)
    while True:
        data = sock.recv(65536)
        if not data:
            return bytes(buf)
        buf += data
