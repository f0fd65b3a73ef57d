"""The judges of `legato bench soak` / the overload test (no server): what counts as a complete body per
format and mode, a well-formed refusal, and how the soak cuts its run into windows."""

from __future__ import annotations

import base64
import json
import subprocess
import sys

import httpx
import numpy as np
import pytest

from legato.bench.soak import SoakConfig, _windows
from legato.bench.speech_calls import SAMPLES_PER_FRAME, Outcome, body_problem, refusal_problem, sse_problem
from legato.cli import main
from legato.server.encoding import StreamEncoder, encode_file

FRAMES = 7


def _audio(frames: int = FRAMES) -> np.ndarray:
    return (0.3 * np.sin(np.arange(frames * SAMPLES_PER_FRAME) / 9.0)).astype(np.float32)


def _streamed(fmt: str, audio: np.ndarray, chunk: int = 2 * SAMPLES_PER_FRAME) -> bytes:
    enc = StreamEncoder(fmt, 24000)
    out = enc.start() + b"".join(enc.encode(audio[i:i + chunk]) for i in range(0, len(audio), chunk))
    return out + enc.finish()


@pytest.mark.parametrize("fmt", ["pcm", "wav", "mp3"])
def test_whole_bodies_pass_and_short_ones_fail(fmt):
    audio = _audio()
    whole = encode_file(audio, 24000, fmt)
    assert body_problem((fmt, "file"), FRAMES, whole) is None
    assert body_problem((fmt, "stream"), FRAMES, _streamed(fmt, audio)) is None
    short = encode_file(audio[:-SAMPLES_PER_FRAME], 24000, fmt)
    assert body_problem((fmt, "file"), FRAMES, short) is not None


def test_sse_needs_the_done_event_with_every_frame():
    pcm = encode_file(_audio(), 24000, "pcm")
    deltas = [{"type": "speech.audio.delta", "audio": base64.b64encode(pcm[i:i + 7680]).decode()}
              for i in range(0, len(pcm), 7680)]
    done = {"type": "speech.audio.done", "usage": {"output_tokens": FRAMES}}
    assert sse_problem(("pcm", "sse"), FRAMES, [*deltas, done]) is None
    assert "did not end" in sse_problem(("pcm", "sse"), FRAMES, deltas)
    assert "bytes" in sse_problem(("pcm", "sse"), FRAMES, [*deltas[1:], done])
    assert "frames" in sse_problem(("pcm", "sse"), FRAMES + 1, [*deltas, done])


def test_a_refusal_must_say_why_and_a_429_when_to_retry():
    err = json.dumps({"error": {"message": "server busy", "code": "queue_full"}}).encode()
    assert refusal_problem(httpx.Response(429, headers={"retry-after": "3"}), err) is None
    assert "Retry-After" in refusal_problem(httpx.Response(429), err)
    assert refusal_problem(httpx.Response(503), err) is None
    assert "JSON" in refusal_problem(httpx.Response(503), b"Service Unavailable")


def test_requests_fall_in_the_window_they_ended_in():
    cfg = SoakConfig(duration_s=120, windows=None)
    assert cfg.windows == 2  # one a minute
    outs = [Outcome(("pcm", "stream"), 8, "ok", 200, started=100.0 + t, e2e_s=1.0) for t in (5, 58, 61, 130)]
    outs.append(Outcome(("wav", "file"), 8, "bad", 500, started=110.0, e2e_s=1.0))
    samples = [{"t": 1.0, "kv_usage": 0.1, "rss_bytes": 100 << 20}, {"t": 100.0, "kv_usage": 0.3,
                                                                     "rss_bytes": 110 << 20}]
    first, last = _windows(cfg, outs, samples, t0=100.0)
    assert (first["ok"], first["bad"], last["ok"]) == (2, 1, 2)  # the one ending past the duration: last
    assert (first["rss_mb"], last["rss_mb"], last["kv_usage_max"]) == (100.0, 110.0, 0.3)


def test_the_summary_says_rss_was_not_read_without_a_pid():
    """A walkthrough saw "RSS None -> None MB (xNone)" from `bench soak` without --pid."""
    from legato.bench.soak import summary

    window = {"window": 0, "start_s": 0, "end_s": 60, "requests": 3, "ok": 3, "rejected": 0, "disconnected": 0,
              "bad": 0, "e2e_p50_s": 1.0, "e2e_p99_s": 1.5, "rss_mb": None, "kv_usage_max": 0.2}
    result = {"totals": {"requests": 3, "ok": 3, "rejected": 0, "disconnected": 0, "bad": 0, "by_status": {"200": 3},
                         "audio_s": 9.0},
              "first_last": {"p99_first_s": 1.5, "p99_last_s": 1.5, "p99_ratio": 1.0, "rss_first_mb": None,
                             "rss_last_mb": None, "rss_ratio": None},
              "drain": {"seconds": 0.1, "running": 0, "waiting": 0, "free_kv_blocks": 8, "num_kv_blocks": 8,
                        "leaked_blocks": 0},
              "windows": [window], "ran_s": 60.0, "aborted_during_run": {}, "bad": []}
    text = summary(result)
    assert "RSS not read (give --pid)" in text and "None" not in text


def test_the_command_says_when_the_server_is_not_there(capsys):
    from serve_process import free_port

    from legato.cli import main

    assert main(["bench", "soak", "--url", f"http://127.0.0.1:{free_port()}", "--duration", "1", "--no-warmup"]) == 2
    assert "legato bench soak: error" in capsys.readouterr().err


def test_soak_refuses_a_pid_it_cannot_read_before_the_run(capsys):
    """A wrong --pid used to run the whole soak and then report "RSS not read (give --pid)": the RSS check, the
    point of the soak, was skipped while the run passed."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=60)
    assert main(["bench", "soak", "--pid", str(gone.pid), "--url", "http://127.0.0.1:9", "--duration", "1"]) == 2
    assert f"--pid {gone.pid}: no such process here" in capsys.readouterr().err
