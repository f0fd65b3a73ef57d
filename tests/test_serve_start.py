"""`legato serve` starting: a port in use is one line before anything loads, and the fix the CUDA deploy
error suggests on a CPU machine really starts the deployment (issue 20)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from serve_process import ROOT, ServeProcess, speech_body

DEPLOY = ROOT / "deploy"


def serve(tmp: Path, *flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "LEGATO_CACHE": str(tmp / "cache"),
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "legato.cli", "serve", *flags], capture_output=True, text=True,
                          timeout=120, env=env)


@pytest.mark.parametrize("model", [[], ["--model", "/nonexistent/model"]], ids=["default", "missing-model"])
def test_a_port_in_use_is_one_line_before_the_model_loads(tmp_path, model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = serve(tmp_path, "--port", str(port), *model)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"legato serve: error: cannot listen on 127.0.0.1:{port}: the port is already in use (another server?); "
        "stop it or pick another --port"], proc.stderr
    assert not (tmp_path / "cache").exists()  # the default model was never written, let alone loaded


def test_an_address_this_machine_lacks_is_one_line(tmp_path):
    proc = serve(tmp_path, "--host", "192.0.2.1", "--port", "8000")  # TEST-NET-1: never a local address
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "legato serve: error: cannot listen on 192.0.2.1:8000: this machine has no such address; check --host"]


@pytest.mark.parametrize(("flags", "line"), [
    (["--prefill-interval", "0"], "--prefill-interval must be a positive int, got 0"),
    (["--max-num-seqs", "0"], "--max-num-seqs must be a positive int, got 0"),  # in the flag's name, not the field's
    (["--topology", "single", "--devices", "cpu,cpu"], "single runs 1 worker: give it 1 device (--devices), got 2: "
                                                       "cpu,cpu"),
    (["--topology", "1p1d", "--fronts", "2", "--workers", "process"],
     "--fronts > 1 runs with the single and replicas topologies, not --topology 1p1d"),
])
def test_a_bad_engine_option_is_one_line_in_the_flags_words(tmp_path, flags, line):
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    proc = serve(tmp_path, "--host", "127.0.0.1", "--port", str(port), *flags)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == f"legato serve: error: {line}", proc.stderr


def test_a_voices_dir_that_is_a_file_is_one_line(tmp_path):
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    (tmp_path / "afile").write_text("x")
    proc = serve(tmp_path, "--host", "127.0.0.1", "--port", str(port), "--voices-dir", str(tmp_path / "afile"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith("afile is a file, not a directory"), proc.stderr


@pytest.mark.parametrize(("flag", "zero"), [("--frames-per-text-token", "no cap"), ("--request-timeout", "never")])
def test_a_negative_cap_or_timeout_is_one_line_not_off(tmp_path, flag, zero):
    """Only 0 turns these off: a negative value was taken as off (an outside probe's request then ran 60 s)."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    proc = serve(tmp_path, "--host", "127.0.0.1", "--port", str(port), flag, "-1")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"legato serve: error: {flag} must be a number >= 0 (0: {zero}), got -1.0"), proc.stderr


@pytest.mark.slow
def test_the_fix_the_cuda_deploy_error_suggests_starts_the_deployment(tmp_path):
    fix = ["--device", "cpu"]
    if not torch.cuda.is_available():  # the refusal names the fix; follow it to the letter
        refused = serve(tmp_path, "--deploy", str(DEPLOY / "1p1d.yaml"), "--port", "9")
        assert refused.returncode == 2
        suggested = re.search(r"\(use (--device \S+),", refused.stderr)
        assert suggested is not None, refused.stderr
        fix = suggested.group(1).split()
    with ServeProcess(tmp_path, "--deploy", str(DEPLOY / "1p1d.yaml"), *fix) as srv:
        r = httpx.post(f"{srv.url}/v1/audio/speech", json=speech_body(3, stream=False, response_format="wav"),
                       timeout=120)
        assert r.status_code == 200 and r.headers["x-usage-output-tokens"] == "3", r.text
        note = srv.wait_log(lambda x: "overrides the deploy file's devices" in x.get("msg", ""), timeout=5)
        assert note is not None and note["msg"].endswith("(cuda:0,cuda:0): cpu,cpu"), srv.log_text()[-2000:]
