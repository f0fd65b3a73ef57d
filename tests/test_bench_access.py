"""`legato bench serve` and `bench soak` against a server they cannot use (no server, a key wanted, a key
refused): one line saying what to do, exit 2, before any request is sent; with the key, soak sends it."""

from __future__ import annotations

import http.server
import threading

import pytest

from legato.cli import main


class _KeyedServer(http.server.BaseHTTPRequestHandler):
    """Answers 401 unless the request carries `Bearer sk-good`; records the requests' paths and keys."""

    seen: list[tuple[str, str | None]] = []

    def _answer(self) -> None:
        key = self.headers.get("Authorization")
        type(self).seen.append((self.path, key))
        if key != "Bearer sk-good":
            body = b'{"error": {"message": "missing or wrong API key"}}'
            self.send_response(401)
        else:
            body = b'{"error": {"message": "nothing here"}}'
            self.send_response(404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def keyed_server():
    _KeyedServer.seen = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _KeyedServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_bench_serve_names_the_missing_key_before_sending_requests(keyed_server, capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("LEGATO_API_KEY", raising=False)
    argv = ["bench", "serve", "--base-url", keyed_server, "--num-prompts", "2", "--mode", "voice", "--voice", "ryan",
            "--result-dir", str(tmp_path), "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "wants an API key" in err and "--api-key" in err and "LEGATO_API_KEY" in err
    assert [path for path, _ in _KeyedServer.seen] == ["/v1/models"]  # no speech request was sent
    assert main([*argv, "--api-key", "sk-bad"]) == 2
    assert "refused the API key given" in capsys.readouterr().err


def test_bench_serve_without_a_server_says_so(capsys, tmp_path):
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "2",
                 "--result-dir", str(tmp_path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "no server answers at http://127.0.0.1:9" in err and "Traceback" not in err


def test_bench_soak_takes_a_key_and_names_a_missing_one(keyed_server, capsys, monkeypatch):
    monkeypatch.delenv("LEGATO_API_KEY", raising=False)
    argv = ["bench", "soak", "--url", keyed_server, "--duration", "1", "--no-warmup"]
    assert main(argv) == 2
    assert "wants an API key" in capsys.readouterr().err
    monkeypatch.setenv("LEGATO_API_KEY", "sk-good")
    assert main(argv) == 2  # past the key: this stand-in is no legato server, which the soak says in one line
    err = capsys.readouterr().err
    assert "has no engine stats: the soak needs a legato server" in err and "Traceback" not in err
    assert ("/v1/models", "Bearer sk-good") in _KeyedServer.seen and ("/health", "Bearer sk-good") in _KeyedServer.seen


def test_ctrl_c_ends_a_bench_run_in_one_line(tmp_path):
    """SIGINT while `legato bench serve` waits on a server that never answers: exit 130, no traceback."""
    import os
    import signal
    import socket
    import subprocess
    import sys

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "legato", "bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--mode", "voice",
         "--voice", "ryan", "--num-prompts", "2", "--result-dir", str(tmp_path), "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "LEGATO_API_KEY": ""})
    try:
        listener.settimeout(60)
        conn, _ = listener.accept()  # the bench is now waiting on this server: interrupt it there
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        conn.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        listener.close()
    assert proc.returncode == 130, err
    assert "legato bench: interrupted" in err and "Traceback" not in err
